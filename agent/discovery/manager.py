"""``DiscoveryManager``: one :class:`ConfigurationRunner` per Configuration.

Follows Configuration events from the store: starts a runner for a new Configuration, hands an
edited one to its runner (which restarts discovery only if the discovery handler's part of the
spec changed), stops a deleted one and removes this node from its Instances. A Configuration
naming an unknown handler, or with unusable discoveryDetails, is reported (log line + event)
and does not affect the others; the last good version of an edited Configuration keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from agent.discovery.plan import grace_for
from agent.discovery.runner import ConfigurationRunner, remove_node
from agent.events import Subscription
from agent.model.configuration import Configuration
from agent.store.base import ConfigurationEvent, EventType, InstanceEvent, InstanceStore
from discovery_handlers.base import Device, InvalidDiscoveryDetailsError
from discovery_handlers.registry import HandlerRegistry

log = logging.getLogger("agent.discovery")


@dataclass(frozen=True)
class GraceSettings:
    """Default offline grace periods (seconds) for local and shared devices."""

    local: float = 0.0
    shared: float = 300.0


class DiscoveryManager:
    """Keeps one runner per valid Configuration."""

    def __init__(
        self,
        store: InstanceStore,
        handlers: HandlerRegistry,
        node: str,
        grace: GraceSettings = GraceSettings(),
    ) -> None:
        self.store = store
        self.handlers = handlers
        self.node = node
        self.grace = grace
        self.runners: dict[str, ConfigurationRunner] = {}
        self._offline_listeners: list[Callable[[], None]] = []
        self._tasks: list[asyncio.Task[None]] = []

    def _grace_for(self, configuration: Configuration, shared: bool) -> float:
        return grace_for(configuration, shared, self.grace.local, self.grace.shared)

    async def start(self) -> None:
        """Remove this node from Instances of vanished Configurations, then follow events."""
        await self._sweep_orphans()
        configurations = self.store.subscribe_configurations()
        instances = self.store.subscribe_instances()
        self._tasks = [
            asyncio.create_task(self._follow_configurations(configurations), name="configs"),
            asyncio.create_task(self._follow_instances(instances), name="instances"),
        ]

    async def close(self) -> None:
        """Stop all runners (Instances stay; a restarted agent picks them up)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for runner in list(self.runners.values()):
            await runner.stop(remove_instances=False)
        self.runners.clear()

    def add_offline_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever the set of offline (in-grace) Instances changes."""
        self._offline_listeners.append(listener)

    def _offline_changed(self) -> None:
        for listener in self._offline_listeners:
            listener()

    def offline_instances(self) -> frozenset[str]:
        """Instances this node has lost but keeps during the grace period (slots Unhealthy)."""
        result: set[str] = set()
        for runner in self.runners.values():
            result |= runner.offline
        return frozenset(result)

    def device_for(self, instance: str) -> Device | None:
        """The device behind ``instance`` as this node last discovered it."""
        for runner in self.runners.values():
            device = runner.devices_by_instance.get(instance)
            if device is not None:
                return device
        return None

    async def _sweep_orphans(self) -> None:
        known = {cfg.name for cfg in self.store.configurations()}
        for instance in self.store.list_cached():
            if instance.configuration_name not in known and self.node in instance.nodes:
                log.info(
                    "instance %s: configuration %s no longer exists; removing node %s",
                    instance.name,
                    instance.configuration_name,
                    self.node,
                )
                await remove_node(self.store, instance.name, self.node)

    async def _follow_configurations(self, events: Subscription[ConfigurationEvent]) -> None:
        async for event in events:
            try:
                await self.handle_configuration_event(event)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("configuration %s: unexpected error", event.name)

    async def _follow_instances(self, events: Subscription[InstanceEvent]) -> None:
        async for event in events:
            runner = self.runners.get(event.instance.configuration_name)
            if runner is not None:
                runner.wake()

    async def handle_configuration_event(self, event: ConfigurationEvent) -> None:
        """Start, update or stop the runner for one Configuration event."""
        if event.error is not None:
            return  # already logged by the source; the last good version keeps running
        if event.type is EventType.DELETED:
            runner = self.runners.pop(event.name, None)
            if runner is not None:
                log.info(
                    "configuration %s deleted: stopping discovery, removing its instances",
                    event.name,
                )
                await runner.stop(remove_instances=True)
            return
        configuration = event.configuration
        assert configuration is not None
        problem = self._check(configuration)
        if problem is not None:
            reason, message = problem
            log.error("configuration %s: %s", configuration.name, message)
            await self.store.record_configuration_event(configuration, reason, message)
            return
        runner = self.runners.get(configuration.name)
        if runner is not None and runner.handler.name == configuration.discovery_handler.name:
            runner.update(configuration)
            return
        if runner is not None:
            await runner.stop(remove_instances=True)
        handler = self.handlers.get(configuration.discovery_handler.name)
        assert handler is not None
        log.info(
            "configuration %s: starting %s discovery (capacity %d)",
            configuration.name,
            handler.name,
            configuration.capacity,
        )
        runner = ConfigurationRunner(
            configuration,
            handler,
            self.store,
            self.node,
            self._grace_for,
            on_offline_change=self._offline_changed,
        )
        self.runners[configuration.name] = runner
        runner.start()

    def _check(self, configuration: Configuration) -> tuple[str, str] | None:
        name = configuration.discovery_handler.name
        handler = self.handlers.get(name)
        if handler is None:
            return (
                "UnknownDiscoveryHandler",
                f"spec.discoveryHandler.name: no discovery handler named {name!r} "
                f"(available: {', '.join(self.handlers.names()) or 'none'})",
            )
        try:
            handler.validate(configuration.discovery_handler.discovery_details)
        except InvalidDiscoveryDetailsError as error:
            return ("InvalidDiscoveryDetails", f"spec.discoveryHandler.discoveryDetails: {error}")
        return None
