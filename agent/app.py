"""Wiring: store + handlers + discovery manager + activity log, run until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agent.activity_log import log_instance_changes
from agent.discovery.manager import DiscoveryManager, GraceSettings
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

    async def start(self) -> None:
        """Load state (raises CorruptStateError), then start discovery."""
        await self.store.start()
        self._activity = asyncio.create_task(
            log_instance_changes(self.store.subscribe_instances()), name="activity-log"
        )
        await self.discovery.start()
        log.info(
            "agent started on node %s (handlers: %s; %d configuration(s))",
            self.settings.node_name,
            ", ".join(self.handlers.names()) or "none",
            len(self.store.configurations()),
        )

    async def stop(self) -> None:
        """Stop discovery; Instances and slots stay as they are for the next start."""
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
