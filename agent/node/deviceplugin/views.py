"""Pure views: which devices each plugin lists, and which are Healthy.

The rule behind every choice (DESIGN.md invariant 2): a device is Healthy exactly when an
Allocate for it would succeed on the current cache.

Instance-level plugin (resource ``akri.sh/<instance>``, on nodes in ``instance.nodes``): lists
every slot ``<instance>-<n>`` (n < capacity).

* held by this node's IL plugin → Healthy (kubelet re-offering its own device is idempotent);
* free, with held count < capacity → Healthy;
* held by anyone else (another node, this node's CL or DRA), draining, unknown → Unhealthy;
* every slot is Unhealthy while the device is offline (grace period), this node is draining
  the Instance (listed in ``instance.draining_nodes``: the stored mark counts, whatever the
  runner's offline set says) or the Instance is being deleted.

Configuration-level plugin (resource ``akri.sh/<configuration>``): virtual devices
``<configuration>-<k>``, as in Akri:

* one per slot this node's CL plugin holds (``C:<vdev>:<node>``), Healthy (idempotent
  re-allocation) unless its Instance is offline or draining on this node;
* plus one free vdev per Instance (on this node, online, not draining) that has a free slot,
  Healthy,
  numbered with the lowest free numbers in Instance-name order.

So a single container is never offered more CL devices than there are distinct Instances with
room, and the count shown to kubelet is what can really be given.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from agent.core.ledger.decisions import free_slots, held_count
from agent.core.model.device_usage import ConfigurationUsage, NodeUsage, format_usage, parse_usage
from agent.core.model.instance import Instance
from agent.core.model.naming import configuration_resource_name

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
RESOURCE_PREFIX = "akri.sh/"


def instance_resource(instance: str) -> str:
    """Kubelet resource name of the IL plugin."""
    return RESOURCE_PREFIX + instance


def configuration_resource(configuration: str) -> str:
    """Kubelet resource name of the CL plugin."""
    return RESOURCE_PREFIX + configuration_resource_name(configuration)


@dataclass(frozen=True)
class DeviceView:
    """One device as kubelet will see it."""

    id: str
    healthy: bool


@dataclass(frozen=True)
class VirtualDevice:
    """A CL virtual device: bound to an Instance, and to a slot once held."""

    id: str
    instance: str
    slot: str | None
    healthy: bool


def instance_devices(instance: Instance, node: str, offline: bool) -> list[DeviceView]:
    """The IL plugin's device list for ``instance`` on ``node``."""
    if node not in instance.nodes:
        return []
    unavailable = (
        offline or instance.deletion_timestamp is not None or node in instance.draining_nodes
    )
    room = held_count(instance) < instance.capacity
    usage = instance.device_usage
    # compared as strings, not parsed (this runs for every slot on every Instance change):
    # this node's IL value is the bare node name (format_usage(NodeUsage(node))), free is ""
    mine = format_usage(NodeUsage(node))
    free_healthy = room and not unavailable
    result = []
    for slot in instance.slot_ids():
        value = usage.get(slot, "")
        if value == mine:
            healthy = not unavailable
        elif value == "":
            healthy = free_healthy
        else:
            healthy = False
        result.append(DeviceView(slot, healthy))
    return result


def instance_health_key(instance: Instance, node: str, offline: bool) -> Hashable:
    """What :func:`instance_devices` depends on, computed without a Python loop over the
    slots in the common cases: two Instances with equal keys have equal lists (the converse
    need not hold: a key may change while the list does not).

    The list is every slot id (name, capacity) with a health that follows from whether the
    Instance is unavailable, whether it has room, and each slot's kind: this node's IL value,
    free, or anything else. With room, mine and free slots are Healthy alike, so only the
    other slots matter; without room only this node's slots are Healthy. A new IL claim of a
    slot (free → mine) with room left thus keeps the key: kubelet's list does not change."""
    if node not in instance.nodes:
        return None
    if offline or instance.deletion_timestamp is not None or node in instance.draining_nodes:
        return (instance.name, instance.capacity, False)
    usage = instance.device_usage
    values = usage.values()
    mine = format_usage(NodeUsage(node))
    free = operator.countOf(values, "")
    if len(usage) - free < instance.capacity:  # room (held_count, inlined)
        if free + operator.countOf(values, mine) == len(usage):
            return (instance.name, instance.capacity, True, True, frozenset())
        others = frozenset(slot for slot, value in usage.items() if value and value != mine)
        return (instance.name, instance.capacity, True, True, others)
    held = frozenset(slot for slot, value in usage.items() if value == mine)
    return (instance.name, instance.capacity, True, False, held)


