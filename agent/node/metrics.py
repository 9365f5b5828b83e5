"""The node agent's own Prometheus metrics, read from its state at scrape time.

The process-wide ones (telemetry counters, slot writes, API errors) are in
``agent/ops/metrics.py``; this collector adds what only a node agent knows: the cached
Instances and their slot holders, each Configuration's discovery state, the reclaimers,
kubelet re-registrations, refused ResourceSlice writes and dropped Events. It reads the agent
through :class:`NodeParts`, so it does not import ``agent/node/app.py`` (which imports it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.core.model.device_usage import (
    ClaimUsage,
    ConfigurationUsage,
    Free,
    NodeUsage,
    parse_usage,
)

if TYPE_CHECKING:
    from agent.core.store.base import InstanceStore
    from agent.node.deviceplugin.manager import DevicePluginManager
    from agent.node.deviceplugin.reclaimer import SlotReclaimer
    from agent.node.discovery.manager import DiscoveryManager
    from agent.node.dra.driver import DraDriver
    from agent.node.dra.publisher import SlicePublisher
    from agent.node.dra.reclaim import DraReclaimer

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


class NodeParts(Protocol):
    """What the collector reads of a node agent (``agent.node.app.Agent`` has all of it)."""

    @property
    def store(self) -> InstanceStore: ...
    @property
    def discovery(self) -> DiscoveryManager: ...
    @property
    def plugins(self) -> DevicePluginManager | None: ...
    @property
    def reclaimer(self) -> SlotReclaimer | None: ...
    @property
    def dra(self) -> DraDriver | None: ...
    @property
    def dra_reclaimer(self) -> DraReclaimer | None: ...
    @property
    def publisher(self) -> SlicePublisher | None: ...


class NodeCollector(Collector):
    """Reads one node agent's state at scrape time."""

    def __init__(self, agent: NodeParts) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        yield from self._instances()
        yield self._handler_states()
        yield from self._budget()
        yield from self._node_counters()
        yield self._extended_resource_path()
        yield self._runtime_cdi()

    def _extended_resource_path(self) -> Metric:
        path = GaugeMetricFamily(
            "akri_extended_resource_path",
            "Which path serves pods' limits akri.sh/<name> on this node (1 for the one in use): "
            "dra (ResourceSlices + DRA driver) or device-plugins",
            labels=["path"],
        )
        current = getattr(self.agent, "extended_resource_path", None)
        for name in ("dra", "device-plugins"):
            path.add_metric([name], 1 if current == name else 0)
        return path

    def _runtime_cdi(self) -> Metric:
        gauge = GaugeMetricFamily(
            "akri_runtime_cdi",
            "This node's container runtime (status.nodeInfo.containerRuntimeVersion) and whether "
            "it injects CDI devices, which DRA needs to hand a container its device: yes, no, "
            "or unknown (off by default, e.g. containerd 1.7; the Node label "
            "akri.sh/runtime-cdi overrides); absent before the Node was read",
            labels=["runtime", "cdi"],
        )
        runtime = getattr(self.agent, "runtime_cdi", None)
        if runtime is not None:
            gauge.add_metric([runtime.runtime, runtime.shown], 1)
        return gauge

    def _budget(self) -> Iterator[Metric]:
        budget = self.agent.discovery.budget
        limit = GaugeMetricFamily(
            "akri_instance_budget",
            "The most devices that become Instances on this node (--max-instances; 0: no limit)",
        )
        limit.add_metric([], budget.limit or 0)
        over = GaugeMetricFamily(
            "akri_instances_over_budget",
            "Devices discovered on this node but left out because the Instance budget is full, "
            "by Configuration",
            labels=["configuration"],
        )
        for key, left_out in sorted(budget.left_out.items()):
            over.add_metric([str(key)], left_out)
        yield limit
        yield over

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

    def _handler_states(self) -> Metric:
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
        return state

    def _node_counters(self) -> Iterator[Metric]:
        agent = self.agent
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
        paused = GaugeMetricFamily(
            "akri_slot_reclaim_paused",
            "1 while kubelet's pod-resources cannot be read: the slots this node holds through "
            "device plugins are kept, none is reclaimed",
        )
        paused.add_metric([], 1 if agent.reclaimer is not None and agent.reclaimer.paused else 0)
        yield paused
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
        failures = CounterMetricFamily(
            "akri_kubelet_registration_failures_total",
            "Registrations with kubelet that failed (device plugins: Register calls; DRA: "
            "refusals kubelet reported); logged once per streak",
            labels=["plugin"],
        )
        failures.add_metric(
            ["device_plugin"],
            agent.plugins.registration_failures if agent.plugins is not None else 0,
        )
        failures.add_metric(
            ["dra"], agent.dra.registration_failures if agent.dra is not None else 0
        )
        yield failures

        refused = CounterMetricFamily(
            "akri_resource_slice_writes_refused_total",
            "ResourceSlice pool writes the API server refused (403/400/422: e.g. the admission "
            "policy); the pool is skipped, the others are published",
        )
        publisher = agent.publisher
        refused.add_metric([], publisher.refused_writes if publisher is not None else 0)
        yield refused
        pending = GaugeMetricFamily(
            "akri_dra_pending_releases",
            "DRA claims unprepared on this node (an uninstalled agent) whose slot release the "
            "API refused: kept in the DRA checkpoint and retried until done",
        )
        pending.add_metric([], len(agent.dra.state.checkpoint.releases) if agent.dra else 0)
        yield pending
        dropped = CounterMetricFamily(
            "akri_events_dropped_total",
            "Kubernetes Events not sent because too many sends were already pending",
        )
        dropped.add_metric([], int(getattr(agent.store, "events_dropped", 0)))
        yield dropped
