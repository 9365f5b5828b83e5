"""LoopMonitor: a held event loop shows up as lag, in the log and on /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.core import telemetry
from agent.ops.loop_monitor import LoopMonitor
from agent.ops.metrics import registry_for


def lag_histogram() -> dict[str, float]:
    """The exported ``akri_event_loop_lag_seconds`` samples, by sample name and ``le``."""
    text = generate_latest(registry_for()).decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "akri_event_loop_lag_seconds":
            for sample in family.samples:
                found[sample.name + sample.labels.get("le", "")] = sample.value
    return found


async def samples_beyond(monitor: LoopMonitor, count: int) -> None:
    for _ in range(3000):  # 30 s at most, even on a loaded machine
        if monitor.samples > count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the monitor took no sample beyond {count}")


async def test_a_held_loop_is_counted_in_the_lag_histogram(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = lag_histogram()
    held_before = before.get("akri_event_loop_lag_seconds_count", 0) - before.get(
        "akri_event_loop_lag_seconds_bucket0.05", 0
    )
    monitor = LoopMonitor(interval=0.01, warn_after=0.05)
    task = asyncio.create_task(monitor.run())
    with caplog.at_level(logging.WARNING, logger="agent.ops.loop_monitor"):
        await samples_beyond(monitor, 1)  # the monitor is running
        time.sleep(0.2)  # hold the loop, as a blocking call would
        await samples_beyond(monitor, monitor.samples)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    after = lag_histogram()
    held_after = (
        after["akri_event_loop_lag_seconds_count"] - after["akri_event_loop_lag_seconds_bucket0.05"]
    )
    assert held_after >= held_before + 1  # at least one sample over 50 ms
    assert after["akri_event_loop_lag_seconds_count"] == telemetry.LOOP_LAG.count
    assert monitor.max_lag >= 0.15
    assert "the event loop was held" in caplog.text