class InstanceDevices:
    """:func:`instance_devices` for one (Instance name, node), the list kept (the very same
    tuple) while :func:`instance_health_key` says it cannot have changed: a stream that gets
    the tuple it last sent knows, without comparing 1,000 devices, that it has nothing to
    send."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._key: Hashable = ()  # no Instance's key
        self._devices: tuple[DeviceView, ...] = ()
        self.computed = 0  # lists built, for tests

    def __call__(self, instance: Instance | None, offline: bool) -> tuple[DeviceView, ...]:
        if instance is None:
            key: Hashable = None
        else:
            key = instance_health_key(instance, self.node, offline)
        if key != self._key:
            self._key = key
            self._devices = (
                () if instance is None else tuple(instance_devices(instance, self.node, offline))
            )
            self.computed += 1
        return self._devices


@dataclass(frozen=True)
class _InstancePart:
    """What one Instance contributes to the CL list: the vdevs this node holds in it (slot
    order; Healthy unless the Instance is being deleted or this node drains it), and whether
    it has a free slot. ``unavailable``: being deleted, or draining on this node (no free
    vdev then)."""

    held: tuple[VirtualDevice, ...]
    has_free: bool
    unavailable: bool


def _instance_part(instance: Instance, node: str) -> _InstancePart:
    unavailable = instance.deletion_timestamp is not None or node in instance.draining_nodes
    usage_map = instance.device_usage
    values = usage_map.values()
    free = operator.countOf(values, "")
    # held_count < capacity: then some slot id below capacity is free (free_slots is
    # non-empty), found without listing them
    has_free = len(usage_map) - free < instance.capacity
    held = []
    # the common case (free and IL slots only, as during a burst of IL Allocates) is
    # counted in C; only Instances with other values are scanned for CL ones
    if free + operator.countOf(values, format_usage(NodeUsage(node))) != len(usage_map):
        for slot, value in sorted(usage_map.items()):
            if not value.startswith("C:"):
                continue  # free, another node's IL slot, DRA, unknown: not a held vdev
            usage = parse_usage(value)
            if isinstance(usage, ConfigurationUsage) and usage.node == node:
                held.append(VirtualDevice(usage.vdev, instance.name, slot, not unavailable))
    return _InstancePart(tuple(held), has_free, unavailable)


class ConfigurationDevices:
    """:func:`configuration_devices` for one (configuration, node), with each Instance's part
    (its slots parsed, its vdevs built) kept until the Instance object changes. The store's
    objects are immutable and replaced on every change, so an Instance is recognised by
    identity: a computation parses only the Instances that changed, and reuses the free vdev
    of an Instance whose number did not change. When no part changed (an IL claim of another
    slot of an Instance with room left, say), the very same tuple as last time is returned:
    a stream that sent it knows without comparing it that it has nothing new to send."""

    def __init__(self, configuration: str, node: str) -> None:
        self.configuration = configuration
        self.node = node
        self.prefix = configuration_resource_name(configuration)
        self._parts: dict[str, tuple[Instance, _InstancePart]] = {}
        self._free: dict[str, tuple[int, VirtualDevice]] = {}  # Instance -> its free vdev
        self._offline: frozenset[str] = frozenset()  # of the Instances in _parts, last time
        self._result: tuple[VirtualDevice, ...] | None = None
        self.parsed = 0  # Instances (re)parsed, for tests

    def __call__(
        self, instances: Iterable[Instance], offline: Collection[str]
    ) -> tuple[VirtualDevice, ...]:
        node = self.node
        configuration = self.configuration
        previous = self._parts
        parts: dict[str, tuple[Instance, _InstancePart]] = {}
        same = self._result is not None
        for inst in instances:
            if inst.configuration_name != configuration or node not in inst.nodes:
                continue
            entry = previous.get(inst.name)
            if entry is None or entry[0] is not inst:
                part = _instance_part(inst, node)
                self.parsed += 1
                if entry is None or entry[1] != part:
                    same = False
                entry = (inst, part)
            parts[inst.name] = entry
        self._parts = parts
        offline_here = frozenset(name for name in offline if name in parts)
        if same and parts.keys() == previous.keys() and offline_here == self._offline:
            assert self._result is not None
            return self._result  # every part as before: the list is too
        self._offline = offline_here
        names = sorted(parts)
        result: list[VirtualDevice] = []
        used_ids: set[str] = set()
        for name in names:
            part = parts[name][1]
            if not part.held:
                continue
            offline_now = name in offline
            for vdev in part.held:
                if vdev.id in used_ids:
                    continue  # the same vdev twice would confuse kubelet; the reclaimer sorts it
                used_ids.add(vdev.id)
                result.append(replace(vdev, healthy=False) if offline_now else vdev)
        dash = self.prefix + "-"
        used_numbers = {
            int(tail)
            for vdev_id in used_ids
            if vdev_id.startswith(dash)
            and (tail := vdev_id[len(dash) :]).isascii()
            and tail.isdigit()
            and str(int(tail)) == tail
        }
        free_before = self._free
        free: dict[str, tuple[int, VirtualDevice]] = {}
        number = 0
        for name in names:
            part = parts[name][1]
            if not part.has_free or part.unavailable or name in offline:
                continue
            while number in used_numbers:
                number += 1
            kept = free_before.get(name)
            vdev = (
                kept[1]
                if kept is not None and kept[0] == number
                else VirtualDevice(f"{dash}{number}", name, None, True)
            )
            free[name] = (number, vdev)
            result.append(vdev)
            number += 1
        self._free = free
        self._result = tuple(result)
        return self._result


def configuration_devices(
    configuration: str,
    instances: Sequence[Instance],
    node: str,
    offline: Collection[str],
) -> list[VirtualDevice]:
    """The CL plugin's device list: held vdevs, then one free vdev per Instance with room."""
    return list(ConfigurationDevices(configuration, node)(instances, offline))


