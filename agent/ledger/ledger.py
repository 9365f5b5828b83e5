"""``SlotLedger``: the single per-node allocator. IL and CL Allocate, DRA prepare and the
reclaimer all go through it.

Claims on one Instance are serialised inside this process (one asyncio lock per Instance) and
written with a resourceVersion precondition; a conflict (another node, or an Akri agent, wrote
first) re-reads the Instance and re-decides, with bounded jittered backoff (``agent.store.cas``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from agent.ledger.decisions import (
    Granted,
    Owner,
    Refused,
    Released,
    decide_claim,
    decide_claim_any,
    decide_release,
    decide_release_slots,
    decide_release_values,
    regranted,
)
from agent.model.instance import Instance
from agent.store.base import InstanceStore, NotFoundError
from agent.store.cas import DEFAULT_RETRY, RetryPolicy, cas_update

log = logging.getLogger(__name__)


class SlotRefusedError(Exception):
    """A claim or release was refused; ``reason`` is the decision's code."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class ClaimResult:
    """A granted claim: the slot and the Instance as written."""

    slot: str
    instance: Instance
    changed: bool


class SlotLedger:
    """Claims and frees slots of Instances for owners on ``node``."""

    def __init__(
        self,
        store: InstanceStore,
        node: str,
        *,
        policy: RetryPolicy = DEFAULT_RETRY,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.store = store
        self.node = node
        self._policy = policy
        # grant times must come from the same clock as the reclaimer's evidence (monotonic)
        self._clock = clock
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # instance -> slot -> time of the last grant by this node, including idempotent
        # re-grants that write nothing: the reclaimer must not free a slot that was handed out
        # again after it judged the slot unused (the CAS cannot see such re-grants). A slot
        # this ledger frees loses its entry: any later holder is granted (and recorded) anew.
        self._granted: defaultdict[str, dict[str, float]] = defaultdict(dict)

    def _now(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()

    def last_granted(self, instance: str, slot: str) -> float | None:
        """Time (monotonic) this node last granted ``slot`` (None if never, or if this ledger
        freed it since)."""
        return self._granted.get(instance, {}).get(slot)

    def _regranted(self, instance: str, since: float | Mapping[str, float] | None) -> set[str]:
        if since is None:
            return set()
        return regranted(self._granted.get(instance, {}), since)

    def lock_for(self, instance: str) -> asyncio.Lock:
        """The lock serialising this node's writes to ``instance``."""
        return self._locks[instance]

    async def _apply(
        self, name: str, decide: Callable[[Instance], Granted | Refused | Released]
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
            return instance.evolve(device_usage=dict(decision.device_usage))

        async with self.lock_for(name):
            try:
                stored = await cas_update(self.store, name, mutate, policy=self._policy)
            except NotFoundError as error:
                raise SlotRefusedError(
                    "UnknownInstance", f"instance {name} does not exist"
                ) from error
            done = outcome[0] if outcome else None
            if isinstance(done, Granted):
                self._granted[name][done.slot] = self._now()
            elif isinstance(done, Released) and done.changed and name in self._granted:
                grants = self._granted[name]
                for slot in done.slots:
                    grants.pop(slot, None)
        if refusal:
            raise SlotRefusedError(refusal[0].reason, refusal[0].message)
        assert stored is not None and outcome
        return stored, outcome[0]

    async def claim(
        self, instance: str, slot: str, owner: Owner, *, reclaimable: Collection[str] = ()
    ) -> ClaimResult:
        """Claim ``slot`` of ``instance`` for ``owner``; raises :class:`SlotRefusedError`."""
        stored, decision = await self._apply(
            instance, lambda inst: decide_claim(inst, slot, owner, reclaimable=reclaimable)
        )
        assert isinstance(decision, Granted)
        if decision.changed:
            log.info("slot %s: %r -> %r", slot, decision.replaced, owner.value)
        return ClaimResult(decision.slot, stored, decision.changed)

    async def claim_any(
        self, instance: str, owner: Owner, *, reclaimable: Collection[str] = ()
    ) -> ClaimResult:
        """Claim the owner's slot of ``instance`` or the lowest free one."""
        stored, decision = await self._apply(
            instance, lambda inst: decide_claim_any(inst, owner, reclaimable=reclaimable)
        )
        assert isinstance(decision, Granted)
        if decision.changed:
            log.info("slot %s: %r -> %r", decision.slot, decision.replaced, owner.value)
        return ClaimResult(decision.slot, stored, decision.changed)

    async def release(self, instance: str, slot: str, owner: Owner) -> bool:
        """Free ``slot`` if ``owner`` holds it. Returns True if something was freed."""
        try:
            _, decision = await self._apply(
                instance, lambda inst: decide_release(inst, slot, owner)
            )
        except SlotRefusedError as error:
            if error.reason == "UnknownInstance":
                return False
            raise
        assert isinstance(decision, Released)
        if decision.changed:
            log.info("slot %s: %r -> free", slot, owner.value)
        return decision.changed

    async def release_slots(
        self,
        instance: str,
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
        foreign = [
            v for v in expected.values() if not v.endswith(":" + self.node) and v != self.node
        ]
        if foreign:
            raise ValueError(f"node {self.node} may only release its own slots, not {foreign}")

        def decide(inst: Instance) -> Released:
            keep = self._regranted(instance, unless_granted_since)
            return decide_release_slots(inst, expected, keep=keep)

        try:
            _, decision = await self._apply(instance, decide)
        except SlotRefusedError as error:
            if error.reason == "UnknownInstance":
                return ()
            raise
        assert isinstance(decision, Released)
        return decision.slots

    async def release_values(
        self,
        instance: str,
        values: Collection[str],
        *,
        unless_granted_since: float | None = None,
    ) -> tuple[str, ...]:
        """Free every slot of ``instance`` whose value is in ``values``; returns freed slots.

        With ``unless_granted_since`` (monotonic time), slots this node granted at or after
        that time are kept: the caller's evidence that they are unused predates the grant.
        """
        foreign = [v for v in values if not v.endswith(":" + self.node) and v != self.node]
        if foreign:
            raise ValueError(f"node {self.node} may only release its own slots, not {foreign}")
        try:

            def decide(inst: Instance) -> Released:
                keep = self._regranted(instance, unless_granted_since)
                return decide_release_values(inst, values, keep=keep)

            _, decision = await self._apply(instance, decide)
        except SlotRefusedError as error:
            if error.reason == "UnknownInstance":
                return ()
            raise
        assert isinstance(decision, Released)
        for slot in decision.slots:
            log.info("slot %s: released (stale holder on %s)", slot, self.node)
        return decision.slots
