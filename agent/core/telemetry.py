"""What the agent counts and times for its metrics, kept as plain numbers.

The hot paths (Allocate, NodePrepareResources, every API request, every handler report) only
add to these; ``agent/ops/metrics.py`` turns them into Prometheus metrics when scraped, so an agent
that serves no metrics never imports ``prometheus_client`` and pays nothing but an addition.
They are process-wide, like the process they describe.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# seconds; Allocate and NodePrepareResources sit in the low milliseconds (docs/performance.md)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# seconds a handler takes to its first device list (ONVIF probes wait discoveryTimeoutSeconds)
DISCOVERY_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Cumulative-at-read bucket counts, sum and count of observations."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus wants them (``+Inf`` last)."""
        result, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            result.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return result


class LabelledHistograms:
    """One :class:`Histogram` per label value."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.by_label: dict[str, Histogram] = {}

    def observe(self, label: str, value: float) -> None:
        histogram = self.by_label.get(label)
        if histogram is None:
            histogram = self.by_label[label] = Histogram(self.buckets)
        histogram.observe(value)


ALLOCATE = LabelledHistograms(LATENCY_BUCKETS)  # by plugin kind: instance / configuration
NODE_PREPARE = Histogram(LATENCY_BUCKETS)
DISCOVERY_RESPONSE_TIME = LabelledHistograms(DISCOVERY_BUCKETS)  # by configuration
DISCOVERY_RESULTS: Counter[tuple[str, str]] = Counter()  # (handler, success/failure)
API_ERRORS: Counter[str] = Counter()  # HTTP status code, or "transport"
EXTERNAL_CUT_OFFS: Counter[str] = Counter()  # by handler name: streams cut off (flood, garbage...)
# by handler name: endpoints forgotten, unreachable past the reconnect window
EXTERNAL_FORGOTTEN: Counter[str] = Counter()
# seconds the event loop ran a timer late (agent/ops/loop_monitor.py), one sample a second
LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LOOP_LAG = Histogram(LOOP_LAG_BUCKETS)
