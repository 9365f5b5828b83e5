"""The controller section: a real ``akri controller`` process against the API-server double.

* ``broker_pod_created_ms`` — an Instance created (whose Configuration has a
  ``brokerPodSpec``) → its broker Pod object exists in the API server; p50/p99 over
  ``samples`` Instances created one at a time (target p99 < 500 ms);
* ``dead_node_slots_freed_s`` — a node set NotReady → its slots are free in the Instance; the
  grace (``--node-grace``) is part of it (target: grace + < 5 s), with ``over_grace_s`` the
  part beyond the grace;
* ``controller_scale`` — ``instances`` Instances x ``nodes`` nodes, one broker Pod per node
  each: ``full_reconcile_s`` (leader elected → every Pod exists), ``steady_pass_ms`` (one pass
  with nothing to do, the controller's own ``akri_controller_last_reconcile_seconds``) and the
  controller's ``rss_mb`` with everything cached.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import AgentProcess, ApiServer, log, rss_mb
from benchmarks.stats import summarize

CONTROLLER_COMMAND = (sys.executable, "-m", "agent.cli", "controller")
LEASE = ("--lease-duration", "3", "--renew-deadline", "2", "--retry-period", "0.2")


@dataclass(frozen=True)
class ControllerPlan:
    samples: int = 100  # broker_pod_created_ms
    dead_node_samples: int = 3
    node_grace: float = 2.0
    instances: int = 1000
    nodes: int = 10


def _node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def _set_status(api: ApiServer, resource: str, name: str, status: dict[str, Any]) -> None:
    double = api.api
    rt = double.resource(resource)
    current = double.get(resource, name)
    assert current is not None
    current["status"] = status
    current["metadata"].pop("resourceVersion", None)
    namespace = "default" if rt.namespaced else None
    double.store.update(rt, rt.preferred_version, namespace, name, current, subresource="status")


def _ready(api: ApiServer, name: str, ready: bool, reason: str = "Bench") -> None:
    condition = {"type": "Ready", "status": "True" if ready else "False", "reason": reason}
    _set_status(api, "nodes", name, {"conditions": [condition]})


def _configuration(name: str, capacity: int, broker: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "discoveryHandler": {"name": "debugEcho", "discoveryDetails": "descriptions: [a]"},
        "capacity": capacity,
    }
    if broker:
        container = {
            "name": "broker",
            "image": "example/broker:1",
            "resources": {"limits": {"{{PLACEHOLDER}}": "1"}},
        }
        spec["brokerSpec"] = {"brokerPodSpec": {"containers": [container]}}
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def _instance(
    name: str, configuration: str, nodes: list[str], capacity: int, usage: dict[str, str]
) -> dict[str, Any]:
    device_usage = {f"{name}-{i}": "" for i in range(capacity)}
    device_usage.update(usage)
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "configurationName": configuration,
            "cdiName": f"akri.sh/{configuration}={name[-6:]}",
            "capacity": capacity,
            "shared": True,
            "nodes": nodes,
            "deviceUsage": device_usage,
            "brokerProperties": {},
        },
    }


async def _until(check: Any, within: float, what: str, interval: float = 0.001) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached within {within:.0f}s: {what}")
        await asyncio.sleep(interval)


def _start(api: ApiServer, base: Path, *extra: str) -> tuple[AgentProcess, int]:
    kubeconfig = api.api.write_kubeconfig(base / "kubeconfig")
    port = _free_port()
    process = AgentProcess(
        ["--kubeconfig", str(kubeconfig), "--lease-namespace", "default", "--health-port",
         str(port), "--health-address", "127.0.0.1", *LEASE, *extra],
        base / "controller.log",
        CONTROLLER_COMMAND,
    )  # fmt: skip
    return process, port


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


async def _leading(api: ApiServer, process: AgentProcess, within: float = 120) -> None:
    def holder() -> bool:
        process.check_running()
        lease = api.api.get("leases.coordination.k8s.io", "akri-controller", "default") or {}
        return bool((lease.get("spec") or {}).get("holderIdentity"))

    await _until(holder, within, "controller leading", 0.05)


async def broker_pod_created(api: ApiServer, plan: ControllerPlan, base: Path) -> dict[str, Any]:
    """Instance created → broker Pod exists."""
    double = api.api
    double.create(_node("node-0"))
    _ready(api, "node-0", True)
    double.create(_configuration("lat", 2, broker=True))
    process, _port = _start(api, base)
    try:
        await _leading(api, process)
        samples: list[float] = []
        for index in range(plan.samples):
            name = f"lat-{index:06x}"
            started = time.perf_counter()
            double.create(_instance(name, "lat", ["node-0"], 2, {}))
            pod = f"node-0-{name}-pod"
            await _until(lambda p=pod: double.get("pods", p, "default") is not None, 30, pod)
            samples.append((time.perf_counter() - started) * 1000)
        return summarize(samples)
    finally:
        await process.stop()


async def dead_node_slots_freed(api: ApiServer, plan: ControllerPlan, base: Path) -> dict[str, Any]:
    """Node NotReady → its slots free (the grace included)."""
    double = api.api
    for name in ("node-a", "node-b"):
        double.create(_node(name))
        _ready(api, name, True)
    double.create(_configuration("dead", 4, broker=False))
    process, _port = _start(api, base, "--node-grace", str(plan.node_grace))
    try:
        await _leading(api, process)
        samples: list[float] = []
        for index in range(plan.dead_node_samples):
            name = f"dead-{index:06x}"
            usage = {f"{name}-0": "node-a", f"{name}-1": "C:dead-0:node-b",
                     f"{name}-2": f"D:claim-{index}:node-b"}  # fmt: skip
            double.create(_instance(name, "dead", ["node-a", "node-b"], 4, usage))
            await asyncio.sleep(0.5)  # the controller has seen it (not part of the figure)
            started = time.perf_counter()
            _ready(api, "node-b", False)

            def freed(n: str = name) -> bool:
                obj = double.get("instances.akri.sh", n, "default") or {}
                values = (obj.get("spec") or {}).get("deviceUsage") or {}
                return not any(v.endswith(":node-b") for v in values.values())

            await _until(freed, plan.node_grace + 60, "node-b's slots freed")
            samples.append(time.perf_counter() - started)
            _ready(api, "node-b", True)
            await asyncio.sleep(0.5)
        return {
            "grace_s": plan.node_grace,
            "samples_s": [round(s, 3) for s in samples],
            "max_s": round(max(samples), 3),
            "over_grace_max_s": round(max(samples) - plan.node_grace, 3),
        }
    finally:
        await process.stop()


async def controller_scale(api: ApiServer, plan: ControllerPlan, base: Path) -> dict[str, Any]:
    """``instances`` x ``nodes``: the first full reconcile, a steady pass, RSS."""
    double = api.api
    nodes = [f"node-{i:02d}" for i in range(plan.nodes)]
    for name in nodes:
        double.create(_node(name))
        _ready(api, name, True)
    double.create(_configuration("scale", plan.nodes, broker=True))
    for index in range(plan.instances):
        double.create(_instance(f"scale-{index:06x}", "scale", nodes, plan.nodes, {}))
    wanted = plan.instances * plan.nodes
    log(f"controller scale: {plan.instances} Instances x {plan.nodes} nodes = {wanted} brokers")
    process, port = _start(api, base)
    try:
        await _leading(api, process)
        started = time.perf_counter()

        def pods() -> int:
            return len(double.store._bucket(double.resource("pods")))

        await _until(lambda: pods() >= wanted, 1800, f"{wanted} broker pods", 0.05)
        full = time.perf_counter() - started
        await asyncio.sleep(2.0)  # the last watch events reach the controller
        passes = _metric(port, "akri_controller_reconcile_passes_total") or 0
        _ready(api, nodes[0], True, "Touched")  # a Node change: one more pass, nothing to do
        await _until(
            lambda: (_metric(port, "akri_controller_reconcile_passes_total") or 0) > passes,
            60,
            "a steady pass",
            0.05,
        )
        steady = _metric(port, "akri_controller_last_reconcile_seconds")
        return {
            "instances": plan.instances,
            "nodes": plan.nodes,
            "broker_pods": pods(),
            "full_reconcile_s": round(full, 2),
            "pods_per_second": round(wanted / full, 1),
            "steady_pass_ms": None if steady is None else round(steady * 1000, 1),
            "rss_mb": round(rss_mb(process.pid), 1),
            "rss_peak_mb": round(rss_mb(process.pid, "VmHWM"), 1),
        }
    finally:
        await process.stop()
