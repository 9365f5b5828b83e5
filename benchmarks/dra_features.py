"""Benchmarks of the DRA features of issue 26 (device health, extended resources, slice sizes).

    python benchmarks/dra_features.py [--samples N] [--out FILE] [--only NAME ...]

Runs in one process: the API-server double, an in-process agent node (``tests/harness/
dp_nodes.py``: the real Agent with the Kubernetes store over HTTP, debugEcho devices) and the
DRA kubelet double speaking gRPC over unix sockets, so start and end of every sample are read
from one monotonic clock. Prints one JSON object and writes it to ``--out``.

* ``dra_health_update_ms``: the agent learns a device is offline (its discovery handler
  reported a list without it; the discovery manager's offline listener fires) → the kubelet
  double has received the ``UNHEALTHY`` ``NodeWatchResources`` message for it. The device is
  brought back between samples (and its ``HEALTHY`` message awaited).
* ``dra_slices_capacity_1000``: slices, devices, bytes and first-publish time of one Instance
  with 1,000 slots, one device per slot vs one consumable-capacity device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` and ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.node.discovery.manager import GraceSettings
from benchmarks.stats import summarize
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.harness.dp_nodes import start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration

DRIVER = "akri.sh"
NODE = "bench-a"
SLICES = "resourceslices.resource.k8s.io"


async def _wait(predicate: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.002)


async def measure_health(samples: int) -> dict[str, Any]:
    """``dra_health_update_ms``: offline noticed by the agent → UNHEALTHY at the kubelet."""
    latencies: list[float] = []
    async with ApiServerDouble(crds=CRDS) as api:
        api.create(debug_echo_configuration("cam", ("foo0",), 2))
        with tempfile.TemporaryDirectory() as tmp:
            node = await start_dp_node(
                api, NODE, Path(tmp), dra=True, grace=GraceSettings(local=0, shared=3600)
            )
            kubelet = DraKubeletDouble(node.registry_dir, NODE, api)
            try:
                await kubelet.start()
                await kubelet.wait_for_registration(DRIVER, timeout=20)
                instance = "cam-8120fe"
                device = f"{instance}-0"
                await kubelet.wait_for_health(DRIVER, instance, device, "Healthy", timeout=20)
                noticed: list[float] = []
                node.agent.discovery.add_offline_listener(lambda: noticed.append(time.monotonic()))
                for _ in range(samples):
                    noticed.clear()
                    mark = len(kubelet.health_updates)
                    node.offline()
                    await _wait(
                        lambda m=mark: any(
                            u.devices.get((instance, device)) is not None
                            and u.devices[(instance, device)].health == "Unhealthy"
                            for u in kubelet.health_updates[m:]
                        ),
                        20,
                        "UNHEALTHY at the kubelet",
                    )
                    received = next(
                        u.at
                        for u in kubelet.health_updates[mark:]
                        if u.devices[(instance, device)].health == "Unhealthy"
                    )
                    latencies.append((received - noticed[0]) * 1000)
                    node.offline(False)
                    await kubelet.wait_for_health(DRIVER, instance, device, "Healthy", timeout=20)
            finally:
                await kubelet.stop()
                await node.stop()
    return {
        **summarize(latencies, 2),
        "method": "discovery manager's offline listener fires for the device (its handler "
        "reported a list without it) → the DRA kubelet double receives the NodeWatchResources "
        "message with the device UNHEALTHY (v1 stream over the agent's DRA unix socket; one "
        "process, one monotonic clock)",
    }


async def measure_slices(samples: int) -> dict[str, Any]:
    """``dra_slices_capacity_1000``: one local Instance with 1,000 slots published by the
    real SlicePublisher over HTTP to the API-server double, one device per slot vs one
    consumable-capacity device: slices, devices, JSON bytes stored, and the time of the first
    sync (every slice created)."""
    from agent.core.kube import make_kube_client
    from agent.core.model.instance import Instance
    from agent.node.dra.publisher import SlicePublisher
    from agent.node.dra.slices import DeviceOptions

    figures: dict[str, Any] = {}
    async with ApiServerDouble(crds=CRDS) as api:
        with tempfile.TemporaryDirectory() as tmp:
            client = make_kube_client(str(api.write_kubeconfig(Path(tmp) / "kubeconfig")))
            try:
                for mode, options in (
                    ("per_slot", DeviceOptions()),
                    ("consumable", DeviceOptions(consumable=True)),
                ):
                    times: list[float] = []
                    shape: dict[str, Any] = {}
                    for i in range(samples):
                        node = f"bench-{mode.replace('_', '-')}-{i}"
                        instance = Instance(
                            name="cam-123456",
                            configuration_name="cam",
                            capacity=1000,
                            shared=False,
                            nodes=(node,),
                            device_usage={f"cam-123456-{j}": "" for j in range(1000)},
                            broker_properties={"MODEL": "X-100", "FPS": "30"},
                            resource_version="1",
                        )
                        publisher = SlicePublisher(
                            client,
                            node,
                            lambda instance=instance: [instance],  # type: ignore[misc]
                            lambda: (),
                            options_of=lambda _i, options=options: options,  # type: ignore[misc]
                        )
                        start = time.monotonic()
                        await publisher.sync()
                        times.append((time.monotonic() - start) * 1000)
                        stored = [s for s in api.list(SLICES) if s["spec"]["pool"]["name"] == node]
                        shape = {
                            "slices": len(stored),
                            "devices": sum(len(s["spec"].get("devices") or []) for s in stored),
                            "json_bytes": sum(
                                len(json.dumps(s["spec"], separators=(",", ":"))) for s in stored
                            ),
                        }
                    figures[mode] = {**shape, "publish_ms": summarize(times, 1)}
            finally:
                await client.close()
    figures["method"] = (
        "one local Instance, capacity 1,000, two properties; SlicePublisher.sync() from an "
        "empty pool through the Kubernetes client over HTTP to the API-server double "
        "(validation on); json_bytes = the stored specs, compact JSON"
    )
    return figures


async def measure_extended_resource(samples: int) -> dict[str, Any]:
    """``dra_extended_resource_pod_ready_ms`` next to the device-plugin Allocate path: a pod
    with ``limits: {akri.sh/cam: 1}`` on a node whose agent serves it through DRA (scheduler
    emulator: special claim + allocation from the slices; DRA kubelet double: prepare over
    gRPC, the Instance write, the CDI spec), and the same pod on a node whose agent serves it
    through its configuration-level device plugin (kubelet double: admission + Allocate)."""
    import dataclasses

    from agent.core.deviceclasses import InstanceRef, desired_device_classes
    from agent.core.model.keys import ObjectKey
    from tests.doubles.dra_scheduler import AllocationError, schedule_extended_resources

    key = ObjectKey("default", "cam")
    dra_ms: list[float] = []
    dp_ms: list[float] = []
    async with ApiServerDouble(crds=CRDS) as api:
        api.create(debug_echo_configuration("cam", ("foo0",), 2))
        for device_class in desired_device_classes(
            [key], [InstanceRef("cam-8120fe", key)], lambda k: True
        ).values():
            api.create(device_class)
        with tempfile.TemporaryDirectory() as tmp:
            node = await start_dp_node(api, NODE, Path(tmp), dra=True)
            kubelet = DraKubeletDouble(node.registry_dir, NODE, api)
            try:
                await node.restart_agent(
                    dataclasses.replace(node.agent.settings, extended_resources="dra")
                )
                await kubelet.start()
                await kubelet.wait_for_registration(DRIVER, timeout=20)
                for i in range(samples):
                    name = f"pod-{i}"
                    start = time.monotonic()
                    pod = api.create(
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "metadata": {"name": name, "namespace": "default"},
                            "spec": {
                                "containers": [
                                    {"name": "c", "resources": {"limits": {"akri.sh/cam": "1"}}}
                                ]
                            },
                        }
                    )
                    deadline = time.monotonic() + 20
                    while True:  # the freed slot may still be on its way back into the slice
                        try:
                            claim = schedule_extended_resources(api, "default", name, NODE)
                            break
                        except AllocationError:
                            if time.monotonic() > deadline:
                                raise
                            await asyncio.sleep(0.002)
                    assert claim is not None
                    await kubelet.prepare_pod(api.get("pods", name, "default") or pod)
                    dra_ms.append((time.monotonic() - start) * 1000)
                    await kubelet.remove_pod(pod["metadata"]["uid"])
                    api.delete(
                        "resourceclaims.resource.k8s.io", claim["metadata"]["name"], "default"
                    )
                await kubelet.stop()
                await node.restart_agent(
                    dataclasses.replace(node.agent.settings, extended_resources="device-plugins")
                )
                await node.kubelet.wait_registered("akri.sh/cam")
                for i in range(samples):
                    await _wait(
                        lambda: node.kubelet.allocatable("akri.sh/cam") >= 1, 20, "a free slot"
                    )
                    start = time.monotonic()
                    admitted = await node.kubelet.admit_pod(
                        "default", f"dp-{i}", [("c", {"akri.sh/cam": 1})]
                    )
                    dp_ms.append((time.monotonic() - start) * 1000)
                    assert admitted.error is None, admitted.error
                    await node.kubelet.delete_pod("default", f"dp-{i}")
                    await _wait(  # the reclaimer frees the slot (pod-resources shows no user)
                        lambda: all(
                            not v
                            for o in api.list("instances.akri.sh")
                            for v in (o["spec"].get("deviceUsage") or {}).values()
                        ),
                        20,
                        "the slot freed",
                    )
            finally:
                await kubelet.stop()
                await node.stop()
    return {
        "dra": summarize(dra_ms, 2),
        "device_plugin_allocate": summarize(dp_ms, 2),
        "method": "dra: pod object created -> scheduler emulator's extended-resource claim "
        "(special claim, allocation from the agent's slices, pod status) -> DRA kubelet double's "
        "NodePrepareResources returned (claim read, Instance CAS write, CDI spec); "
        "device_plugin_allocate: kubelet double's admission of the same limit through the "
        "agent's configuration-level device plugin (GetPreferredAllocation + Allocate with the "
        "Instance CAS write); one process, one node, capacity 2, one pod at a time",
    }


MEASUREMENTS = {
    "dra_health_update_ms": measure_health,
    "dra_slices_capacity_1000": measure_slices,
    "dra_extended_resource_pod_ready_ms": measure_extended_resource,
}


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "samples": args.samples,
    }
    for name in args.only:
        print(f"measuring {name} ...", file=sys.stderr)
        try:
            results[name] = await MEASUREMENTS[name](args.samples)
        except Exception as exc:  # report, keep measuring the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--only", nargs="+", choices=sorted(MEASUREMENTS), default=sorted(MEASUREMENTS)
    )
    args = parser.parse_args(argv)
    results = asyncio.run(amain(args))
    text = json.dumps(results, indent=2, sort_keys=True)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if any(isinstance(v, dict) and "error" in v for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
