"""Wiring: store + handlers + discovery manager + activity log, run until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from agent.activity_log import log_instance_changes
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.reclaimer import SlotReclaimer
from agent.discovery.manager import DiscoveryManager, GraceSettings
from agent.events import Subscription
from agent.gc_tuning import freeze_long_lived, freeze_when_settled
from agent.ledger.ledger import SlotLedger
from agent.store.base import InstanceEvent

if TYPE_CHECKING:
    from agent.dra.driver import DraDriver
    from agent.dra.publisher import SlicePublisher
from agent.settings import AgentSettings
from agent.store.base import InstanceStore
from discovery_handlers.debug_echo import DebugEchoHandler
from discovery_handlers.registry import HandlerRegistry
from discovery_handlers.udev import UdevHandler

log = logging.getLogger("agent")


def build_handlers(settings: AgentSettings) -> HandlerRegistry:
    """The embedded handlers this agent runs."""
    registry = HandlerRegistry()
    # only runs when a Configuration names "udev"
    registry.register(UdevHandler(monitor_source=settings.udev_monitor_source))
    if settings.debug_echo:
        registry.register(
            DebugEchoHandler(
                shared=settings.debug_echo_shared,
                availability_file=settings.debug_echo_availability_file,
                poll_interval=min(0.5, settings.poll_interval),
            )
        )
    return registry


class Agent:
    """One node's agent."""

    def __init__(self, settings: AgentSettings, store: InstanceStore) -> None:
        self.settings = settings
        self.store = store
        self.handlers = build_handlers(settings)
        self.discovery = DiscoveryManager(
            store,
            self.handlers,
            settings.node_name,
            GraceSettings(settings.local_offline_grace, settings.shared_offline_grace),
        )
        self._activity: asyncio.Task[None] | None = None
        self.ledger = SlotLedger(store, settings.node_name)
        self.plugins: DevicePluginManager | None = None
        self.reclaimer: SlotReclaimer | None = None
        self._reclaim_task: asyncio.Task[None] | None = None
        self.dra: DraDriver | None = None
        self.publisher: SlicePublisher | None = None
        self._slice_events: asyncio.Task[None] | None = None
        self._gc_freeze: asyncio.Task[None] | None = None
        if settings.device_plugin_dir is not None:
            self.plugins = DevicePluginManager(
                store, self.ledger, self.discovery, settings.device_plugin_dir
            )
            self.discovery.add_offline_listener(self.plugins.offline_changed)
            self.reclaimer = SlotReclaimer(
                self.ledger,
                store.list_cached,
                settings.pod_resources_socket,
                interval=settings.reclaim_interval,
                grace=settings.reclaim_grace,
                events=store.subscribe_instances,
            )

    def _build_dra(self) -> None:
        """DRA driver + slice publisher (cluster mode only: claims live in the API)."""
        from agent.dra.cdi import CdiWriter
        from agent.dra.checkpoint import Checkpoint
        from agent.dra.driver import DraDriver
        from agent.dra.publisher import SlicePublisher
        from agent.dra.state import DraState
        from agent.store.kubernetes import KubernetesInstanceStore

        if not isinstance(self.store, KubernetesInstanceStore):
            return
        checkpoint = Checkpoint(self.settings.dra_plugin_dir / "checkpoint.json")
        checkpoint.load()
        state = DraState(
            self.ledger,
            self.store.list_cached,
            self.discovery.device_for,
            self.store.read_resource_claim,
            CdiWriter(self.settings.cdi_dir),
            checkpoint,
        )
        self.dra = DraDriver(
            state, self.settings.plugins_registry_dir, self.settings.dra_plugin_dir
        )
        self.publisher = SlicePublisher(
            self.store.api_client,
            self.settings.node_name,
            self.store.list_cached,
            self.discovery.offline_instances,
        )
        self.discovery.add_offline_listener(self.publisher.trigger)

    async def start(self) -> None:
        """Load state (raises CorruptStateError), then start discovery."""
        await self.store.start()
        if self.settings.dra:
            self._build_dra()
        self._activity = asyncio.create_task(
            log_instance_changes(self.store.subscribe_instances()), name="activity-log"
        )
        await self.discovery.start()
        if self.plugins is not None and self.reclaimer is not None:
            await self.plugins.start()
            self._reclaim_task = asyncio.create_task(self.reclaimer.run(), name="reclaimer")
        if self.dra is not None and self.publisher is not None:
            await self.dra.start()
            await self.publisher.start()
            self._slice_events = asyncio.create_task(
                self._trigger_publisher(self.store.subscribe_instances()), name="slice-trigger"
            )
        freeze_long_lived()
        changes = self.store.subscribe_instances()
        self._gc_freeze = asyncio.create_task(self._freeze_when_settled(changes), name="gc")
        log.info(
            "agent started on node %s (handlers: %s; %d configuration(s))",
            self.settings.node_name,
            ", ".join(self.handlers.names()) or "none",
            len(self.store.configurations()),
        )

    async def _freeze_when_settled(self, changes: Subscription[InstanceEvent]) -> None:
        try:
            await freeze_when_settled(changes)
        finally:
            changes.close()

    async def _trigger_publisher(self, events: Subscription[InstanceEvent]) -> None:
        async for _ in events:
            if self.publisher is not None:
                self.publisher.trigger()

    async def stop(self) -> None:
        """Stop discovery; Instances and slots stay as they are for the next start."""
        if self._gc_freeze is not None:
            self._gc_freeze.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_freeze
        if self._slice_events is not None:
            self._slice_events.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._slice_events
        if self.publisher is not None:
            await self.publisher.close()
        if self.dra is not None:
            await self.dra.stop()
        if self._reclaim_task is not None:
            self._reclaim_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reclaim_task
        if self.plugins is not None:
            await self.plugins.close()
        await self.discovery.close()
        if self._activity is not None:
            self._activity.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._activity
        await self.store.close()
        log.info("agent stopped")

    async def run(self, stop: asyncio.Event) -> None:
        """Start, wait for ``stop``, stop."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()
