"""Summaries of measured samples (no estimation: every figure comes from a recorded sample)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default ``linear`` method). ``values`` must not be empty."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = math.ceil(position)
    if low == high:
        return ordered[low]
    weight = position - low
    return ordered[low] * (1 - weight) + ordered[high] * weight


def summarize(values: Sequence[float], digits: int = 1) -> dict[str, Any]:
    """``{"p50", "p99", "n", "min", "max", "mean"}`` of ``values`` (already in the unit wanted).

    With few samples p99 is close to the maximum: read it together with ``n``.
    """
    if not values:
        return {"error": "no samples", "n": 0}
    return {
        "p50": round(percentile(values, 50), digits),
        "p99": round(percentile(values, 99), digits),
        "n": len(values),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "mean": round(sum(values) / len(values), digits),
    }


def ms(seconds: Sequence[float]) -> list[float]:
    """Seconds to milliseconds."""
    return [s * 1000.0 for s in seconds]
