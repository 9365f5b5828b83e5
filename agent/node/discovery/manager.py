"""``DiscoveryManager``: one :class:`ConfigurationRunner` per Configuration.

Follows Configuration events from the store: starts a runner for a new Configuration, hands an
edited one to its runner (which restarts discovery only if the discovery handler's part of the
spec changed), and retires a deleted one (this node leaves its Instances, each as soon as it
holds none of its slots). Invalid input never costs a slot:

* a Configuration naming an unknown handler, or with unusable discoveryDetails, is reported
  (log line + Event); the last good version of an edited Configuration keeps running;
* a Configuration that exists but has never been valid leaves its Instances exactly as they
  are (no leave, no delete, no slot change), and says so;
* at start, Instances that list this node but whose Configuration no longer exists are
  retired — unless a Configuration source cannot be read at all (it may define them), in
  which case nothing is taken for an orphan until it can;
* a Configuration whose name another namespace owns (kubelet and DRA names are node-global,
  see :mod:`agent.node.discovery.ownership`) is refused and starts once the name is free; its
  Instances on this node — e.g. when the name moved to the other namespace while it ran —
  are retired (draining while this node holds slots in them), since nothing here serves them
  any more and their slots must be freed when their containers end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.aio.events import Subscription
from agent.core.bounded_yaml import brief
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.configuration import Configuration
from agent.core.model.keys import ObjectKey
from agent.core.store.base import ConfigurationEvent, EventType, InstanceEvent, InstanceStore
from agent.node.discovery.budget import InstanceBudget
from agent.node.discovery.ownership import Ownership
from agent.node.discovery.plan import grace_for
from agent.node.discovery.retirement import Retirement
from agent.node.discovery.runner import ConfigurationRunner
from discovery_handlers.base import Device, InvalidDiscoveryDetailsError
from discovery_handlers.registry import HandlerRegistry

log = logging.getLogger("agent.discovery")


@dataclass(frozen=True)
class GraceSettings:
    """Default offline grace periods (seconds) for local and shared devices."""

    local: float = 0.0
    shared: float = 300.0


class DiscoveryManager:
    """Keeps one runner per valid Configuration, and retires the Instances of gone ones."""

    def __init__(
        self,
        store: InstanceStore,
        handlers: HandlerRegistry,
        node: str,
        grace: GraceSettings = GraceSettings(),
        *,
        ledger: SlotLedger | None = None,
        ownership: Ownership | None = None,
        max_instances: int | None = None,
    ) -> None:
        self.store = store
        # at most this many devices become Instances on this node (None: no limit)
        self.budget = InstanceBudget(max_instances, self._over_budget)
        # called when the budget's left-out devices or the refused Configurations change
        self.notes_listeners: list[Callable[[], None]] = []
        self._refusals: dict[ObjectKey, str] = {}
        self.handlers = handlers
        self.node = node
        self.grace = grace
        self.ledger = ledger or SlotLedger(store, node)
        self.ownership = ownership or Ownership(store)
        self.runners: dict[ObjectKey, ConfigurationRunner] = {}
        self.retirements: dict[ObjectKey, Retirement] = {}
        self.refused: dict[ObjectKey, Configuration] = {}  # waiting for their name
        # waiting for an external handler of their discoveryHandler.name to register
        self.waiting_for_handler: dict[ObjectKey, Configuration] = {}
        self._noticed: dict[ObjectKey, str] = {}  # last notice logged per Configuration
        self._sweep_pending = True
        self._unreadable_noticed: list[str] = []
        self._offline_listeners: list[Callable[[], None]] = []
        self._seen_listeners: list[Callable[[], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._retries: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()  # one Configuration event at a time

    def _grace_for(self, configuration: Configuration, shared: bool) -> float:
        return grace_for(configuration, shared, self.grace.local, self.grace.shared)

    async def start(self) -> None:
        """Follow Configuration and Instance events; retire orphaned Instances."""
        configurations = self.store.subscribe_configurations()
        instances = self.store.subscribe_instances()
        self.ownership.add_listener(self._owners_changed)
        self.store.on_catalog_change(self._catalog_changed)
        self._notice_invalid()
        self._sweep_orphans()
        self._tasks = [
            asyncio.create_task(self._follow_configurations(configurations), name="configs"),
            asyncio.create_task(self._follow_instances(instances), name="instances"),
        ]

    async def close(self) -> None:
        """Stop all runners (Instances stay; a restarted agent picks them up)."""
        for task in [*self._tasks, *self._retries]:
            task.cancel()
        for task in [*self._tasks, *self._retries]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for runner in list(self.runners.values()):
            await runner.stop()
        for retirement in list(self.retirements.values()):
            await retirement.stop()
        self.runners.clear()
        self.retirements.clear()

    # -- what the device plugins and the DRA driver ask ----------------------------------------
    def add_offline_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever the set of offline (in-grace or draining) Instances
        changes."""
        self._offline_listeners.append(listener)

    def _offline_changed(self) -> None:
        for listener in self._offline_listeners:
            listener()

    def add_seen_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever :meth:`seen_instances` may have changed."""
        self._seen_listeners.append(listener)

    def _seen_changed(self) -> None:
        for listener in self._seen_listeners:
            listener()

    def offline_instances(self) -> frozenset[str]:
        """Served (node-global) names of the Instances whose slots must not be offered:
        devices this node lost but keeps during the grace period, and Instances draining
        before this node leaves. Only the owner namespace's Instances count: another
        namespace's Instance of the same name (refused, or retiring) is not the one the
        device plugins and the DRA driver serve under that name."""
        result: set[str] = set()
        for key, runner in self.runners.items():
            if self.ownership.owns(key):
                result |= runner.offline
        for key, retirement in self.retirements.items():
            if self.ownership.owns(key):
                result |= retirement.offline
        return frozenset(result)

    def offline_until(self) -> dict[ObjectKey, float]:
        """Instances in their offline grace on this node, and when it ends (monotonic): what
        ``akri status`` shows as ``offline`` (local mode: through the node's notes)."""
        result: dict[ObjectKey, float] = {}
        for key, runner in self.runners.items():
            if self.ownership.owns(key):
                for name, until in runner.offline_until().items():
                    result[ObjectKey(key.namespace, name)] = until
        return result

    def seen_instances(self) -> frozenset[str]:
        """Served names of the Instances whose devices this node's discovery reports now (in
        its handler's latest list): an offline mark of this node on them is stale."""
        result: set[str] = set()
        for key, runner in self.runners.items():
            if self.ownership.owns(key):
                result.update(runner.devices_by_instance)
        return frozenset(result)

    def draining(self) -> dict[ObjectKey, tuple[str, ...]]:
        """Instances this node stays in only because it still holds these slots."""
        result: dict[ObjectKey, tuple[str, ...]] = {}
        for runner in self.runners.values():
            for name, slots in runner.draining.items():
                result[ObjectKey(runner.configuration.namespace, name)] = slots
        for retirement in self.retirements.values():
            for name, slots in retirement.draining.items():
                result[ObjectKey(retirement.configuration.namespace, name)] = slots
        return result

    def retiring_instances(self) -> frozenset[str]:
        """Names of the Instances of Configurations that are gone here (draining, or left
        to the garbage collector): their slots are offered nowhere, and they are no device
        that went offline — this node writes no offline mark onto them. Only the owner
        namespace's count, as in :meth:`offline_instances`: another namespace's retiring
        Instance of the same name is not the one served under it."""
        result: set[str] = set()
        for key, retirement in self.retirements.items():
            if self.ownership.owns(key):
                result |= retirement.offline
        return frozenset(result)

    def device_for(self, instance: str) -> Device | None:
        """The device behind Instance ``instance`` (a served name) as last discovered here."""
        for key, runner in self.runners.items():
            if not self.ownership.owns(key):
                continue
            device = runner.devices_by_instance.get(instance)
            if device is not None:
                return device
        return None

    # -- orphans and invalid Configurations ----------------------------------------------------
    def _known_configurations(self) -> set[ObjectKey]:
        known = {c.key for c in self.store.configurations()}
        return known | {i.key for i in self.store.invalid_configurations()}

    def _sweep_orphans(self) -> None:
        """Retire Instances on this node whose Configuration does not exist, unless a
        Configuration source is unreadable (then no Instance is taken for an orphan)."""
        unreadable = self.store.unreadable_sources()
        if unreadable:
            if self._unreadable_noticed != unreadable:
                self._unreadable_noticed = unreadable
                log.warning(
                    "not leaving any instance of an unknown configuration while a configuration "
                    "source cannot be read (it may define it): %s",
                    "; ".join(unreadable),
                )
            self._sweep_pending = True
            return
        self._sweep_pending = False
        self._unreadable_noticed = []
        known = self._known_configurations()
        for key in sorted(self.store.instance_configurations() - known):
            if key in self.retirements or key in self.runners:
                continue
            if any(self.node in i.nodes for i in self.store.list_cached(key)):
                log.info(
                    "configuration %s no longer exists: %s leaves its instances",
                    key,
                    self.node,
                )
                self._retire(key, "its Configuration no longer exists")

    def _notice_invalid(self) -> None:
        """Say (once per message) that Instances of never-valid Configurations are kept."""
        for invalid in self.store.invalid_configurations():
            mine = [i for i in self.store.list_cached(invalid.key) if self.node in i.nodes]
            if not mine or invalid.key in self.runners:
                continue
            message = (
                f"configuration {invalid.key} is invalid and has no good version to run "
                f"({invalid.message}); its {len(mine)} instance(s) on {self.node} are left "
                "exactly as they are (no slot is freed) until it is fixed or deleted"
            )
            if self._noticed.get(invalid.key) == message:
                continue
            self._noticed[invalid.key] = message
            log.warning("%s", message)
            task = asyncio.get_running_loop().create_task(
                self.store.record_raw_configuration_event(invalid.raw, "InstancesKept", message)
            )
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)

    def _retire(self, key: ObjectKey, why: str, asked: bool = True) -> None:
        """``asked``: the Configuration was deleted (not refused here)."""
        if key in self.retirements:
            return
        if not any(self.node in i.nodes for i in self.store.list_cached(key)):
            return
        retirement = Retirement(
            key, self.store, self.ledger, why, on_offline_change=self._offline_changed, asked=asked
        )
        self.retirements[key] = retirement
        retirement.start()

        async def forget_when_done() -> None:
            await retirement.done.wait()
            if self.retirements.get(key) is retirement:
                del self.retirements[key]

        task = asyncio.get_running_loop().create_task(forget_when_done())
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    # -- events ----------------------------------------------------------------------------------
    async def _follow_configurations(self, events: Subscription[ConfigurationEvent]) -> None:
        async for event in events:
            try:
                await self.handle_configuration_event(event)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("configuration %s: unexpected error", event.key)

    async def _follow_instances(self, events: Subscription[InstanceEvent]) -> None:
        async for event in events:
            key = event.instance.configuration_key
            runner = self.runners.get(key)
            if runner is not None:
                runner.wake()
            retirement = self.retirements.get(key)
            if retirement is not None:
                retirement.wake()

    def wake_all(self) -> None:
        """Every runner decides again (this node's Node serves again: the Instances it could
        not join meanwhile are joined now)."""
        for runner in self.runners.values():
            runner.wake()

    def _catalog_changed(self) -> None:
        if self._sweep_pending and self._tasks:
            self._sweep_orphans()  # e.g. an unreadable Configuration file became readable

    def _owners_changed(self, names: set[str]) -> None:
        displaced = [k for k in self.runners if k.name in names and not self.ownership.owns(k)]
        if displaced:
            self._spawn(self._stop_displaced(displaced))
        waiting = [c for c in self.refused.values() if c.name in names]
        if not waiting:
            return

        async def retry() -> None:
            for configuration in waiting:
                current = next(
                    (c for c in self.store.configurations() if c.key == configuration.key), None
                )
                if current is not None and configuration.key in self.refused:
                    await self.handle_configuration_event(
                        ConfigurationEvent(EventType.ADDED, current.key, current)
                    )

        self._spawn(retry())

    async def _stop_displaced(self, keys: list[ObjectKey]) -> None:
        """Stop the runners of Configurations whose (node-global) name another namespace
        now owns, so that two namespaces never run discovery for one name, and retire their
        Instances on this node (:meth:`_refuse`); they start again when the name is
        theirs."""
        async with self._lock:
            for key in keys:
                runner = self.runners.get(key)
                if runner is None or self.ownership.owns(key):
                    continue
                await self._refuse(runner.configuration)

    def handler_registered(self, name: str) -> None:
        """An external handler registered under ``name``: start the Configurations waiting
        for it, and move running ones to it if it replaces an embedded handler."""
        handler = self.handlers.get(name)
        if handler is None:
            return
        for runner in self.runners.values():
            if (
                runner.configuration.discovery_handler.name == name
                and runner.handler is not handler
            ):
                runner.replace_handler(handler)
        waiting = [c for c in self.waiting_for_handler.values() if c.discovery_handler.name == name]
        if waiting:
            self._spawn(self._start_waiting(waiting))

    async def _start_waiting(self, waiting: list[Configuration]) -> None:
        for configuration in waiting:
            current = next(
                (c for c in self.store.configurations() if c.key == configuration.key), None
            )
            if current is not None and configuration.key in self.waiting_for_handler:
                await self.handle_configuration_event(
                    ConfigurationEvent(EventType.ADDED, current.key, current)
                )

    def handler_problem(self, name: str, reason: str, message: str) -> None:
        """Show a handler's problem (already logged) as an Event on every Configuration
        that uses it."""
        for runner in list(self.runners.values()):
            if runner.configuration.discovery_handler.name == name:
                self._spawn(
                    self.store.record_configuration_event(runner.configuration, reason, message)
                )

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def handle_configuration_event(self, event: ConfigurationEvent) -> None:
        """Start, update, refuse or retire for one Configuration event."""
        async with self._lock:
            await self._handle(event)
            if self._sweep_pending:
                self._sweep_orphans()

    async def _handle(self, event: ConfigurationEvent) -> None:
        key = event.key
        if event.error is not None:
            # already logged by the source; the last good version (if any) keeps running
            self._notice_invalid()
            return
        assert key is not None
        if event.type is EventType.DELETED:
            if self.refused.pop(key, None) is not None:
                self._notes_changed()
            self.waiting_for_handler.pop(key, None)
            self._noticed.pop(key, None)
            runner = self.runners.pop(key, None)
            if runner is not None:
                await runner.stop()
            if any(self.node in i.nodes for i in self.store.list_cached(key)):
                log.info(
                    "configuration %s deleted: stopping discovery; %s leaves its instances "
                    "as soon as it holds none of their slots",
                    key,
                    self.node,
                )
            self._retire(key, "its Configuration was deleted")
            return
        configuration = event.configuration
        assert configuration is not None
        # an edit can make a Configuration runnable or not, which weighs in who holds a name
        # (agent/core/name_claims.py); the catalog only changes when one comes or goes
        self.ownership.refresh()
        if not self.ownership.owns(key):
            await self._refuse(configuration)
            return
        if self.refused.pop(key, None) is not None:
            self._notes_changed()
        self._noticed.pop(key, None)
        problem, warnings = self._check(configuration)
        self.waiting_for_handler.pop(key, None)
        if problem is not None:
            reason, message = problem
            if reason == "UnknownDiscoveryHandler":
                # an external handler may still register (it also does after every agent
                # restart): this Configuration starts then
                self.waiting_for_handler[key] = configuration
                message += "; it starts when a handler of that name registers"
            log.error("configuration %s: %s", key, message)
            await self.store.record_configuration_event(configuration, reason, message)
            return
        for warning in warnings:
            log.warning("configuration %s: %s", key, warning)
            await self.store.record_configuration_event(
                configuration, "UnknownDiscoveryDetailsFields", warning
            )
        retirement = self.retirements.pop(key, None)
        if retirement is not None:
            await retirement.stop()
        runner = self.runners.get(key)
        if runner is not None and runner.handler.name == configuration.discovery_handler.name:
            runner.update(configuration)
            return
        if runner is not None:
            await runner.stop()  # another handler: the new runner takes the Instances over
        handler = self.handlers.get(configuration.discovery_handler.name)
        assert handler is not None
        log.info(
            "configuration %s: starting %s discovery (capacity %d)",
            key,
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
            ledger=self.ledger,
            budget=self.budget,
            on_seen_change=self._seen_changed,
        )
        self.runners[key] = runner
        runner.start()

    def refusals(self) -> dict[ObjectKey, str]:
        """The Configurations refused here (another has their kubelet names), with why."""
        return {key: self._refusals.get(key, "refused") for key in sorted(self.refused)}

    def _notes_changed(self) -> None:
        for listener in self.notes_listeners:
            listener()

    def _over_budget(self, key: ObjectKey, left_out: int, reported: int, limit: int) -> None:
        """Record on the Configuration that devices of it are left out (or none any more)."""
        self._notes_changed()
        runner = self.runners.get(key)
        if runner is None:
            return
        configuration = runner.configuration
        if left_out:
            message = (
                f"{left_out} of its {reported} devices are not served on {self.node}: the node "
                f"serves at most {limit} instances (--max-instances / AKRI_MAX_INSTANCES); "
                "Configurations are served in order of namespace and name, devices in order "
                "of id"
            )
            work = self.store.record_configuration_event(configuration, "OverBudget", message)
        else:
            message = f"all {reported} devices are served on {self.node} again"
            work = self.store.record_configuration_event(
                configuration, "WithinBudget", message, warning=False
            )
        self._spawn(work)

    async def _refuse(self, configuration: Configuration) -> None:
        """Refuse a Configuration whose name another namespace owns; stop its runner if it
        ran (the name moved to the other namespace), and retire its Instances on this node:
        nothing serves them here any more, and a slot held in one would otherwise never be
        freed (the reclaimers free it once its container ends; the Instance drains until
        then and this node leaves it after). It runs again, taking them over, once the name
        is its own."""
        key = configuration.key
        reason = self.ownership.refusal(key) or (
            f"the name {configuration.name!r} is in use by the Configuration in namespace "
            f"{self.ownership.owner(configuration.name)!r}"
        )
        runner = self.runners.pop(key, None)
        if runner is not None:
            log.warning(
                "configuration %s: stopping discovery: %s; %s leaves its instances as soon as "
                "it holds none of their slots",
                key,
                reason,
                self.node,
            )
            await runner.stop()
        self._retire(key, reason, asked=False)
        message = (
            f"{reason}: kubelet resource names (akri.sh/<name>) and DRA device names are "
            f"node-global, so {key} is not run and {self.node} leaves its instances once "
            f"none of their slots is in use; it starts by itself once the other "
            f"Configuration and its instances are gone"
        )
        self.refused[key] = configuration
        self._refusals[key] = reason
        self._notes_changed()
        if self._noticed.get(key) == message:
            return
        self._noticed[key] = message
        log.error("configuration %s: %s", key, message)
        await self.store.record_configuration_event(configuration, "NameConflict", message)

    def _check(self, configuration: Configuration) -> tuple[tuple[str, str] | None, Sequence[str]]:
        """(reason and message why it cannot run, or None; warnings)."""
        name = configuration.discovery_handler.name
        handler = self.handlers.get(name)
        if handler is None:
            return (
                "UnknownDiscoveryHandler",
                f"spec.discoveryHandler.name: no discovery handler named {brief(name)} "
                f"(available: {', '.join(self.handlers.names()) or 'none'})",
            ), ()
        try:
            warnings = handler.validate(configuration.discovery_handler.discovery_details)
        except InvalidDiscoveryDetailsError as error:
            return (
                "InvalidDiscoveryDetails",
                f"spec.discoveryHandler.discoveryDetails: {error}",
            ), ()
        return None, tuple(warnings or ())
