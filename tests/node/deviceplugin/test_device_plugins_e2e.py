"""Device plugins end to end: kubelet doubles + API double, 2-3 simulated nodes."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from agent.core.ledger.decisions import Owner, held_count
from agent.core.model.device_usage import ConfigurationUsage, NodeUsage, parse_usage
from agent.core.model.keys import ObjectKey
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import (
    DpNode,
    api_instances,
    assert_never_over_capacity,
    one_device_configuration,
    start_dp_node,
)
from tests.harness.k8s_nodes import CRDS, eventually

IL = "akri.sh/cam-8120fe"  # shared debugEcho device "foo0" of configuration "cam"
CL = "akri.sh/cam"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def nodes_ready(nodes: list[DpNode], resources: list[str]) -> None:
    """Every resource registered on every node and its first device list received."""
    for node in nodes:
        for resource in resources:
            await node.kubelet.wait_registered(resource, timeout=10)
            await eventually(
                lambda node=node, resource=resource: node.kubelet.allocatable(resource) > 0,
                what=f"{resource} devices on {node.name}",
            )


async def test_il_and_cl_share_one_pool(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(one_device_configuration("cam", ("foo0",), capacity=2))
    a = await start_dp_node(api, "node-a", tmp_path)
    b = await start_dp_node(api, "node-b", tmp_path)
    try:
        await eventually(lambda: len(api_instances(api).get("cam-8120fe", _empty()).nodes) == 2)
        await nodes_ready([a, b], [IL, CL])
        await eventually(lambda: a.kubelet.allocatable(IL) == 2 and b.kubelet.allocatable(CL) == 1)
        pod1 = await a.kubelet.admit_pod("default", "il", [("c", {IL: 1})])
        assert pod1.admitted, pod1.message
        pod2 = await b.kubelet.admit_pod("default", "cl", [("c", {CL: 1})])
        assert pod2.admitted, pod2.message
        usage = api_instances(api)["cam-8120fe"].device_usage
        values = sorted(v for v in usage.values() if v)
        assert values[0] == "C:cam-0:node-b" and values[1] == "node-a"
        # the pool is full: both nodes stop offering anything
        await eventually(lambda: a.kubelet.allocatable(IL) == 1)  # only its own slot
        await eventually(lambda: b.kubelet.allocatable(IL) == 0)
        await eventually(lambda: a.kubelet.allocatable(CL) == 0)
        pod3 = await b.kubelet.admit_pod("default", "more", [("c", {IL: 1})])
        assert not pod3.admitted
        env = pod1.container("c").envs
        assert env["DEBUG_ECHO_DESCRIPTION"] == "foo0"
        assert env["DEBUG_ECHO_DESCRIPTION_8120FE"] == "foo0"
        assert_never_over_capacity(api)
    finally:
        await a.stop()
        await b.stop()


def _empty():  # type: ignore[no-untyped-def]
    from agent.core.model.instance import Instance

    return Instance("x", "x", 1)


async def test_randomized_schedule_never_double_allocates(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(one_device_configuration("cam", ("foo0", "foo1"), capacity=2))
    nodes = [await start_dp_node(api, f"node-{c}", tmp_path) for c in "abc"]
    il = ["akri.sh/cam-8120fe", "akri.sh/cam-a19705"]
    try:
        await eventually(
            lambda: (
                len(api_instances(api)) == 2
                and all(len(i.nodes) == 3 for i in api_instances(api).values())
            )
        )
        await nodes_ready(nodes, [*il, CL])
        rng = random.Random(20261122)
        live: list[tuple[DpNode, str]] = []
        admitted = refused = 0
        for step in range(60):
            if live and rng.random() < 0.4:
                node, pod = live.pop(rng.randrange(len(live)))
                await node.kubelet.delete_pod("default", pod)
            else:
                node = rng.choice(nodes)
                resource = rng.choice([*il, CL])
                pod = f"p{step}"
                result = await node.kubelet.admit_pod("default", pod, [("c", {resource: 1})])
                if result.admitted:
                    live.append((node, pod))
                    admitted += 1
                else:
                    refused += 1
            assert_never_over_capacity(api)
            _assert_no_slot_shared_by_live_pods(nodes)
            await asyncio.sleep(0.05)
        assert admitted >= 10 and refused >= 1
        for node, pod in live:
            await node.kubelet.delete_pod("default", pod)
        await eventually(
            lambda: all(held_count(i) == 0 for i in api_instances(api).values()),
            within=10,
            what="every slot reclaimed",
        )
    finally:
        for node in nodes:
            await node.stop()


def _assert_no_slot_shared_by_live_pods(nodes: list[DpNode]) -> None:
    for node in nodes:
        seen: dict[tuple[str, str], str] = {}
        for pod in node.kubelet.pods():
            for device in pod.devices():
                key = (node.name, device)
                assert key not in seen, f"{device} given to {seen[key]} and {pod.name}"
                seen[key] = pod.name


async def test_pod_recreation_is_admitted_at_once(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(one_device_configuration("cam", ("foo0",), capacity=1))
    node = await start_dp_node(api, "node-a", tmp_path, reclaim_grace=30)
    try:
        await nodes_ready([node], [IL, CL])
        for resource in (CL, IL):
            first = await node.kubelet.admit_pod("default", "web", [("c", {resource: 1})])
            assert first.admitted, first.message
            await node.kubelet.delete_pod("default", "web")
            # the slot is not reclaimed yet (grace 30 s) — the re-created pod still gets it
            again = await node.kubelet.admit_pod("default", "web", [("c", {resource: 1})])
            assert again.admitted, again.message
            assert again.devices() == first.devices()
            await node.kubelet.delete_pod("default", "web")
            # hand the slot back before switching plugins
            usage = next(iter(api_instances(api).values())).device_usage
            for value in {v for v in usage.values() if v}:
                await node.ledger.release_values(ObjectKey("default", "cam-8120fe"), {value})
            await eventually(lambda: node.kubelet.allocatable(IL) == 1, what="slot free again")
        errors = [c for c in node.kubelet.rpc_calls if c.code not in (None, grpc.StatusCode.OK)]
        assert errors == []
    finally:
        await node.stop()


async def test_multi_container_and_multi_device_pods(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(one_device_configuration("cam", ("foo0", "foo1"), capacity=2))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await nodes_ready([node], [CL])
        await eventually(lambda: node.kubelet.allocatable(CL) == 2)
        pod = await node.kubelet.admit_pod(
            "default", "two", [("main", {CL: 2})], init_containers=[("init", {CL: 1})]
        )
        assert pod.admitted, pod.message
        main = pod.container("main")
        assert len(main.devices[CL]) == 2
        # ONE response for the container, merging both devices (Akri returns one per device)
        assert main.envs["DEBUG_ECHO_DESCRIPTION_8120FE"] == "foo0"
        assert main.envs["DEBUG_ECHO_DESCRIPTION_A19705"] == "foo1"
        held = [
            parse_usage(v)
            for i in api_instances(api).values()
            for v in i.device_usage.values()
            if v
        ]
        assert len(held) == 2 and all(isinstance(u, ConfigurationUsage) for u in held)
        # asking for more distinct devices than there are instances fails clearly
        refused = await node.kubelet.admit_pod("default", "three", [("c", {CL: 3})])
        assert not refused.admitted
    finally:
        await node.stop()


async def test_bad_allocate_requests_get_clear_errors(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(one_device_configuration("cam", ("foo0",), capacity=2))
    a = await start_dp_node(api, "node-a", tmp_path)
    b = await start_dp_node(api, "node-b", tmp_path)
    try:
        await eventually(lambda: len(api_instances(api).get("cam-8120fe", _empty()).nodes) == 2)
        await nodes_ready([a, b], [IL, CL])
        unknown = await a.kubelet.admit_pod(
            "default", "bad", [("c", {IL: 1})], choose={IL: ["cam-8120fe-7"]}
        )
        assert not unknown.admitted
        assert unknown.grpc_code == grpc.StatusCode.INVALID_ARGUMENT, unknown.message
        assert "cam-8120fe-7" in (unknown.grpc_details or "")
        # node-b takes slot 0 behind node-a's back; node-a's kubelet still thinks it is free
        await b.ledger.claim(
            ObjectKey("default", "cam-8120fe"), "cam-8120fe-0", Owner.instance_level("node-b")
        )
        raced = await a.kubelet.admit_pod(
            "default", "raced", [("c", {IL: 1})], choose={IL: ["cam-8120fe-0"]}
        )
        assert not raced.admitted
        assert raced.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
        assert "node-b" in (raced.grpc_details or "")
        await eventually(
            lambda: a.kubelet.devices(IL).get("cam-8120fe-0") == "Unhealthy",
            what="taken slot reported Unhealthy",
        )
        ok = await a.kubelet.admit_pod("default", "ok", [("c", {IL: 1})])
        assert ok.admitted and ok.devices() == ["cam-8120fe-1"]
        usage = api_instances(api)["cam-8120fe"].device_usage
        assert usage == {"cam-8120fe-0": "node-b", "cam-8120fe-1": "node-a"}
    finally:
        await a.stop()
        await b.stop()


async def test_kubelet_restart_reregisters_within_a_second(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(one_device_configuration("cam", ("foo0", "foo1"), capacity=2))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        resources = ["akri.sh/cam-8120fe", "akri.sh/cam-a19705", CL]
        await nodes_ready([node], resources)
        pod = await node.kubelet.admit_pod("default", "keep", [("c", {CL: 1})])
        assert pod.admitted
        started = time.monotonic()
        await node.kubelet.restart()
        for resource in resources:
            await node.kubelet.wait_registered(resource, timeout=30)
        elapsed = time.monotonic() - started
        assert elapsed < 1.5, f"re-registration took {elapsed:.2f}s"
        await eventually(lambda: node.kubelet.allocatable(CL) >= 1)
        # the allocation survived the restart (kubelet keeps its checkpoint; so do we)
        assert any(
            isinstance(parse_usage(v), ConfigurationUsage)
            for i in api_instances(api).values()
            for v in i.device_usage.values()
        )
    finally:
        await node.stop()


async def test_deleted_pod_slot_is_reclaimed(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(one_device_configuration("cam", ("foo0",), capacity=1))
    node = await start_dp_node(api, "node-a", tmp_path, reclaim_grace=0.5, reclaim_interval=0.2)
    try:
        await nodes_ready([node], [IL])
        pod = await node.kubelet.admit_pod("default", "p", [("c", {IL: 1})])
        assert pod.admitted
        await asyncio.sleep(1.5)  # in use: never reclaimed
        assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == "node-a"
        await node.kubelet.delete_pod("default", "p")
        await eventually(
            lambda: api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == "",
            within=5,
            what="slot freed after the pod is gone",
        )
        # the reclaimer counts once its write has returned, a moment after the API has it
        await eventually(lambda: node.reclaimer.freed == 1, within=2, what="counted as reclaimed")
    finally:
        await node.stop()


async def test_offline_device_turns_unhealthy_then_plugin_goes(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    from agent.node.discovery.manager import GraceSettings

    api.create(one_device_configuration("cam", ("foo0",), capacity=2))
    node = await start_dp_node(api, "node-a", tmp_path, grace=GraceSettings(local=0, shared=1.5))
    try:
        await nodes_ready([node], [IL])
        socket = node.plugins.instance_plugins["cam-8120fe"].socket_path
        assert socket is not None and socket.exists()
        node.offline()
        await eventually(
            lambda: set(node.kubelet.devices(IL).values()) == {"Unhealthy"},
            what="slots Unhealthy during the grace period",
        )
        await eventually(lambda: "cam-8120fe" not in node.plugins.instance_plugins)
        assert not socket.exists()
    finally:
        await node.stop()


async def test_missing_pod_resources_socket_is_tolerated(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.node.deviceplugin.reclaimer import SlotReclaimer
    from agent.node.kubelet.state import KubeletState

    api.create(one_device_configuration("cam", ("foo0",), capacity=1))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        missing = KubeletState(tmp_path / "none.sock", tmp_path / "none-checkpoint")
        reclaimer = SlotReclaimer(node.ledger, node.store.list_cached, missing)
        with caplog.at_level("WARNING"):
            assert await reclaimer.reclaim_once() == []
            assert await reclaimer.reclaim_once() == []
        warnings = [r for r in caplog.records if "reclaim is off" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        await node.stop()


def test_node_usage_helpers() -> None:
    assert parse_usage("node-a") == NodeUsage("node-a")
