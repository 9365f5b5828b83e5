"""``akri status``: Configurations and Instances of a cluster, or the Instances of a local
state directory, as a table or JSON; and which of the two to read."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.core.kube.kubeconfig import SERVICE_ACCOUNT_DIR
from agent.core.ledger.decisions import held_count, node_slots
from agent.core.model.instance import Instance
from agent.core.model.keys import DEFAULT_NAMESPACE, ObjectKey


class StatusUsageError(ValueError):
    """Flags of ``akri status`` that contradict each other."""


@dataclass(frozen=True)
class StatusSource:
    """What ``akri status`` reads, and why (said when it cannot be read)."""

    kind: Literal["cluster", "local"]
    reason: str


def choose_source(
    *,
    kubeconfig: str | None,
    cluster: bool,
    local: bool,
    state_dir: Path | None,
    environ: Mapping[str, str],
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> StatusSource:
    """The cluster when asked (``--kubeconfig``, ``--cluster``) or when one is configured
    (``$AKRI_KUBECONFIG``, a pod's service account, as ``kubectl exec`` into the agent has, or
    ``$KUBECONFIG``); else the local state directory. ``--local`` or ``--state-dir`` (or
    ``AKRI_LOCAL=true``, or ``AKRI_STATE_DIR`` set: the environment of a local agent) always
    mean the state directory. The reason names what the client will really use: in a pod it
    takes the service account over ``$KUBECONFIG``
    (:func:`agent.core.kube.kubeconfig.load_config`)."""
    asked_cluster = [f for f, on in (("--kubeconfig", kubeconfig), ("--cluster", cluster)) if on]
    asked_local = [f for f, on in (("--local", local), ("--state-dir", state_dir)) if on]
    if asked_cluster and asked_local:
        raise StatusUsageError(
            f"{' and '.join(asked_cluster)} read the cluster, {' and '.join(asked_local)} a "
            "local state directory: give one or the other"
        )
    if asked_cluster:
        return StatusSource("cluster", f"{asked_cluster[0]} given")
    if asked_local:
        return StatusSource("local", f"{asked_local[0]} given")
    if environ.get("AKRI_LOCAL", "").strip().lower() in ("1", "true", "yes", "on"):
        return StatusSource("local", "AKRI_LOCAL is set")
    # a developer's shell often exports KUBECONFIG for kubectl; AKRI_STATE_DIR says that the
    # agent they mean to ask is a local one (as AKRI_LOCAL does)
    if environ.get("AKRI_STATE_DIR"):
        return StatusSource("local", "$AKRI_STATE_DIR is set")
    # in the order the client picks them: an explicit file, the pod's service account, then
    # $KUBECONFIG (ignored by the client in a pod)
    if environ.get("AKRI_KUBECONFIG"):
        return StatusSource("cluster", "$AKRI_KUBECONFIG is set; --local reads a state directory")
    in_a_pod = (
        environ.get("KUBERNETES_SERVICE_HOST")
        and environ.get("KUBERNETES_SERVICE_PORT")
        and (service_account_dir / "token").is_file()
    )
    if in_a_pod:
        ignored = " ($KUBECONFIG is not used in a pod)" if environ.get("KUBECONFIG") else ""
        return StatusSource(
            "cluster",
            f"running in a pod (service account){ignored}; --local reads a state directory",
        )
    if environ.get("KUBECONFIG"):
        return StatusSource("cluster", "$KUBECONFIG is set; --local reads a state directory")
    return StatusSource("local", "no cluster configured ($KUBECONFIG unset, not in a pod)")


def _object_json(metadata: dict[str, Any], spec: Any) -> dict[str, Any]:
    return {"metadata": metadata, "spec": spec}


def instances_json(instances: Sequence[Instance]) -> list[dict[str, Any]]:
    """``{"metadata": {"name": ...}, "spec": {...}}`` per Instance as in the CRD (with
    ``namespace`` and ``annotations`` in ``metadata`` when they are not the defaults)."""
    items: list[dict[str, Any]] = []
    for instance in instances:
        obj = instance.to_dict()
        metadata: dict[str, Any] = {"name": instance.name}
        if instance.namespace != DEFAULT_NAMESPACE:
            metadata["namespace"] = instance.namespace
        if instance.annotations:
            metadata["annotations"] = dict(instance.annotations)
        items.append(_object_json(metadata, obj["spec"]))
    return items


def to_json(instances: Sequence[Instance]) -> str:
    """A local state directory's Instances: a JSON list of CRD-shaped objects."""
    return json.dumps(instances_json(instances), indent=2, sort_keys=True)


