"""Pure ResourceSlice content: which devices this node publishes, with typed attributes.

Model (DESIGN.md §5): **one DRA device per slot**, so every DRA-GA cluster (≥ 1.34) can use it
without feature gates.

* **Local (unshared) Instances** go in the node's pool: pool name = node name,
  ``spec.nodeName`` = node.
* **Shared Instances** get a pool of their own, named after the Instance, available on exactly
  the nodes that serve it and see the device now — ``instance.nodes`` without the nodes that
  only drain it and without those in their offline grace (each records it in the Instance,
  ``akri.sh/offline.<node>``) — (``nodeSelector``: one term, ``kubernetes.io/hostname In
  <nodes>``, the only many-node form the API server validates), and published by one
  deterministic agent: the first of them (``agent/core/model/resource_slices.py``). So the
  scheduler sees each slot once, whichever node it schedules on, and never places a claim on a
  node that has lost the device while another still sees it.
* A slot is published while it is **free or held by a DRA claim** (held DRA slots stay so the
  scheduler's accounting of existing allocations is unchanged). A slot taken through a device
  plugin (IL ``<node>`` or CL ``C:…``) leaves the slice; so do all slots of an Instance that
  is offline (grace period), being deleted, or draining on the publishing node (listed in
  ``instance.draining_nodes``: the stored mark, whatever the runner's offline set says).
  Another node draining a shared Instance stays in its pool's ``nodeSelector`` (the slice
  admission policy ties the publisher to that list); a claim prepared there is refused
  (``Draining``). The remaining race (scheduler allocates a slot
  a device plugin claims at the same moment) is arbitrated by the Instance CAS: prepare fails
  with an error naming the holder.

**Offline devices are tainted, not hidden** (KEP-5055, ``DRADeviceTaints``): while this node
keeps a local Instance in its offline grace period its published slots stay, each with the
taint ``akri.sh/offline=<node>:NoSchedule`` — the scheduler skips them, a claim that tolerates
the taint can still get them. A shared pool is tainted only when every node serving it is
offline (``akri.sh/offline=<publisher>``); while one still sees the device, the pool just
leaves the others out. Once the grace is over and the node only drains, the slots leave the
slice, or, with the Configuration annotation ``akri.sh/dra-offline-evict: "true"``, the slots
DRA claims hold stay tainted ``NoExecute`` so the pods using the vanished device are evicted.
A slice with a tainted device holds at most 64 devices (128 otherwise).

**Consumable capacity** (KEP-5075, ``DRAConsumableCapacity``), opt-in with the Configuration
annotation ``akri.sh/dra-consumable-capacity: "true"``: one device per Instance, named after
it, with ``allowMultipleAllocations: true`` and a ``slots`` capacity equal to the Instance's
capacity (each allocation consumes 1 by default, any whole number up to the capacity), while
at least one slot is free or DRA-held; slots held through a device plugin lower the capacity.
The publisher falls back to one device per slot where the API server drops those fields.

**Extended resources** (KEP-5004): every device carries the bool attributes
``extendedResources`` (may serve ``akri.sh/<instance>`` limits) and
``configurationExtendedResources`` (``akri.sh/<configuration>`` limits), which the
DeviceClasses behind those names require (``agent/core/deviceclasses.py``). They are true only
where no node that can use the slot serves that name through a device plugin — the rule of
``agent/node/dra/name_paths.py``, from each node's mode (the label
``akri.sh/extended-resources`` on its local slices; a node that says nothing counts as device
plugins) and the Instances. A slot of a name served through device plugins stays allocatable to
explicit claims but never to a pod's extended-resource limit: in the seconds before kubelet
posts a freshly registered plugin's resource the scheduler would otherwise satisfy the limit
through DRA on that node, and its device plugin would never be asked.

Device names are DNS labels: the slot id when it is one, else a sanitised prefix + hash.
Attributes (≤ 32 per device, names are C identifiers ≤ 32 chars, string values ≤ 64 chars):
``configuration``, ``instance``, ``slot`` (int), ``shared`` (bool), ``extendedResources``
and ``configurationExtendedResources`` (bool), then device properties,
typed — integers as ``int``, ``true``/``false`` as ``bool``, semantic versions as ``version``,
other strings ≤ 64 chars as ``string`` — in name order until the limit. Properties that do not
fit (long values, names that cannot be C identifiers) are left out (they still reach the
container as env vars).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.core.model.device_usage import ClaimUsage, parse_usage
from agent.core.model.instance import Instance
from agent.core.model.naming import is_dns_label

# re-exported: the node's DRA modules (and tests) take them from here
from agent.core.model.resource_slices import DRIVER as DRIVER
from agent.core.model.resource_slices import HOSTNAME_LABEL as HOSTNAME_LABEL
from agent.core.model.resource_slices import selected_nodes as selected_nodes
from agent.core.model.resource_slices import serving_nodes as serving_nodes
from agent.core.model.resource_slices import shared_node_selector as shared_node_selector
from agent.core.model.resource_slices import shared_pool_nodes as shared_pool_nodes
from agent.core.model.resource_slices import shared_publisher as shared_publisher
from agent.node.dra.name_paths import MODE_LABEL, Eligibility, slot_eligibility

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64  # ResourceSliceMaxDevicesWithTaintsOrConsumesCounters
OFFLINE_TAINT = "akri.sh/offline"
CONSUMABLE_ANNOTATION = "akri.sh/dra-consumable-capacity"
EVICT_ANNOTATION = "akri.sh/dra-offline-evict"
SLOTS_CAPACITY = "slots"
USABLE, OFFLINE, DRAINING = "usable", "offline", "draining"
MAX_ATTRIBUTES = 32
MAX_ATTRIBUTE_NAME = 32
MAX_STRING_VALUE = 64
EXTENDED_ATTRIBUTE = "extendedResources"
CONFIGURATION_EXTENDED_ATTRIBUTE = "configurationExtendedResources"
# on a node's local ResourceSlices: the path that node serves akri.sh/* through ("dra" /
# "device-plugins"), read by the publishers of shared pools and by `akri status`
PATH_LABEL = MODE_LABEL
RESERVED_ATTRIBUTES = (
    "configuration",
    "instance",
    "slot",
    "shared",
    EXTENDED_ATTRIBUTE,
    CONFIGURATION_EXTENDED_ATTRIBUTE,
)
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INT = re.compile(r"^[+-]?\d{1,18}$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def typed_attribute(value: str) -> dict[str, Any] | None:
    """The typed DeviceAttribute for a property value, or None if it does not fit."""
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return {"bool": lowered == "true"}
    if _INT.match(value.strip()):
        number = int(value.strip())
        if -(2**63) <= number < 2**63:
            return {"int": number}
    if len(value) <= MAX_STRING_VALUE and _SEMVER.match(value.strip()):
        return {"version": value.strip()}
    if len(value) <= MAX_STRING_VALUE:
        return {"string": value}
    return None


def attribute_name(name: str) -> str | None:
    """A C identifier (≤ 32 chars) for a property name, or None."""
    candidate = re.sub(r"[^A-Za-z0-9_]", "_", name)
    if candidate and candidate[0].isdigit():
        candidate = "_" + candidate
    if not _C_IDENTIFIER.match(candidate) or len(candidate) > MAX_ATTRIBUTE_NAME:
        return None
    return candidate


def device_name(slot: str) -> str:
    """DRA device name (DNS label) for a slot id."""
    if is_dns_label(slot):
        return slot
    digest = hashlib.sha256(slot.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^a-z0-9-]", "-", slot.lower()).strip("-")[:50].strip("-")
    return f"{cleaned}-{digest}" if cleaned else f"d-{digest}"


def device_attributes(
    instance: Instance, index: int, *, extended: bool = True, configuration_extended: bool = True
) -> dict[str, dict[str, Any]]:
    """Typed attributes of one slot device."""
    return _with_slot(_instance_attributes(instance, extended, configuration_extended), index)


def _instance_attributes(
    instance: Instance, extended: bool = True, configuration_extended: bool = True
) -> dict[str, dict[str, Any]]:
    """The attributes every slot of ``instance`` shares (``slot`` is a placeholder).
    ``extendedResources`` / ``configurationExtendedResources``: whether the slots may serve
    pods' ``akri.sh/<instance>`` / ``akri.sh/<configuration>`` limits through DRA
    (:class:`SlotState`)."""
    attributes: dict[str, dict[str, Any]] = {
        "configuration": {"string": instance.configuration_name[:MAX_STRING_VALUE]},
        "instance": {"string": instance.name[:MAX_STRING_VALUE]},
        "slot": {},
        "shared": {"bool": instance.shared},
        EXTENDED_ATTRIBUTE: {"bool": extended},
        CONFIGURATION_EXTENDED_ATTRIBUTE: {"bool": configuration_extended},
    }
    for key, value in sorted(instance.broker_properties.items()):
        if len(attributes) >= MAX_ATTRIBUTES:
            break
        name = attribute_name(key)
        if name is None or name in attributes:
            continue
        typed = typed_attribute(value)
        if typed is not None:
            attributes[name] = typed
    return attributes


def _with_slot(common: dict[str, dict[str, Any]], index: int) -> dict[str, dict[str, Any]]:
    # the value dicts are shared between the slots of one Instance (never mutated): the
    # publisher keeps every slot's attributes, 4000+ maps at 1000 Instances
    return {name: {"int": index} if name == "slot" else value for name, value in common.items()}


@dataclass(frozen=True)
class DeviceOptions:
    """A Configuration's DRA opt-ins (its annotations)."""

    consumable: bool = False  # one device per Instance with a "slots" capacity
    evict: bool = False  # NoExecute taint on DRA-held slots while draining


