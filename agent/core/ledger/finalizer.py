"""The ``akri.sh/slots`` finalizer: a deleted Instance waits for the pods that hold its slots.

Every Instance carries the finalizer while it exists. Deleting it — ``kubectl delete instance``,
or Kubernetes' garbage collector after its Configuration was deleted (Instances keep Akri's
owner reference to their Configuration) — then only marks it terminating
(``deletionTimestamp``): the device plugins and the DRA driver offer none of its slots, claims
are refused (``Deleting``) except kubelet re-asking for a slot its owner already holds, and the
reclaimers free the slots as their containers and claims end. The write that frees the last
held slot also removes the finalizer, and the API server deletes the Instance then. An Instance
deleted while nothing is held loses the finalizer at once (:meth:`SlotLedger.settle_finalizer`)
by one write of one node: the *settler*, the first of its ``nodes`` in sorted order. Every
other agent waits its turn (:func:`settle_delay`: the next node after :data:`SETTLE_STEP`
seconds, and so on; agents not listed after all of them), so a settler whose agent is gone
delays the deletion, never stops it; the compare-and-swap still decides every attempt. Nodes
do not leave a terminating Instance (:func:`~agent.core.ledger.decisions.decide_leave`): it
goes as a whole. Before (issue 36), every agent removed the finalizer and left on its own,
and at 50 nodes on a real API server the writes racing for the same objects took 27
requests per agent and 10.9 s.

The finalizer is shared: it stays while *any* node holds a slot. A node that died holding slots
cannot free them; the controller's dead-node cleanup releases its share with
:func:`release_finalizer_share`.

Pure decisions first; :func:`release_finalizer_share` is the one helper that writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging

from agent.core.ledger.decisions import decide_release_slots, held_count, node_slots, with_draining
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import SLOTS_FINALIZER
from agent.core.store.base import InstanceStore, NotFoundError
from agent.core.store.cas import DEFAULT_RETRY, RetryPolicy, cas_update

log = logging.getLogger(__name__)

# seconds between one settler's turn and the next (:func:`settle_delay`): long enough that a
# live settler on a loaded node has written before the next one looks (a second attempt is
# only a conflict, never a loss), short enough that a gone one delays the deletion little
SETTLE_STEP = 5.0
# agents not listed in ``nodes`` spread over this many turns after the listed ones
UNLISTED_TURNS = 4


def is_terminating(instance: Instance) -> bool:
    return instance.deletion_timestamp is not None


def finalizer_done(instance: Instance) -> bool:
    """Whether ``instance`` is terminating, still has our finalizer and no slot is held: the
    finalizer may go (and with it the Instance)."""
    return (
        is_terminating(instance)
        and SLOTS_FINALIZER in instance.finalizers
        and held_count(instance) == 0
    )


def settle_finalizer(instance: Instance) -> Instance:
    """``instance`` as it should be written: a live Instance gets the finalizer (Instances
    written by an older agent or by Akri's get it at their next write); a terminating one
    loses it once no slot is held. The API server refuses new finalizers on a terminating
    object, so none is added there."""
    if is_terminating(instance):
        if finalizer_done(instance):
            return instance.evolve(
                finalizers=tuple(f for f in instance.finalizers if f != SLOTS_FINALIZER)
            )
        return instance
    if SLOTS_FINALIZER in instance.finalizers:
        return instance
    return instance.evolve(finalizers=(*instance.finalizers, SLOTS_FINALIZER))


def settle_delay(instance: Instance, node: str) -> float:
    """Seconds ``node`` waits before removing the finalizer of ``instance`` (terminating,
    nothing held): 0 for the first of its ``nodes`` in sorted order, :data:`SETTLE_STEP` for
    the second, and so on; a node not listed comes after all of them, in one of
    :data:`UNLISTED_TURNS` turns chosen by a hash of its name and the Instance's (every node
    computes the same). An attempt is made only if the Instance is still waiting then."""
    members = sorted(instance.nodes)
    if node in members:
        return members.index(node) * SETTLE_STEP
    digest = hashlib.blake2b(f"{instance.name}/{node}".encode(), digest_size=2).digest()
    turn = len(members) + 1 + int.from_bytes(digest, "big") % UNLISTED_TURNS
    return turn * SETTLE_STEP


def decide_release_share(instance: Instance, node: str) -> Instance | None:
    """A *dead* ``node``'s share of a terminating Instance: free the slots it holds (its
    containers died with it), take it out of ``nodes`` and the draining/offline marks, and
    drop the finalizer when nothing else is held. None when there is nothing to change (a
    live Instance, or one that does not name the node)."""
    if not is_terminating(instance):
        return None
    held = node_slots(instance, node)
    if not held and node not in instance.nodes:
        return None
    expected = {slot: instance.device_usage.get(slot, "") for slot in held}
    usage = decide_release_slots(instance, expected).device_usage
    updated = (
        with_draining(instance, node, False)
        .without_offline_mark(node)
        .evolve(nodes=tuple(n for n in instance.nodes if n != node), device_usage=dict(usage))
    )
    return settle_finalizer(updated)


async def release_finalizer_share(
    store: InstanceStore, node: str, *, policy: RetryPolicy = DEFAULT_RETRY
) -> list[ObjectKey]:
    """For the controller's dead-node cleanup: release ``node``'s share of the finalizer of
    every terminating Instance in the store's cache (:func:`decide_release_share`, one
    compare-and-swap write each). Live Instances are not touched here (freeing a dead node's
    slots in them is the cleanup's own decision). Returns the Instances written."""
    written: list[ObjectKey] = []
    decided: list[bool] = []

    def mutate(current: Instance) -> Instance | None:
        desired = decide_release_share(current, node)
        decided[:] = [desired is not None]
        return desired

    for cached in store.list_cached():
        if decide_release_share(cached, node) is None:
            continue
        decided.clear()
        with contextlib.suppress(NotFoundError):
            await cas_update(store, cached.key, mutate, policy=policy)
            if decided == [True]:
                written.append(cached.key)
                log.info(
                    "instance %s: released the share of dead node %s in its finalizer",
                    cached.key,
                    node,
                )
    return written
