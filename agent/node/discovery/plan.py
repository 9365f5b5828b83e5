"""Pure discovery decisions: device list + cached Instances → what this node must write.

Naming with collision resolution: devices are taken in order of their hash key; each gets the
first candidate name (Akri's name first, then salted ones, see ``agent.core.model.naming``) that is
not held by an Instance standing for a different device (the ``akri.sh/device-digest``
annotation holds a sha256 fingerprint of the key) and not already given to another device in
this list. Instances written by Akri carry no fingerprint and are adopted by the device whose
Akri name they have. Existing Instances keep their names, so a new device never renames an old
one.

Offline grace: a device this node had but no longer sees is kept (its slots reported
Unhealthy) until ``grace`` seconds have passed, then this node leaves the Instance — through
the slot ledger, which keeps the node (draining) while it still holds slots there.

A device missing from the first full list of an edited Configuration is not offline but no
longer selected (a filter, a URL or a property changed what the handler looks for): this
node leaves it at once, without the grace — draining while it holds slots, as on a
Configuration delete. Every handler's filters get this, the handler need not say anything.

``deviceUsage`` is never decided here: new Instances get theirs from the ledger, and a
capacity change is resized by the ledger in the same write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agent.core.ledger.decisions import with_draining
from agent.core.model.configuration import Configuration
from agent.core.model.instance import Instance
from agent.core.model.naming import (
    CONFIGURATION_LABEL,
    DEVICE_DIGEST_ANNOTATION,
    OFFLINE_ANNOTATION,
    candidate_names,
    cdi_name,
    device_fingerprint,
    device_key,
)
from discovery_handlers.base import Device

GRACE_ANNOTATION = "akri.sh/offline-grace-seconds"


@dataclass(frozen=True)
class DesiredInstance:
    """A discovered device and the Instance name it maps to."""

    name: str
    digest: str
    fingerprint: str
    device: Device


@dataclass(frozen=True)
class DiscoveryPlan:
    """What to write after one device list."""

    upserts: tuple[DesiredInstance, ...]
    leave: tuple[str, ...]
    offline: tuple[str, ...]
    missing_since: Mapping[str, float]
    next_deadline: float | None
    duplicate_ids: tuple[str, ...] = field(default=())
    # of ``leave``: devices an edited Configuration no longer selects (left without grace)
    unselected: tuple[str, ...] = field(default=())


def assign_names(
    configuration: str,
    node: str,
    shared: bool,
    devices: Sequence[Device],
    instances: Mapping[str, Instance],
) -> tuple[list[DesiredInstance], list[str]]:
    """Map devices to Instance names. Returns (desired, duplicate device ids dropped)."""
    keyed: dict[str, Device] = {}
    duplicates: list[str] = []
    for device in devices:
        key = device_key(device.id, node, shared)
        if key in keyed:
            duplicates.append(device.id)
            continue
        keyed[key] = device
    taken: set[str] = set()
    desired: list[DesiredInstance] = []
    for key in sorted(keyed):
        fingerprint = device_fingerprint(key)
        for name, digest in candidate_names(configuration, key):
            if name in taken:
                continue
            existing = instances.get(name)
            if existing is not None and (
                existing.configuration_name != configuration
                or existing.device_fingerprint not in (None, fingerprint)
            ):
                continue
            taken.add(name)
            desired.append(DesiredInstance(name, digest, fingerprint, keyed[key]))
            break
    return desired, duplicates


def grace_for(
    configuration: Configuration, shared: bool, local_grace: float, shared_grace: float
) -> float:
    """Offline grace in seconds: the Configuration's annotation, else the agent default."""
    override = configuration.annotations.get(GRACE_ANNOTATION)
    if override is not None:
        try:
            value = float(override)
            if value >= 0:
                return value
        except ValueError:
            pass
    return shared_grace if shared else local_grace


