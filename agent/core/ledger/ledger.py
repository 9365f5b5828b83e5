"""``SlotLedger``: the single per-node writer of ``deviceUsage``.

Everything that changes a slot goes through it: IL and CL Allocate, DRA prepare, the
reclaimers, and discovery's creation, spec changes (capacity, properties, nodes) and
departures. Writes on one Instance are serialised inside this process (one asyncio lock per
Instance) and made with a resourceVersion precondition; a conflict (another node, or an Akri
agent, wrote first) re-reads the Instance and re-decides, with bounded jittered backoff
(``agent.core.store.cas``). The decisions are the pure functions of ``agent.core.ledger.decisions``.

Two rules keep a live container's slot from being lost by the agent's own choices:

* a new Instance starts with the slots this node's kubelet (pod-resources ``List`` and its
  checkpoint) or DRA checkpoint already shows in use held by this node (:class:`SlotEvidence`),
  and a node that joins an Instance someone else (re-)created, or re-joins one at start, takes
  the free slots that evidence shows in use in the same write (:meth:`SlotLedger.join_instance`;
  a slot another holder has is reported, never taken);
* a node leaves an Instance only while it holds none of its slots; until then it stays in
  ``nodes``, marked draining (the reclaimers free the slots once nothing uses them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from agent.core.ledger.decisions import (
    Drain,
    Granted,
    Leave,
    Owner,
    Refused,
    Released,
    SlotConflict,
    SlotsInUse,
    decide_adopt,
    decide_claim,
    decide_claim_any,
    decide_leave,
    decide_release,
    decide_release_slots,
    decide_release_values,
    decide_update,
    initial_usage,
    regranted,
    with_draining,
)
from agent.core.ledger.finalizer import finalizer_done, settle_finalizer
from agent.core.ledger.reservations import RESERVED, UNSETTLED, Reservations
from agent.core.model.device_usage import ClaimUsage
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import offline_annotation
from agent.core.store.base import (
    ConflictError,
    InstanceStore,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from agent.core.store.cas import (
    DEFAULT_RETRY,
    STATS,
    RetriesExhaustedError,
    RetryPolicy,
    cas_update,
)

log = logging.getLogger(__name__)


class SlotRefusedError(Exception):
    """A claim or release was refused; ``reason`` is the decision's code."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class EvidenceReadError(Exception):
    """An evidence source's answer cannot be used now (a malformed kubelet checkpoint or
    pod-resources answer, ...). Evidence sources raise subclasses of it (the ledger knows no
    source: kubelet's lives in ``agent/node/kubelet``)."""


class NodeNotServingError(Exception):
    """This node's Node does not serve (NotReady, deleted, tainted out-of-service): by the
    rule it shares with the controller (:mod:`agent.core.ledger.node_standing`) it writes
    itself into no Instance — no create, no join, no adoption — until it serves again.
    Nothing was written."""

    def __init__(self, instance: ObjectKey, node: str) -> None:
        self.instance = instance
        super().__init__(
            f"node {node} does not serve (its Node is not Ready, deleted or out-of-service): "
            f"not creating or joining instance {instance} until it does"
        )


class EvidenceUnavailableError(Exception):
    """This node's evidence could not be had (kubelet's ``List`` failed, its checkpoint is
    unreadable, ...): nothing was written; the creation or join is to be retried later."""

    def __init__(self, instance: ObjectKey, cause: Exception) -> None:
        self.instance = instance
        self.cause = cause
        super().__init__(
            f"what this node uses in instance {instance} cannot be read now: "
            f"{type(cause).__name__}: {cause}"
        )


def is_evidence_io_error(error: BaseException) -> bool:
    """Whether ``error`` says the evidence cannot be read *now* (kubelet's ``List`` failed or
    timed out, a checkpoint is unreadable or malformed): worth retrying later."""
    if isinstance(error, (EvidenceReadError, OSError, TimeoutError)):
        return True
    # gRPC is imported only by an agent that talks to kubelet (a local agent never loads it);
    # if it is not loaded, no gRPC error can have been raised
    grpc = sys.modules.get("grpc")
    return grpc is not None and isinstance(error, grpc.aio.AioRpcError)


class SlotEvidence(Protocol):
    """What this node's kubelet and DRA driver say is in use, for an Instance being created or
    joined."""

    async def in_use(self, instance: Instance, not_before: float) -> SlotsInUse:
        """This node's usage values for the slots of ``instance`` (by namespace and name) that
        a live container or a prepared claim on this node uses, as seen at or after
        ``not_before`` (monotonic: this node's last grant of a slot of that Instance). Raises
        when the evidence cannot be had now (the creation or join is retried later)."""


class NoEvidence:
    """No kubelet and no DRA driver on this agent: nothing can be in use here."""

    async def in_use(self, instance: Instance, not_before: float) -> SlotsInUse:
        return SlotsInUse()


