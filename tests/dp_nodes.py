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
from agent.ledger.decisions import held_count
from agent.ledger.ledger import SlotLedger
from agent.model.instance import Instance
from agent.store.kubernetes import KubernetesInstanceStore, KubernetesSettings, make_api_client
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

    def offline(self, value: bool = True) -> None:
        self.availability.write_text("OFFLINE" if value else "ONLINE")

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
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
) -> DpNode:
    # unix socket paths are limited to 108 bytes: keep the node's directory short
    base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
    plugin_dir = base / "device-plugins"
    plugin_dir.mkdir(parents=True)
    (tmp / f"{name}-dir").write_text(str(base))  # where to look when debugging
    kubelet = KubeletDouble(plugin_dir, base / "pod-resources.sock", reregistration="kubelet")
    await kubelet.start()
    client = await make_api_client(str(api.write_kubeconfig(base / "kubeconfig")))
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
    node.tasks.append(asyncio.create_task(reclaimer.run()))
    return node


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