def cluster_json(configurations: Sequence[Mapping[str, Any]], instances: Sequence[Instance]) -> str:
    """A cluster's ``{"configurations": [...], "instances": [...]}``, both CRD-shaped
    (``metadata`` with name, namespace outside ``default`` and annotations; ``spec``)."""
    shaped = []
    for obj in configurations:
        raw = obj.get("metadata") or {}
        metadata: dict[str, Any] = {"name": raw.get("name", "?")}
        if raw.get("namespace", DEFAULT_NAMESPACE) != DEFAULT_NAMESPACE:
            metadata["namespace"] = raw["namespace"]
        if raw.get("annotations"):
            metadata["annotations"] = dict(raw["annotations"])
        shaped.append(_object_json(metadata, obj.get("spec") or {}))
    shaped.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
    body = {"configurations": shaped, "instances": instances_json(instances)}
    return json.dumps(body, indent=2, sort_keys=True)


def state(instance: Instance, offline: Sequence[str] = ()) -> str:
    """``ok``, or ``offline (node, …)`` for each node in its offline grace (its slots are
    Unhealthy there: ``offline``, what the nodes say, see :func:`local_offline` and
    :func:`cluster_offline`; or a mark an earlier agent version stored) and ``draining: N
    slots in use (node)`` for each node that stays in the Instance only until its slots are
    released; ``terminating: N slots in use`` first for a deleted Instance its
    ``akri.sh/slots`` finalizer keeps until those slots are freed."""
    parts = []
    if instance.deletion_timestamp is not None:
        held = held_count(instance)
        parts.append(f"terminating: {held} slot{'s' if held != 1 else ''} in use")
    # a node's own mark (shared Instances), unless what the nodes say names it already
    parts += [
        f"offline ({node})"
        for node in instance.offline_nodes
        if not any(text.startswith((f"offline ({node})", f"offline ({node},")) for text in offline)
    ]
    parts += list(offline)
    for node in instance.draining_nodes:
        count = len(node_slots(instance, node))
        parts.append(f"draining: {count} slot{'s' if count != 1 else ''} in use ({node})")
    return "; ".join(parts) or "ok"


def _usage_summary(instance: Instance) -> str:
    parts = []
    for slot in instance.slot_ids() + sorted(
        k for k in instance.device_usage if k not in set(instance.slot_ids())
    ):
        value = instance.device_usage.get(slot, "")
        parts.append(f"{slot.rsplit('-', 1)[-1]}={value or '-'}")
    return " ".join(parts)


def local_offline(
    until: Mapping[ObjectKey, Mapping[str, float]], now: float
) -> dict[ObjectKey, list[str]]:
    """``offline (node, N s left)`` per Instance, from the local agents' notes (when each
    node's offline grace ends, seconds since the epoch; ``now`` likewise)."""
    return {
        key: [
            f"offline ({node}, {max(0.0, end - now):.0f} s left)"
            for node, end in sorted(nodes.items())
        ]
        for key, nodes in until.items()
    }


OFFLINE_TAINT = "akri.sh/offline"  # agent/node/dra/slices.py's taint of offline devices
INSTANCE_ATTRIBUTE_LENGTH = 64  # a ResourceSlice string attribute's limit (the name is cut)


