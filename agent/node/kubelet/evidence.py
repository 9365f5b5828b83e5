"""``NodeEvidence``: what is already in use on this node, for an Instance being (re-)created or
joined.

The slot ledger asks it before creating an Instance and when this node joins one (or re-joins
it at start) (:class:`agent.core.ledger.ledger.SlotEvidence`), so an Instance that comes back —
deleted by a user, by another agent, or lost with a local state directory — never has the
slots of this node's running containers free:

* instance-level slots from kubelet: its pod-resources ``List`` and its device-manager
  checkpoint list device ids ``<instance>-<n>`` under ``akri.sh/<instance>``. The answer must
  be newer than this node's last grant of a slot of that Instance (``not_before``): a pod
  admitted through the old Instance is in any answer from after its grant, so an earlier
  answer is reused only when nothing was granted since (without the pod-resources socket the
  checkpoint alone is read);
* configuration-level slots from kubelet's checkpoint: an entry under
  ``akri.sh/<configuration>`` lists virtual device ids, not slots, but its ``AllocResp`` holds
  the env vars our Allocate returned, whose names end in ``_<DIGEST>`` of each Instance behind
  the container's virtual devices (:mod:`agent.node.deviceplugin.container_env`). Such an entry
  holds *some* slot of that Instance as ``C:<vdev>:<node>`` (which slot does not matter; the
  ledger takes a free one). A container with several virtual devices does not say which vdev
  went to which Instance: a vdev one of its other Instances holds now stays that Instance's,
  the rest are paired in sorted order (harmless: all of them are released together when the
  container ends, and no vdev is given to two Instances); the evidence names every vdev of the
  container (``SlotsInUse.represented_by``), and the ledger leaves an entry alone that the
  version it writes over already holds under any of them. An Instance without broker
  properties gives its containers no env var and cannot be recognised
  (docs/slot-model.md);
* DRA slots from this node's DRA checkpoint (prepared claims on slots of that Instance).

None of it depends on the Instance's current ``deviceUsage`` (only on its namespace, name and
Configuration name): the ledger may apply it to a newer version than the one it was asked
for (re-created meanwhile), and decides on that version what is already held.

Without the pod-resources socket, and for the configuration-level part always, the
checkpoint file is read on every question but parsed only when its bytes changed
(:class:`CheckpointCache`): an agent starting with 1000 Instances parses it once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from agent.core.ledger.decisions import Owner, SlotsInUse
from agent.core.model.instance import Instance
from agent.core.model.naming import digest_of_instance, parse_slot_id
from agent.node.deviceplugin.views import configuration_resource, instance_resource
from agent.node.kubelet.state import (
    CheckpointAllocation,
    KubeletState,
    parse_checkpoint_allocations,
    read_checkpoint_bytes,
)


class DraEvidence(Protocol):
    """The DRA driver's part (:class:`agent.node.dra.state.DraState`)."""

    def in_use(self, instance: Instance) -> dict[str, str]: ...