@dataclass(frozen=True)
class SlotState:
    """How this node publishes one Instance: its availability here and its options."""

    availability: str = USABLE  # USABLE, OFFLINE (grace period) or DRAINING
    options: DeviceOptions = DeviceOptions()
    node: str = ""  # the taint's value
    # may serve pods' akri.sh/<instance> (extended) and akri.sh/<configuration>
    # (configuration_extended) limits through DRA: no node that can use the device serves that
    # name through a device plugin (agent/node/dra/name_paths.py; the classes require it)
    extended: bool = True
    configuration_extended: bool = True


def device_options(annotations: Mapping[str, str]) -> DeviceOptions:
    """The opt-ins a Configuration's annotations ask for (``"true"``, any case)."""
    return DeviceOptions(
        consumable=annotations.get(CONSUMABLE_ANNOTATION, "").strip().lower() == "true",
        evict=annotations.get(EVICT_ANNOTATION, "").strip().lower() == "true",
    )


def _is_dra_held(value: str) -> bool:
    # only "D:" values need parsing (this runs on every change)
    return value.startswith("D:") and isinstance(parse_usage(value), ClaimUsage)


def published_slots(instance: Instance, state: SlotState | bool) -> list[tuple[int, str]]:
    """(index, slot id) of the slots that belong in a slice: free or DRA-held slots, while
    the Instance is usable or offline (grace; tainted); only the DRA-held ones while draining
    with eviction on (tainted NoExecute); none otherwise. ``True``/``False``: draining /
    usable (the form before taints)."""
    if isinstance(state, bool):
        state = SlotState(DRAINING if state else USABLE)
    if instance.deletion_timestamp is not None:
        return []
    evicting = state.availability == DRAINING and state.options.evict
    if state.availability == DRAINING and not evicting:
        return []
    result = []
    device_usage = instance.device_usage
    for index, slot in enumerate(instance.slot_ids()):
        value = device_usage.get(slot, "")
        if (value == "" and not evicting) or _is_dra_held(value):
            result.append((index, slot))
    return result


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def taints(state: SlotState) -> list[dict[str, Any]]:
    """The taints of a device in ``state`` (none while usable). The value names the node
    that lost the device when the name is a valid label value (≤ 63 characters)."""
    if state.availability == OFFLINE:
        effect = "NoSchedule"
    elif state.availability == DRAINING and state.options.evict:
        effect = "NoExecute"
    else:
        return []
    taint = {"key": OFFLINE_TAINT, "effect": effect}
    if state.node and len(state.node) <= 63 and _LABEL_VALUE.match(state.node):
        taint["value"] = state.node
    return [taint]