def cluster_offline(
    instances: Sequence[Instance],
    nodes: Iterable[Mapping[str, Any]],
    slices: Iterable[Mapping[str, Any]],
) -> dict[ObjectKey, list[str]]:
    """What the cluster shows of Instances in a node's offline grace beyond the Instance's
    own marks (a shared Instance's nodes record theirs, :func:`state` shows them; nothing is
    written to a local Instance): ``offline (node)`` where the node's agent publishes the
    Instance's devices tainted ``akri.sh/offline:NoSchedule`` (DRA), ``unhealthy (node,
    kubelet)`` where kubelet counts none of its slots healthy (device plugins:
    ``status.allocatable`` of ``akri.sh/<instance>`` is 0 of a capacity above 0) though a slot
    is free — the device is offline there, or the node's agent is not running. Not where the
    node serves that name through DRA (``agent/node/dra/name_paths.py``, from the modes its
    slices say): kubelet keeps a resource whose device plugin went away at allocatable 0 until
    it restarts, which says nothing about the device. Draining and offline-marked nodes are not
    repeated (the Instance's own marks say so)."""
    from agent.node.dra.name_paths import DRA, instance_on_dra, modes_of_slices

    slices = list(slices)
    modes = modes_of_slices(slices)
    by_name: dict[str, list[Instance]] = {}
    for instance in instances:
        by_name.setdefault(instance.name[:INSTANCE_ATTRIBUTE_LENGTH], []).append(instance)
    found: dict[ObjectKey, dict[str, str]] = {}

    def note(instance: Instance, node: str, text: str) -> None:
        if node not in instance.draining_nodes and node not in instance.offline_nodes:
            found.setdefault(instance.key, {}).setdefault(node, text)

    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != "akri.sh":
            continue
        for device in spec.get("devices") or []:
            tainted = [
                t
                for t in device.get("taints") or []
                if t.get("key") == OFFLINE_TAINT and t.get("effect") == "NoSchedule"
            ]
            name = ((device.get("attributes") or {}).get("instance") or {}).get("string")
            if not tainted or not isinstance(name, str):
                continue
            node = str(tainted[0].get("value") or spec.get("nodeName") or "?")
            for instance in by_name.get(name, ()):
                note(instance, node, f"offline ({node})")
    for node_object in nodes:
        node = str((node_object.get("metadata") or {}).get("name"))
        status = node_object.get("status") or {}
        capacity, allocatable = status.get("capacity") or {}, status.get("allocatable") or {}
        for instance in instances:
            resource = f"akri.sh/{instance.name}"
            has_free = any(not value for value in instance.device_usage.values())
            if (
                node in instance.nodes
                and str(capacity.get(resource, "0")) != "0"
                and str(allocatable.get(resource, "")) == "0"
                and has_free
                and not (modes.get(node) == DRA and instance_on_dra(instance, modes))
            ):
                note(instance, node, f"unhealthy ({node}, kubelet)")
    return {key: [text for _, text in sorted(nodes.items())] for key, nodes in found.items()}


def to_table(
    instances: Sequence[Instance], offline: Mapping[ObjectKey, Sequence[str]] | None = None
) -> str:
    """An aligned text table: name, configuration, nodes, shared, capacity, used, state (with
    ``offline``: what the nodes say of Instances in their offline grace), deviceUsage."""
    header = (
        "NAME",
        "CONFIGURATION",
        "NODES",
        "SHARED",
        "CAPACITY",
        "USED",
        "STATE",
        "DEVICE USAGE",
    )
    rows = [header]
    for inst in instances:
        used = sum(1 for v in inst.device_usage.values() if v)
        name = inst.name if inst.namespace == DEFAULT_NAMESPACE else f"{inst.namespace}/{inst.name}"
        rows.append(
            (
                name,
                inst.configuration_name,
                ",".join(inst.nodes) or "-",
                str(inst.shared).lower(),
                str(inst.capacity),
                str(used),
                state(inst, (offline or {}).get(inst.key, ())),
                _usage_summary(inst),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True))
        + "  "
        + row[-1]
        for row in rows
    ]
    if not instances:
        lines.append("(no instances)")
    return "\n".join(line.rstrip() for line in lines)