@dataclass(frozen=True)
class ClaimResult:
    """A granted claim: the slot and the Instance as written."""

    slot: str
    instance: Instance
    changed: bool


@dataclass(frozen=True)
class JoinResult:
    """What :meth:`SlotLedger.join_instance` wrote: the Instance as stored (the cached object
    itself when nothing was written), the slots taken from this node's evidence, the
    conflicts it found, and whether the evidence was checked (against this Instance)."""

    instance: Instance
    adopted: tuple[tuple[str, str], ...] = ()
    conflicts: tuple[SlotConflict, ...] = ()
    checked: bool = False


@dataclass(frozen=True)
class LeaveResult:
    """What :meth:`SlotLedger.leave` did: ``left`` (and ``deleted``), or stayed draining
    because this node still holds ``slots``."""

    left: bool
    deleted: bool = False
    slots: tuple[str, ...] = ()


class SlotWriteTimeoutError(StoreUnavailableError):
    """A claim's write got no answer within the ledger's ``claim_timeout``: the caller
    (Allocate, NodePrepareResources) fails now, well before kubelet gives up. The write may
    still land; the slot is held back until a re-read settles it (:meth:`SlotLedger.unsettled`)."""


# A write the API server neither confirmed nor refused can land as long as the server works
# on the request: kube-apiserver ends a request after its --request-timeout (60 s).
UNKNOWN_OUTCOME_LIMIT = 60.0


def only_joins(before: Instance, after: Instance, node: str) -> bool:
    """Whether ``after`` is ``before`` with ``node`` added to ``nodes`` and nothing else."""
    return (
        node not in before.nodes
        and set(after.nodes) == {*before.nodes, node}
        and after.evolve(nodes=before.nodes) == before
    )


def _wants_mark(instance: Instance, node: str, since: str | None) -> bool:
    """Whether ``node``'s offline mark on ``instance`` must change to say ``since`` (set) or
    nothing (None): a member's mark, on a live Instance; a draining node is not marked (its
    draining mark says more, and the write that drains clears the offline one)."""
    present = offline_annotation(node) in instance.annotations
    if since is None:
        return present
    return (
        not present
        and node in instance.nodes
        and node not in instance.draining_nodes
        and instance.deletion_timestamp is None
    )


