"""``FailureStreak``: a failure that repeats is logged when it starts and when it ends, and
counted throughout.

Something retried with backoff — registering the device plugins on ``kubelet.sock`` before
kubelet is there, kubelet refusing the DRA driver — fails the same way at every attempt. One
line per attempt buried the logs: fifty agents without a kubelet socket wrote about 9,300
warnings in five minutes (issue 36). A streak lasts while at least one *subject* (a resource
being registered, ...) fails: its first failure logs one line (the subject, the error, and that
what follows is counted, not logged), the rest go to DEBUG and to :attr:`failures` (a metric);
when the last failing subject succeeds, or is given up, one line says it works again, after
how many failed attempts over how long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class FailureStreak:
    """Failures of one kind of operation, over any number of subjects."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        counted_in: str,
        *,
        noun: str = "subject",
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.noun = noun  # what a subject is, for the end line: "resource", ...
        self.what = what  # e.g. "registering device plugins with kubelet"
        self.counted_in = counted_in  # the metric that counts the failures not logged
        self._level = level
        self._clock = clock
        self.failures = 0  # every failure, for the metric
        self._failing: set[str] = set()
        self._started = 0.0
        self._in_streak = 0  # failures of the current streak
        self._subjects = 0  # distinct subjects that failed in the current streak

    @property
    def failing(self) -> frozenset[str]:
        """The subjects failing now."""
        return frozenset(self._failing)

    def failed(self, subject: str, error: str) -> None:
        """An attempt for ``subject`` failed with ``error`` (and will be retried)."""
        self.failures += 1
        self._in_streak += 1
        if subject not in self._failing:
            self._subjects += 1
        if not self._failing:
            self._started = self._clock()
            self._failing.add(subject)
            self._log.log(
                self._level,
                "%s failed (%s: %s); retrying with backoff. Further failures are not logged "
                "but counted (%s) until it works again",
                self.what,
                subject,
                error,
                self.counted_in,
            )
            return
        self._failing.add(subject)
        self._log.debug("%s failed again (%s: %s)", self.what, subject, error)

    def succeeded(self, subject: str) -> None:
        """An attempt for ``subject`` worked."""
        self._end(subject, "works again")

    def forget(self, subject: str) -> None:
        """``subject`` is not tried any more (stopped)."""
        self._end(subject, "is not tried any more")

    def _end(self, subject: str, how: str) -> None:
        if subject not in self._failing:
            return
        self._failing.discard(subject)
        if self._failing:
            return
        self._log.info(
            "%s %s after %d failed attempt(s) over %.1fs (%d %s(s); last: %s)",
            self.what,
            how,
            self._in_streak,
            self._clock() - self._started,
            self._subjects,
            self.noun,
            subject,
        )
        self._in_streak = 0
        self._subjects = 0