def plan_discovery(
    configuration: Configuration,
    node: str,
    shared: bool,
    devices: Sequence[Device],
    instances: Mapping[str, Instance],
    missing_since: Mapping[str, float],
    now: float,
    grace: float,
    own: Iterable[Instance] | None = None,
    reselected: bool = False,
) -> DiscoveryPlan:
    """Decide upserts, departures and offline Instances for this node. ``instances`` maps
    names of the Configuration's namespace to Instances (lookups only, unless ``own`` — the
    Configuration's Instances — is not given). ``reselected``: ``devices`` is the first full
    list of an edited Configuration — a device missing from it is not offline but no longer
    selected (a filter or a URL changed): left at once, without the offline grace (draining
    while this node holds slots, as on a Configuration delete)."""
    desired, duplicates = assign_names(configuration.name, node, shared, devices, instances)
    discovered = {item.name for item in desired}
    candidates = own if own is not None else instances.values()
    mine = {
        inst.name
        for inst in candidates
        if inst.configuration_name == configuration.name and node in inst.nodes
    }
    still_missing: dict[str, float] = {}
    leave: list[str] = []
    offline: list[str] = []
    deadline: float | None = None
    unselected: list[str] = []
    for name in sorted(mine - discovered):
        since = missing_since.get(name, now)
        if reselected:
            unselected.append(name)
            leave.append(name)
        elif now - since >= grace:
            leave.append(name)
        else:
            still_missing[name] = since
            offline.append(name)
            expiry = since + grace
            deadline = expiry if deadline is None else min(deadline, expiry)
    return DiscoveryPlan(
        upserts=tuple(desired),
        leave=tuple(leave),
        offline=tuple(offline),
        missing_since=still_missing,
        next_deadline=deadline,
        duplicate_ids=tuple(duplicates),
        unselected=tuple(unselected),
    )


def broker_properties(configuration: Configuration, device: Device) -> dict[str, str]:
    """Device properties overlaid with the Configuration's brokerProperties (Akri v0.13)."""
    return {**dict(device.properties), **dict(configuration.broker_properties)}


def owner_reference(configuration: Configuration) -> dict[str, object] | None:
    """ownerReference to the Configuration (only when its uid is known)."""
    if not configuration.uid:
        return None
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "name": configuration.name,
        "uid": configuration.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def new_instance(
    configuration: Configuration, desired: DesiredInstance, node: str, shared: bool
) -> Instance:
    """The Instance to create for a newly discovered device (the ledger fills its slots)."""
    ref = owner_reference(configuration)
    return Instance(
        name=desired.name,
        namespace=configuration.namespace,
        configuration_name=configuration.name,
        cdi_name=cdi_name(configuration.name, desired.digest),
        capacity=configuration.capacity,
        broker_properties=broker_properties(configuration, desired.device),
        shared=shared,
        nodes=(node,),
        labels={CONFIGURATION_LABEL: configuration.name},
        annotations={DEVICE_DIGEST_ANNOTATION: desired.fingerprint},
        owner_references=(ref,) if ref else (),
    )


def join_instance(
    instance: Instance,
    configuration: Configuration,
    desired: DesiredInstance,
    node: str,
    shared: bool,
) -> Instance | None:
    """The Instance with this node in ``nodes`` (no longer offline or draining: it sees the
    device) and
    the Configuration's current settings, or None when nothing needs writing. A capacity
    change is only the ``capacity`` field here: the ledger resizes the slots."""
    changes: dict[str, object] = {}
    if node not in instance.nodes:
        changes["nodes"] = (*instance.nodes, node)
    if instance.capacity != configuration.capacity:
        changes["capacity"] = configuration.capacity
    props = broker_properties(configuration, desired.device)
    if dict(instance.broker_properties) != props:
        changes["broker_properties"] = props
    if instance.shared != shared:
        changes["shared"] = shared
    expected_cdi = cdi_name(configuration.name, desired.digest)
    if instance.cdi_name != expected_cdi:
        changes["cdi_name"] = expected_cdi
    annotations = dict(instance.annotations)
    # an earlier agent's offline list is cleared here; this node's own offline annotation is
    # not: the node's offline marks (agent/node/discovery/offline_marks.py) apply it and take it
    # away without a resourceVersion precondition, so N nodes seeing a device again at once
    # make N writes and no conflict
    if node in instance.draining_nodes or node in instance.marked_nodes(OFFLINE_ANNOTATION):
        back = with_draining(instance, node, False).with_node_mark(OFFLINE_ANNOTATION, node, False)
        annotations = dict(back.annotations)
    if annotations.get(DEVICE_DIGEST_ANNOTATION) != desired.fingerprint:
        annotations[DEVICE_DIGEST_ANNOTATION] = desired.fingerprint
    if annotations != dict(instance.annotations):
        changes["annotations"] = annotations
    if instance.labels.get(CONFIGURATION_LABEL) != configuration.name:
        changes["labels"] = {**dict(instance.labels), CONFIGURATION_LABEL: configuration.name}
    ref = owner_reference(configuration)
    if ref is not None and not any(r.get("uid") == ref["uid"] for r in instance.owner_references):
        changes["owner_references"] = (
            *(r for r in instance.owner_references if r.get("kind") != "Configuration"),
            ref,
        )
    if not changes:
        return None
    return instance.evolve(**changes)
