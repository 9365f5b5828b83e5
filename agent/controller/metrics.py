"""The controller's own Prometheus metrics (``/metrics``, with the process-wide ones of
``agent/ops/metrics.py``), read from the reconciler and the leader elector when scraped.
Every metric is listed in docs/metrics.md."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.controller.leader import LeaderElector
from agent.controller.reconcile import Reconciler


class ControllerCollector(Collector):
    """Broker workloads, dead-node cleanup and leadership."""

    def __init__(self, reconciler: Reconciler, elector: LeaderElector) -> None:
        self.reconciler = reconciler
        self.elector = elector

    def collect(self) -> Iterator[Metric]:
        stats = self.reconciler.stats
        pods = GaugeMetricFamily(
            "akri_broker_pod_count",
            "Broker Pods (not terminating) per Configuration and node (Akri's metric)",
            labels=["configuration", "node"],
        )
        for (configuration, node), number in sorted(self.reconciler.broker_pod_counts().items()):
            pods.add_metric([configuration, node], number)
        yield pods
        jobs = GaugeMetricFamily(
            "akri_broker_job_count", "Broker Jobs per Configuration", labels=["configuration"]
        )
        for configuration, number in sorted(
            self.reconciler.count_by_configuration(self.reconciler.job_cache).items()
        ):
            jobs.add_metric([configuration], number)
        yield jobs
        services = GaugeMetricFamily(
            "akri_broker_service_count",
            "Instance and configuration Services per Configuration",
            labels=["configuration"],
        )
        for configuration, number in sorted(
            self.reconciler.count_by_configuration(self.reconciler.service_cache).items()
        ):
            services.add_metric([configuration], number)
        yield services
        waiting = GaugeMetricFamily(
            "akri_broker_waiting_for_slot",
            "Brokers (Pods per node, or Jobs) not started because their Instance has no free "
            "slot for them, per Configuration, at the last pass",
            labels=["configuration"],
        )
        for configuration, number in sorted(stats.brokers_waiting.items()):
            waiting.add_metric([configuration], number)
        yield waiting
        created = CounterMetricFamily(
            "akri_broker_pods_created_total", "Broker Pods created", labels=["configuration"]
        )
        for configuration, number in sorted(stats.pods_created.items()):
            created.add_metric([configuration], number)
        yield created
        removed = CounterMetricFamily(
            "akri_broker_pods_removed_total",
            "Broker Pods removed, by reason (NodeLeft, Failed, PendingTooLong, RolledOver, "
            "MakeRoom, InstanceGone, NoBrokerPodSpec)",
            labels=["configuration", "reason"],
        )
        for (configuration, reason), number in sorted(stats.pods_removed.items()):
            removed.add_metric([configuration, reason], number)
        yield removed
        jobs_created = CounterMetricFamily(
            "akri_broker_jobs_created_total", "Broker Jobs created", labels=["configuration"]
        )
        for configuration, number in sorted(stats.jobs_created.items()):
            jobs_created.add_metric([configuration], number)
        yield jobs_created
        for name, counter, what in (
            ("akri_controller_dead_nodes_cleaned_total", stats.nodes_cleaned,
             "Dead nodes (not serving, none of their pods that may use devices left) removed "
             "from the Instances"),
            ("akri_controller_nodes_freed_by_timer_total", stats.nodes_freed_by_timer,
             "Nodes whose slots --free-slots-of-unready-nodes-after freed while their pods "
             "remained"),
            ("akri_controller_slots_freed_total", stats.slots_freed,
             "Slots freed because the node holding them was dead"),
            ("akri_controller_instances_deleted_total", stats.instances_deleted,
             "Instances deleted because their last node was dead"),
            ("akri_controller_slices_handed_over_total", stats.slices_handed_over,
             "Shared ResourceSlices deleted because they listed only dead nodes"),
            ("akri_controller_write_errors_total", stats.write_errors,
             "Broker/Service writes the API server refused (other than 404/409)"),
            ("akri_controller_leader_changes_total", self.elector.transitions,
             "Times this replica started or stopped leading"),
            ("akri_controller_reconcile_passes_total", stats.passes,
             "Reconcile passes run while leading"),
            ("akri_controller_reconcile_failures_total", stats.pass_failures,
             "Reconcile passes ended by an unexpected error (logged with its traceback)"),
        ):  # fmt: skip
            family = CounterMetricFamily(name, what)
            family.add_metric([], counter)
            yield family
        leader = GaugeMetricFamily(
            "akri_controller_leader", "1 while this replica holds the leader-election Lease"
        )
        leader.add_metric([], 1 if self.elector.leading.is_set() else 0)
        yield leader
        holding = GaugeMetricFamily(
            "akri_controller_nodes_holding_slots",
            "Nodes not Ready (or deleted, or out-of-service) whose slots are kept because "
            "their pods that may use devices still exist",
        )
        holding.add_metric([], stats.nodes_holding)
        yield holding
        last = GaugeMetricFamily(
            "akri_controller_last_reconcile_seconds", "Duration of the last reconcile pass"
        )
        last.add_metric([], stats.last_pass_seconds)
        yield last
