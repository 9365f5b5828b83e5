"""Process-wide Prometheus metrics, built when scraped (``prometheus_client`` custom collector).

Nothing here runs between scrapes: :class:`TelemetryCollector` reads the plain counters of
``agent/core/telemetry.py`` and the CAS write statistics, which every process (the node agent,
the controller) keeps. What a particular process knows beyond those (the node agent's cached
Instances, runners, plugins) is its own collector (``agent/node/metrics.py``), handed to
:func:`registry_for`. This module imports nothing of the node agent or the controller.
Every metric is listed in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from agent.core import telemetry
from agent.core.aio import fswatch
from agent.core.store.cas import DEFAULT_RETRY, OPERATIONS, STATS, OperationStats


class TelemetryCollector(Collector):
    """The process-wide counters and histograms (discovery results and times, Allocate and
    prepare times, slot writes, API errors)."""

    def collect(self) -> Iterator[Metric]:
        # untyped, so that the name is exactly Akri's (a counter would gain "_total")
        results = UnknownMetricFamily(
            "akri_discovery_response_result",
            "Device lists received from discovery handlers, by handler and result (Akri's "
            "metric, a counter): success, or failure (an error, or a list over the bounds)",
            labels=["discovery_handler_name", "response_result"],
        )
        for (handler, result), number in sorted(telemetry.DISCOVERY_RESULTS.items()):
            results.add_metric([handler, result], number)
        yield results
        yield histograms(
            "akri_discovery_response_time",
            "Seconds from starting a Configuration's discovery to its first device list "
            "(Akri's metric)",
            "configuration",
            telemetry.DISCOVERY_RESPONSE_TIME,
        )
        yield histograms(
            "akri_allocate_seconds",
            "Device-plugin Allocate handling time, by plugin kind (instance, configuration)",
            "plugin",
            telemetry.ALLOCATE,
        )
        prepare = HistogramMetricFamily(
            "akri_node_prepare_resources_seconds",
            "DRA NodePrepareResources handling time",
        )
        histogram = telemetry.NODE_PREPARE
        prepare.add_metric([], histogram.cumulative(), histogram.total)
        yield prepare
        writes = CounterMetricFamily(
            "akri_slot_writes_total",
            "Instance writes, by operation (join, leave, update, claim, release): "
            "resourceVersion-checked, or membership applies (join/leave) that touch no slot",
            labels=["operation"],
        )
        conflicts = CounterMetricFamily(
            "akri_slot_write_conflicts_total",
            "Instance writes refused as stale (409) and retried on a fresh read, by operation",
            labels=["operation"],
        )
        gave_up = CounterMetricFamily(
            "akri_slot_write_retries_exhausted_total",
            f"Instance writes given up after {DEFAULT_RETRY.attempts} conflicts in a row, by "
            "operation (the Allocate, prepare or release that needed it failed; its caller may "
            "retry)",
            labels=["operation"],
        )
        per_operation = STATS.per_operation()
        # every operation is exported from the start (a counter that appears only at its
        # first increment breaks rate() and the alerts' ratios)
        for operation in sorted({*OPERATIONS, *per_operation}):
            counted = per_operation.get(operation, OperationStats())
            writes.add_metric([operation], counted.writes)
            conflicts.add_metric([operation], counted.conflicts)
            gave_up.add_metric([operation], counted.gave_up)
        yield writes
        yield conflicts
        yield gave_up
        errors = CounterMetricFamily(
            "akri_api_request_errors_total",
            "Kubernetes API requests that failed, by HTTP status code (or 'transport': no answer)",
            labels=["code"],
        )
        for code, number in sorted(telemetry.API_ERRORS.items()):
            errors.add_metric([code], number)
        yield errors
        # read at scrape time: tests swap the module's STATS for a fresh one
        inotify = fswatch.STATS
        fallbacks = CounterMetricFamily(
            "akri_inotify_fallbacks_total",
            "Times the kernel refused inotify (kind: instance = inotify_init, e.g. EMFILE; "
            "watch = a directory, e.g. ENOSPC) and watched directories were polled instead",
            labels=["kind"],
        )
        for kind in ("instance", "watch"):
            fallbacks.add_metric([kind], inotify.fallbacks.get(kind, 0))
        yield fallbacks
        yield GaugeMetricFamily(
            "akri_inotify_available",
            "1 while inotify works for this process, 0 while its directories are polled "
            "(retried every few minutes)",
            value=1 if inotify.available else 0,
        )
        cut_offs = CounterMetricFamily(
            "akri_discovery_handler_cut_offs_total",
            "Streams of an external discovery handler cut off (flooding, garbage, a hung first "
            "list): the endpoint is paused and its last good list kept",
            labels=["discovery_handler_name"],
        )
        for name, number in sorted(telemetry.EXTERNAL_CUT_OFFS.items()):
            cut_offs.add_metric([name], number)
        yield cut_offs
        forgotten = CounterMetricFamily(
            "akri_discovery_handler_endpoints_forgotten_total",
            "External discovery handler endpoints forgotten after being unreachable for the "
            "reconnect window: their devices follow the offline grace until they register again",
            labels=["discovery_handler_name"],
        )
        for name, number in sorted(telemetry.EXTERNAL_FORGOTTEN.items()):
            forgotten.add_metric([name], number)
        yield forgotten
        lag = HistogramMetricFamily(
            "akri_event_loop_lag_seconds",
            "How late the event loop ran a 1 s timer (anything holding the loop: a long "
            "synchronous pass, a full garbage collection, a blocking write)",
        )
        lag.add_metric([], telemetry.LOOP_LAG.cumulative(), telemetry.LOOP_LAG.total)
        yield lag


def histograms(
    name: str, documentation: str, label: str, source: telemetry.LabelledHistograms
) -> HistogramMetricFamily:
    """One histogram family with a series per label value of ``source``."""
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for value, histogram in sorted(source.by_label.items()):
        family.add_metric([value], histogram.cumulative(), histogram.total)
    return family


def registry_for(*collectors: Collector) -> CollectorRegistry:
    """A registry with the process-wide metrics and the process's own ``collectors`` only (no
    process/platform collectors: the kubelet's cAdvisor already has the container's CPU and
    memory)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TelemetryCollector())
    for collector in collectors:
        registry.register(collector)
    return registry
