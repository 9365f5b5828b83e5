"""Pure slot decisions over one Instance: who may take which slot.

No I/O here. Each function takes an Instance (as cached or freshly re-read) and a request and
returns either the new ``deviceUsage`` or a refusal with a reason. The ledger applies the new
map with a resourceVersion-checked write, re-deciding on conflict, so the rules below are
enforced against the exact version being replaced.

Rules (invariant 1 of DESIGN.md):

* only a node listed in ``instance.nodes`` may claim a slot (it sees the device), and not
  while it is *draining* there (``instance.draining_nodes``: it keeps the slots it holds —
  kubelet re-offering one of them is still granted — but takes no new one);
* a slot is one of ``<instance>-0`` … ``<instance>-<capacity-1>``; anything else is refused;
* a slot has at most one holder: a claim succeeds only on a free slot, or on a slot already
  held by exactly the same owner (idempotent: "kubelet knows best"), or on a slot whose
  current holder the caller has proven stale (``reclaimable``: usage values of this node whose
  containers no longer exist, per kubelet's pod-resources API) — the latter only while the
  held count is within capacity, so draining slots are not kept alive by a takeover;
* held slots never exceed capacity: held entries at indexes ≥ capacity (left by a capacity
  decrease) count against capacity until released;
* values we cannot parse count as held and are never handed out;
* a release only frees a slot held by the releasing owner; releasing a free slot is a no-op;
* a new Instance starts with every slot free except those this node's kubelet or DRA
  checkpoint already shows in use (:func:`initial_usage`), and a node joining or re-joining
  an Instance takes the free slots its evidence shows in use (:func:`decide_adopt`; a slot
  held by someone else is reported, never taken): re-creating an Instance never hands out a
  slot a running container holds;
* a spec change (capacity, nodes, properties) keeps every held slot (:func:`decide_update`);
* a node leaves an Instance only while it holds none of its slots (:func:`decide_leave`);
  until then it is *draining*. The last node deletes the Instance only when no slot is held
  by anyone.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from agent.core.model.device_usage import (
    FREE,
    ClaimUsage,
    ConfigurationUsage,
    Free,
    HeldUsage,
    NodeUsage,
    SlotUsage,
    format_usage,
    holder_node,
    parse_usage,
)
from agent.core.model.instance import Instance
from agent.core.model.naming import DRAINING_ANNOTATION, parse_slot_id, slot_id


@dataclass(frozen=True)
class Owner:
    """Who takes a slot: a usage value for one node (IL, CL vdev, or DRA claim)."""

    usage: HeldUsage

    @classmethod
    def instance_level(cls, node: str) -> Owner:
        return cls(NodeUsage(node))

    @classmethod
    def configuration_level(cls, vdev: str, node: str) -> Owner:
        return cls(ConfigurationUsage(vdev, node))

    @classmethod
    def claim(cls, claim_uid: str, node: str) -> Owner:
        return cls(ClaimUsage(claim_uid, node))

    @property
    def value(self) -> str:
        """The deviceUsage string this owner writes."""
        return format_usage(self.usage)

    @property
    def node(self) -> str:
        return self.usage.node


@dataclass(frozen=True)
class Granted:
    """The claim succeeded. ``changed`` is False when the owner already held the slot."""

    slot: str
    device_usage: Mapping[str, str]
    changed: bool
    replaced: str = ""


@dataclass(frozen=True)
class Refused:
    """The claim or release was refused; ``reason`` is a short code, ``message`` says why."""

    reason: str
    message: str


@dataclass(frozen=True)
class Released:
    """Slots freed (``changed`` False if there was nothing to free)."""

    slots: tuple[str, ...]
    device_usage: Mapping[str, str]
    changed: bool


def usage_map(instance: Instance) -> dict[str, SlotUsage]:
    """Every slot index < capacity plus any held slot beyond it, parsed."""
    result: dict[str, SlotUsage] = {sid: FREE for sid in instance.slot_ids()}
    for key, value in instance.device_usage.items():
        parsed = parse_usage(value)
        if key in result or not isinstance(parsed, Free):
            result[key] = parsed
    return result


def held_count(instance: Instance) -> int:
    """Number of slots currently held (including unknown values and beyond-capacity slots).
    Only ``""`` is free (see :func:`parse_usage`), so this counts non-empty values, in C:
    it runs on every Instance change, at every capacity."""
    usage = instance.device_usage
    return len(usage) - operator.countOf(usage.values(), "")


def free_slots(instance: Instance) -> list[str]:
    """Free slot ids in index order, empty if the held count already reaches capacity."""
    if held_count(instance) >= instance.capacity:
        return []
    usage = instance.device_usage
    return [sid for sid in instance.slot_ids() if not usage.get(sid)]  # "" or absent: free


def slots_held_by(instance: Instance, owner: Owner) -> list[str]:
    """Slot ids held by exactly ``owner`` (compared as strings: no slot is parsed)."""
    value = owner.value
    if value not in instance.device_usage.values():  # the common case, scanned in C
        return []
    return sorted(
        (sid for sid, held in instance.device_usage.items() if held == value),
        key=lambda sid: parse_slot_id(instance.name, sid) or 0,
    )


def _with(instance: Instance, slot: str, value: str) -> dict[str, str]:
    usage = dict(instance.device_usage)
    usage[slot] = value
    return usage


def decide_claim(
    instance: Instance,
    slot: str,
    owner: Owner,
    *,
    reclaimable: Collection[str] = (),
) -> Granted | Refused:
    """Claim a specific slot for ``owner``."""
    # a terminating Instance (its akri.sh/slots finalizer waits for its holders) gives no new
    # slot, but kubelet re-asking for the one its owner holds is granted below
    if instance.deletion_timestamp is not None and instance.device_usage.get(slot) != owner.value:
        return Refused("Deleting", f"instance {instance.name} is being deleted")
    if owner.node not in instance.nodes:
        return _not_on_node(instance, owner)
    index = parse_slot_id(instance.name, slot)
    if index is None:
        return Refused("UnknownSlot", f"{slot!r} is not a slot of instance {instance.name}")
    current_value = instance.device_usage.get(slot, "")
    if current_value and current_value == owner.value:
        # kubelet re-offering a slot this owner holds: O(1), no copy, nothing to write. Before
        # the capacity check: a slot draining beyond a lowered capacity is still this owner's,
        # and kubelet hands an init container's devices to the app containers with a new
        # Allocate (issue 23, 7b)
        return Granted(slot, instance.device_usage, changed=False)
    if index >= instance.capacity:
        return Refused(
            "UnknownSlot",
            f"{slot} is beyond the capacity {instance.capacity} of instance {instance.name}",
        )
    if owner.node in instance.draining_nodes:
        return _draining(instance, owner)
    current = parse_usage(current_value)
    if not isinstance(current, Free):
        if (
            current_value in reclaimable
            and owner.node == holder_node(current)
            # over capacity (draining after a decrease): let the stale slot go instead
            and held_count(instance) <= instance.capacity
        ):
            return Granted(slot, _with(instance, slot, owner.value), True, current_value)
        return Refused("SlotInUse", f"slot {slot} is held by {current_value!r}")
    if held_count(instance) >= instance.capacity:
        return Refused(
            "CapacityReached",
            f"instance {instance.name} has all {instance.capacity} slots in use",
        )
    return Granted(slot, _with(instance, slot, owner.value), changed=True)


def _draining(instance: Instance, owner: Owner) -> Refused:
    return Refused(
        "Draining",
        f"node {owner.node} is draining instance {instance.name}: it keeps only the slots "
        "its containers already use there and takes no new one",
    )


def _not_on_node(instance: Instance, owner: Owner) -> Refused:
    return Refused(
        "NotOnNode",
        f"node {owner.node} is not in the nodes of instance {instance.name} "
        f"({', '.join(instance.nodes) or 'none'}): it does not see the device",
    )


def decide_claim_any(
    instance: Instance,
    owner: Owner,
    *,
    reclaimable: Collection[str] = (),
) -> Granted | Refused:
    """Claim one slot for ``owner``: the one it already holds, else the lowest free slot,
    else a slot the caller proved stale."""
    held = slots_held_by(instance, owner)
    if held:
        return Granted(held[0], instance.device_usage, changed=False)
    if owner.node not in instance.nodes:
        return _not_on_node(instance, owner)
    if owner.node in instance.draining_nodes:
        return _draining(instance, owner)
    for sid in free_slots(instance):
        return decide_claim(instance, sid, owner)
    for sid in instance.slot_ids():
        value = instance.device_usage.get(sid, "")
        if value and value in reclaimable:
            result = decide_claim(instance, sid, owner, reclaimable=reclaimable)
            if isinstance(result, Granted):
                return result
    if instance.deletion_timestamp is not None:
        return Refused("Deleting", f"instance {instance.name} is being deleted")
    return Refused(
        "CapacityReached", f"instance {instance.name} has all {instance.capacity} slots in use"
    )


def decide_release(instance: Instance, slot: str, owner: Owner) -> Released | Refused:
    """Free ``slot`` if ``owner`` holds it."""
    current_value = instance.device_usage.get(slot, "")
    current = parse_usage(current_value)
    if isinstance(current, Free):
        return Released((), dict(instance.device_usage), changed=False)
    if current != owner.usage:
        return Refused(
            "NotHolder", f"slot {slot} is held by {current_value!r}, not {owner.value!r}"
        )
    return Released((slot,), _release_keys(instance, [slot]), changed=True)


def decide_release_values(
    instance: Instance, values: Collection[str], *, keep: Collection[str] = ()
) -> Released:
    """Free every slot whose usage value is in ``values`` (e.g. all of one node's stale ones),
    except the slots in ``keep``."""
    slots = [
        sid
        for sid, value in sorted(instance.device_usage.items())
        if value and value in values and sid not in keep
    ]
    if not slots:
        return Released((), dict(instance.device_usage), changed=False)
    return Released(tuple(slots), _release_keys(instance, slots), changed=True)


def decide_release_slots(
    instance: Instance, expected: Mapping[str, str], *, keep: Collection[str] = ()
) -> Released:
    """Free exactly the slots in ``expected`` whose value is still the expected one (IL values
    are just the node name, so releasing by value alone would free every IL slot of the node
    in this Instance), except those in ``keep``."""
    slots = [
        sid
        for sid, value in sorted(expected.items())
        if value and instance.device_usage.get(sid) == value and sid not in keep
    ]
    if not slots:
        return Released((), dict(instance.device_usage), changed=False)
    return Released(tuple(slots), _release_keys(instance, slots), changed=True)


def regranted(granted: Mapping[str, float], since: float | Mapping[str, float]) -> set[str]:
    """Slots granted (``granted``: slot -> grant time) at or after ``since``: one time for
    every slot, or a time per slot (slots missing from the mapping are not guarded).

    A release based on evidence gathered from ``since`` on must keep these: the evidence that
    they are unused predates the grant."""
    if isinstance(since, Mapping):
        return {slot for slot, when in granted.items() if slot in since and when >= since[slot]}
    return {slot for slot, when in granted.items() if when >= since}


def _release_keys(instance: Instance, slots: Collection[str]) -> dict[str, str]:
    """Write explicit ``""`` for freed slots within capacity; drop keys beyond capacity."""
    usage = dict(instance.device_usage)
    for sid in slots:
        index = parse_slot_id(instance.name, sid)
        if index is not None and index < instance.capacity:
            usage[sid] = ""
        else:
            usage.pop(sid, None)
    return usage


def resize_usage(instance: Instance, capacity: int) -> dict[str, str]:
    """deviceUsage for a new capacity: add free slots, drop free slots beyond it, keep held ones
    (they drain: never handed out again, removed when released)."""
    usage = dict(instance.device_usage)
    for index in range(capacity):
        usage.setdefault(slot_id(instance.name, index), "")
    for key in list(usage):
        position = parse_slot_id(instance.name, key)
        if position is not None and position >= capacity and usage[key] == "":
            del usage[key]
    return usage


@dataclass(frozen=True)
class SlotsInUse:
    """What this node's kubelet and DRA driver show live containers or prepared claims using
    in one Instance, as this node's usage values.

    ``slots``: slot id -> value, where the slot is known (an instance-level device id, a DRA
    claim's device). ``anywhere``: values that hold *some* slot of the Instance, which one
    kubelet cannot tell (configuration-level virtual devices: ``C:<vdev>:<node>``).
    ``represented_by``: for an ``anywhere`` value, every value its container may already be
    held under (the ``C:<vdev>:<node>`` of each of its virtual devices; a value missing here
    stands for itself).

    Nothing here depends on an Instance version: the evidence may be gathered on one version
    and applied to another (a re-created Instance, a conflict retry), and
    :func:`decide_adopt` compares it with the version it replaces."""

    slots: Mapping[str, str] = field(default_factory=dict)
    anywhere: tuple[str, ...] = ()
    represented_by: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.slots) or bool(self.anywhere)


@dataclass(frozen=True)
class SlotConflict:
    """A slot this node's evidence shows in use that deviceUsage gives to someone else: the
    device is already used twice (nothing safe can be done but report it). ``slot`` is None
    for an ``anywhere`` value that found no free slot; ``holder`` names the other holder(s)."""

    slot: str | None
    ours: str
    holder: str


@dataclass(frozen=True)
class Adoption:
    """:func:`decide_adopt`: the new ``deviceUsage``, the (slot, value) pairs newly held and the
    conflicts found."""

    device_usage: Mapping[str, str]
    adopted: tuple[tuple[str, str], ...]
    conflicts: tuple[SlotConflict, ...]


def _is_held_value(value: str) -> bool:
    return isinstance(parse_usage(value), NodeUsage | ConfigurationUsage | ClaimUsage)


def decide_adopt(instance: Instance, in_use: SlotsInUse) -> Adoption:
    """Take for this node the slots its evidence (``in_use``) shows in use and ``instance``
    has free: when the node creates, joins or re-joins (at start) an Instance, whoever wrote
    the current ``deviceUsage`` could not see this node's containers.

    * a known slot that is free (or absent: beyond the capacity, it then drains) gets the
      value; one already holding that value is left alone; one held by anything else is a
      :class:`SlotConflict` and is **not** taken (the other holder may be a live container);
    * an ``anywhere`` value whose container is already held by some slot (under that value
      or any other of its ``represented_by`` group) is left alone; otherwise it takes the
      highest free slot while the held count is below the capacity, else it is a conflict.

    Values that are not held values and ids that are not slots of ``instance`` are ignored."""
    usage = dict(instance.device_usage)
    adopted: list[tuple[str, str]] = []
    conflicts: list[SlotConflict] = []
    for slot, value in sorted(in_use.slots.items()):
        if parse_slot_id(instance.name, slot) is None or not _is_held_value(value):
            continue
        current = usage.get(slot, "")
        if current == value:
            continue
        if current:
            conflicts.append(SlotConflict(slot, value, current))
            continue
        usage[slot] = value
        adopted.append((slot, value))
    for value in sorted(set(in_use.anywhere)):
        if not _is_held_value(value):
            continue
        group = in_use.represented_by.get(value, frozenset()) | {value}
        if not group.isdisjoint(usage.values()):
            continue  # this container is already represented in the Instance
        held = len(usage) - operator.countOf(usage.values(), "")
        # the highest free slot: which one does not matter to a CL container, and an IL
        # container of another node, which this node cannot see, more likely sits low
        # (kubelet's own choice; Allocate hands out the lowest free slot first)
        free = next((sid for sid in reversed(instance.slot_ids()) if not usage.get(sid)), None)
        if free is None or held >= instance.capacity:
            holders = ", ".join(sorted({v for v in usage.values() if v})) or "nobody"
            conflicts.append(SlotConflict(None, value, holders))
            continue
        usage[free] = value
        adopted.append((free, value))
    return Adoption(usage, tuple(adopted), tuple(conflicts))


def initial_usage(instance: Instance, in_use: SlotsInUse | Mapping[str, str]) -> dict[str, str]:
    """``deviceUsage`` of a new Instance: every slot free, except those ``in_use`` (this
    node's evidence: what kubelet or the DRA checkpoint shows a live container or claim
    using) adopts (:func:`decide_adopt`; a slot beyond the capacity is kept held: it drains
    like after a capacity decrease)."""
    evidence = in_use if isinstance(in_use, SlotsInUse) else SlotsInUse(dict(in_use))
    empty = instance.evolve(device_usage={sid: "" for sid in instance.slot_ids()})
    return dict(decide_adopt(empty, evidence).device_usage)


def decide_update(current: Instance, changed: Instance) -> Instance | None:
    """``changed`` (a spec/metadata change decided on ``current``, e.g. by discovery) with the
    slots of ``current`` carried over and resized to the new capacity: held slots are never
    dropped, free ones follow the capacity. None when nothing changes."""
    usage = resize_usage(current, changed.capacity)
    result = changed.evolve(device_usage=usage)
    return None if result == current else result


@dataclass(frozen=True)
class Leave:
    """This node may go: ``instance`` is what to write (without this node), or ``delete`` it
    when no node and no held slot remain."""

    instance: Instance
    delete: bool


@dataclass(frozen=True)
class Drain:
    """This node still holds ``slots``: it stays (draining). ``instance`` carries the draining
    mark to write, or is None when nothing is to be written (already marked, or the Instance
    is terminating)."""

    slots: tuple[str, ...]
    instance: Instance | None


def node_slots(instance: Instance, node: str) -> tuple[str, ...]:
    """Slots held by ``node`` through any plugin (IL, CL or DRA)."""
    return tuple(
        sorted(
            (
                sid
                for sid, value in instance.device_usage.items()
                if value and holder_node(parse_usage(value)) == node
            ),
            key=lambda sid: (parse_slot_id(instance.name, sid) or 0, sid),
        )
    )


def with_draining(instance: Instance, node: str, draining: bool) -> Instance:
    """``instance`` with ``node`` added to / removed from the draining annotation."""
    return instance.with_node_mark(DRAINING_ANNOTATION, node, draining)


def decide_leave(instance: Instance, node: str) -> Leave | Drain | None:
    """Whether ``node`` may leave ``instance`` now (None: it is not a member, or nothing is
    to be written).

    A terminating Instance (deleted, kept by the ``akri.sh/slots`` finalizer) is not written
    to: it offers nothing already (as a draining mark would make it), and it goes as a whole
    once no slot is held — the write that frees its last held slot, or one node's settle
    (``agent/core/ledger/finalizer.py``), removes the finalizer. Every node leaving it, or
    marking itself draining, would only be N writes racing for the same object (issue 36).
    A node holding slots of it stays (:class:`Drain` with nothing to write) until they are
    freed."""
    if node not in instance.nodes:
        return None
    held = node_slots(instance, node)
    if instance.deletion_timestamp is not None:
        return Drain(held, None) if held else None
    if held:
        if node in instance.draining_nodes:
            return Drain(held, None)
        # the draining mark says more than an offline one: the same write clears it
        return Drain(held, with_draining(instance, node, True).without_offline_mark(node))
    remaining = tuple(n for n in instance.nodes if n != node)
    updated = (
        with_draining(instance, node, False).without_offline_mark(node).evolve(nodes=remaining)
    )
    return Leave(updated, delete=not remaining and held_count(instance) == 0)


@dataclass(frozen=True)
class Eviction:
    """:func:`decide_evict_node`: ``instance`` without the dead node (to write), or ``delete``
    it when no node is left; ``freed`` are the slots the dead node held."""

    instance: Instance
    freed: tuple[str, ...]
    delete: bool


def decide_evict_node(instance: Instance, node: str) -> Eviction | None:
    """Remove a *dead* ``node`` from ``instance`` (the controller, for a node NotReady past its
    grace or deleted): free exactly the slots whose value names that node (``<node>``,
    ``C:<vdev>:<node>``, ``D:<claim>:<node>``) — never another node's, nor a value that cannot
    be parsed — drop it from ``nodes`` and from the draining/offline marks. ``delete`` when no
    node is left (nobody sees the device any more). None when the node neither is listed nor
    holds a slot.

    Unlike :func:`decide_leave`, which lets a live node go only once it holds nothing, this
    frees held slots: their containers died with the node. The node's own agent re-joins with
    its kubelet's evidence (:func:`decide_adopt`) if it comes back."""
    held = node_slots(instance, node)
    if node not in instance.nodes and not held:
        return None
    usage = _release_keys(instance, held) if held else dict(instance.device_usage)
    remaining = tuple(n for n in instance.nodes if n != node)
    updated = (
        with_draining(instance, node, False)
        .without_offline_mark(node)
        .evolve(nodes=remaining, device_usage=usage)
    )
    return Eviction(updated, held, delete=not remaining)
