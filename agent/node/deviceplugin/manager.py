"""``DevicePluginManager``: which plugins exist, and keeping kubelet aware of them.

* an instance-level plugin for every Instance listing this node, a configuration-level plugin
  for every Configuration with at least one such Instance; plugins appear and disappear with
  Instances. On a node in ``dra`` mode only for the names the rule of
  ``agent/node/dra/name_paths.py`` gives to device plugins (an Instance shared with a
  device-plugin node, a Configuration whose group has one): a name moves between the paths
  when an Instance's nodes or a node's mode change (:meth:`DevicePluginManager.paths_changed`),
  its held slots stay held (the reclaimer frees them when their pods end);
* a *holding* plugin (:class:`~agent.node.deviceplugin.plugins.HoldingPlugin`) for every
  resource name under which this node holds slots that no running plugin serves (the name
  went to DRA, its Instance left the node): registered, offering no device, until those
  slots are freed — kubelet rewrites its checkpoint only when a plugin sends it a list, and
  the reclaimer needs that rewrite to see an ended pod go (docs/device-plugins.md, "A name
  nobody serves any more");
* every Instance change notifies exactly the plugins whose lists may change (its IL plugin
  and its Configuration's CL plugin); an offline (grace) change notifies all;
* kubelet restarts are detected by watching ``kubelet.sock`` (new inode) and our own sockets
  (removed): every plugin then gets a new socket and re-registers. inotify says when a socket
  in the directory is created or removed (no polling); where it cannot be used, the
  directory is polled every ``kubelet_poll`` seconds.

Costs, so that thousands of plugins stay cheap:

* a sync costs O(Instances changed since the last one): the manager keeps which Instances
  list this node (and how many per Configuration) up to date from the change events, and
  only re-reads the whole cache on the first sync and after a failed one;
* new plugins start concurrently (at most ``concurrency`` at a time); removed plugins stop in
  the background (tracked, awaited by :meth:`DevicePluginManager.close`), so a stopping
  plugin never delays a new one;
* the configuration-level list re-computes at most every ``cl_update_interval`` seconds (see
  :class:`DevicePluginService`), and only re-parses the Instances that changed;
* each check costs two ``stat`` calls (``kubelet.sock`` and the directory); our own sockets
  are only checked (one directory listing) when the directory changed; kubelet's own
  checkpoint writes in the directory do not wake the manager (only ``*.sock`` names do);
* after a kubelet restart the plugins restart concurrently (at most ``concurrency`` at a
  time), each as before: new server on a new socket, self-dial, Register (retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from agent.core.aio.events import Subscription
from agent.core.aio.fswatch import DirectoryWatch
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import configuration_resource_name
from agent.core.store.base import InstanceEvent
from agent.node.deviceplugin.endpoint import PluginEndpoint
from agent.node.deviceplugin.held_slots import HeldIndex
from agent.node.deviceplugin.plugins import (
    ConfigurationPlugin,
    DeviceSource,
    HoldingPlugin,
    InstancePlugin,
)
from agent.node.deviceplugin.registration import KUBELET_SOCKET, KubeletRegistrar
from agent.node.deviceplugin.service import DevicePluginService
from agent.node.deviceplugin.strays import remove_stale_sockets
from agent.node.deviceplugin.views import (
    RESOURCE_PREFIX,
    configuration_resource,
    instance_resource,
)
from agent.node.discovery.ownership import ServedInstances

if TYPE_CHECKING:  # a local agent with device plugins imports nothing of DRA
    from agent.node.dra.name_paths import NodeNamePaths

log = logging.getLogger(__name__)
# starts and restarts in flight at once: each step of each is ~0.5 ms of gRPC work on the loop,
# so at 64 one loop iteration after a 1001-plugin kubelet restart held the loop 400-550 ms;
# at 8 the total time is the same (3.5 s, CPU-bound) and the loop stays responsive
MAX_CONCURRENT_STARTS = 8
CL_UPDATE_INTERVAL = 0.05
# a directory mtime this close to now may not yet reflect a change made within the same
# filesystem timestamp tick, so the directory is checked again on the next poll
RECENT_MTIME_NS = 1_000_000_000
SOCKET_SETTLE = 0.03  # seconds to let a burst of socket changes finish before acting
DRA_MODE = "dra"  # agent/node/dra/name_paths.py's DRA


class DevicePluginManager:
    """Runs the IL and CL plugins of this node."""

    def __init__(
        self,
        served: ServedInstances,
        ledger: SlotLedger,
        source: DeviceSource,
        directory: Path,
        *,
        kubelet_poll: float = 0.2,
        concurrency: int = MAX_CONCURRENT_STARTS,
        cl_update_interval: float = CL_UPDATE_INTERVAL,
        paths: NodeNamePaths | None = None,
        claims_needed: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.served = served
        # which names this node serves through its plugins (None: all of them)
        self.paths = paths
        # awaited with True before a plugin starts (slots allocated to ResourceClaims must be
        # held back first: agent/node/dra/allocated.py), with False once none runs
        self.claims_needed = claims_needed
        self.ledger = ledger
        self.node = ledger.node
        self.source = source
        self.directory = directory
        self.kubelet_poll = kubelet_poll
        self.cl_update_interval = cl_update_interval
        self.instance_plugins: dict[str, PluginEndpoint] = {}
        self.configuration_plugins: dict[str, PluginEndpoint] = {}
        # resource name -> a plugin offering nothing, kept while this node holds slots under
        # the name that no running plugin serves (HoldingPlugin)
        self.holding_plugins: dict[str, PluginEndpoint] = {}
        # the slots this node holds through device plugins (the reclaimer's served Instances),
        # and how many per resource name: which names need a holding plugin
        self._held = HeldIndex(self.node, served.served)
        self._held_names: dict[str, set[ObjectKey]] = {}  # Instance name -> keys in _held
        self.held_resources: Counter[str] = Counter()
        self.kubelet_restarts = 0
        # observability (tests, debugging)
        self.syncs = 0
        self.own_socket_checks = 0  # polls that looked at our own sockets
        self.max_concurrent_starts = 0  # starts and restarts in flight at once, at most
        self._in_flight = 0
        self._limit = asyncio.Semaphore(concurrency)
        self._wake = asyncio.Event()
        self._dirty: set[str] = set()
        self._full_sync = True  # re-read the whole cache on the next sync
        self._on_node: dict[str, str] = {}  # Instance listing this node -> its Configuration
        self._per_configuration: Counter[str] = Counter()  # of _on_node
        self._stopping: dict[PluginEndpoint, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._kubelet_id: tuple[int, int] | None = None
        self._directory_id: tuple[int, int] | None = None
        self._check_own_next = False
        self._directory_gone_logged = False
        self._restart_listeners: list[Callable[[], None]] = []
        self._registrar = KubeletRegistrar(directory)  # one kubelet channel for every plugin
        # queued for a restart (waiting for a start slot): their socket is missing on purpose
        self._restart_queued: set[PluginEndpoint] = set()
        self.socket_watch: DirectoryWatch | None = None
        # configuration-level resource names not served (an Instance has the name) -> the
        # Configuration name; tests and status
        self.refused_names: dict[str, str] = {}
        # Instances whose plugin waits for the old meaning of its name to end
        self.held_back: set[str] = set()

    @property
    def registration_failures(self) -> int:
        """Register calls to kubelet that failed (``akri_kubelet_registration_failures_total``)."""
        return self._registrar.failures.failures

    def endpoints(self) -> list[PluginEndpoint]:
        """Every running plugin endpoint, the holding ones included."""
        return [*self.serving_endpoints(), *self.holding_plugins.values()]

    def serving_endpoints(self) -> list[PluginEndpoint]:
        """The instance- and configuration-level plugins (those that offer devices)."""
        return [*self.instance_plugins.values(), *self.configuration_plugins.values()]

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        # before any plugin of ours serves: what is left of ours is a killed run's
        await asyncio.to_thread(remove_stale_sockets, self.directory)
        self._kubelet_id = self._kubelet_socket_id()
        self._directory_id = self._directory_state()
        events = self.served.store.subscribe_instances()
        self.served.ownership.add_listener(self._owners_changed)
        self.ledger.reservations.add_listener(self._reservations_changed)
        self._tasks = [
            asyncio.create_task(self._follow(events), name="plugins-follow"),
            asyncio.create_task(self._sync_loop(), name="plugins-sync"),
            asyncio.create_task(self._watch_kubelet(), name="kubelet-watch"),
        ]
        self._wake.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        endpoints = self.endpoints()
        self.instance_plugins.clear()
        self.configuration_plugins.clear()
        self.holding_plugins.clear()
        # concurrently: hundreds of plugins must stop within Kubernetes' 30 s termination grace
        await asyncio.gather(
            *(self._stop(endpoint) for endpoint in endpoints),
            *self._stopping.values(),
            return_exceptions=True,
        )
        await self._registrar.close()

    def on_kubelet_restart(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` when kubelet restarted (its ``kubelet.sock`` was re-created)."""
        self._restart_listeners.append(listener)

    def nudge_kubelet(self) -> bool:
        """Have kubelet rewrite its device-manager checkpoint: one plugin re-sends its
        (unchanged) device list. False when no plugin is running — which, while this node
        holds slots through device plugins, lasts only until the holding plugin of their name
        has started (:meth:`sync`)."""
        for endpoint in self.endpoints():
            endpoint.service.resend()
            return True
        return False

    def _reserved_view(self, name: str) -> Instance | None:
        """The served Instance as the plugins see it: slots reserved for allocated DRA claims
        or held back after a timed-out write show as held (never offered, never placed)."""
        instance = self.served.get(name)
        return None if instance is None else self.ledger.reservations.overlay(instance)

    def _reserved_views(self, configuration: str) -> list[Instance]:
        overlay = self.ledger.reservations.overlay
        return [overlay(i) for i in self.served.of_configuration(configuration)]

    def _reservations_changed(self, keys: set[ObjectKey]) -> None:
        """Reserved slots changed: the lists of those Instances (and their Configurations'
        plugins) are sent again."""
        for key in keys:
            self._dirty.add(key.name)
        self._wake.set()

    def paths_changed(self) -> None:
        """A node's mode changed (this node's, or another's label): which names this node
        serves through its plugins is decided again for every Instance."""
        self._full_sync = True
        self._wake.set()

    def _instance_wanted(self, name: str) -> bool:
        """Whether this node serves ``akri.sh/<name>`` through its plugin (it lists the node)."""
        if self.paths is None:
            return True
        instance = self.served.get(name)
        return instance is not None and self.paths.instance_on_plugins(instance)

    def _configuration_wanted(self, configuration: str) -> bool:
        if self.paths is None:
            return True
        return self.paths.configuration_on_plugins(self.served.of_configuration(configuration))

    def _path_note(self, name: str) -> str:
        instance = self.served.get(name)
        if self.paths is None or instance is None:
            return ""
        return f" ({self.paths.why_instance(instance)})"

    def _owners_changed(self, names: set[str]) -> None:
        """Another namespace's Instances are served now: re-read everything."""
        self._full_sync = True
        self._wake.set()

    def offline_changed(self) -> None:
        """Discovery's grace set changed: every list may change."""
        for endpoint in self.endpoints():
            endpoint.service.changed()

    async def _follow(self, events: Subscription[InstanceEvent]) -> None:
        async for event in events:
            self._dirty.add(event.instance.name)
            self._wake.set()

    async def _sync_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("device plugin sync failed")
                self._full_sync = True
                await asyncio.sleep(1)
                self._wake.set()

    # ------------------------------------------------------------------ sync

    def _track(self, name: str) -> tuple[str | None, str | None]:
        """Bring ``_on_node`` up to date for one Instance: (Configuration before, after)."""
        cached = self.served.get(name)
        after = (
            cached.configuration_name if cached is not None and self.node in cached.nodes else None
        )
        before = self._on_node.get(name)
        if before != after:
            if before is not None:
                self._per_configuration[before] -= 1
                if self._per_configuration[before] <= 0:
                    del self._per_configuration[before]
                del self._on_node[name]
            if after is not None:
                self._on_node[name] = after
                self._per_configuration[after] += 1
        return before, after

    def _track_held(self, name: str) -> None:
        """Bring the slots held through device plugins up to date for the Instances called
        ``name`` (any namespace: the reclaimer's served ones), and their count per resource
        name. Costs the slots that changed (:class:`HeldIndex`)."""
        current = {i.key: i for i in self.served.store.instances_named(name)}
        keys = self._held_names.get(name, set()) | set(current)
        for key in keys:
            before = Counter(slot.resource for slot in self._held.slots_of(key))
            instance = current.get(key)
            if instance is None:
                self._held.remove(key)
            else:
                self._held.update(instance)
            after = Counter(slot.resource for slot in self._held.slots_of(key))
            if before != after:
                self.held_resources.subtract(before)
                self.held_resources.update(after)
                for resource in before:
                    if self.held_resources[resource] <= 0:
                        del self.held_resources[resource]
        if current:
            self._held_names[name] = set(current)
        else:
            self._held_names.pop(name, None)

    def _plan_holding(
        self, starting: set[str]
    ) -> list[tuple[dict[str, PluginEndpoint], str, PluginEndpoint]]:
        """Stop the holding plugins no longer needed (no slot held under their name, or a
        plugin serves it: running, or in ``starting``); return those to start: one per name
        held with no plugin serving it."""
        serving = {e.resource_name for e in self.serving_endpoints()} | starting
        needed = {name for name in self.held_resources if name not in serving}
        for resource in sorted(set(self.holding_plugins) - needed):
            endpoint = self.holding_plugins.pop(resource)
            why = (
                "its device plugin serves it again"
                if resource in serving
                else "no slot is held through it any more"
            )
            self._stop_later(endpoint, f"stopped holding device plugin {resource}: {why}")
        new = []
        for resource in sorted(needed - set(self.holding_plugins)):
            log.info(
                "keeping device plugin %s registered on node %s, offering no device: %d "
                "slot(s) are still held through it by pods that got them from a device plugin "
                "(kubelet rewrites its checkpoint only when a plugin sends it a list: the "
                "reclaimer needs that to free them when the pods end)",
                resource,
                self.node,
                self.held_resources[resource],
            )
            endpoint = self._endpoint(HoldingPlugin(resource, self.node))
            new.append((self.holding_plugins, resource, endpoint))
        return new

    async def sync(self) -> None:
        """Start/stop plugins to match the cache and notify the affected ones."""
        self.syncs += 1
        dirty, self._dirty = self._dirty, set()
        full = self._full_sync
        self._full_sync = False
        if full:
            self._on_node.clear()
            self._per_configuration.clear()
            self._held.clear()
            self._held_names.clear()
            self.held_resources.clear()
            held_dirty = {i.name for i in self.served.store.list_cached()}
            dirty |= {i.name for i in self.served.all()} | set(self.instance_plugins)
        else:
            held_dirty = set(dirty)
        for name in held_dirty:
            self._track_held(name)
        touched: set[str] = set()
        for name in dirty:
            before, after = self._track(name)
            touched.update(c for c in (before, after) if c is not None)
            if self.paths is not None:
                # any Instance of a Configuration this node has may change the group that
                # decides its configuration-level name's path
                cached = self.served.get(name)
                if cached is not None and cached.configuration_name in self._per_configuration:
                    touched.add(cached.configuration_name)
        if full:
            touched |= set(self.configuration_plugins)
        for name in sorted(n for n in dirty if n in self.instance_plugins):
            if name not in self._on_node:
                endpoint = self.instance_plugins.pop(name)
                self._stop_later(endpoint, f"stopped device plugin {endpoint.resource_name}")
            elif not self._instance_wanted(name):
                endpoint = self.instance_plugins.pop(name)
                self._stop_later(
                    endpoint,
                    f"stopped device plugin {endpoint.resource_name}: served through DRA "
                    f"now{self._path_note(name)}; the slots its pods hold stay held",
                )
        for configuration in sorted(c for c in touched if c in self.configuration_plugins):
            if configuration not in self._per_configuration:
                endpoint = self.configuration_plugins.pop(configuration)
                self._stop_later(
                    endpoint, f"stopped configuration device plugin for {configuration}"
                )
            elif not self._configuration_wanted(configuration):
                endpoint = self.configuration_plugins.pop(configuration)
                self._stop_later(
                    endpoint,
                    f"stopped configuration device plugin for {configuration}: "
                    f"{endpoint.resource_name} is served through DRA now (every node its "
                    "shared Instances link serves akri.sh/* through DRA); the slots its pods "
                    "hold stay held",
                )
        dirty |= self.held_back  # their old meaning's slots may be free now
        new_il = []
        for name in sorted(
            n for n in dirty if n in self._on_node and n not in self.instance_plugins
        ):
            if not self._instance_wanted(name):
                continue
            if self._held_under_old_meaning(name):
                self.held_back.add(name)
                continue
            self.held_back.discard(name)
            new_il.append(name)
        self.held_back &= set(self._on_node)
        # one resource name, one meaning: a configuration-level plugin whose resource name an
        # Instance of this node has is not run (instance names win; the ownership rules
        # refuse such a Configuration — this is the last guard, e.g. an Instance written by
        # another agent before they saw it)
        il_resources = {instance_resource(n) for n in self._on_node}
        touched |= set(self.refused_names.values())  # their Instance may be gone now
        self.refused_names = {
            r: c
            for r, c in self.refused_names.items()
            if r in il_resources and c in self._per_configuration
        }
        for configuration in sorted(self.configuration_plugins):
            endpoint = self.configuration_plugins[configuration]
            if endpoint.resource_name in il_resources:
                self._refuse_name(endpoint.resource_name, configuration)
                del self.configuration_plugins[configuration]
                self._stop_later(endpoint, f"stopped device plugin {endpoint.resource_name}")
        new_cl = []
        for configuration in sorted(touched):
            if (
                configuration not in self._per_configuration
                or configuration in self.configuration_plugins
            ):
                continue
            if configuration_resource(configuration) in il_resources:
                self._refuse_name(configuration_resource(configuration), configuration)
                continue
            if not self._configuration_wanted(configuration):
                continue
            new_cl.append(configuration)
        starting: list[tuple[dict[str, PluginEndpoint], str, PluginEndpoint]] = []
        for name in new_il:
            logic = InstancePlugin(name, self._reserved_view, self.ledger, self.source)
            starting.append((self.instance_plugins, name, self._endpoint(logic)))
        for name in new_cl:
            cl_logic = ConfigurationPlugin(name, self._reserved_views, self.ledger, self.source)
            starting.append((self.configuration_plugins, name, self._endpoint(cl_logic)))
        if starting and self.claims_needed is not None:
            await self.claims_needed(True)  # before any of them offers a slot
        if self.paths is not None and self.paths.mode == DRA_MODE:
            # a node on DRA serving a name through its device plugin: say why
            for plugins, name, endpoint in starting:
                why = (
                    self._path_note(name)
                    if plugins is self.instance_plugins
                    else " (a node its shared Instances link does not serve akri.sh/* "
                    "through DRA: device plugins on all of them)"
                )
                log.info("%s on node %s: device plugin%s", endpoint.resource_name, self.node, why)
        # after the serving plugins' stops and before their starts: a holding plugin stopped
        # here is waited for by a serving plugin of its name starting now (_start)
        starting.extend(self._plan_holding({e.resource_name for _, _, e in starting}))
        for plugins, name, endpoint in starting:
            plugins[name] = endpoint  # listed at once: close() stops it even mid-start
        failed = await self._start_all(starting)
        for name in dirty:
            il = self.instance_plugins.get(name)
            if il is not None:
                il.service.changed()
        for configuration in touched:
            cl = self.configuration_plugins.get(configuration)
            if cl is not None:
                cl.service.changed()
        if self.claims_needed is not None and not self._serving_or_stopping():
            await self.claims_needed(False)
        if failed:
            raise RuntimeError(f"{failed} device plugin(s) did not start")

    def _held_under_old_meaning(self, instance: str) -> bool:
        """Whether this node still holds configuration-level slots of a Configuration whose
        resource name is ``akri.sh/<instance>`` (one refused since, see
        :mod:`agent.node.discovery.ownership`, rule 4): kubelet still has its containers
        under that name, with vdev ids shaped like this Instance's slot ids. The Instance's
        plugin waits until they are released, so that the name never has two meanings on
        this node at once (logged once)."""
        store = self.served.store
        own = self.served.get(instance)
        mark = f":{self.node}"
        for key in store.instance_configurations():
            if configuration_resource_name(key.name) != instance:
                continue
            if own is not None and key == own.configuration_key:
                continue
            for other in store.list_cached(key):
                if any(
                    v.startswith("C:") and v.endswith(mark) for v in other.device_usage.values()
                ):
                    if instance not in self.held_back:
                        log.warning(
                            "not yet serving device plugin %s: configuration-level slots of "
                            "%s/%s, whose resource name it was, are still held on this node "
                            "(it starts once they are released)",
                            instance_resource(instance),
                            key.namespace,
                            key.name,
                        )
                    return True
        return False

    def _refuse_name(self, resource: str, configuration: str) -> None:
        """Log (once per name) a configuration-level plugin not run: an Instance has its
        resource name."""
        if self.refused_names.get(resource) == configuration:
            return
        self.refused_names[resource] = configuration
        log.error(
            "not serving the configuration-level device plugin of %s: %s is the resource "
            "name of the instance-level plugin of Instance %s on this node (instance names "
            "win; one resource name never has two meanings)",
            configuration,
            resource,
            resource.removeprefix(RESOURCE_PREFIX),
        )

    def _endpoint(
        self, logic: InstancePlugin | ConfigurationPlugin | HoldingPlugin
    ) -> PluginEndpoint:
        interval = self.cl_update_interval if isinstance(logic, ConfigurationPlugin) else 0.0
        return PluginEndpoint(
            DevicePluginService(logic, min_interval=interval),
            self.directory,
            registrar=self._registrar,
        )

    async def _start_all(
        self, starting: list[tuple[dict[str, PluginEndpoint], str, PluginEndpoint]]
    ) -> int:
        """Start the endpoints, at most ``concurrency`` at a time; the number that failed
        (those are no longer listed)."""
        results = await asyncio.gather(
            *(self._start(endpoint) for _, _, endpoint in starting), return_exceptions=True
        )
        failed = 0
        for (plugins, name, endpoint), result in zip(starting, results, strict=True):
            if isinstance(result, BaseException):
                failed += 1
                log.error("starting device plugin %s failed: %s", endpoint.resource_name, result)
                if plugins.get(name) is endpoint:
                    del plugins[name]
        return failed

    async def _start(self, endpoint: PluginEndpoint) -> None:
        # the same resource stopping in the background: let it end first, or its stream's end
        # could reach kubelet after the new registration
        previous = [
            task
            for old, task in self._stopping.items()
            if old.resource_name == endpoint.resource_name
        ]
        if previous:
            await asyncio.wait(previous)
        async with self._limited():
            await endpoint.start()
        log.info("serving device plugin %s on %s", endpoint.resource_name, endpoint.socket_path)

    def _stop_later(self, endpoint: PluginEndpoint, done: str) -> None:
        """Stop a removed plugin in the background (tracked until done); log ``done`` then."""
        task = asyncio.create_task(
            self._stop(endpoint, done), name=f"stop-{endpoint.resource_name}"
        )
        self._stopping[endpoint] = task
        task.add_done_callback(lambda _: self._stopped(endpoint))

    def _stopped(self, endpoint: PluginEndpoint) -> None:
        self._stopping.pop(endpoint, None)
        if self.claims_needed is not None and not self._serving_or_stopping():
            self._wake.set()  # the last one: the next sync says claims need no following

    def _serving_or_stopping(self) -> bool:
        """Whether a plugin that offers devices runs or is still stopping (a holding plugin
        offers none: the DRA claims need no following for it)."""
        return bool(self.serving_endpoints()) or any(
            not isinstance(e.service.logic, HoldingPlugin) for e in self._stopping
        )

    async def _stop(self, endpoint: PluginEndpoint, done: str | None = None) -> None:
        try:
            await endpoint.stop()
        except Exception:
            log.exception("stopping device plugin %s failed", endpoint.resource_name)
            return
        if done is not None:
            log.info("%s", done)

    @contextlib.asynccontextmanager
    async def _limited(self) -> AsyncIterator[None]:
        async with self._limit:
            self._in_flight += 1
            self.max_concurrent_starts = max(self.max_concurrent_starts, self._in_flight)
            try:
                yield
            finally:
                self._in_flight -= 1

    # ------------------------------------------------------------------ kubelet watch

    def _kubelet_socket_id(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.directory / KUBELET_SOCKET)
        except FileNotFoundError:
            return None
        return (stat.st_ino, stat.st_ctime_ns)

    def _kubelet_recreated(self) -> bool:
        current = self._kubelet_socket_id()
        return current is not None and current != self._kubelet_id

    def _directory_state(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.directory)
        except FileNotFoundError:
            return None
        return (stat.st_ino, stat.st_mtime_ns)

    async def _watch_kubelet(self) -> None:
        watch = DirectoryWatch([self.directory], self.kubelet_poll, interesting=_socket_event)
        self.socket_watch = watch
        try:
            watch.arm()
            await self.check_sockets()  # what changed before the watch was armed
            while True:
                # a check after a failed restart must not wait for the next event
                woken = await watch.changed(
                    within=self.kubelet_poll if self._check_own_next else None
                )
                if woken:
                    # kubelet's restart removes every socket, then creates kubelet.sock: let
                    # the burst end, so the plugins restart once, for the new kubelet — and
                    # not a moment longer once the new kubelet.sock is there
                    deadline = time.monotonic() + SOCKET_SETTLE
                    while not self._kubelet_recreated():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0 or not await watch.changed(within=remaining):
                            break
                    await watch.changed(within=0)
                await self.check_sockets()
        finally:
            watch.close()

    async def check_sockets(self) -> None:
        """One poll: a re-created ``kubelet.sock`` (kubelet restarted) re-registers every
        plugin; a changed directory (new inode or mtime) has our sockets checked, and the
        plugins whose socket is gone re-register."""
        current = self._kubelet_socket_id()
        recreated = current is not None and current != self._kubelet_id
        self._kubelet_id = current
        changed = self._directory_changed()
        removed = self._removed_sockets() if changed and not recreated else []
        if recreated:
            self.kubelet_restarts += 1
            self._registrar.reset()
            for listener in self._restart_listeners:
                listener()
            targets = self.endpoints()
            log.info(
                "kubelet.sock was re-created (kubelet restarted): re-registering %d plugin(s)",
                len(targets),
            )
        elif removed:
            log.info("%d plugin socket(s) removed: re-registering", len(removed))
            targets = removed
        else:
            return
        if not await self._restart_all(targets):
            self._check_own_next = True  # retry the ones whose socket is still missing

    def _directory_changed(self) -> bool:
        """Did the directory change (inode or mtime) since the last poll? Every removal of a
        socket in it updates its mtime. Also True on the poll after one that saw an mtime
        close to now (a change within the same timestamp tick keeps the mtime) or after a
        failed restart. False while the directory is missing (its re-creation is a change)."""
        state = self._directory_state()
        changed = state != self._directory_id or self._check_own_next
        self._directory_id = state
        if state is None:
            if not self._directory_gone_logged:
                log.warning("device plugin directory %s is gone; waiting for it", self.directory)
                self._directory_gone_logged = True
            self._check_own_next = False
            return False
        self._directory_gone_logged = False
        self._check_own_next = abs(time.time_ns() - state[1]) < RECENT_MTIME_NS
        return changed

    def _removed_sockets(self) -> list[PluginEndpoint]:
        """Our endpoints whose socket is gone (one listing of the directory)."""
        self.own_socket_checks += 1
        try:
            present = set(os.listdir(self.directory))
        except FileNotFoundError:
            return []  # the next poll sees the directory gone (or re-created: a change)
        return [
            e
            for e in self.endpoints()
            if e not in self._restart_queued and e.socket_missing(present)
        ]

    async def _restart_all(self, targets: Iterable[PluginEndpoint]) -> bool:
        """Restart concurrently (at most ``concurrency`` at a time); True if all succeeded."""
        queued = [e for e in targets if e not in self._restart_queued]
        self._restart_queued.update(queued)
        results = await asyncio.gather(*(self._restart(e) for e in queued))
        return all(results)

    async def _restart(self, endpoint: PluginEndpoint) -> bool:
        try:
            async with self._limited():
                await endpoint.restart()
        except Exception:
            log.exception("restarting %s failed", endpoint.resource_name)
            return False
        finally:
            self._restart_queued.discard(endpoint)
        return True


def _socket_event(name: str, removed: bool) -> bool:
    """What the socket watch wakes for: ``kubelet.sock`` created or removed, and any other
    socket removed (ours created, or kubelet's checkpoint written, are no news)."""
    if name == KUBELET_SOCKET:
        return True
    return removed and name.endswith(".sock")
