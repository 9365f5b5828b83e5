"""Simulated nodes with device plugins: API double + per-node kubelet double + the agent.

Each node runs the agent exactly as ``akri agent`` wires it (:class:`agent.node.app.Agent`, with
the Kubernetes backend on the API-server double and the debugEcho handler reading a per-node
availability file), next to its own kubelet double serving the device-plugin directory, the
pod-resources socket and the kubelet checkpoint.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.core.kube import make_kube_client
from agent.core.ledger.decisions import held_count
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.node.app import Agent
from agent.node.deviceplugin.manager import DevicePluginManager
from agent.node.deviceplugin.reclaimer import SlotReclaimer
from agent.node.discovery.manager import DiscoveryManager, GraceSettings
from agent.node.dra.driver import DraDriver
from agent.node.dra.publisher import SlicePublisher
from agent.node.dra.reclaim import DraReclaimer
from agent.node.settings import AgentSettings
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.kubelet_double import KubeletDouble

NO_GRACE = GraceSettings(local=0, shared=0)


@dataclass
class DpNode:
    """One node: kubelet double + the agent (store, discovery, ledger, plugins, reclaimers)."""

    name: str
    kubelet: KubeletDouble
    agent: Agent
    base: Path

    @property
    def store(self) -> KubernetesInstanceStore:
        assert isinstance(self.agent.store, KubernetesInstanceStore)
        return self.agent.store

    @property
    def discovery(self) -> DiscoveryManager:
        return self.agent.discovery

    @property
    def ledger(self) -> SlotLedger:
        return self.agent.ledger

    @property
    def plugins(self) -> DevicePluginManager:
        assert self.agent.plugins is not None
        return self.agent.plugins

    @property
    def reclaimer(self) -> SlotReclaimer:
        assert self.agent.reclaimer is not None
        return self.agent.reclaimer

    @property
    def dra(self) -> DraDriver | None:
        return self.agent.dra

    @property
    def dra_reclaimer(self) -> DraReclaimer | None:
        return self.agent.dra_reclaimer

    @property
    def publisher(self) -> SlicePublisher | None:
        return self.agent.publisher

    @property
    def availability(self) -> Path:
        return self.base / "avail"

    @property
    def cdi_dir(self) -> Path:
        return self.base / "cdi"

    @property
    def registry_dir(self) -> Path:
        return self.base / "plugins_registry"

    @property
    def dra_dir(self) -> Path:
        return self.base / "dra"

    def offline(self, value: bool = True) -> None:
        self.availability.write_text("OFFLINE" if value else "ONLINE")

    async def restart_agent(self, settings: AgentSettings | None = None) -> None:
        """kill the agent and start it again (kubelet, its pods and the files stay)."""
        old = self.agent.settings if settings is None else settings
        await self.agent.stop()
        client = make_kube_client(old.kubeconfig)
        store = KubernetesInstanceStore(client, KubernetesSettings(self.name, request_timeout=5))
        self.agent = Agent(old, store, freeze_gc=False)
        await self.agent.start()

    async def stop(self, *, keep_files: bool = False) -> None:
        """Stop the agent and the kubelet double (``keep_files`` for a restart)."""
        await self.agent.stop()
        await self.kubelet.stop()
        if not keep_files:
            shutil.rmtree(self.base, ignore_errors=True)


def node_settings(
    api: ApiServerDouble,
    name: str,
    base: Path,
    *,
    grace: GraceSettings = NO_GRACE,
    reclaim_grace: float = 0.5,
    reclaim_interval: float = 0.2,
    dra: bool = False,
    token: str | None = None,
) -> AgentSettings:
    """The settings ``akri agent`` would run this simulated node with (``token``: the bearer
    token of an identity registered with ``api.add_user``; else an administrator)."""
    return AgentSettings(
        local=False,
        state_dir=base / "state",
        config=[],
        node_name=name,
        log_level="INFO",
        local_offline_grace=grace.local,
        shared_offline_grace=grace.shared,
        debug_echo=True,
        debug_echo_shared=True,
        debug_echo_availability_file=base / "avail",
        kubeconfig=str(api.write_kubeconfig(base / "kubeconfig", token=token)),
        namespace=None,
        device_plugin_dir=base / "device-plugins",
        pod_resources_socket=base / "pod-resources.sock",
        reclaim_interval=reclaim_interval,
        reclaim_grace=reclaim_grace,
        dra=dra,
        plugins_registry_dir=base / "plugins_registry",
        dra_plugin_dir=base / "dra",
        cdi_dir=base / "cdi",
        udev_monitor_source=None,
        poll_interval=0.05,
        discovery_handlers_dir=base / "dh",
    )


async def start_dp_node(
    api: ApiServerDouble,
    name: str,
    tmp: Path,
    *,
    grace: GraceSettings = NO_GRACE,
    reclaim_grace: float = 0.5,
    reclaim_interval: float = 0.2,
    dra: bool = False,
    base: Path | None = None,
    token: str | None = None,
    changes: Mapping[str, Any] | None = None,
    pod_environ: Mapping[str, str] | None = None,
) -> DpNode:
    """Start a node (``base``: reuse the directories of a stopped node, as after a restart;
    ``token``: the agent's identity, see :func:`node_settings`; ``changes``: other settings;
    ``pod_environ``: the agent's POD_NAME/POD_NAMESPACE, as the DaemonSet gives them)."""
    # unix socket paths are limited to 108 bytes: keep the node's directory short
    if base is None:
        base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
        (tmp / f"{name}-dir").write_text(str(base))  # where to look when debugging
    settings = node_settings(
        api,
        name,
        base,
        grace=grace,
        reclaim_grace=reclaim_grace,
        reclaim_interval=reclaim_interval,
        dra=dra,
        token=token,
    )
    if changes:
        settings = dataclasses.replace(settings, **changes)
    assert settings.device_plugin_dir is not None
    settings.device_plugin_dir.mkdir(parents=True, exist_ok=True)
    kubelet = KubeletDouble(
        settings.device_plugin_dir, settings.pod_resources_socket, reregistration="kubelet"
    )
    await kubelet.start()
    client = make_kube_client(settings.kubeconfig)
    store = KubernetesInstanceStore(client, KubernetesSettings(name, request_timeout=5))
    agent = Agent(settings, store, freeze_gc=False)
    if pod_environ is not None:
        agent.pod_environ = pod_environ
    await agent.start()
    return DpNode(name, kubelet, agent, base)


def api_instances(api: ApiServerDouble) -> dict[str, Instance]:
    return {
        obj["metadata"]["name"]: Instance.from_dict(obj) for obj in api.list("instances.akri.sh")
    }


def assert_never_over_capacity(api: ApiServerDouble) -> None:
    for instance in api_instances(api).values():
        assert held_count(instance) <= instance.capacity, instance.device_usage


def one_device_configuration(name: str, descriptions: tuple[str, ...], capacity: int) -> Any:
    from tests.harness.k8s_nodes import debug_echo_configuration

    return debug_echo_configuration(name, descriptions, capacity)
