"""The slots this node holds, per Instance, kept up to date from Instance events.

Split out of :mod:`agent.node.deviceplugin.reclaimer`: both reclaimers (device plugins here,
DRA in :mod:`agent.node.dra.reclaim`, with its own ``extract``) and nothing else need to know
which slots this node holds, and keeping that index cheap is a job of its own — apart from
*when* a held slot is freed (the reclaimers' timing and release decisions).

Idle cost. The index is fed by the store's Instance events, so keeping it costs
O(events), not a parse of every slot of every Instance: an update parses only the slots whose
value changed. :func:`follow_until_held` lets a reclaimer sleep on the event stream while the
node holds nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from agent.core.aio.events import Subscription
from agent.core.model.device_usage import ConfigurationUsage, NodeUsage, parse_usage
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import EventType, InstanceEvent
from agent.node.deviceplugin.views import configuration_resource, instance_resource

SlotKey = tuple[ObjectKey, str]  # (instance, slot)


@dataclass(frozen=True)
class HeldSlot:
    """A slot this node holds through a device plugin, and the kubelet ID that proves use."""

    instance: ObjectKey
    slot: str
    value: str
    resource: str
    device_id: str

    @property
    def key(self) -> SlotKey:
        return (self.instance, self.slot)


def held_slot(instance: Instance, slot: str, value: str, node: str) -> HeldSlot | None:
    """``slot`` (holding ``value``) as an IL/CL slot ``node`` holds, or None."""
    if not value or value.startswith("D:"):
        return None  # free (most slots), or DRA's
    usage = parse_usage(value)
    if usage == NodeUsage(node):
        return HeldSlot(instance.key, slot, value, instance_resource(instance.name), slot)
    if isinstance(usage, ConfigurationUsage) and usage.node == node:
        resource = configuration_resource(instance.configuration_name)
        return HeldSlot(instance.key, slot, value, resource, usage.vdev)
    return None


SlotExtractor = Callable[[Instance, str, str, str], HeldSlot | None]


def held_in(
    instance: Instance, node: str, extract: SlotExtractor = held_slot
) -> tuple[HeldSlot, ...]:
    """The slots of one Instance that ``node`` holds (IL/CL by default)."""
    result = []
    for slot, value in sorted(instance.device_usage.items()):
        if value and (held := extract(instance, slot, value, node)) is not None:
            result.append(held)
    return tuple(result)


async def follow_until_held(
    index: HeldIndex,
    subscription: Subscription[InstanceEvent],
    idle: asyncio.Event,
    current: Callable[[], bool] = lambda: True,
) -> bool:
    """Apply Instance events to ``index`` until this node holds a slot (or ``current()``
    turns False); ``idle`` is set meanwhile. False when the subscription ended."""
    idle.set()
    try:
        while not index and current():
            try:
                event = await anext(subscription)
            except StopAsyncIteration:
                return False
            index.apply(event)
        return True
    finally:
        idle.clear()


class HeldIndex:
    """The slots ``node`` holds (``extract``: IL/CL by default), per Instance, kept up to date
    by :meth:`update` / :meth:`remove` (from Instance events) or :meth:`sync` (from a list).
    Instances for which ``served`` is False are left out.

    An update costs what changed: the slots whose value differs from the object the entry
    was computed from are found with a set difference of the two ``deviceUsage`` maps (done in
    C), and only those are parsed — a claim on an Instance of capacity 1000 parses one slot,
    not a thousand."""

    def __init__(
        self,
        node: str,
        served: Callable[[Instance], bool] = lambda _: True,
        extract: SlotExtractor = held_slot,
    ) -> None:
        self.node = node
        self._served = served
        self._extract = extract
        self._held: dict[ObjectKey, dict[str, HeldSlot]] = {}  # only Instances with held slots
        self._seen: dict[ObjectKey, Instance] = {}  # the object each entry was computed from
        self.parsed = 0  # slots parsed (tests)

    def update(self, instance: Instance) -> None:
        """Record the current state of ``instance``."""
        key = instance.key
        if not self._served(instance):
            self.remove(key)
            return
        previous = self._seen.get(key)
        self._seen[key] = instance
        if previous is instance:
            return
        if (
            previous is None
            or previous.configuration_name != instance.configuration_name
            or previous.name != instance.name
        ):
            held = {h.slot: h for h in held_in(instance, self.node, self._extract)}
            self.parsed += len(instance.device_usage)
        else:
            changed = {
                slot for slot, _ in previous.device_usage.items() ^ instance.device_usage.items()
            }
            if not changed:
                return  # no slot changed (status, nodes, properties, resourceVersion only)
            held = dict(self._held.get(key, {}))
            for slot in changed:
                value = instance.device_usage.get(slot, "")
                found = self._extract(instance, slot, value, self.node) if value else None
                self.parsed += 1
                if found is None:
                    held.pop(slot, None)
                else:
                    held[slot] = found
        if held:
            self._held[key] = held
        else:
            self._held.pop(key, None)

    def remove(self, name: ObjectKey) -> None:
        """``name`` was deleted."""
        self._seen.pop(name, None)
        self._held.pop(name, None)

    def apply(self, event: InstanceEvent) -> None:
        """Apply one store event."""
        if event.type == EventType.DELETED:
            self.remove(event.instance.key)
        else:
            self.update(event.instance)

    def sync(self, instances: Iterable[Instance]) -> None:
        """Make the index match ``instances`` (every cached Instance)."""
        names = set()
        for instance in instances:
            names.add(instance.key)
            self.update(instance)
        for name in [n for n in self._seen if n not in names]:
            self.remove(name)

    def clear(self) -> None:
        self._held.clear()
        self._seen.clear()

    def slots_of(self, key: ObjectKey) -> tuple[HeldSlot, ...]:
        """The slots this node holds in one Instance (as last updated)."""
        return tuple(self._held.get(key, {}).values())

    def keys(self) -> list[ObjectKey]:
        """The Instances recorded (held slots or not)."""
        return list(self._seen)

    def __bool__(self) -> bool:
        return bool(self._held)

    def __len__(self) -> int:
        return sum(len(slots) for slots in self._held.values())

    def __iter__(self) -> Iterator[HeldSlot]:
        for key in list(self._held):
            slots = self._held[key]
            yield from sorted(slots.values(), key=lambda h: h.slot)