class CheckpointCache:
    """kubelet's checkpoint, parsed: its entries with their ``AllocResp`` digests, and the
    device ids per resource. The file is read on every call (a container allocated a moment
    ago must be seen), parsed again only when its bytes changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._raw: bytes | None = None
        self._entries: list[CheckpointAllocation] = []
        self._assigned: dict[str, frozenset[str]] = {}
        self.parses = 0  # how often the file was parsed (tests)

    def _refresh(self) -> None:
        """Raises :class:`agent.node.kubelet.state.KubeletStateError`."""
        raw = read_checkpoint_bytes(self.path)
        if raw == self._raw:
            return
        entries = parse_checkpoint_allocations(raw) if raw is not None else []
        assigned: dict[str, set[str]] = {}
        for entry in entries:
            assigned.setdefault(entry.resource, set()).update(entry.device_ids)
        self.parses += raw is not None
        self._entries = entries
        self._assigned = {resource: frozenset(ids) for resource, ids in assigned.items()}
        self._raw = raw

    def current(self) -> list[CheckpointAllocation]:
        """The entries now. Raises ``KubeletStateError``."""
        self._refresh()
        return self._entries

    def assigned(self) -> dict[str, frozenset[str]]:
        """Device ids per resource now (every container, init ones included). Raises
        ``KubeletStateError``."""
        self._refresh()
        return self._assigned


def configuration_level_in_use(
    instance: Instance,
    node: str,
    allocations: list[CheckpointAllocation],
    siblings: Iterable[Instance] = (),
) -> dict[str, frozenset[str]]:
    """``C:<vdev>:<node>`` values of the configuration-level containers that use ``instance``,
    each with every value its container may be held under (pure; see the module docstring).
    Only the Instance's name and Configuration name are read: whether such a container is
    already held is decided on the version the ledger writes over.

    ``siblings``: the Configuration's other Instances as cached now. A vdev of the container
    that one of them holds (``C:<vdev>:<node>``) is that sibling's, whatever the sorted order
    says; only the container's other vdevs are paired, in sorted order, with its other
    Instances. Without this, an Instance re-created while a sibling kept its slot could be
    given the sibling's vdev: one ``C:<vdev>:<node>`` in two Instances, the second held for
    as long as kubelet hands that vdev to anyone (issue 23, 7a)."""
    resource = configuration_resource(instance.configuration_name)
    digest = digest_of_instance(instance.name).upper()
    prefix = "C:"
    suffix = f":{node}"
    held_by: dict[str, str] = {}  # this node's C: value -> digest of the sibling holding it
    for sibling in siblings:
        if sibling.name == instance.name or sibling.configuration_name != (
            instance.configuration_name
        ):
            continue
        for value in sibling.device_usage.values():
            if value.startswith(prefix) and value.endswith(suffix):
                held_by[value] = digest_of_instance(sibling.name).upper()
    values: dict[str, frozenset[str]] = {}
    for entry in allocations:
        if entry.resource != resource or digest not in entry.digests or not entry.device_ids:
            continue
        vdevs = sorted(entry.device_ids)
        candidates = [Owner.configuration_level(vdev, node).value for vdev in vdevs]
        group = frozenset(candidates)
        claimed = {
            held_by[value]: value
            for value in candidates
            if value in held_by and held_by[value] in entry.digests and held_by[value] != digest
        }
        left = [value for value in candidates if value not in claimed.values()]
        others = sorted(d for d in entry.digests if d not in claimed)
        if not left or digest not in others:
            continue  # every vdev of the container is held by its other Instances
        position = others.index(digest)
        values[left[min(position, len(left) - 1)]] = group
    return values


class NodeEvidence:
    """Implements ``SlotEvidence`` for this node."""

    def __init__(self, node: str, kubelet: KubeletState | None = None) -> None:
        self.node = node
        self.kubelet = kubelet
        self.dra: DraEvidence | None = None
        # the Configuration's Instances as cached (the app wires the store in): pairs a
        # configuration-level container's vdevs with its Instances (configuration_level_in_use)
        self.siblings: Callable[[Instance], Iterable[Instance]] = lambda _: ()
        self.checkpoint = CheckpointCache(kubelet.checkpoint) if kubelet else None

    async def in_use(self, instance: Instance, not_before: float) -> SlotsInUse:
        result: dict[str, str] = {}
        anywhere: dict[str, frozenset[str]] = {}
        if self.kubelet is not None:
            assert self.checkpoint is not None
            if self.kubelet.available():
                assigned = (await self.kubelet.view_after(not_before)).in_use
            else:
                assigned = self.checkpoint.assigned()
            for device_id in assigned.get(instance_resource(instance.name), frozenset()):
                if parse_slot_id(instance.name, device_id) is not None:
                    result[device_id] = self.node
            # read after the view above: a container allocated before it is in the file
            anywhere = configuration_level_in_use(
                instance, self.node, self.checkpoint.current(), self.siblings(instance)
            )
        if self.dra is not None:
            result.update(self.dra.in_use(instance))
        return SlotsInUse(result, tuple(anywhere), anywhere)