@dataclass(frozen=True)
class Pool:
    """One pool this node publishes."""

    name: str
    node_name: str | None  # local pool
    nodes: tuple[str, ...] = ()  # shared pool: nodeSelector over these node names
    devices: tuple[dict[str, Any], ...] = field(default=())
    # shared pool: the Instance (uid, resourceVersion) this node's view of it comes from
    instance_uid: str | None = None
    instance_version: str | None = None

    def slice_specs(self) -> list[dict[str, Any]]:
        """Slice ``spec``s (without pool generation/count) of ≤ 128 devices each; an empty
        pool still gets one empty slice ("empty pool" ≠ "no pool")."""
        size = (
            MAX_DEVICES_PER_SLICE_WITH_TAINTS
            if any(d.get("taints") for d in self.devices)
            else MAX_DEVICES_PER_SLICE
        )
        chunks = [list(self.devices[i : i + size]) for i in range(0, len(self.devices), size)] or [
            []
        ]
        specs = []
        for chunk in chunks:
            spec: dict[str, Any] = {"driver": DRIVER, "devices": chunk}
            if self.node_name is not None:
                spec["nodeName"] = self.node_name
            else:
                spec["nodeSelector"] = shared_node_selector(self.nodes)
            specs.append(spec)
        return specs


DevicesOf = Callable[[Instance, SlotState], Sequence[dict[str, Any]]]
OptionsOf = Callable[[Instance], DeviceOptions]
ExtendedOf = Callable[[Instance], Eligibility]


