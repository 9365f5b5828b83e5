"""The agent's Prometheus metrics, built when scraped (``prometheus_client`` custom collector).

Nothing here runs between scrapes: the values are read from the agent's state (cached
Instances, runners, plugins, reclaimers) and from the plain counters of ``agent/telemetry.py``.
Every metric is listed in docs/metrics.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from agent import telemetry
from agent.model.device_usage import (
    ClaimUsage,
    ConfigurationUsage,
    Free,
    NodeUsage,
    parse_usage,
)
from agent.store.cas import DEFAULT_RETRY, STATS

if TYPE_CHECKING:
    from agent.app import Agent

HOLDERS = ("instance", "configuration", "dra", "free", "unknown")
HANDLER_STATES = ("starting", "ok", "failed", "invalid")


def holder_kind(value: str) -> str:
    """Which kind of holder a deviceUsage value names."""
    usage = parse_usage(value)
    if isinstance(usage, Free):
        return "free"
    if isinstance(usage, NodeUsage):
        return "instance"
    if isinstance(usage, ConfigurationUsage):
        return "configuration"
    if isinstance(usage, ClaimUsage):
        return "dra"
    return "unknown"


class AgentCollector(Collector):
    """Reads one agent's state at scrape time."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        yield from self._instances()
        yield from self._discovery()
        yield from self._slots_activity()
        yield from self._api()

    def _instances(self) -> Iterator[Metric]:
        agent = self.agent
        count = GaugeMetricFamily(
            "akri_instance_count",
            "Instances in the agent's cache, by Configuration and sharing (Akri's metric)",
            labels=["configuration", "is_shared"],
        )
        slots = GaugeMetricFamily(
            "akri_instance_slots",
            "Slots of each Instance by holder kind (instance-level plugin, configuration-level "
            "plugin, DRA claim, free, unknown value)",
            labels=["namespace", "instance", "holder"],
        )
        per_configuration: Counter[tuple[str, str]] = Counter()
        for instance in agent.store.list_cached():
            shared = "true" if instance.shared else "false"
            per_configuration[(instance.configuration_name, shared)] += 1
            kinds: Counter[str] = Counter()
            for slot in instance.slot_ids():
                kinds[holder_kind(instance.device_usage.get(slot, ""))] += 1
            for holder in HOLDERS:
                slots.add_metric([instance.namespace, instance.name, holder], kinds[holder])
        for (configuration, shared), number in sorted(per_configuration.items()):
            count.add_metric([configuration, shared], number)
        yield count
        yield slots

    def _discovery(self) -> Iterator[Metric]:
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
        yield _histograms(
            "akri_discovery_response_time",
            "Seconds from starting a Configuration's discovery to its first device list "
            "(Akri's metric)",
            "configuration",
            telemetry.DISCOVERY_RESPONSE_TIME,
        )
        state = GaugeMetricFamily(
            "akri_discovery_handler_state",
            "1 for the current state of each Configuration's discovery: starting, ok, "
            "failed (the last device list is kept), invalid (discoveryDetails refused)",
            labels=["configuration", "discovery_handler_name", "state"],
        )
        for key, runner in sorted(self.agent.discovery.runners.items()):
            for name in HANDLER_STATES:
                value = 1 if runner.handler_state == name else 0
                state.add_metric([str(key), runner.handler.name, name], value)
        yield state

    def _slots_activity(self) -> Iterator[Metric]:
        agent = self.agent
        yield _histograms(
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
            "akri_slot_writes_total", "resourceVersion-checked writes of Instances (slot changes)"
        )
        writes.add_metric([], STATS.writes)
        yield writes
        conflicts = CounterMetricFamily(
            "akri_slot_write_conflicts_total",
            "Instance writes refused as stale (409) and retried on a fresh read",
        )
        conflicts.add_metric([], STATS.conflicts)
        yield conflicts
        gave_up = CounterMetricFamily(
            "akri_slot_write_retries_exhausted_total",
            f"Instance writes given up after {DEFAULT_RETRY.attempts} conflicts in a row (the "
            "Allocate, prepare or release that needed it failed; its caller may retry)",
        )
        gave_up.add_metric([], STATS.gave_up)
        yield gave_up
        reclaimed = CounterMetricFamily(
            "akri_slots_reclaimed_total",
            "Slots freed because no container or prepared claim used them any more",
            labels=["kind"],
        )
        reclaimed.add_metric(
            ["device_plugin"], agent.reclaimer.freed if agent.reclaimer is not None else 0
        )
        reclaimed.add_metric(
            ["dra"], agent.dra_reclaimer.freed if agent.dra_reclaimer is not None else 0
        )
        yield reclaimed
        restarts = CounterMetricFamily(
            "akri_kubelet_reregistrations_total",
            "Times the agent registered again with a restarted kubelet",
            labels=["plugin"],
        )
        restarts.add_metric(
            ["device_plugin"], agent.plugins.kubelet_restarts if agent.plugins is not None else 0
        )
        restarts.add_metric(["dra"], agent.dra.re_registrations if agent.dra is not None else 0)
        yield restarts

    def _api(self) -> Iterator[Metric]:
        errors = CounterMetricFamily(
            "akri_api_request_errors_total",
            "Kubernetes API requests that failed, by HTTP status code (or 'transport': no answer)",
            labels=["code"],
        )
        for code, number in sorted(telemetry.API_ERRORS.items()):
            errors.add_metric([code], number)
        yield errors
        refused = CounterMetricFamily(
            "akri_resource_slice_writes_refused_total",
            "ResourceSlice pool writes the API server refused (403/400/422: e.g. the admission "
            "policy); the pool is skipped, the others are published",
        )
        publisher = self.agent.publisher
        refused.add_metric([], publisher.refused_writes if publisher is not None else 0)
        yield refused
        dropped = CounterMetricFamily(
            "akri_events_dropped_total",
            "Kubernetes Events not sent because too many sends were already pending",
        )
        dropped.add_metric([], int(getattr(self.agent.store, "events_dropped", 0)))
        yield dropped


def _histograms(
    name: str, documentation: str, label: str, source: telemetry.LabelledHistograms
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for value, histogram in sorted(source.by_label.items()):
        family.add_metric([value], histogram.cumulative(), histogram.total)
    return family


def registry_for(agent: Agent) -> CollectorRegistry:
    """A registry with the agent's metrics only (no process/platform collectors: the
    kubelet's cAdvisor already has the container's CPU and memory)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    return registry
