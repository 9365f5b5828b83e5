"""Wiring of ``akri controller``: health server, store, caches, leader election, reconciler.

Every replica keeps its caches warm and answers ``/readyz`` once they are synced; only the
replica holding the Lease reconciles. Losing the Lease cancels the reconcile task at once
(the elector stops leading before its renew deadline ends, which is shorter than the lease
duration a standby waits: the two never reconcile together).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from agent.controller.deviceclasses import DeviceClassReconciler
from agent.controller.leader import LeaderElector, LeaseSettings
from agent.controller.metrics import ControllerCollector
from agent.controller.node_labels import NodeLabelKeeper
from agent.controller.reconcile import Reconciler, ReconcileSettings
from agent.controller.settings import ControllerSettings
from agent.core.kube import KubeClient
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.ops.health import HealthServer
from agent.ops.metrics import registry_for

log = logging.getLogger("agent.controller")

STOP_DEADLINE = 5.0  # seconds to release the Lease and close at SIGTERM


class Controller:
    """One ``akri controller`` process."""

    def __init__(
        self,
        settings: ControllerSettings,
        client: KubeClient,
    ) -> None:
        self.settings = settings
        self.client = client
        self.store = KubernetesInstanceStore(
            client,
            KubernetesSettings(
                node_name=settings.identity, namespace=settings.namespace, all_instances=True
            ),
        )
        self.reconciler = Reconciler(
            client,
            self.store,
            ReconcileSettings(
                node_grace=settings.node_grace,
                free_slots_of_unready_nodes_after=settings.free_slots_of_unready_nodes_after,
                pending_broker_grace=settings.pending_broker_grace,
                failed_broker_grace=settings.failed_broker_grace,
                resync_interval=settings.resync_interval,
                namespace=settings.namespace,
                agent_selector=settings.agent_selector or None,
            ),
        )
        # KEP-5004: the DeviceClasses that serve akri.sh/<name> limits through DRA
        self.device_classes = DeviceClassReconciler(client, self.store)
        # issue 41: each agent watches only the Instances labelled with its node
        self.node_labels = NodeLabelKeeper(self.store)
        self.elector = LeaderElector(
            client,
            LeaseSettings(
                namespace=settings.lease_namespace or client.namespace or "default",
                name=settings.lease_name,
                identity=settings.identity,
                lease_duration=settings.lease_duration,
                renew_deadline=settings.renew_deadline,
                retry_period=settings.retry_period,
            ),
        )
        if settings.free_slots_of_unready_nodes_after is not None:
            log.warning(
                "--free-slots-of-unready-nodes-after %gs: the slots of a node not Ready for "
                "that long are freed even while its pods remain. If its containers still run "
                "(a kubelet down, a network partition), a device may be given to more "
                "consumers than its capacity; without the flag they are kept until "
                "Kubernetes says those pods are gone (docs/controller.md)",
                settings.free_slots_of_unready_nodes_after,
            )
        self._stage = "starting"
        self.health: HealthServer | None = None

    def readiness(self) -> list[str]:
        """Why ``/readyz`` fails (empty: ready). A standby is ready: it is warm."""
        return [] if self.reconciler.synced else [self._stage]

    async def run(self, stop: asyncio.Event) -> None:
        if self.settings.health_port:
            registry = registry_for(ControllerCollector(self.reconciler, self.elector))
            self.health = HealthServer(
                self.settings.health_address,
                self.settings.health_port,
                self.readiness,
                lambda: _exposition(registry),
            )
            await self.health.start()
        tasks: list[asyncio.Task[None]] = []
        try:
            self._stage = "waiting for the API server and the akri.sh CRDs"
            await _until(stop, self.store.start())
            if stop.is_set():
                return
            self._stage = "listing Nodes, broker Pods, Jobs, Services"
            await _until(stop, self.reconciler.start())
            if stop.is_set():
                return
            log.info(
                "controller %s ready; campaigning for Lease %s/%s",
                self.settings.identity,
                self.elector.settings.namespace,
                self.elector.settings.name,
            )
            tasks.append(asyncio.create_task(self.elector.run(), name="leader-election"))
            tasks.append(asyncio.create_task(self._lead(), name="lead"))
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_DEADLINE):
                    await self.elector.release()
            await self.reconciler.stop()
            await self.store.close()
            if self.health is not None:
                await self.health.stop()

    async def _lead(self) -> None:
        """Reconcile while leading; cancel the work the moment leadership is lost."""
        while True:
            await self.elector.leading.wait()
            work = [
                asyncio.create_task(self.reconciler.run(), name="reconcile"),
                asyncio.create_task(self.device_classes.run(), name="device-classes"),
                asyncio.create_task(self.node_labels.run(), name="node-labels"),
            ]
            try:
                while self.elector.leading.is_set():
                    self.elector.changed.clear()
                    await self.elector.changed.wait()
            finally:
                for task in work:
                    task.cancel()
                await asyncio.gather(*work, return_exceptions=True)


async def _until(stop: asyncio.Event, work: Coroutine[Any, Any, None]) -> None:
    """Await ``work`` unless ``stop`` is set first (SIGTERM while waiting for the CRDs)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    task.result()


def _exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