def _no_options(instance: Instance) -> DeviceOptions:
    return DeviceOptions()


def slots_capacity(count: int) -> dict[str, Any]:
    """The ``slots`` capacity of a consumable device with ``count`` slots to give: each
    allocation takes 1 unless its request asks for more (whole numbers up to ``count``)."""
    return {
        SLOTS_CAPACITY: {
            "value": str(count),
            "requestPolicy": {
                "default": "1",
                "validRange": {"min": "1", "max": str(count), "step": "1"},
            },
        }
    }


def instance_devices(
    instance: Instance, state: SlotState | bool, *, binds_to_node: bool = True
) -> tuple[dict[str, Any], ...]:
    """The slice devices of one Instance: its published slots with their attributes, or (with
    consumable capacity) one device for all of them; tainted while offline or evicting.

    A shared Instance's devices carry ``bindsToNode: true`` (unless ``binds_to_node`` is off:
    the API server drops the field): the scheduler then pins a claim's allocation to the one
    node it chose (``nodeSelector`` ``metadata.name In [<node>]``) instead of copying the
    pool's selector over all the Instance's nodes. A slot is prepared for one node anyway
    (``D:<claim>:<node>``), and only an allocation pinned to the agent's own node lets the
    agent write the claim's ``status.devices`` with ``associated-node:update`` (1.36's granular
    status authorization; the real API server answered 422 on every shared device before)."""
    if isinstance(state, bool):
        state = SlotState(DRAINING if state else USABLE)
    slots = published_slots(instance, state)
    if not slots:
        return ()
    common = _instance_attributes(instance, state.extended, state.configuration_extended)
    extra: dict[str, Any] = {}
    if instance.shared and binds_to_node:
        extra["bindsToNode"] = True
    tainted = taints(state)
    if tainted:
        extra["taints"] = tainted
    if state.options.consumable:
        attributes = {name: value for name, value in common.items() if name != "slot"}
        return (
            {
                "name": device_name(instance.name),
                "attributes": attributes,
                "allowMultipleAllocations": True,
                "capacity": slots_capacity(len(slots)),
                **extra,
            },
        )
    return tuple(
        {"name": device_name(slot), "attributes": _with_slot(common, index), **extra}
        for index, slot in slots
    )


def availability(instance: Instance, node: str, offline: Collection[str]) -> str:
    """``node``'s view of ``instance``: DRAINING (the stored mark: e.g. adopted draining after
    another node re-created it), OFFLINE (in its grace period here, or draining before the
    mark is written) or USABLE."""
    if node in instance.draining_nodes:
        return DRAINING
    if instance.name in offline:
        return OFFLINE
    return USABLE


def unusable_here(instance: Instance, node: str, offline: Collection[str]) -> bool:
    """Whether ``node`` must not offer ``instance``'s slots untainted."""
    return availability(instance, node, offline) != USABLE


def _state(
    instance: Instance,
    node: str,
    offline: Collection[str],
    options_of: OptionsOf,
    extended_of: ExtendedOf,
) -> SlotState:
    eligible = extended_of(instance)
    return SlotState(
        availability(instance, node, offline),
        options_of(instance),
        node,
        eligible.instance,
        eligible.configuration,
    )


def _devices(
    instances: Iterable[Instance],
    node: str,
    offline: Collection[str],
    devices_of: DevicesOf,
    options_of: OptionsOf,
    extended_of: ExtendedOf,
) -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = []
    for instance in sorted(instances, key=lambda i: i.name):
        state = _state(instance, node, offline, options_of, extended_of)
        devices.extend(devices_of(instance, state))
    return devices


def _always_extended(instance: Instance) -> Eligibility:
    return Eligibility(True, True)


def extended_eligibility(instances: Sequence[Instance], paths: Mapping[str, str]) -> ExtendedOf:
    """``extended_of`` for :func:`desired_pools`: whether an Instance's slots may serve pods'
    ``akri.sh/<instance>`` and ``akri.sh/<configuration>`` limits through DRA, from every
    node's mode (``paths``: node -> mode, unknown nodes count as device plugins) and
    ``instances`` (all this node knows: the configuration-level name depends on the nodes the
    Configuration's shared Instances link). A slot eligible for a name on a node that serves
    that name through a device plugin would be allocated through DRA there — whose kubelet had
    not posted the plugin's resource yet (< 10 s after registration) — and the device plugin
    would never be asked (KEP-5004's "never both on one node"): the rule of
    :mod:`agent.node.dra.name_paths`."""
    return slot_eligibility(instances, paths)


