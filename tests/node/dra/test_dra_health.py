"""DRA device health (KEP-4680): the agent's ``DRAResourceHealth`` service, consumed by the DRA
kubelet double the way kubelet does, surfacing as the pod's ``allocatedResourcesStatus``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.instance import Instance
from agent.node.discovery.manager import GraceSettings
from agent.node.dra.health import HEALTH_SERVICES, MAX_MESSAGE, device_health, offline_message
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import HEALTH_V1, HEALTH_V1ALPHA1, DraKubeletDouble
from tests.doubles.dra_scheduler import allocate_claim, create_claim
from tests.harness.dp_nodes import DpNode, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually

DRIVER = "akri.sh"
INSTANCE = "cam-8120fe"
SLICES = "resourceslices.resource.k8s.io"


def instance(name: str, nodes: tuple[str, ...], *, shared: bool, capacity: int = 2) -> Instance:
    return Instance.from_dict(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Instance",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "configurationName": "cam",
                "capacity": capacity,
                "shared": shared,
                "nodes": list(nodes),
                "deviceUsage": {f"{name}-{i}": "" for i in range(capacity)},
                "brokerProperties": {},
            },
        }
    )


def test_device_health_pools_offline_and_gone_instances() -> None:
    local = instance("usb-aaaaaa", ("node-a",), shared=False)
    shared = instance("cam-bbbbbb", ("node-a", "node-b"), shared=True, capacity=1)
    other = instance("cam-cccccc", ("node-b",), shared=True)  # not this node's device
    entries = device_health(
        [local, shared, other],
        "node-a",
        offline={"cam-bbbbbb"},
        prepared=[("node-a", "usb-gone00-0", "usb-gone00"), ("node-a", "usb-aaaaaa-0", "x")],
    )
    by_key = {(e.pool, e.device): e for e in entries}
    # every slot device, and each Instance's own name (its device with consumable capacity)
    assert sorted(by_key) == [
        ("cam-bbbbbb", "cam-bbbbbb"),
        ("cam-bbbbbb", "cam-bbbbbb-0"),
        ("node-a", "usb-aaaaaa"),
        ("node-a", "usb-aaaaaa-0"),
        ("node-a", "usb-aaaaaa-1"),
        ("node-a", "usb-gone00-0"),
    ]
    assert not by_key[("cam-bbbbbb", "cam-bbbbbb")].healthy
    assert by_key[("node-a", "usb-aaaaaa-0")].healthy  # a prepared device of a live Instance
    assert by_key[("node-a", "usb-aaaaaa-0")].message == ""
    offline = by_key[("cam-bbbbbb", "cam-bbbbbb-0")]
    assert not offline.healthy
    assert offline.message == offline_message(shared, "node-a")
    assert "offline on node node-a" in offline.message and "cam-bbbbbb" in offline.message
    gone = by_key[("node-a", "usb-gone00-0")]
    assert not gone.healthy and "usb-gone00" in gone.message


def test_draining_mark_is_unhealthy_and_messages_fit() -> None:
    drained = instance("cam-dddddd", ("node-a",), shared=True, capacity=1)
    drained = drained.evolve(annotations={"akri.sh/draining": "node-a"})
    assert drained.draining_nodes == ("node-a",)
    entries = device_health([drained], "node-a", offline=())
    assert len(entries) == 2 and not any(e.healthy for e in entries)
    long = instance("c" * 60 + "-eeeeee", ("node-a",), shared=True, capacity=1)
    long = long.evolve(configuration_name="x" * 2000)
    assert len(offline_message(long, "node-a")) == MAX_MESSAGE


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def create_pod(api: ApiServerDouble, name: str, claim: str) -> dict[str, Any]:
    """A pod whose container uses the claim ``claim`` (pod claim name ``cam``), with the
    ``status.resourceClaimStatuses`` the resource-claim controller writes."""
    pod = api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeName": "node-a",
                "resourceClaims": [{"name": "cam", "resourceClaimName": claim}],
                "containers": [
                    {"name": "app", "image": "busybox", "resources": {"claims": [{"name": "cam"}]}}
                ],
            },
        }
    )
    meta = pod["metadata"]
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "resourceVersion": meta["resourceVersion"],
        },
        "status": {"resourceClaimStatuses": [{"name": "cam", "resourceClaimName": claim}]},
    }
    return api.store.update(api.resource("pods"), "v1", "default", name, body, subresource="status")


async def start(
    api: ApiServerDouble, tmp: Path, **kubelet_args: Any
) -> tuple[DpNode, DraKubeletDouble]:
    # shared devices keep their Instance for the grace period: the device is offline, not gone
    node = await start_dp_node(
        api, "node-a", tmp, dra=True, grace=GraceSettings(local=0, shared=600)
    )
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api, **kubelet_args)
    await kubelet.start()
    await kubelet.wait_for_registration(DRIVER, timeout=10)
    return node, kubelet


def allocated_status(api: ApiServerDouble, pod: str) -> list[dict[str, Any]]:
    stored = api.get("pods", pod, "default") or {}
    statuses = (stored.get("status") or {}).get("containerStatuses") or [{}]
    return list(statuses[0].get("allocatedResourcesStatus") or [])


async def test_offline_device_is_unhealthy_in_pod_status_at_once(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node, kubelet = await start(api, tmp_path)
    try:
        registration = kubelet.registration(DRIVER)
        assert registration is not None
        assert registration.service == "v1.DRAPlugin"  # the health entries change nothing there
        assert registration.supported_versions[2:] == HEALTH_SERVICES
        await kubelet.wait_for_health(DRIVER, INSTANCE, f"{INSTANCE}-0", "Healthy")
        assert kubelet.health_streams_opened[0] == (DRIVER, HEALTH_V1)
        await eventually(lambda: any(s["spec"].get("devices") for s in api.list(SLICES)), within=10)
        claim = create_claim(api, "default", "c1")
        uid = claim["metadata"]["uid"]
        pod = create_pod(api, "p1", "c1")
        pod_uid = pod["metadata"]["uid"]
        allocate_claim(api, "default", "c1", "node-a", pod_name="p1", pod_uid=pod_uid)
        results = await kubelet.prepare(pod_uid, [("default", uid, "c1")])
        (device,) = results[uid].devices
        kubelet.track_pod(pod)
        cdi_id = f"k8s.akri.sh/device={uid}-{device.device_name}"
        assert allocated_status(api, "p1") == [
            {"name": "claim:cam", "resources": [{"resourceID": cdi_id, "health": "Healthy"}]}
        ]

        sent_before = len(kubelet.health_updates)
        node.offline()
        await kubelet.wait_for_health(DRIVER, INSTANCE, device.device_name, "Unhealthy")
        # pushed on the offline change, not found by a periodic re-send (10 s apart)
        update = next(u for u in kubelet.health_updates[sent_before:] if u.devices and u.changed)
        state = update.devices[(INSTANCE, device.device_name)]
        assert state.health == "Unhealthy"
        assert "offline on node node-a" in state.message
        await eventually(
            lambda: (
                allocated_status(api, "p1")
                == [
                    {
                        "name": "claim:cam",
                        "resources": [
                            {"resourceID": cdi_id, "health": "Unhealthy", "message": state.message}
                        ],
                    }
                ]
            ),
            within=10,
        )
        # the slot is still held (offline is not gone): the grace period keeps the Instance
        assert INSTANCE in node.agent.discovery.offline_instances()

        node.offline(False)
        await kubelet.wait_for_health(DRIVER, INSTANCE, device.device_name, "Healthy")
        await eventually(
            lambda: allocated_status(api, "p1")[0]["resources"][0]["health"] == "Healthy",
            within=10,
        )
        assert "message" not in allocated_status(api, "p1")[0]["resources"][0]
    finally:
        await kubelet.stop()
        await node.stop()


async def test_kubelet_before_pick_health_service_uses_v1alpha1(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 1))
    node, kubelet = await start(api, tmp_path, health_by_advertisement=False)
    try:
        await kubelet.wait_for_health(DRIVER, INSTANCE, f"{INSTANCE}-0", "Healthy")
        assert {service for _, service in kubelet.health_streams_opened} == {HEALTH_V1ALPHA1}
        node.offline()
        await kubelet.wait_for_health(DRIVER, INSTANCE, f"{INSTANCE}-0", "Unhealthy")
    finally:
        await kubelet.stop()
        await node.stop()


async def test_stream_end_clears_health_and_kubelet_reopens(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 1))
    node, kubelet = await start(api, tmp_path, health_retry=0.2)
    try:
        await kubelet.wait_for_health(DRIVER, INSTANCE, f"{INSTANCE}-0", "Healthy")
        opened = len(kubelet.health_streams_opened)
        # the agent's DRA sockets are removed: it serves them again, kubelet re-registers
        assert node.agent.dra is not None
        node.agent.dra.dra_socket.unlink()
        await kubelet.wait_for(
            lambda: len(kubelet.health_streams_opened) > opened, 10, "a new health stream"
        )
        await kubelet.wait_for_health(DRIVER, INSTANCE, f"{INSTANCE}-0", "Healthy")
    finally:
        await kubelet.stop()
        await node.stop()


@pytest.mark.parametrize("turns", range(8))
async def test_a_cancel_that_comes_with_a_change_ends_the_stream(turns: int) -> None:
    """kubelet closes a health stream just as the list changes: on Python 3.11
    ``asyncio.wait_for`` returned and dropped the cancel, and the stream's generator went on.
    Each ``turns`` cancels at another step of the change's way to the waiting stream."""
    import asyncio

    from agent.node.dra.health import HealthReporter, health_v1

    offline: set[str] = set()
    usb = instance("usb-aaaaaa", ("node-a",), shared=False)
    reporter = HealthReporter("node-a", lambda: [usb], lambda: offline, resend=3600)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in reporter.watch(health_v1):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    for _ in range(3):
        await asyncio.sleep(0)  # the stream waits for a change
    offline.add("usb-aaaaaa")
    reporter.changed()
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10)  # bound of a failure, not a timing
    assert done, "the stream went on after its cancel"
    assert task.cancelled()
