"""Pure broker decisions: which broker Pods and Jobs an Instance should have.

Akri's rules (``controller/src/util/instance_action.rs``, ``pod_action.rs``,
``shared/src/k8s/{pod,job}.rs``), kept where they exist:

* ``brokerPodSpec``: one Pod per node in ``Instance.nodes``, named ``<instance>-pod`` (unshared)
  or ``<node>-<instance>-pod`` (shared), ``.`` turned into ``-``; labels ``app``,
  ``controller=akri.sh``, ``akri.sh/configuration``, ``akri.sh/instance``,
  ``akri.sh/target-node``; owned by the Instance (``controller: true``); pinned with a
  *required* node affinity on ``metadata.name``; ``{{PLACEHOLDER}}`` in the resources of every
  container and init container becomes ``akri.sh/<instance>``.
* A Pod on a node that left the Instance is removed; a Failed or Succeeded Pod is replaced at
  once, a Pending one after the pending grace (Akri: 5 minutes).
* ``brokerJobSpec``: one Job ``<instance>-<configuration generation>-job`` per Instance, so a
  Configuration edit starts a new Job; older generations' Jobs are left to finish.

Better than Akri (it relies on the device plugin refusing surplus pods, which then sit
Pending): a broker Pod or Job is created only while the Instance has a free slot for it
(free slots minus what Pending brokers will take), and a ``brokerPodSpec`` edit rolls brokers
over by starting the new Pod *before* removing the old one when a slot is free for it (the
old one goes once the new one runs), else by removing the old one first. The spec a Pod was
made from is the label ``akri.sh/broker-spec`` (a hash); a replacement that cannot take
Akri's name because the old Pod still has it is named ``<akri name minus -pod>-<hash5>-pod``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.ledger.decisions import free_slots
from agent.core.model.configuration import Configuration
from agent.core.model.instance import API_VERSION as INSTANCE_API_VERSION
from agent.core.model.instance import Instance

PLACEHOLDER = "{{PLACEHOLDER}}"
CONTROLLER_LABEL = "controller"
CONTROLLER_VALUE = "akri.sh"
APP_LABEL = "app"
CONFIGURATION_LABEL = "akri.sh/configuration"
INSTANCE_LABEL = "akri.sh/instance"
TARGET_NODE_LABEL = "akri.sh/target-node"
SPEC_LABEL = "akri.sh/broker-spec"  # ours: which brokerPodSpec/brokerJobSpec a broker runs
BROKER_SELECTOR = f"{CONTROLLER_LABEL}={CONTROLLER_VALUE}"
PENDING_GRACE = 300.0  # seconds (Akri's PENDING_POD_GRACE_PERIOD_MINUTES = 5)
FAILED_GRACE = 0.0  # seconds (Akri: Failed/Succeeded pods are replaced at once)


def resource_name(instance_name: str) -> str:
    """The instance-level extended resource: ``akri.sh/<instance>``."""
    return f"akri.sh/{instance_name}"


def dashed(name: str) -> str:
    """Akri replaces ``.`` with ``-`` in broker and service names."""
    return name.replace(".", "-")


def broker_pod_name(instance: Instance, node: str) -> str:
    """Akri's broker Pod name."""
    if instance.shared:
        return dashed(f"{node}-{instance.name}-pod")
    return dashed(f"{instance.name}-pod")


def surge_pod_name(akri_name: str, spec_hash: str) -> str:
    """The name of a rolled-over broker while ``akri_name`` is still taken."""
    base = akri_name[: -len("-pod")] if akri_name.endswith("-pod") else akri_name
    return f"{base}-{spec_hash[:5]}-pod"


def job_name(instance: Instance, generation: int | None) -> str:
    """Akri's broker Job name: one per Configuration generation."""
    return dashed(f"{instance.name}-{generation or 0}-job")