def desired_pools(
    instances: Sequence[Instance],
    node: str,
    offline: Collection[str],
    devices_of: DevicesOf = instance_devices,
    options_of: OptionsOf = _no_options,
    extended_of: ExtendedOf = _always_extended,
    unready: Collection[str] = (),
) -> list[Pool]:
    """The pools ``node`` must publish: its local pool (always, possibly empty) and the pool of
    every shared Instance for which it is the publishing node (:func:`shared_publisher`), over
    the nodes that serve it and see the device (:func:`shared_pool_nodes`; ``offline`` says
    which Instances this node does not see now, before its own mark reaches the Instance),
    tainted when none does. ``devices_of`` may be a memoized :func:`instance_devices`
    (the publisher caches it per Instance version); ``options_of`` gives each Instance's
    Configuration opt-ins, ``extended_of`` whether its slots may serve extended resources
    (:func:`extended_eligibility`); ``unready``: the nodes whose Node does not serve (no
    shared pool selects them, none of them publishes one — this node neither, when it is
    one of them)."""
    local = [i for i in instances if not i.shared and node in i.nodes]
    pools = [
        Pool(
            name=node,
            node_name=node,
            devices=tuple(_devices(local, node, offline, devices_of, options_of, extended_of)),
        )
    ]
    for instance in sorted(instances, key=lambda i: i.name):
        if not instance.shared:
            continue
        nodes, all_offline = shared_pool_nodes(instance, node, instance.name in offline, unready)
        if not nodes or nodes[0] != node:
            continue
        if node in instance.draining_nodes:
            available = DRAINING  # every serving node drains (serving_nodes)
        else:
            available = OFFLINE if all_offline else USABLE
        eligible = extended_of(instance)
        state = SlotState(
            available, options_of(instance), node, eligible.instance, eligible.configuration
        )
        pools.append(
            Pool(
                name=instance.name,
                node_name=None,
                nodes=nodes,
                devices=tuple(devices_of(instance, state)),
                instance_uid=instance.uid,
                instance_version=instance.resource_version,
            )
        )
    return pools


def same_slice_content(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether a stored slice ``spec`` has the ``wanted`` content (``pool`` aside). A plain
    comparison — JSON from the API server compares equal to the dicts we build — except that
    an empty list is stored as absent (``omitempty``), so absent and empty are the same."""

    def present(spec: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in spec.items() if k != "pool" and v != []}

    return present(without_taint_times(stored)) == present(wanted)


def without_taint_times(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """``spec`` without the ``timeAdded`` the API server stamps on taints we send without one
    (so a stored tainted slice still compares equal to what we would send)."""
    devices = spec.get("devices")
    if not devices or not any(isinstance(d, dict) and d.get("taints") for d in devices):
        return spec
    cleaned = []
    for device in devices:
        if isinstance(device, dict) and device.get("taints"):
            device = {
                **device,
                "taints": [
                    {k: v for k, v in t.items() if k != "timeAdded"} for t in device["taints"]
                ],
            }
        cleaned.append(device)
    return {**spec, "devices": cleaned}


def slot_for_device(
    pool: str, device: str, instances: Mapping[str, Instance], node: str
) -> tuple[Instance, str] | None:
    """Resolve an allocated (pool, device) back to (Instance, slot id)."""
    candidates: Iterable[Instance]
    if pool == node:
        candidates = [i for i in instances.values() if not i.shared and node in i.nodes]
    else:
        found = instances.get(pool)
        candidates = [found] if found is not None else []
    for instance in candidates:
        for slot in instance.slot_ids():
            if device_name(slot) == device:
                return instance, slot
    return None


def consumable_instance(
    pool: str, device: str, instances: Mapping[str, Instance], node: str
) -> Instance | None:
    """Resolve an allocated consumable-capacity device (one per Instance) to its Instance."""
    candidates: Iterable[Instance]
    if pool == node:
        candidates = [i for i in instances.values() if not i.shared and node in i.nodes]
    else:
        found = instances.get(pool)
        candidates = [found] if found is not None else []
    return next((i for i in candidates if device_name(i.name) == device), None)


def consumed_slots(result: Mapping[str, Any]) -> int:
    """How many slots an allocation result of a consumable device takes: its
    ``consumedCapacity.slots`` (a whole-number Quantity), 1 when absent."""
    value = (result.get("consumedCapacity") or {}).get(SLOTS_CAPACITY)
    if value is None:
        return 1
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"consumedCapacity.{SLOTS_CAPACITY} {value!r} is not a whole number")
    return int(text)
