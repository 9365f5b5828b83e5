"""Shared fixtures: an API-server double with the akri.sh CRDs, Nodes, Configurations and
Instances written straight into it, and an in-process controller against it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.controller.app import Controller
from agent.controller.reconcile import Reconciler, ReconcileSettings
from agent.controller.settings import ControllerSettings
from agent.core.kube import make_kube_client
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from tests.doubles.apiserver import ApiServerDouble
from tests.paths import REPO

CRDS = [REPO / "crds" / "akri-configuration-crd.yaml", REPO / "crds" / "akri-instance-crd.yaml"]
WITHIN = 20.0  # seconds: generous bound of every event-driven wait (a loaded CI machine)


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def node(name: str, ready: bool = True) -> dict[str, Any]:
    """A Node with a Ready condition."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "reason": "Test"}
            ]
        },
    }


def add_node(api: ApiServerDouble, name: str, ready: bool = True) -> None:
    """Create a Node and give it its Ready condition (a create drops ``status``)."""
    api.create(node(name, ready))
    set_ready(api, name, ready)


def set_status(
    api: ApiServerDouble,
    resource: str,
    name: str,
    status: dict[str, Any],
    namespace: str | None = None,
) -> None:
    """Write an object's ``status`` through its status subresource (what kubelet does)."""
    rt = api.resource(resource)
    current = api.get(resource, name, namespace)
    assert current is not None, f"{resource} {name} does not exist"
    current["status"] = status
    current["metadata"].pop("resourceVersion", None)
    ns = (namespace or "default") if rt.namespaced else None
    api.store.update(rt, rt.preferred_version, ns, name, current, subresource="status")


def set_ready(api: ApiServerDouble, name: str, ready: bool) -> None:
    """The kubelet's (or node controller's) part: flip the Ready condition."""
    set_status(api, "nodes", name, node(name, ready)["status"])


def configuration(
    name: str = "cams",
    capacity: int = 2,
    *,
    pod_spec: dict[str, Any] | None = None,
    job_spec: dict[str, Any] | None = None,
    instance_service: dict[str, Any] | None = None,
    configuration_service: dict[str, Any] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "discoveryHandler": {"name": "debugEcho", "discoveryDetails": "descriptions: [a]"},
        "capacity": capacity,
    }
    broker: dict[str, Any] = {}
    if pod_spec is not None:
        broker["brokerPodSpec"] = pod_spec
    if job_spec is not None:
        broker["brokerJobSpec"] = job_spec
    if broker:
        spec["brokerSpec"] = broker
    if instance_service is not None:
        spec["instanceServiceSpec"] = instance_service
    if configuration_service is not None:
        spec["configurationServiceSpec"] = configuration_service
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def broker_pod_spec(image: str = "example/broker:1", slots: int = 1) -> dict[str, Any]:
    return {
        "containers": [
            {
                "name": "broker",
                "image": image,
                "resources": {"limits": {"{{PLACEHOLDER}}": str(slots)}},
            }
        ]
    }


def instance(
    api: ApiServerDouble,
    name: str,
    nodes: list[str],
    *,
    configuration_name: str = "cams",
    capacity: int = 2,
    usage: dict[str, str] | None = None,
    shared: bool = True,
    finalizers: list[str] | None = None,
) -> dict[str, Any]:
    """Create an Instance (as the agents would have) owned by its Configuration."""
    owner = api.get("configurations.akri.sh", configuration_name)
    device_usage = {f"{name}-{i}": "" for i in range(capacity)}
    device_usage.update(usage or {})
    obj = {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": {
            "name": name,
            "namespace": "default",
            "ownerReferences": [
                {
                    "apiVersion": "akri.sh/v0",
                    "kind": "Configuration",
                    "name": configuration_name,
                    "uid": (owner or {}).get("metadata", {}).get("uid", ""),
                    "controller": True,
                }
            ],
            **({"finalizers": finalizers} if finalizers else {}),
        },
        "spec": {
            "configurationName": configuration_name,
            "cdiName": f"akri.sh/{configuration_name}={name[-6:]}",
            "capacity": capacity,
            "shared": shared,
            "nodes": nodes,
            "deviceUsage": device_usage,
            "brokerProperties": {},
        },
    }
    return api.create(obj)