def spec_hash(spec: Any) -> str:
    """A short stable hash of a broker spec (label value)."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def owner_reference(api_version: str, kind: str, name: str, uid: str | None) -> dict[str, Any]:
    """An owner reference with ``controller: true`` (Akri's), so owner GC removes the object."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": uid or "",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def instance_owner(instance: Instance) -> dict[str, Any]:
    return owner_reference(INSTANCE_API_VERSION, "Instance", instance.name, instance.uid)


def substitute_placeholder(pod_spec: Mapping[str, Any], instance_name: str) -> dict[str, Any]:
    """A copy of ``pod_spec`` whose containers' and init containers' resource limits and
    requests name ``akri.sh/<instance>`` where the user wrote ``{{PLACEHOLDER}}``."""
    spec: dict[str, Any] = copy.deepcopy(dict(pod_spec))
    for group in ("containers", "initContainers"):
        for container in spec.get(group) or []:
            if not isinstance(container, dict):
                continue
            resources = container.get("resources")
            if not isinstance(resources, dict):
                continue
            for kind in ("limits", "requests"):
                amounts = resources.get(kind)
                if isinstance(amounts, dict) and PLACEHOLDER in amounts:
                    amounts[resource_name(instance_name)] = amounts.pop(PLACEHOLDER)
    return spec


def _amount(value: Any) -> int:
    try:
        return max(0, int(str(value)))
    except ValueError:
        return 1  # an extended resource is a whole number; anything else counts as one


def _container_slots(container: Any) -> int:
    if not isinstance(container, Mapping):
        return 0
    resources = container.get("resources")
    if not isinstance(resources, Mapping):
        return 0
    amounts = [
        _amount(found[PLACEHOLDER])
        for kind in ("limits", "requests")
        if isinstance(found := resources.get(kind), Mapping) and PLACEHOLDER in found
    ]
    return max(amounts, default=0)


def slots_per_broker(pod_spec: Mapping[str, Any]) -> int:
    """Slots one broker Pod of ``pod_spec`` takes: the containers' ``{{PLACEHOLDER}}``
    amounts added up, or the largest init container's (they run one at a time, before the
    containers), whichever is more; 0 when the spec does not ask for the device."""
    containers = sum(_container_slots(c) for c in pod_spec.get("containers") or [])
    inits = max((_container_slots(c) for c in pod_spec.get("initContainers") or []), default=0)
    return max(containers, inits)


def pinned_to(pod_spec: dict[str, Any], node: str) -> dict[str, Any]:
    """``pod_spec`` with a required node affinity on ``metadata.name`` = ``node`` added to
    every node-selector term the user wrote (terms are ORed, so each must carry it)."""
    requirement = {"key": "metadata.name", "operator": "In", "values": [node]}
    affinity = pod_spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term.setdefault("matchFields", []).append(requirement)
    required["nodeSelectorTerms"] = terms
    return pod_spec


def broker_labels(instance: Instance, name: str) -> dict[str, str]:
    return {
        APP_LABEL: name,
        CONTROLLER_LABEL: CONTROLLER_VALUE,
        CONFIGURATION_LABEL: instance.configuration_name,
        INSTANCE_LABEL: instance.name,
    }


def broker_pod(
    configuration: Configuration, instance: Instance, node: str, name: str
) -> dict[str, Any]:
    """The broker Pod object for ``instance`` on ``node``."""
    raw_spec = _pod_spec(configuration) or {}
    labels = broker_labels(instance, name)
    labels[TARGET_NODE_LABEL] = node
    labels[SPEC_LABEL] = spec_hash(raw_spec)
    spec = pinned_to(substitute_placeholder(raw_spec, instance.name), node)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": instance.namespace,
            "labels": labels,
            "ownerReferences": [instance_owner(instance)],
        },
        "spec": spec,
    }


def broker_job(configuration: Configuration, instance: Instance) -> dict[str, Any]:
    """The broker Job object for ``instance`` (Akri: not pinned to a node)."""
    raw_spec = _job_spec(configuration) or {}
    name = job_name(instance, configuration.generation)
    labels = broker_labels(instance, name)
    labels[SPEC_LABEL] = spec_hash(raw_spec)
    spec: dict[str, Any] = copy.deepcopy(dict(raw_spec))
    template = spec.setdefault("template", {})
    template_meta = template.setdefault("metadata", {})
    template_labels = template_meta.setdefault("labels", {})
    for key in (CONTROLLER_LABEL, CONFIGURATION_LABEL, INSTANCE_LABEL):
        template_labels[key] = labels[key]
    template["spec"] = substitute_placeholder(template.get("spec") or {}, instance.name)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": instance.namespace,
            "labels": labels,
            "ownerReferences": [instance_owner(instance)],
        },
        "spec": spec,
    }


def _pod_spec(configuration: Configuration) -> Mapping[str, Any] | None:
    spec = (configuration.broker_spec or {}).get("brokerPodSpec")
    return spec if isinstance(spec, Mapping) else None


def _job_spec(configuration: Configuration) -> Mapping[str, Any] | None:
    spec = (configuration.broker_spec or {}).get("brokerJobSpec")
    return spec if isinstance(spec, Mapping) else None


def broker_kind(configuration: Configuration) -> str | None:
    """``"pod"``, ``"job"`` or None (no broker)."""
    if _pod_spec(configuration) is not None:
        return "pod"
    if _job_spec(configuration) is not None:
        return "job"
    return None


@dataclass(frozen=True)
class ObservedPod:
    """What the decisions need of a broker Pod (or a Job: ``phase`` is then Active/Done)."""

    name: str
    uid: str
    node: str
    spec: str  # SPEC_LABEL value
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    created: float  # seconds since the epoch (creationTimestamp)
    deleting: bool = False

    @property
    def running(self) -> bool:
        return self.phase == "Running" and not self.deleting


@dataclass(frozen=True)
class Removal:
    """Delete ``name`` (uid precondition: never a newer object of the same name)."""

    name: str
    uid: str
    # NodeLeft, Failed, PendingTooLong, RolledOver, MakeRoom, InstanceGone, NoBrokerPodSpec
    reason: str


@dataclass(frozen=True)
class PodPlan:
    """What to do for one Instance's broker Pods. ``waiting``: nodes without a broker because
    the Instance has no free slot for one (reported, retried on the next change)."""

    create: tuple[dict[str, Any], ...] = ()
    remove: tuple[Removal, ...] = ()
    waiting: tuple[str, ...] = ()
    next_check: float | None = None  # when a Pending pod's grace ends (epoch seconds)


