"""``LoopMonitor``: how late the event loop runs a timer — the delay any callback (an
Allocate, a ListAndWatch send) would have seen at that moment.

A task sleeps ``interval`` seconds again and again and records how much later than asked it
woke. Anything that holds the loop (a long synchronous pass, a full garbage collection, a
blocking file write) shows up as lag. The maximum is logged when the agent stops (the
benchmarks read it there), a stall above ``warn_after`` is logged when it happens, and
:attr:`last_tick` tells a health probe whether the loop is alive at all.
"""

from __future__ import annotations

import asyncio
import logging
import time

from agent.core import telemetry

log = logging.getLogger(__name__)

INTERVAL = 1.0  # seconds between samples (an idle agent wakes for little else)
WARN_AFTER = 0.1  # seconds of lag worth a log line


class LoopMonitor:
    """Run :meth:`run` as a task; read :attr:`max_lag` and :attr:`last_tick`."""

    def __init__(self, interval: float = INTERVAL, warn_after: float = WARN_AFTER) -> None:
        self.interval = interval
        self.warn_after = warn_after
        self.max_lag = 0.0
        self.samples = 0
        self.started = time.monotonic()
        self.last_tick = self.started

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.interval)
            lag = max(0.0, loop.time() - asked - self.interval)
            self.samples += 1
            telemetry.LOOP_LAG.observe(lag)
            self.last_tick = time.monotonic()
            if lag > self.max_lag:
                self.max_lag = lag
            if lag > self.warn_after:
                log.warning("the event loop was held for %.0f ms", lag * 1000)

    def report(self) -> None:
        """Log the maximum lag (the benchmarks parse this line)."""
        log.info(
            "event loop lag: max %.1f ms over %.0f s (%d samples)",
            self.max_lag * 1000,
            time.monotonic() - self.started,
            self.samples,
        )
