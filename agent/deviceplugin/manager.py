"""``DevicePluginManager``: which plugins exist, and keeping kubelet aware of them.

* an instance-level plugin for every Instance listing this node, a configuration-level plugin
  for every Configuration with at least one such Instance; plugins appear and disappear with
  Instances;
* every Instance change notifies exactly the plugins whose lists may change (its IL plugin
  and its Configuration's CL plugin); an offline (grace) change notifies all;
* kubelet restarts are detected by watching ``kubelet.sock`` (new inode) and our own sockets
  (removed): every plugin then gets a new socket and re-registers, within ~``poll`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from agent.deviceplugin.endpoint import KUBELET_SOCKET, PluginEndpoint
from agent.deviceplugin.plugins import ConfigurationPlugin, DeviceSource, InstancePlugin
from agent.deviceplugin.service import DevicePluginService
from agent.events import Subscription
from agent.ledger.ledger import SlotLedger
from agent.model.instance import Instance
from agent.store.base import InstanceEvent, InstanceStore

log = logging.getLogger(__name__)
OWN_SOCKET_CHECK_EVERY = 10


class DevicePluginManager:
    """Runs the IL and CL plugins of this node."""

    def __init__(
        self,
        store: InstanceStore,
        ledger: SlotLedger,
        source: DeviceSource,
        directory: Path,
        *,
        kubelet_poll: float = 0.2,
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.node = ledger.node
        self.source = source
        self.directory = directory
        self.kubelet_poll = kubelet_poll
        self.instance_plugins: dict[str, PluginEndpoint] = {}
        self.configuration_plugins: dict[str, PluginEndpoint] = {}
        self.kubelet_restarts = 0
        self._wake = asyncio.Event()
        self._dirty: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._kubelet_id: tuple[int, int] | None = None

    def endpoints(self) -> list[PluginEndpoint]:
        """Every running plugin endpoint."""
        return [*self.instance_plugins.values(), *self.configuration_plugins.values()]

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._kubelet_id = self._kubelet_socket_id()
        events = self.store.subscribe_instances()
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
        # concurrently: each stop waits its gRPC grace while kubelet's ListAndWatch stream is
        # open, so one after another would not fit Kubernetes' 30 s termination grace with
        # hundreds of plugins
        await asyncio.gather(*(endpoint.stop() for endpoint in self.endpoints()))
        self.instance_plugins.clear()
        self.configuration_plugins.clear()

    def offline_changed(self) -> None:
        """Discovery's grace set changed: every list may change."""
        for endpoint in self.endpoints():
            endpoint.service.notify_soon()

    async def _follow(self, events: Subscription[InstanceEvent]) -> None:
        async for event in events:
            self._dirty.add(event.instance.name)
            self._wake.set()

    def _mine(self) -> list[Instance]:
        return [i for i in self.store.list_cached() if self.node in i.nodes]

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
                await asyncio.sleep(1)
                self._wake.set()

    async def sync(self) -> None:
        """Start/stop plugins to match the cache and notify the affected ones."""
        dirty, self._dirty = self._dirty, set()
        mine = self._mine()
        wanted_il = {i.name for i in mine}
        wanted_cl = {i.configuration_name for i in mine}
        for name in sorted(set(self.instance_plugins) - wanted_il):
            await self.instance_plugins.pop(name).stop()
            log.info("stopped device plugin akri.sh/%s", name)
        for name in sorted(set(self.configuration_plugins) - wanted_cl):
            await self.configuration_plugins.pop(name).stop()
            log.info("stopped configuration device plugin for %s", name)
        for name in sorted(wanted_il - set(self.instance_plugins)):
            logic = InstancePlugin(name, self.store.get_cached, self.ledger, self.source)
            self.instance_plugins[name] = await self._start(logic)
        for name in sorted(wanted_cl - set(self.configuration_plugins)):
            cl_logic = ConfigurationPlugin(name, self.store.list_cached, self.ledger, self.source)
            self.configuration_plugins[name] = await self._start(cl_logic)
        touched_configurations: set[str] = set()
        for name in dirty:
            endpoint = self.instance_plugins.get(name)
            if endpoint is not None:
                await endpoint.service.notify()
            cached = self.store.get_cached(name)
            if cached is not None:
                touched_configurations.add(cached.configuration_name)
        if any(self.store.get_cached(n) is None for n in dirty):
            # a deleted Instance is no longer cached: refresh every CL list to be safe
            touched_configurations = set(self.configuration_plugins)
        for configuration in touched_configurations:
            cl = self.configuration_plugins.get(configuration)
            if cl is not None:
                await cl.service.notify()

    async def _start(self, logic: InstancePlugin | ConfigurationPlugin) -> PluginEndpoint:
        endpoint = PluginEndpoint(DevicePluginService(logic), self.directory)
        await endpoint.start()
        log.info("serving device plugin %s on %s", logic.resource_name, endpoint.socket_path)
        return endpoint

    def _kubelet_socket_id(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.directory / KUBELET_SOCKET)
        except FileNotFoundError:
            return None
        return (stat.st_ino, stat.st_ctime_ns)

    async def _watch_kubelet(self) -> None:
        """Poll for a re-created kubelet.sock (one ``stat`` per poll: the kubelet-restart
        signal) and, every ``OWN_SOCKET_CHECK_EVERY`` polls, for plugin sockets someone else
        removed (one ``stat`` per plugin: kept rare so idle CPU stays low with many plugins)."""
        polls = 0
        while True:
            await asyncio.sleep(self.kubelet_poll)
            polls += 1
            current = self._kubelet_socket_id()
            recreated = current is not None and current != self._kubelet_id
            self._kubelet_id = current
            check_own = polls % OWN_SOCKET_CHECK_EVERY == 0
            wiped = [e for e in self.endpoints() if e.socket_missing()] if check_own else []
            if not recreated and not wiped:
                continue
            if recreated:
                self.kubelet_restarts += 1
                log.info(
                    "kubelet.sock was re-created (kubelet restarted): re-registering %d plugin(s)",
                    len(self.endpoints()),
                )
                targets = self.endpoints()
            else:
                log.info("%d plugin socket(s) removed: re-registering", len(wiped))
                targets = wiped
            for endpoint in targets:
                try:
                    await endpoint.restart()
                except Exception:
                    log.exception("restarting %s failed", endpoint.resource_name)
