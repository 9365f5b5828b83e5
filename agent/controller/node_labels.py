"""The controller keeps every Instance's node labels equal to its content (issue 41).

Each agent watches only the Instances carrying its node's label (``node.akri.sh/<hash>``,
:mod:`agent.core.model.node_labels`). Our agents' writes keep the labels right; a writer
without them — Akri's agent, or an earlier version of ours during a rolling upgrade — can add a
node to ``spec.nodes`` (or a slot holder to ``deviceUsage``) without its label, and that node
would then not see the Instance. The controller, which watches them all, writes the labels of
such an Instance (a resourceVersion-checked update that changes nothing else: the store's
update computes them from the content). Leader only; one write per Instance version found
stale, none while the labels are right.
"""

from __future__ import annotations

import logging

from agent.core.model.instance import Instance
from agent.core.model.node_labels import concerned_nodes, labels_match
from agent.core.store.base import EventType, InstanceStore, NotFoundError, StoreError
from agent.core.store.cas import cas_update

log = logging.getLogger("agent.controller.node_labels")


def labels_stale(instance: Instance) -> bool:
    """Whether ``instance``'s node labels differ from what its content asks for."""
    if instance.deletion_timestamp is not None:
        return False  # terminating: its nodes keep watching it until it is gone
    return not labels_match(instance.labels, concerned_nodes(instance.nodes, instance.device_usage))


class NodeLabelKeeper:
    """Follows the store's Instance events and relabels the stale ones (leader only)."""

    def __init__(self, store: InstanceStore) -> None:
        self.store = store
        self.relabelled = 0

    async def run(self) -> None:
        async with self.store.subscribe_instances() as events:
            async for event in events:
                if event.type is EventType.DELETED or not labels_stale(event.instance):
                    continue
                await self._relabel(event.instance)

    async def _relabel(self, instance: Instance) -> None:
        def mutate(current: Instance) -> Instance | None:
            return current if labels_stale(current) else None

        try:
            stored = await cas_update(self.store, instance.key, mutate)
        except NotFoundError:
            return
        except StoreError as error:
            log.warning("could not label instance %s: %s", instance.key, error)
            return
        if stored is not None and not labels_stale(stored):
            self.relabelled += 1
            log.info("instance %s: node labels written from its nodes and slots", instance.key)
