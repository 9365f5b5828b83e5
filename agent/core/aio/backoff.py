"""Per-key backoff for repeated failures, with rate-limited reporting (pure: times are given).

A write that fails during an API-server outage fails again a second later; retrying it every
pass and logging every failure floods the log (once a second per Instance) and loads a
recovering server. :class:`FailureBackoff` spaces the attempts of each key exponentially
(``initial`` doubling to ``maximum``) and says which failures to log: the first, then at most
one per ``log_every`` seconds (with how many were not logged), and when it works again.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class _Failing:
    failures: int
    retry_at: float
    delay: float
    logged_at: float
    unlogged: int = 0


@dataclass(frozen=True)
class Failure:
    """What :meth:`FailureBackoff.failed` decided: the next attempt is ``delay`` seconds away;
    ``log`` whether to report this failure (``unlogged`` earlier ones were not)."""

    delay: float
    log: bool
    failures: int
    unlogged: int


class FailureBackoff(Generic[K]):
    """Exponential backoff and log rate limit, per key."""

    def __init__(self, initial: float = 1.0, maximum: float = 30.0, log_every: float = 30.0):
        self.initial = initial
        self.maximum = maximum
        self.log_every = log_every
        self._failing: dict[K, _Failing] = {}

    def due(self, key: K, now: float) -> bool:
        """Whether ``key`` may be tried now (never failed, or its backoff is over)."""
        state = self._failing.get(key)
        return state is None or now >= state.retry_at

    def failed(self, key: K, now: float) -> Failure:
        state = self._failing.get(key)
        if state is None:
            self._failing[key] = _Failing(1, now + self.initial, self.initial, now)
            return Failure(self.initial, True, 1, 0)
        state.failures += 1
        state.delay = min(self.maximum, state.delay * 2)
        state.retry_at = now + state.delay
        if now - state.logged_at >= self.log_every:
            unlogged, state.unlogged, state.logged_at = state.unlogged, 0, now
            return Failure(state.delay, True, state.failures, unlogged)
        state.unlogged += 1
        return Failure(state.delay, False, state.failures, state.unlogged)

    def succeeded(self, key: K) -> int:
        """Forget ``key``'s failures; returns how many there were (0: it was not failing)."""
        state = self._failing.pop(key, None)
        return 0 if state is None else state.failures

    def forget(self, key: K) -> None:
        self._failing.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._failing

    def __len__(self) -> int:
        return len(self._failing)
