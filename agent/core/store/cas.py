"""Compare-and-swap update loop shared by the slot ledger and the discovery manager.

A mutation is a pure function ``Instance -> Instance | None`` (None = nothing to write). It is
applied to the cached object, written with that object's resourceVersion as precondition, and
on a conflict re-applied to a fresh read, with bounded, jittered exponential backoff. There is
no check-then-write anywhere: the decision is always re-made on the version being replaced.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import ConflictError, InstanceStore, NotFoundError, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded jittered exponential backoff for CAS retries."""

    attempts: int = 12
    base_delay: float = 0.005
    max_delay: float = 0.25

    def delay(self, attempt: int) -> float:
        """Full-jitter delay before retry number ``attempt`` (1-based)."""
        ceiling = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
        return random.uniform(0, ceiling)


DEFAULT_RETRY = RetryPolicy()


class RetriesExhaustedError(StoreError):
    """Too many conflicting writers; the caller should report a transient failure."""


OPERATIONS = ("join", "leave", "update", "claim", "release", "offline")
"""What a slot write was for (the ``operation`` label of the write/conflict metrics)."""


@dataclass
class OperationStats:
    """Counters of one operation."""

    writes: int = 0
    conflicts: int = 0
    gave_up: int = 0


@dataclass
class CasStats:
    """Counters for metrics and benchmarks: totals, and per operation. Writers that only
    bump the totals (``STATS.writes += 1``) show up as operation ``other``."""

    writes: int = 0
    conflicts: int = 0
    gave_up: int = 0  # writes abandoned after ``RetryPolicy.attempts`` conflicts in a row
    by_operation: dict[str, OperationStats] = field(default_factory=dict)

    def record(
        self, operation: str, *, writes: int = 0, conflicts: int = 0, gave_up: int = 0
    ) -> None:
        """Count writes, conflicts (409 on a resourceVersion-checked write) or give-ups."""
        stats = self.by_operation.get(operation)
        if stats is None:
            stats = self.by_operation[operation] = OperationStats()
        stats.writes += writes
        stats.conflicts += conflicts
        stats.gave_up += gave_up
        self.writes += writes
        self.conflicts += conflicts
        self.gave_up += gave_up

    def per_operation(self) -> dict[str, OperationStats]:
        """Every operation's counters; ``other`` holds what was counted in the totals only."""
        result = dict(self.by_operation)
        other = OperationStats(
            self.writes - sum(s.writes for s in result.values()),
            self.conflicts - sum(s.conflicts for s in result.values()),
            self.gave_up - sum(s.gave_up for s in result.values()),
        )
        if other.writes or other.conflicts or other.gave_up:
            result["other"] = other
        return result


STATS = CasStats()


async def cas_update(
    store: InstanceStore,
    key: ObjectKey,
    mutate: Callable[[Instance], Instance | None],
    *,
    policy: RetryPolicy = DEFAULT_RETRY,
    fresh: bool = False,
    operation: str = "update",
) -> Instance | None:
    """Apply ``mutate`` to Instance ``key`` with optimistic concurrency.

    Returns the stored Instance after the write, the unchanged Instance if ``mutate`` returned
    None, or raises :class:`NotFoundError` if it does not exist. Writes, conflicts and a give-up
    are counted under ``operation`` (:data:`OPERATIONS`).
    """
    current = None if fresh else store.get_cached(key)
    if current is None:
        current = await store.get(key)
    for attempt in range(1, policy.attempts + 1):
        desired = mutate(current)
        if desired is None:
            return current
        try:
            stored = await store.update(desired)
            STATS.record(operation, writes=1)
            return stored
        except ConflictError:
            STATS.record(operation, conflicts=1)
            if attempt == policy.attempts:
                break
            await asyncio.sleep(policy.delay(attempt))
            current = await store.get(key)
        except NotFoundError:
            raise
    STATS.record(operation, gave_up=1)
    raise RetriesExhaustedError(f"gave up updating {key} after {policy.attempts} conflicts")
