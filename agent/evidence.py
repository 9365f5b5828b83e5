"""``NodeEvidence``: what is already in use on this node, for an Instance being (re-)created.

The slot ledger asks it before creating an Instance (:class:`agent.ledger.ledger.SlotEvidence`),
so an Instance that comes back — deleted by a user, by another agent, or lost with a local
state directory — starts with the slots of running containers held, not free:

* instance-level slots from kubelet: its pod-resources ``List`` and its device-manager
  checkpoint list device ids ``<instance>-<n>`` under ``akri.sh/<instance>``. The answer must
  be newer than this node's last grant of a slot of that Instance (``not_before``): a pod
  admitted through the old Instance is in any answer from after its grant, so an earlier
  answer is reused only when nothing was granted since (without the pod-resources socket the
  checkpoint alone is read);
* DRA slots from this node's DRA checkpoint (prepared claims on slots of that Instance).

Configuration-level slots cannot be recovered this way: kubelet knows only the virtual device
id, not which Instance backed it (docs/slot-model.md).
"""

from __future__ import annotations

from typing import Protocol

from agent.deviceplugin.kubelet_state import KubeletState, read_kubelet_checkpoint
from agent.deviceplugin.views import instance_resource
from agent.ledger.decisions import SlotsInUse
from agent.model.instance import Instance
from agent.model.naming import parse_slot_id


class DraEvidence(Protocol):
    """The DRA driver's part (:class:`agent.dra.state.DraState`)."""

    def in_use(self, instance: Instance) -> dict[str, str]: ...


class NodeEvidence:
    """Implements ``SlotEvidence`` for this node."""

    def __init__(self, node: str, kubelet: KubeletState | None = None) -> None:
        self.node = node
        self.kubelet = kubelet
        self.dra: DraEvidence | None = None

    async def in_use(self, instance: Instance, not_before: float) -> SlotsInUse:
        result: dict[str, str] = {}
        if self.kubelet is not None:
            if self.kubelet.available():
                assigned = (await self.kubelet.view_after(not_before)).in_use
            else:
                assigned = read_kubelet_checkpoint(self.kubelet.checkpoint)
            for device_id in assigned.get(instance_resource(instance.name), frozenset()):
                if parse_slot_id(instance.name, device_id) is not None:
                    result[device_id] = self.node
        if self.dra is not None:
            result.update(self.dra.in_use(instance))
        return SlotsInUse(result)