BUDGET_REASONS = ("OverBudget", "WithinBudget")


def budget_notes(events: Sequence[Mapping[str, Any]]) -> dict[ObjectKey, str]:
    """From the agents' ``OverBudget``/``WithinBudget`` Events: per Configuration, the nodes
    whose latest such Event says devices are left out (the node's Instance budget,
    ``--max-instances``), as ``over budget on <node>: <its message>``."""
    latest: dict[tuple[ObjectKey, str], tuple[tuple[str, int], str, str]] = {}
    for event in events:
        reason = event.get("reason")
        involved = event.get("involvedObject") or {}
        if reason not in BUDGET_REASONS or involved.get("kind") != "Configuration":
            continue
        key = ObjectKey(
            str(involved.get("namespace") or DEFAULT_NAMESPACE), str(involved.get("name"))
        )
        node = str(event.get("reportingInstance") or (event.get("source") or {}).get("host"))
        when = str(
            event.get("lastTimestamp")
            or event.get("eventTime")
            or (event.get("metadata") or {}).get("creationTimestamp")
            or ""
        )
        # timestamps have whole seconds: two Events of one second are ordered by their
        # resourceVersion (the API server's write order, in practice a growing number)
        version = str((event.get("metadata") or {}).get("resourceVersion", ""))
        order = (when, int(version) if version.isdigit() else -1)
        if (key, node) not in latest or order >= latest[(key, node)][0]:
            latest[(key, node)] = (order, str(reason), str(event.get("message", "")))
    notes: dict[ObjectKey, list[str]] = {}
    for (key, node), (_, reason, message) in sorted(latest.items()):
        if reason == "OverBudget":
            notes.setdefault(key, []).append(f"over budget on {node}: {message.split(':')[0]}")
    return {key: "; ".join(lines) for key, lines in notes.items()}


def configurations_table(
    configurations: Sequence[Mapping[str, Any]],
    instances: Sequence[Instance],
    events: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Configurations (raw API objects, valid or not) with their handler, capacity and
    Instance count; NOTE says why one is refused (its kubelet names are another's: the rule
    every agent applies, :mod:`agent.core.name_claims`) and on which
    nodes devices of it are left out by the Instance budget (``events``:
    :func:`budget_notes`)."""
    from agent.core.name_claims import decide_for_objects
    from discovery_handlers.embedded import details_problem

    with_instances = {instance.configuration_key for instance in instances}
    refused = decide_for_objects(configurations, with_instances, details_problem).refused
    over_budget = budget_notes(events)
    rows = [("CONFIGURATION", "HANDLER", "CAPACITY", "INSTANCES", "SLOTS USED", "NOTE")]
    for obj in configurations:
        metadata = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        namespace, name = metadata.get("namespace", DEFAULT_NAMESPACE), metadata.get("name", "?")
        mine = [i for i in instances if i.namespace == namespace and i.configuration_name == name]
        used = sum(1 for i in mine for v in i.device_usage.values() if v)
        slots = sum(i.capacity for i in mine)
        why = refused.get(ObjectKey(namespace, str(name)))
        notes = [f"refused: {why}"] if why else []
        if ObjectKey(namespace, str(name)) in over_budget:
            notes.append(over_budget[ObjectKey(namespace, str(name))])
        rows.append(
            (
                name if namespace == DEFAULT_NAMESPACE else f"{namespace}/{name}",
                str((spec.get("discoveryHandler") or {}).get("name", "?")),
                str(spec.get("capacity", "?")),
                str(len(mine)),
                f"{used}/{slots}",
                "; ".join(notes),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