@dataclass(frozen=True)
class Timing:
    """Grace periods of broker Pods (seconds)."""

    pending: float = PENDING_GRACE
    failed: float = FAILED_GRACE


def _judge(pod: ObservedPod, nodes: Collection[str], now: float, timing: Timing) -> str | None:
    """Why ``pod`` must go (Akri's PodAction), None to keep it."""
    if pod.node not in nodes:
        return "NodeLeft"
    if pod.phase in ("Failed", "Succeeded"):
        return "Failed" if now - pod.created >= timing.failed else None
    if pod.phase != "Running" and now - pod.created >= timing.pending:
        return "PendingTooLong"
    return None


def plan_pods(
    configuration: Configuration,
    instance: Instance,
    pods: Sequence[ObservedPod],
    ready_nodes: Collection[str],
    now: float,
    timing: Timing = Timing(),
) -> PodPlan:
    """The broker Pod changes ``instance`` needs (``pods``: its current broker Pods;
    ``ready_nodes``: nodes that are Ready now — no broker is started on any other)."""
    raw_spec = _pod_spec(configuration)
    if raw_spec is None or instance.deletion_timestamp is not None:
        # the Instance is being deleted (its slots wait for their pods), or the Configuration
        # no longer asks for broker Pods
        why = "InstanceGone" if instance.deletion_timestamp is not None else "NoBrokerPodSpec"
        return PodPlan(remove=tuple(Removal(p.name, p.uid, why) for p in pods if not p.deleting))
    wanted = spec_hash(raw_spec)
    need = slots_per_broker(raw_spec)
    remove: list[Removal] = []
    alive: list[ObservedPod] = []
    next_check: float | None = None
    # A draining node lost the device and stays in ``nodes`` only until the slots held there
    # are freed: its broker goes as Akri's does when the node leaves the Instance (its broker
    # holding the slot would otherwise keep the node draining for good).
    serving = set(instance.nodes) - set(instance.draining_nodes)
    for pod in pods:
        if pod.deleting:
            continue
        reason = _judge(pod, serving, now, timing)
        if reason is not None:
            remove.append(Removal(pod.name, pod.uid, reason))
            continue
        alive.append(pod)
        if pod.phase not in ("Running", "Failed", "Succeeded"):
            deadline = pod.created + timing.pending
            next_check = deadline if next_check is None else min(next_check, deadline)
    # slots the Pending brokers will take once kubelet admits them
    budget = len(free_slots(instance)) - need * sum(p.phase == "Pending" for p in alive)
    taken_names = {p.name for p in pods}
    excluded = set(instance.draining_nodes) | set(instance.offline_nodes)
    create: list[dict[str, Any]] = []
    waiting: list[str] = []
    for node in sorted(instance.nodes):
        here = [p for p in alive if p.node == node]
        current = [p for p in here if p.spec == wanted]
        old = [p for p in here if p.spec != wanted]
        if current:
            if any(p.running for p in current):
                remove.extend(Removal(p.name, p.uid, "RolledOver") for p in old)
            continue
        if node in excluded or node not in ready_nodes:
            continue
        if need and budget < need:
            if old:
                # no slot for a second broker: the old one goes first, the new one follows
                # once its slot is free
                remove.extend(Removal(p.name, p.uid, "MakeRoom") for p in old)
            else:
                waiting.append(node)
            continue
        akri_name = broker_pod_name(instance, node)
        if akri_name not in taken_names:
            name = akri_name
        elif any(p.name == akri_name for p in old):
            name = surge_pod_name(akri_name, wanted)  # the old broker keeps running meanwhile
        else:
            continue  # Akri's name frees up once the removed Pod is gone: the next pass
        if name in taken_names:
            continue
        taken_names.add(name)
        create.append(broker_pod(configuration, instance, node, name))
        budget -= need
    return PodPlan(tuple(create), tuple(remove), tuple(waiting), next_check)


@dataclass(frozen=True)
class JobPlan:
    create: dict[str, Any] | None = None
    waiting: bool = False


def plan_job(
    configuration: Configuration, instance: Instance, jobs: Iterable[ObservedPod]
) -> JobPlan:
    """The current generation's Job for ``instance`` when it is missing and a slot is free
    for it (its pods ask for ``akri.sh/<instance>``; older generations' Jobs run on)."""
    raw_spec = _job_spec(configuration)
    if raw_spec is None or instance.deletion_timestamp is not None:
        return JobPlan()
    name = job_name(instance, configuration.generation)
    if any(job.name == name for job in jobs):
        return JobPlan()
    template = raw_spec.get("template")
    pod_spec = template.get("spec") if isinstance(template, Mapping) else None
    need = slots_per_broker(pod_spec) if isinstance(pod_spec, Mapping) else 0
    if need and len(free_slots(instance)) < need:
        return JobPlan(waiting=True)
    return JobPlan(create=broker_job(configuration, instance))
