"""In-process simulated nodes: a Kubernetes store + discovery manager per node, against the
API-server double (real HTTP, the agent's own ``agent.core.kube`` client)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.core.kube import make_kube_client
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.node.activity_log import log_instance_changes
from agent.node.discovery.manager import DiscoveryManager, GraceSettings
from agent.node.finalizers import settle_finalizers
from discovery_handlers.base import DiscoveryHandler
from discovery_handlers.debug_echo import DebugEchoHandler
from discovery_handlers.registry import HandlerRegistry
from tests.doubles.apiserver import ApiServerDouble
from tests.paths import REPO

ROOT = REPO
NO_GRACE = GraceSettings(local=0, shared=0)
CRDS = [ROOT / "crds" / "akri-configuration-crd.yaml", ROOT / "crds" / "akri-instance-crd.yaml"]


def akri_configuration_crd(directory: Path) -> Path:
    """Our Configuration CRD without the capacity bounds Akri's own CRD does not have: a
    cluster where Configurations this agent refuses (capacity 0, > 1000) can exist."""
    import yaml

    crd = yaml.safe_load(CRDS[0].read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    capacity = schema["properties"]["spec"]["properties"]["capacity"]
    capacity.pop("minimum", None)
    capacity.pop("maximum", None)
    relaxed = directory / "akri-configuration-crd.yaml"
    relaxed.write_text(yaml.safe_dump(crd))
    return relaxed


def debug_echo_configuration(
    name: str = "echo",
    descriptions: tuple[str, ...] = ("foo0", "foo1"),
    capacity: int = 2,
    broker_properties: dict[str, str] | None = None,
) -> dict[str, Any]:
    quoted = ", ".join(f'"{d}"' for d in descriptions)
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "discoveryHandler": {
                "name": "debugEcho",
                "discoveryDetails": f"descriptions: [{quoted}]",
            },
            "capacity": capacity,
            "brokerProperties": broker_properties or {},
        },
    }


@dataclass
class SimNode:
    """One simulated node."""

    name: str
    store: KubernetesInstanceStore
    manager: DiscoveryManager
    availability: Path
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def offline(self, value: bool = True) -> None:
        self.availability.write_text("OFFLINE" if value else "ONLINE")

    async def stop(self) -> None:
        await self.manager.close()
        for task in self.tasks:
            task.cancel()
        await self.store.close()


async def start_node(
    api: ApiServerDouble,
    name: str,
    tmp: Path,
    *,
    shared: bool = True,
    grace: GraceSettings = NO_GRACE,
    extra_handlers: tuple[DiscoveryHandler, ...] = (),
) -> SimNode:
    kubeconfig = api.write_kubeconfig(tmp / f"kubeconfig-{name}")
    client = make_kube_client(str(kubeconfig))
    store = KubernetesInstanceStore(client, KubernetesSettings(name, request_timeout=5))
    await store.start()
    availability = tmp / f"avail-{name}"
    registry = HandlerRegistry()
    registry.register(
        DebugEchoHandler(shared=shared, availability_file=availability, poll_interval=0.05)
    )
    for handler in extra_handlers:
        registry.register(handler)
    manager = DiscoveryManager(store, registry, name, grace)
    await manager.start()
    node = SimNode(name, store, manager, availability)
    node.tasks.append(asyncio.create_task(log_instance_changes(store.subscribe_instances())))
    # as the agent does: the akri.sh/slots finalizer of a deleted Instance holding nothing goes
    node.tasks.append(
        asyncio.create_task(settle_finalizers(store.subscribe_instances(), manager.ledger))
    )
    return node


def instances(api: ApiServerDouble) -> list[dict[str, Any]]:
    return sorted(api.list("instances.akri.sh"), key=lambda o: o["metadata"]["name"])


def summary(api: ApiServerDouble) -> dict[str, list[str]]:
    return {o["metadata"]["name"]: sorted(o["spec"]["nodes"]) for o in instances(api)}


async def eventually(check: Callable[[], bool], within: float = 30.0, what: str = "") -> None:
    """Poll ``check`` until it holds. The bound is generous (CI may be loaded: a passing check
    returns as soon as it holds, so only a failure waits it out)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if check():
            return
        if loop.time() > deadline:
            raise AssertionError(f"not reached within {within}s: {what}")
        await asyncio.sleep(0.05)


def edited(obj: dict[str, Any], **spec: Any) -> dict[str, Any]:
    result = copy.deepcopy(obj)
    result["spec"].update(spec)
    return result
