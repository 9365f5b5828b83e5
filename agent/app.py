"""Wiring: store + handlers + discovery manager + activity log, run until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agent.activity_log import log_instance_changes
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.reclaimer import SlotReclaimer
from agent.discovery.manager import DiscoveryManager, GraceSettings
from agent.ledger.ledger import SlotLedger
from agent.settings import AgentSettings
from agent.store.base import InstanceStore
from discovery_handlers.debug_echo import DebugEchoHandler
from discovery_handlers.registry import HandlerRegistry

log = logging.getLogger("agent")


def build_handlers(settings: AgentSettings) -> HandlerRegistry:
    """The embedded handlers this agent runs."""
    registry = HandlerRegistry()
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
            )

    async def start(self) -> None:
        """Load state (raises CorruptStateError), then start discovery."""
        await self.store.start()
        self._activity = asyncio.create_task(
            log_instance_changes(self.store.subscribe_instances()), name="activity-log"
        )
        await self.discovery.start()
        if self.plugins is not None and self.reclaimer is not None:
            await self.plugins.start()
            self._reclaim_task = asyncio.create_task(self.reclaimer.run(), name="reclaimer")
        log.info(
            "agent started on node %s (handlers: %s; %d configuration(s))",
            self.settings.node_name,
            ", ".join(self.handlers.names()) or "none",
            len(self.store.configurations()),
        )

    async def stop(self) -> None:
        """Stop discovery; Instances and slots stay as they are for the next start."""
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