@dataclass(frozen=True)
class ClChoice:
    """Where to try to put one requested vdev: candidate Instances in order of preference.
    ``moved_from``: the Instance where this node holds the vdev for a gone container, to be
    released once the vdev has its new slot (it shared an Instance with another vdev of the
    same request)."""

    vdev: str
    held_in: str | None
    candidates: tuple[str, ...]
    moved_from: str | None = None


class InsufficientInstancesError(ValueError):
    """More CL devices requested than there are distinct Instances with room."""


def plan_configuration_allocation(
    requested: Sequence[str],
    devices: Sequence[VirtualDevice],
    instances: Mapping[str, Instance],
) -> list[ClChoice]:
    """For one container request: the vdevs it already holds stay where they are; every other
    vdev gets distinct Instances, its own bound Instance first, then the Instance with the most
    free slots. Raises :class:`InsufficientInstancesError` when not enough Instances remain.

    Two held vdevs of one Instance in one request (two containers each had one; both ended,
    and kubelet, which sees both free and Healthy, gives both to a new container): the first
    stays, the others are placed like new vdevs and ``moved_from`` their old Instance. kubelet
    gave their ids to this container, so no other container on this node uses them: the old
    slot is stale and is released once the new one is held (issue 23, 7d)."""
    by_id = {d.id: d for d in devices}
    taken: set[str] = set()
    choices: list[ClChoice] = []
    moving: dict[str, str] = {}  # vdev -> the Instance it leaves
    for vdev in requested:
        device = by_id.get(vdev)
        if device is not None and device.slot is not None:
            if device.instance in taken:
                moving[vdev] = device.instance
                continue
            taken.add(device.instance)
            choices.append(ClChoice(vdev, device.instance, (device.instance,)))
    pending = [v for v in requested if by_id.get(v) is None or by_id[v].slot is None or v in moving]
    for vdev in pending:
        device = by_id.get(vdev)
        ranked = sorted(
            (i for i in instances.values() if i.name not in taken and free_slots(i)),
            key=lambda i: (-len(free_slots(i)), i.name),
        )
        order = [i.name for i in ranked]
        if device is not None and device.instance in order:
            order.remove(device.instance)
            order.insert(0, device.instance)
        if not order:
            raise InsufficientInstancesError(
                f"cannot allocate {len(requested)} device(s) of this configuration: "
                "not enough distinct instances with a free slot"
            )
        taken.add(order[0])
        choices.append(ClChoice(vdev, None, tuple(order), moving.get(vdev)))
    return choices


def preferred_configuration_devices(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    devices: Sequence[VirtualDevice],
    instances: Mapping[str, Instance],
) -> list[str]:
    """GetPreferredAllocation for CL: must-includes, then vdevs of distinct Instances, the
    least-used (most free slots) first."""
    by_id = {d.id: d for d in devices}
    chosen = [v for v in must_include if v in available][:size]
    used_instances = {by_id[v].instance for v in chosen if v in by_id}

    def rank(vdev: str) -> tuple[int, int, str]:
        device = by_id.get(vdev)
        if device is None:
            return (2, 0, vdev)
        inst = instances.get(device.instance)
        free = len(free_slots(inst)) if inst is not None else 0
        return (0 if device.instance not in used_instances else 1, -free, vdev)

    for vdev in sorted((v for v in available if v not in chosen), key=rank):
        if len(chosen) >= size:
            break
        device = by_id.get(vdev)
        if device is not None and device.instance in used_instances:
            continue
        chosen.append(vdev)
        if device is not None:
            used_instances.add(device.instance)
    for vdev in available:  # fill up if distinct Instances ran out (kubelet would anyway)
        if len(chosen) >= size:
            break
        if vdev not in chosen:
            chosen.append(vdev)
    return chosen