class SlotLedger:
    """Claims and frees slots of Instances for owners on ``node``."""

    def __init__(
        self,
        store: InstanceStore,
        node: str,
        *,
        policy: RetryPolicy = DEFAULT_RETRY,
        clock: Callable[[], float] | None = None,
        evidence: SlotEvidence | None = None,
        claim_timeout: float | None = None,
        may_join: Callable[[], bool] = lambda: True,
    ) -> None:
        self.store = store
        self.node = node
        # whether this node's Node serves (agent/node/followed_nodes.py): only then does it
        # write itself into an Instance (the rule it shares with the controller)
        self.may_join = may_join
        # hot paths (Allocate, NodePrepareResources) wait at most this long for a claim
        self.claim_timeout = claim_timeout
        # slots the device plugins must not take (allocated DRA claims, unsettled writes)
        self.reservations = Reservations()
        # instance -> slot -> (value written, resourceVersion it replaced, when): claim writes
        # whose outcome is unknown (timed out), until a re-read settles them
        self._unsettled: dict[ObjectKey, dict[str, tuple[str, str | None, float]]] = {}
        self._settling: dict[ObjectKey, asyncio.Task[None]] = {}
        self.evidence: SlotEvidence = evidence or NoEvidence()
        self._policy = policy
        # grant times must come from the same clock as the reclaimer's evidence (monotonic)
        self._clock = clock
        self._locks: defaultdict[ObjectKey, asyncio.Lock] = defaultdict(asyncio.Lock)
        # instance -> slot -> time of the last grant by this node, including idempotent
        # re-grants that write nothing: the reclaimer must not free a slot that was handed out
        # again after it judged the slot unused (the CAS cannot see such re-grants). A slot
        # this ledger frees loses its entry: any later holder is granted (and recorded) anew.
        self._granted: defaultdict[ObjectKey, dict[str, float]] = defaultdict(dict)

    def _now(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()

    def last_granted(self, instance: ObjectKey, slot: str) -> float | None:
        """Time (monotonic) this node last granted ``slot`` (None if never, or if this ledger
        freed it since)."""
        return self._granted.get(instance, {}).get(slot)

    def _regranted(
        self, instance: ObjectKey, since: float | Mapping[str, float] | None
    ) -> set[str]:
        if since is None:
            return set()
        return regranted(self._granted.get(instance, {}), since)

    def lock_for(self, instance: ObjectKey) -> asyncio.Lock:
        """The lock serialising this node's writes to ``instance``."""
        return self._locks[instance]

    # -- discovery: create, change, leave ------------------------------------------------------
    async def create_instance(self, instance: Instance) -> Instance:
        """Create ``instance`` (its ``deviceUsage`` is decided here): every slot free except
        those the evidence shows this node using. Raises :class:`AlreadyExistsError`, or
        :class:`EvidenceUnavailableError` or :class:`NodeNotServingError` (nothing
        written)."""
        if not self.may_join():
            raise NodeNotServingError(instance.key, self.node)
        async with self.lock_for(instance.key):
            in_use = await self._evidence_for(instance)
            usage = initial_usage(instance, in_use)
            created = await self.store.create(
                settle_finalizer(instance.evolve(device_usage=usage, deletion_timestamp=None))
            )
        held = {slot: value for slot, value in usage.items() if value}
        if held:
            now = self._now()
            self._granted[instance.key].update(dict.fromkeys(held, now))
            log.warning(
                "instance %s created with %d slot(s) already in use on %s: %s",
                instance.key,
                len(held),
                self.node,
                ", ".join(f"{slot}={value}" for slot, value in sorted(held.items())),
            )
        return created

    async def join_instance(
        self,
        key: ObjectKey,
        change: Callable[[Instance], Instance | None],
        *,
        check_evidence: bool = False,
        expected: Instance | None = None,
    ) -> JoinResult:
        """Apply discovery's ``change`` (as :meth:`update_instance`) and, when this node is not
        yet in the Instance's ``nodes`` or ``check_evidence`` is set (the first join of this
        Instance since the agent started), take in the same write the free slots this node's
        evidence shows in use (:func:`decide_adopt`): the node that (re-)created the Instance
        saw only its own containers. A slot the evidence shows in use that someone else holds
        is logged and reported (Event ``SlotConflict``), never taken. Raises
        :class:`NotFoundError`, or :class:`EvidenceUnavailableError` (nothing written).

        The evidence is read on the cached version and may be written over a newer one (a
        conflict, or the Instance re-created meanwhile): it does not depend on the version
        (:class:`SlotsInUse`), and what is already held is decided on the version replaced."""
        async with self.lock_for(key):
            current = self.store.get_cached(key)
            if current is None and expected is not None:
                unseen = await self._join_unseen(key, change, expected)
                if unseen is not None:
                    return unseen
            if current is None:
                current = await self.store.get(key)
            if self.node not in current.nodes and not self.may_join():
                raise NodeNotServingError(key, self.node)
            in_use: SlotsInUse | None = None
            if check_evidence or self.node not in current.nodes:
                in_use = await self._evidence_for(current)
            joined = await self._join_by_membership(key, change, current, in_use)
            if joined is not None:
                return joined
            stored, result = await self._join(key, change, in_use)
            if result is None:
                # re-created without this node between the read and the write: once more,
                # now with the evidence
                stored, result = await self._join(key, change, await self._evidence_for(stored))
            assert result is not None
        await self._report_adoption(stored, result)
        return result

    async def _join_by_membership(
        self,
        key: ObjectKey,
        change: Callable[[Instance], Instance | None],
        current: Instance,
        in_use: SlotsInUse | None,
    ) -> JoinResult | None:
        """Join without a resourceVersion precondition when joining is all there is to write:
        this node is not listed, its evidence shows nothing in use (no slot to adopt) and
        discovery's ``change`` adds this node and nothing else. Then the store's membership
        write (server-side apply of this node's own ``spec.nodes`` entry) cannot conflict
        with the other nodes joining at the same moment: N nodes joining one shared Instance
        cost N writes, not ~N²/2 conflicts and retries. None: a checked write is needed (or
        the Instance changed meanwhile); the caller does it."""
        if self.node in current.nodes or in_use is None or in_use:
            return None
        changed = change(current)
        target = current if changed is None else decide_update(current, changed) or current
        if not only_joins(current, target, self.node) or settle_finalizer(target) != target:
            return None  # more to write (the akri.sh/slots finalizer too): a checked write
        try:
            stored = await self.store.apply_membership(key, self.node, True, uid=current.uid)
        except ConflictError:
            return None  # re-created meanwhile: decided again on the new one, checked
        if stored is None:
            return None
        STATS.record("join", writes=1)
        return JoinResult(stored, (), (), True)

    async def _join_unseen(
        self, key: ObjectKey, change: Callable[[Instance], Instance | None], expected: Instance
    ) -> JoinResult | None:
        """Join an Instance this node's view does not show (another node created it: this
        node's create was refused, AlreadyExists) without reading it first, when ``expected``
        — what this node would have created — says joining is all there is to write: this
        node's evidence shows none of its slots in use, and discovery's ``change`` adds this
        node and nothing else. The membership write carries the device's fingerprint, so an
        Instance of another device (a digest collision) refuses it. None: read it and decide
        on it (the caller does). Raises :class:`NotFoundError` (gone meanwhile)."""
        # what its creator wrote, had it seen the device as this node does (all slots free)
        base = settle_finalizer(
            expected.evolve(
                nodes=tuple(n for n in expected.nodes if n != self.node),
                device_usage=dict.fromkeys(expected.slot_ids(), ""),
            )
        )
        if await self._evidence_for(base):
            return None
        changed = change(base)
        target = base if changed is None else decide_update(base, changed) or base
        if not only_joins(base, target, self.node) or settle_finalizer(target) != target:
            return None
        try:
            stored = await self.store.apply_membership(
                key, self.node, True, uid=None, fingerprint=expected.device_fingerprint
            )
        except ConflictError:
            return None  # another device's, or refused: decided on what a read shows
        if stored is None:
            return None
        STATS.record("join", writes=1)
        return JoinResult(stored, (), (), True)

    async def _leave_by_membership(self, key: ObjectKey) -> LeaveResult | None:
        """Leave without a resourceVersion precondition when this node holds no slot and
        leaving is all there is to write (no draining or offline mark of this node to clear,
        other nodes remain): the store's membership write removes this node's own entry, so
        nodes leaving together do not conflict. None: a checked write (or delete) is needed —
        also when the entry stays because another writer owns it too (the creator's entry on
        a Kubernetes API server)."""
        current = self.store.get_cached(key)
        if current is None:
            return None
        decision = decide_leave(current, self.node)
        if not isinstance(decision, Leave) or decision.delete:
            return None
        # this node's own offline annotation goes with the same apply (its field manager
        # applied it): leaving it out of the comparison keeps the leave a membership write
        own_mark = offline_annotation(self.node)
        before = current
        if own_mark in current.annotations:
            before = current.evolve(
                annotations={k: v for k, v in current.annotations.items() if k != own_mark}
            )
        if (
            not only_joins(decision.instance, before, self.node)
            or settle_finalizer(decision.instance) != decision.instance
        ):
            return None
        try:
            stored = await self.store.apply_membership(key, self.node, False, uid=current.uid)
        except ConflictError:
            return None
        except NotFoundError:
            return LeaveResult(left=True)
        if stored is None:
            return None
        STATS.record("leave", writes=1)
        if self.node in stored.nodes or own_mark in stored.annotations:
            return None  # another writer owns the entry or the mark too: a checked write
        self._granted.pop(key, None)
        return LeaveResult(left=True)

    async def mark_offline(self, key: ObjectKey, since: str | None) -> bool:
        """Record (``since``: when this node stopped seeing the device, RFC 3339) or clear
        (None) this node's offline mark on the shared Instance ``key``: its own annotation
        (:func:`offline_annotation`), written with the store's membership write (a server-side
        apply with this node's field manager: no resourceVersion precondition, so nodes
        marking one Instance together never conflict). Only while this node is a member that
        does not drain it (a drain or a leave clears the mark in its own write), and never on
        a terminating Instance. Where the store has no such write, or another writer owns the
        annotation too (it stays after the apply), a checked write does it. Returns whether
        anything was written. Raises :class:`StoreError` (the caller retries later)."""
        async with self.lock_for(key):
            current = self.store.get_cached(key)
            if current is None or not _wants_mark(current, self.node, since):
                return False
            try:
                # the apply states this node's whole part: its entry stays as it is (a mark
                # left behind after a leave is cleared without joining again)
                stored = await self.store.apply_membership(
                    key, self.node, self.node in current.nodes, uid=current.uid, offline=since
                )
            except (ConflictError, NotFoundError):
                return False  # re-created or gone: decided again on what the watch brings
            own_mark = offline_annotation(self.node)
            if stored is not None:
                STATS.record("offline", writes=1)
                if (own_mark in stored.annotations) == (since is not None):
                    return True

            def mutate(instance: Instance) -> Instance | None:
                if not _wants_mark(instance, self.node, since):
                    return None
                if since is None:
                    return instance.without_offline_mark(self.node)
                return instance.evolve(annotations={**instance.annotations, own_mark: since})

            with contextlib.suppress(NotFoundError):
                await cas_update(self.store, key, mutate, policy=self._policy, operation="offline")
            return True

    async def _evidence_for(self, instance: Instance) -> SlotsInUse:
        """Raises :class:`EvidenceUnavailableError` when kubelet or a checkpoint cannot be
        read (retried later). Anything else is a bug and propagates: turned into
        "unavailable", it would be retried for ever without a trace of its cause."""
        grants = self._granted.get(instance.key, {})
        try:
            return await self.evidence.in_use(instance, max(grants.values(), default=0.0))
        except Exception as error:
            if not is_evidence_io_error(error):
                raise
            raise EvidenceUnavailableError(instance.key, error) from error

    async def _join(
        self,
        key: ObjectKey,
        change: Callable[[Instance], Instance | None],
        in_use: SlotsInUse | None,
    ) -> tuple[Instance, JoinResult | None]:
        """One CAS write of ``change`` plus the adoption of ``in_use``; the result is None when
        the write joined this node without evidence (the Instance was re-created meanwhile)."""
        outcome: list[JoinResult | None] = []

        def mutate(current: Instance) -> Instance | None:
            outcome.clear()
            if in_use is None and self.node not in current.nodes:
                outcome.append(None)
                return None
            changed = change(current)
            target = current if changed is None else decide_update(current, changed) or current
            adoption = decide_adopt(target, in_use) if in_use else None
            if adoption is not None and adoption.adopted:
                target = target.evolve(device_usage=dict(adoption.device_usage))
            # Instances written before the finalizer existed (or by Akri) get it here: every
            # node joins each Instance once after it starts
            target = settle_finalizer(target)
            outcome.append(
                JoinResult(
                    current,
                    adoption.adopted if adoption else (),
                    adoption.conflicts if adoption else (),
                    in_use is not None,
                )
            )
            return None if target is current else target

        stored = await cas_update(self.store, key, mutate, policy=self._policy, operation="join")
        assert stored is not None and outcome
        done = outcome[0]
        if done is None:
            return stored, None
        if done.adopted:
            now = self._now()
            self._granted[key].update(dict.fromkeys((slot for slot, _ in done.adopted), now))
        return stored, JoinResult(stored, done.adopted, done.conflicts, done.checked)

    async def adopt_draining(
        self, key: ObjectKey, before_write: Callable[[], None] = lambda: None
    ) -> JoinResult | None:
        """Instance ``key`` does not list this node, and this node does not discover its
        device; if this node's evidence still shows containers using some of its slots (it
        was re-created meanwhile, all free), join it **draining** and take those slots in the
        same write (:func:`decide_adopt`): nothing new is given out here, the reclaimers free
        the slots when the containers end, and then this node leaves. Returns None when
        nothing is in use here (nothing written). ``before_write`` is called just before the
        write is sent (the runner marks the Instance offline there, so nothing offers its
        slots even for a moment). Raises :class:`NotFoundError`, or
        :class:`EvidenceUnavailableError` (nothing written)."""
        async with self.lock_for(key):
            current = self.store.get_cached(key)
            if current is None:
                current = await self.store.get(key)
            if self.node in current.nodes:
                return None
            if not self.may_join():
                raise NodeNotServingError(key, self.node)
            in_use = await self._evidence_for(current)
            if not in_use:
                return None
            outcome: list[JoinResult] = []

            def mutate(instance: Instance) -> Instance | None:
                outcome.clear()
                if self.node in instance.nodes or instance.deletion_timestamp is not None:
                    return None  # joined by discovery meanwhile (it checked), or going
                adoption = decide_adopt(instance, in_use)
                outcome.append(JoinResult(instance, adoption.adopted, adoption.conflicts, True))
                if not adoption.adopted:
                    return None
                before_write()
                return settle_finalizer(
                    with_draining(instance, self.node, True).evolve(
                        nodes=(*instance.nodes, self.node),
                        device_usage=dict(adoption.device_usage),
                    )
                )

            stored = await cas_update(
                self.store, key, mutate, policy=self._policy, operation="join"
            )
            if not outcome or stored is None:
                return None
            done = outcome[0]
            if done.adopted:
                now = self._now()
                self._granted[key].update(dict.fromkeys((slot for slot, _ in done.adopted), now))
            result = JoinResult(stored, done.adopted, done.conflicts, True)
        await self._report_adoption(stored, result)
        return result

    async def _report_adoption(self, stored: Instance, result: JoinResult) -> None:
        if result.adopted:
            log.warning(
                "instance %s joined by %s with %d slot(s) its containers already use: %s",
                stored.key,
                self.node,
                len(result.adopted),
                ", ".join(f"{slot}={value}" for slot, value in result.adopted),
            )
        for conflict in result.conflicts:
            where = f"slot {conflict.slot}" if conflict.slot else "no free slot"
            message = (
                f"{where}: kubelet on {self.node} shows it in use ({conflict.ours!r}) but "
                f"deviceUsage gives it to {conflict.holder!r}: the device is used twice; "
                f"nothing is taken from the other holder"
            )
            log.error("instance %s: %s", stored.key, message)
            await self.store.record_instance_event(stored, "SlotConflict", message)

    async def update_instance(
        self, key: ObjectKey, change: Callable[[Instance], Instance | None]
    ) -> Instance:
        """Apply a spec/metadata ``change`` (None: nothing to change) decided on the current
        Instance; its ``deviceUsage`` is not the caller's: held slots are kept, free ones
        follow the capacity. Raises :class:`NotFoundError`."""

        def mutate(current: Instance) -> Instance | None:
            changed = change(current)
            if changed is None:
                return None
            decided = decide_update(current, changed)
            return None if decided is None else settle_finalizer(decided)

        async with self.lock_for(key):
            stored = await cas_update(self.store, key, mutate, policy=self._policy)
        assert stored is not None
        return stored

    async def leave(self, key: ObjectKey) -> LeaveResult:
        """Take this node out of Instance ``key`` if it holds none of its slots (deleting the
        Instance when no node and no held slot remain); otherwise mark it draining and stay.
        A terminating Instance is not written to (:func:`decide_leave`): left at once when this
        node holds none of its slots, draining (unmarked) while it does."""
        async with self.lock_for(key):
            by_membership = await self._leave_by_membership(key)
            if by_membership is not None:
                return by_membership
            for attempt in range(1, self._policy.attempts + 1):
                current = self.store.get_cached(key)
                if current is None:
                    try:
                        current = await self.store.get(key)
                    except NotFoundError:
                        return LeaveResult(left=True)
                decision = decide_leave(current, self.node)
                try:
                    if decision is None:
                        return LeaveResult(left=True)
                    if isinstance(decision, Drain):
                        if decision.instance is not None:
                            await self.store.update(settle_finalizer(decision.instance))
                        return LeaveResult(left=False, slots=decision.slots)
                    assert isinstance(decision, Leave)
                    if decision.delete:
                        await self.store.delete(key, resource_version=current.resource_version)
                    else:
                        await self.store.update(settle_finalizer(decision.instance))
                    self._granted.pop(key, None)
                except NotFoundError:
                    return LeaveResult(left=True)
                except ConflictError:
                    STATS.record("leave", conflicts=1)
                    await asyncio.sleep(self._policy.delay(attempt))
                    with contextlib.suppress(NotFoundError):
                        await self.store.get(key)
                    continue
                if decision.delete:
                    # nothing is held: the finalizer, which kept it terminating, goes too
                    await self._settle_finalizer(key)
                return LeaveResult(left=True, deleted=decision.delete)
        STATS.record("leave", gave_up=1)
        raise RetriesExhaustedError(f"could not take {self.node} out of instance {key}")

    async def settle_finalizer(self, key: ObjectKey) -> bool:
        """Remove the ``akri.sh/slots`` finalizer of Instance ``key`` if it is terminating and
        no slot is held (any agent may: the compare-and-swap decides on the version it
        replaces). Returns whether it was removed by this call."""
        async with self.lock_for(key):
            return await self._settle_finalizer(key)

    async def _settle_finalizer(self, key: ObjectKey) -> bool:
        removed: list[bool] = []

        def mutate(current: Instance) -> Instance | None:
            removed[:] = [finalizer_done(current)]
            return settle_finalizer(current) if removed[0] else None

        try:
            await cas_update(self.store, key, mutate, policy=self._policy)
        except NotFoundError:
            return False
        if removed == [True] and self.store.local:
            log.info("instance %s: no slot is held any more; deleted as asked", key)
        elif removed == [True]:
            log.info("instance %s: no slot is held any more; its finalizer is removed", key)
        return removed == [True]

    # -- claims and releases -------------------------------------------------------------------
    async def _apply(
        self,
        key: ObjectKey,
        decide: Callable[[Instance], Granted | Refused | Released],
        operation: str = "claim",
    ) -> tuple[Instance, Granted | Released]:
        outcome: list[Granted | Released] = []
        refusal: list[Refused] = []

        def mutate(instance: Instance) -> Instance | None:
            outcome.clear()
            refusal.clear()
            decision = decide(instance)
            if isinstance(decision, Refused):
                refusal.append(decision)
                return None
            outcome.append(decision)
            if not decision.changed:
                return None
            # a claim adds the finalizer if missing; the release of the last held slot of a
            # terminating Instance removes it in the same write (then the Instance goes)
            return settle_finalizer(instance.evolve(device_usage=dict(decision.device_usage)))

        async with self.lock_for(key):
            try:
                stored = await cas_update(
                    self.store, key, mutate, policy=self._policy, operation=operation
                )
            except NotFoundError as error:
                raise SlotRefusedError(
                    "UnknownInstance", f"instance {key} does not exist"
                ) from error
            done = outcome[0] if outcome else None
            if isinstance(done, Granted):
                self._granted[key][done.slot] = self._now()
            elif isinstance(done, Released) and done.changed and key in self._granted:
                grants = self._granted[key]
                for slot in done.slots:
                    grants.pop(slot, None)
        if refusal:
            raise SlotRefusedError(refusal[0].reason, refusal[0].message)
        assert stored is not None and outcome
        return stored, outcome[0]

    async def claim(
        self, instance: ObjectKey, slot: str, owner: Owner, *, reclaimable: Collection[str] = ()
    ) -> ClaimResult:
        """Claim ``slot`` of ``instance`` for ``owner``; raises :class:`SlotRefusedError`, or
        :class:`SlotWriteTimeoutError` after ``claim_timeout``. A device-plugin owner is
        refused a reserved slot (``Reserved``) unless it holds it already."""
        sent: list[tuple[str, str, str | None]] = []

        def decide(inst: Instance) -> Granted | Refused:
            reserved = self._reserved_for(inst, owner)
            if slot in reserved and inst.device_usage.get(slot, "") != owner.value:
                return Refused("Reserved", self._reserved_message(inst, slot))
            return self._noting(
                sent, inst, decide_claim(inst, slot, owner, reclaimable=reclaimable)
            )

        stored, decision = await self._bounded(instance, sent, self._apply(instance, decide))
        assert isinstance(decision, Granted)
        if decision.changed:
            # DEBUG: the activity log (agent/node/activity_log.py) writes the one INFO line
            # per slot change, from the store's event, for our writes and other nodes' alike
            log.debug("slot %s: %r -> %r", slot, decision.replaced, owner.value)
        return ClaimResult(decision.slot, stored, decision.changed)

    async def claim_any(
        self, instance: ObjectKey, owner: Owner, *, reclaimable: Collection[str] = ()
    ) -> ClaimResult:
        """Claim the owner's slot of ``instance`` or the lowest free one (for a device-plugin
        owner, not a reserved one)."""
        sent: list[tuple[str, str, str | None]] = []

        def decide(inst: Instance) -> Granted | Refused:
            reserved = self._reserved_for(inst, owner)
            if not reserved:
                return self._noting(
                    sent, inst, decide_claim_any(inst, owner, reclaimable=reclaimable)
                )
            # decided on a view where the reserved free slots are held; the write is the
            # stored usage with only the granted slot changed
            view = inst.evolve(
                device_usage={
                    **inst.device_usage,
                    **{s: RESERVED for s in reserved if not inst.device_usage.get(s)},
                }
            )
            decision = decide_claim_any(view, owner, reclaimable=reclaimable)
            if isinstance(decision, Granted) and decision.changed:
                usage = {**inst.device_usage, decision.slot: owner.value}
                decision = Granted(decision.slot, usage, True, decision.replaced)
            return self._noting(sent, inst, decision)

        stored, decision = await self._bounded(instance, sent, self._apply(instance, decide))
        assert isinstance(decision, Granted)
        if decision.changed:
            log.debug("slot %s: %r -> %r", decision.slot, decision.replaced, owner.value)
        return ClaimResult(decision.slot, stored, decision.changed)

    # -- hot-path bounds and reservations ------------------------------------------------------
    def _reserved_for(self, instance: Instance, owner: Owner) -> frozenset[str]:
        """The slots ``owner`` may not take in ``instance``: none for a DRA claim (the
        reservation is for it, or the CAS decides), the reserved ones for a device plugin."""
        if isinstance(owner.usage, ClaimUsage):
            return frozenset()
        return self.reservations.slots(instance.key)

    def _reserved_message(self, instance: Instance, slot: str) -> str:
        unsettled = slot in self._unsettled.get(instance.key, {})
        why = (
            "an earlier write of it timed out and may still land"
            if unsettled
            else "the scheduler allocated it to a ResourceClaim that is being prepared"
        )
        return f"slot {slot} of instance {instance.name} is reserved: {why}"

    @staticmethod
    def _noting(
        sent: list[tuple[str, str, str | None]], inst: Instance, decision: Granted | Refused
    ) -> Granted | Refused:
        """Remember the write about to be sent (slot, value, version replaced): if no answer
        comes, that is the write whose outcome is unknown."""
        if isinstance(decision, Granted) and decision.changed:
            value = decision.device_usage[decision.slot]
            sent.append((decision.slot, value, inst.resource_version))
        return decision

    async def _bounded(
        self,
        key: ObjectKey,
        sent: list[tuple[str, str, str | None]],
        claim: Awaitable[tuple[Instance, Granted | Released]],
    ) -> tuple[Instance, Granted | Released]:
        """Await ``claim`` for at most ``claim_timeout``. On timeout the write in flight, if
        any, is *unsettled*: its slot is reserved until a re-read shows what happened."""
        if not self.claim_timeout:
            return await claim
        started = self._now()
        deadline = asyncio.timeout(self.claim_timeout)
        try:
            async with deadline:
                return await claim
        except TimeoutError as error:
            if not deadline.expired():
                raise  # a TimeoutError of the claim's own, not the deadline
            if sent:
                slot, value, version = sent[-1]
                self._unsettle(key, slot, value, version, started)
            raise SlotWriteTimeoutError(
                f"instance {key}: the API server did not answer the claim within "
                f"{self.claim_timeout:g}s"
                + (f"; slot {sent[-1][0]} is held back until the outcome is known" if sent else "")
            ) from error

    async def close(self) -> None:
        """Stop settling unknown writes (the agent stops; their slots stay reserved only in
        this process, which ends)."""
        tasks = list(self._settling.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._settling.clear()

    def unsettled(self, key: ObjectKey) -> frozenset[str]:
        """Slots of ``key`` with a claim write whose outcome is not known yet."""
        return frozenset(self._unsettled.get(key, {}))

    def _unsettle(
        self, key: ObjectKey, slot: str, value: str, version: str | None, since: float
    ) -> None:
        self._unsettled.setdefault(key, {})[slot] = (value, version, since)
        self.reservations.add(UNSETTLED, key, slot)
        log.warning(
            "instance %s slot %s: the claim for %r timed out; the slot is held back until a "
            "re-read shows whether the write landed",
            key,
            slot,
            value,
        )
        if key not in self._settling or self._settling[key].done():
            self._settling[key] = asyncio.create_task(
                self._settle_unknown(key), name=f"settle-{key.name}"
            )

    async def _settle_unknown(self, key: ObjectKey) -> None:
        """Re-read ``key`` until each unsettled write is decided: it landed (the slot holds
        its value in a newer version: the request that made it failed, so the slot is freed,
        unless granted again since) or it cannot land any more (the Instance moved past the
        version it replaced, or :data:`UNKNOWN_OUTCOME_LIMIT` passed)."""
        delay = 0.2
        while self._unsettled.get(key):
            try:
                fresh = await self.store.get(key)
            except NotFoundError:
                for slot in self._unsettled.pop(key, {}):
                    self.reservations.discard(UNSETTLED, key, slot)
                return
            except StoreError:
                fresh = None
            if fresh is not None:
                await self._settle_with(key, fresh)
            if self._unsettled.get(key):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self._unsettled.pop(key, None)

    async def _settle_with(self, key: ObjectKey, fresh: Instance) -> None:
        pending = self._unsettled.get(key, {})
        now = self._now()
        for slot, (value, version, since) in list(pending.items()):
            if fresh.resource_version == version and now - since < UNKNOWN_OUTCOME_LIMIT:
                continue  # nothing newer: the write may still land
            if fresh.device_usage.get(slot) == value:
                try:
                    freed = await self.release_slots(
                        key, {slot: value}, unless_granted_since={slot: since}
                    )
                except StoreError:
                    continue  # tried again at the next re-read
                if freed:
                    log.warning(
                        "instance %s slot %s: the timed-out claim for %r landed late; freed "
                        "(the request that made it had failed)",
                        key,
                        slot,
                        value,
                    )
            del pending[slot]
            self.reservations.discard(UNSETTLED, key, slot)

    async def release(self, instance: ObjectKey, slot: str, owner: Owner) -> bool:
        """Free ``slot`` if ``owner`` holds it. Returns True if something was freed."""
        try:
            _, decision = await self._apply(
                instance, lambda inst: decide_release(inst, slot, owner), "release"
            )
        except SlotRefusedError as error:
            if error.reason == "UnknownInstance":
                return False
            raise
        assert isinstance(decision, Released)
        if decision.changed:
            log.debug("slot %s: %r -> free", slot, owner.value)
        return decision.changed

    def _check_own(self, values: Collection[str]) -> None:
        foreign = [v for v in values if not v.endswith(":" + self.node) and v != self.node]
        if foreign:
            raise ValueError(f"node {self.node} may only release its own slots, not {foreign}")

    async def release_slots(
        self,
        instance: ObjectKey,
        expected: Mapping[str, str],
        *,
        unless_granted_since: float | Mapping[str, float] | None = None,
    ) -> tuple[str, ...]:
        """Free the given slots of ``instance`` in one CAS write if they still hold the
        expected values (this node's only). Returns the freed slots.

        Slots granted at or after ``unless_granted_since`` are kept: one time for all slots, or
        a time per slot (each slot's evidence that it is unused started at its own time). The
        kept set is re-computed on every CAS attempt, so a re-grant during a conflict retry
        still counts."""
        self._check_own(expected.values())

        def decide(inst: Instance) -> Released:
            keep = self._regranted(instance, unless_granted_since)
            return decide_release_slots(inst, expected, keep=keep)

        try:
            _, decision = await self._apply(instance, decide, "release")
        except SlotRefusedError as error:
            if error.reason == "UnknownInstance":
                return ()
            raise
        assert isinstance(decision, Released)
        return decision.slots

    async def release_values(
        self,
        instance: ObjectKey,
        values: Collection[str],
        *,
        unless_granted_since: float | None = None,
    ) -> tuple[str, ...]:
        """Free every slot of ``instance`` whose value is in ``values``; returns freed slots.

        With ``unless_granted_since`` (monotonic time), slots this node granted at or after
        that time are kept: the caller's evidence that they are unused predates the grant.
        """
        self._check_own(values)

        def decide(inst: Instance) -> Released:
            keep = self._regranted(instance, unless_granted_since)
            return decide_release_values(inst, values, keep=keep)

        try:
            _, decision = await self._apply(instance, decide, "release")
        except SlotRefusedError as error:
            if error.reason == "UnknownInstance":
                return ()
            raise
        assert isinstance(decision, Released)
        for slot in decision.slots:
            log.debug("slot %s: released (stale holder on %s)", slot, self.node)
        return decision.slots
