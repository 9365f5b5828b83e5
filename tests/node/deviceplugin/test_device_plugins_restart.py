"""The real agent process (local mode) against the kubelet double: kill -9 mid-allocation."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.ledger.decisions import held_count
from agent.core.model.instance import Instance
from agent.core.store.local import read_state_dir
from tests.doubles.kubelet_double import KubeletDouble
from tests.harness.agent_process import AgentProcess
from tests.harness.k8s_nodes import eventually

CONFIG = """apiVersion: akri.sh/v0
kind: Configuration
metadata: {name: cam}
spec:
  discoveryHandler: {name: debugEcho, discoveryDetails: "descriptions: [foo0, foo1]"}
  capacity: 2
"""
IL = ["akri.sh/cam-8120fe", "akri.sh/cam-a19705"]
CL = "akri.sh/cam"


@pytest.fixture
async def kubelet() -> AsyncIterator[KubeletDouble]:
    base = Path(tempfile.mkdtemp(prefix="kd-", dir="/tmp"))
    (base / "dp").mkdir()
    double = KubeletDouble(base / "dp", base / "pr.sock", reregistration="kubelet")
    await double.start()
    yield double
    await double.stop()
    shutil.rmtree(base, ignore_errors=True)


def start_agent(kubelet: KubeletDouble, tmp: Path) -> AgentProcess:
    config = tmp / "cam.yaml"
    config.write_text(CONFIG)
    return AgentProcess(
        [
            "--local",
            "--state-dir",
            str(tmp / "state"),
            "--config",
            str(config),
            "--node-name",
            "test-node",
            "--debug-echo-availability-file",
            str(tmp / "avail"),
            "--device-plugin-dir",
            str(kubelet.device_plugin_dir),
            "--pod-resources-socket",
            str(kubelet.pod_resources_socket),
            "--reclaim-interval",
            "0.2",
            "--reclaim-grace",
            "1",
            "--poll-interval",
            "0.2",
        ]
    )


def instances(tmp: Path) -> list[Instance]:
    return read_state_dir(tmp / "state")


def slot_holders(tmp: Path) -> dict[str, str]:
    return {slot: value for i in instances(tmp) for slot, value in i.device_usage.items() if value}


async def ready(kubelet: KubeletDouble, since: float | None = None) -> None:
    for resource in [*IL, CL]:
        await kubelet.wait_registered(resource, timeout=15, after=since)
        if since is not None:
            await kubelet.wait_list_and_watch(resource, timeout=10)
            continue  # after a restart some resources may legitimately be full
        await kubelet.wait_for(
            lambda r=resource: kubelet.allocatable(r) > 0,
            timeout=10,
            message=f"{resource}: {kubelet.devices(resource)}; holders {kubelet.pods()}",
        )


async def test_kill_9_mid_allocation_leaks_nothing_and_double_allocates_nothing(
    kubelet: KubeletDouble, tmp_path: Path
) -> None:
    agent = start_agent(kubelet, tmp_path)
    try:
        await ready(kubelet)
        kept = await kubelet.admit_pod("default", "kept", [("c", {IL[0]: 1})])
        assert kept.admitted, kept.message
        # a burst of admissions; kill -9 the agent while they are in flight
        burst = [
            asyncio.create_task(kubelet.admit_pod("default", f"b{i}", [("c", {CL: 1})]))
            for i in range(3)
        ]
        await asyncio.sleep(0.05)
        agent.kill()
        await asyncio.gather(*burst, return_exceptions=True)
        restarted_at = time.monotonic()
        agent = start_agent(kubelet, tmp_path)
        await ready(kubelet, since=restarted_at)

        def live_devices() -> set[str]:
            return {d for pod in kubelet.pods() for d in pod.devices()}

        # after the reclaim grace, every held slot belongs to a live container, and capacity
        # was never exceeded
        def consistent() -> bool:
            live = live_devices()
            for inst in instances(tmp_path):
                if held_count(inst) > inst.capacity:
                    return False
            for slot, value in slot_holders(tmp_path).items():
                device_id = value.split(":")[1] if value.startswith("C:") else slot
                if device_id not in live:
                    return False
            return True

        await eventually(consistent, within=10, what="no leaked slot after restart")
        assert slot_holders(tmp_path).get("cam-8120fe-0") == "test-node"  # kept pod's slot
        # no device is used by two live pods
        seen: set[str] = set()
        for pod in kubelet.pods():
            for device in pod.devices():
                assert device not in seen
                seen.add(device)
        # pods go away: everything is freed
        for pod in list(kubelet.pods()):
            await kubelet.delete_pod(pod.namespace, pod.name)
        await eventually(lambda: slot_holders(tmp_path) == {}, within=10, what="all free")
        assert agent.errors() == [], agent.log_text()
    finally:
        agent.cleanup()


async def test_sigterm_removes_sockets(kubelet: KubeletDouble, tmp_path: Path) -> None:
    agent = start_agent(kubelet, tmp_path)
    try:
        await ready(kubelet)
        sockets = [p.name for p in kubelet.device_plugin_dir.glob("akri.sh-*.sock")]
        assert len(sockets) == 3
        assert agent.stop() == 0
        assert list(kubelet.device_plugin_dir.glob("akri.sh-*.sock")) == []
        assert (kubelet.device_plugin_dir / "kubelet.sock").exists()  # never kubelet's
    finally:
        agent.cleanup()
