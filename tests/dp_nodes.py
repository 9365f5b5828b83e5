"""Simulated nodes with device plugins: API double + per-node kubelet double + agent parts."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.reclaimer import SlotReclaimer
from agent.discovery.manager import DiscoveryManager, GraceSettings
from agent.dra.cdi import CdiWriter
from agent.dra.checkpoint import Checkpoint
from agent.dra.driver import DraDriver
from agent.dra.publisher import SlicePublisher
from agent.dra.state import DraState
from agent.kube import make_kube_client
from agent.ledger.decisions import held_count
from agent.ledger.ledger import SlotLedger
from agent.model.instance import Instance
from agent.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from discovery_handlers.debug_echo import DebugEchoHandler
from discovery_handlers.registry import HandlerRegistry
from tests.apiserver import ApiServerDouble
from tests.kubelet_double import KubeletDouble

NO_GRACE = GraceSettings(local=0, shared=0)


@dataclass
class DpNode:
    """One node: kubelet double + store + discovery + ledger + plugins + reclaimer."""

    name: str
    kubelet: KubeletDouble
    store: KubernetesInstanceStore
    discovery: DiscoveryManager
    ledger: SlotLedger
    plugins: DevicePluginManager
    reclaimer: SlotReclaimer
    availability: Path
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    dra: DraDriver | None = None
    publisher: SlicePublisher | None = None
    base: Path | None = None

    @property
    def cdi_dir(self) -> Path:
        assert self.base is not None
        return self.base / "cdi"

    @property
    def registry_dir(self) -> Path:
        assert self.base is not None
        return self.base / "plugins_registry"

    def offline(self, value: bool = True) -> None:
        self.availability.write_text("OFFLINE" if value else "ONLINE")

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.publisher is not None:
            await self.publisher.close()
        if self.dra is not None:
            await self.dra.stop()
        await self.plugins.close()
        await self.discovery.close()
        await self.store.close()
        await self.kubelet.stop()
        shutil.rmtree(self.kubelet.device_plugin_dir.parent, ignore_errors=True)


async def start_dp_node(
    api: ApiServerDouble,
    name: str,
    tmp: Path,
    *,
    grace: GraceSettings = NO_GRACE,
    reclaim_grace: float = 0.5,
    reclaim_interval: float = 0.2,
    dra: bool = False,
) -> DpNode:
    # unix socket paths are limited to 108 bytes: keep the node's directory short
    base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
    plugin_dir = base / "device-plugins"
    plugin_dir.mkdir(parents=True)
    (tmp / f"{name}-dir").write_text(str(base))  # where to look when debugging
    kubelet = KubeletDouble(plugin_dir, base / "pod-resources.sock", reregistration="kubelet")
    await kubelet.start()
    client = make_kube_client(str(api.write_kubeconfig(base / "kubeconfig")))
    store = KubernetesInstanceStore(client, KubernetesSettings(name, request_timeout=5))
    await store.start()
    availability = base / "avail"
    registry = HandlerRegistry()
    registry.register(DebugEchoHandler(availability_file=availability, poll_interval=0.05))
    discovery = DiscoveryManager(store, registry, name, grace)
    ledger = SlotLedger(store, name)
    plugins = DevicePluginManager(store, ledger, discovery, plugin_dir, kubelet_poll=0.1)
    discovery.add_offline_listener(plugins.offline_changed)
    reclaimer = SlotReclaimer(
        ledger,
        store.list_cached,
        kubelet.pod_resources_socket,
        interval=reclaim_interval,
        grace=reclaim_grace,
    )
    await discovery.start()
    await plugins.start()
    node = DpNode(name, kubelet, store, discovery, ledger, plugins, reclaimer, availability)
    node.base = base
    node.tasks.append(asyncio.create_task(reclaimer.run()))
    if dra:
        await _start_dra(node, base)
    return node


async def _start_dra(node: DpNode, base: Path) -> None:
    checkpoint = Checkpoint(base / "dra" / "checkpoint.json")
    checkpoint.load()
    state = DraState(
        node.ledger,
        node.store.list_cached,
        node.discovery.device_for,
        node.store.read_resource_claim,
        CdiWriter(base / "cdi"),
        checkpoint,
    )
    node.dra = DraDriver(state, base / "plugins_registry", base / "dra", poll=0.1)
    node.publisher = SlicePublisher(
        node.store.api_client, node.name, node.store.list_cached, node.discovery.offline_instances
    )
    node.discovery.add_offline_listener(node.publisher.trigger)
    await node.dra.start()
    await node.publisher.start()

    async def follow() -> None:
        async for _ in node.store.subscribe_instances():
            assert node.publisher is not None
            node.publisher.trigger()

    node.tasks.append(asyncio.create_task(follow()))


def api_instances(api: ApiServerDouble) -> dict[str, Instance]:
    return {
        obj["metadata"]["name"]: Instance.from_dict(obj) for obj in api.list("instances.akri.sh")
    }


def assert_never_over_capacity(api: ApiServerDouble) -> None:
    for instance in api_instances(api).values():
        assert held_count(instance) <= instance.capacity, instance.device_usage


def one_device_configuration(name: str, descriptions: tuple[str, ...], capacity: int) -> Any:
    from tests.k8s_nodes import debug_echo_configuration

    return debug_echo_configuration(name, descriptions, capacity)