def broker_pods(api: ApiServerDouble, instance_name: str | None = None) -> list[dict[str, Any]]:
    selector = "controller=akri.sh"
    if instance_name is not None:
        selector += f",akri.sh/instance={instance_name}"
    pods = api.list("pods", label_selector=selector)
    return sorted(
        (p for p in pods if not p["metadata"].get("deletionTimestamp")),
        key=lambda p: p["metadata"]["name"],
    )


def set_phase(api: ApiServerDouble, name: str, phase: str, namespace: str = "default") -> None:
    """The kubelet's part: report a Pod's phase."""
    set_status(api, "pods", name, {"phase": phase}, namespace)


async def eventually(check: Callable[[], Any], what: str, within: float = WITHIN) -> Any:
    """Wait (polling the double's state) until ``check()`` is truthy; its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        value = check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"not reached within {within}s: {what}")
        await asyncio.sleep(0.02)


def controller_settings(**changes: Any) -> ControllerSettings:
    values: dict[str, Any] = {
        "kubeconfig": None,
        "namespace": None,
        "lease_namespace": "default",
        "lease_name": "akri-controller",
        "identity": "test-controller",
        "lease_duration": 3.0,
        "renew_deadline": 2.0,
        "retry_period": 0.2,
        "node_grace": 300.0,
        "free_slots_of_unready_nodes_after": None,
        "pending_broker_grace": 300.0,
        "failed_broker_grace": 0.0,
        "agent_selector": "app.kubernetes.io/name=akri-agent",
        "resync_interval": 60.0,
        "health_port": 0,
        "health_address": "127.0.0.1",
        "log_level": "INFO",
        "log_format": "text",
    }
    values.update(changes)
    return ControllerSettings(**values)


@dataclass
class RunningController:
    controller: Controller
    stop: asyncio.Event
    task: asyncio.Task[None]
    extra: dict[str, Any] = field(default_factory=dict)

    async def leading(self) -> None:
        await asyncio.wait_for(self.controller.elector.leading.wait(), WITHIN)


@contextlib.asynccontextmanager
async def running_controller(
    api: ApiServerDouble, tmp_path: Path, **changes: Any
) -> AsyncIterator[RunningController]:
    """An in-process controller that leads (the only replica) until the block ends."""
    kubeconfig = api.write_kubeconfig(tmp_path / f"kubeconfig-{changes.get('identity', 'c')}")
    settings = controller_settings(kubeconfig=str(kubeconfig), **changes)
    controller = Controller(settings, make_kube_client(str(kubeconfig)))
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    running = RunningController(controller, stop, task)
    try:
        await running.leading()
        yield running
    finally:
        stop.set()
        await asyncio.wait_for(task, WITHIN)


class FakeClock:
    """A monotonic clock the test moves by hand (grace periods without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextlib.asynccontextmanager
async def reconciler_for(
    api: ApiServerDouble, tmp_path: Path, clock: FakeClock, **settings: Any
) -> AsyncIterator[Reconciler]:
    """A Reconciler with its store and caches, passes run by the test
    (``await reconciler.reconcile_once()``), grace periods on ``clock``."""
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig-reconciler")
    client = make_kube_client(str(kubeconfig))
    store = KubernetesInstanceStore(
        client, KubernetesSettings("akri-controller", all_instances=True)
    )
    await store.start()
    reconciler = Reconciler(client, store, ReconcileSettings(**settings), monotonic=clock)
    await reconciler.start()
    try:
        yield reconciler
    finally:
        await reconciler.stop()
        await store.close()


async def more_passes(reconciler: Reconciler, count: int) -> None:
    """Make the running reconciler do ``count`` more whole passes (each woken on purpose)."""
    target = reconciler.stats.passes + count
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN
    while reconciler.stats.passes < target:
        if loop.time() > deadline:
            raise AssertionError(f"fewer than {count} passes within {WITHIN}s")
        reconciler.wake.set()
        await asyncio.sleep(0.02)
