"""ONVIF end to end: a fake camera (real WS-Discovery multicast and SOAP on loopback) → one
shared Instance that two simulated nodes join (each the whole agent with its kubelet double,
against the API-server double) → one slot allocated through each node's device plugin, and
nothing beyond the capacity. Skipped where multicast over loopback does not work."""

from __future__ import annotations

import hashlib
import uuid as uuid_module
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.fake_onvif import FakeCamera
from tests.handlers.test_onvif_discovery import _loopback_multicast
from tests.harness.dp_nodes import api_instances, assert_never_over_capacity, start_dp_node
from tests.harness.k8s_nodes import CRDS, eventually

_REASON = _loopback_multicast()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def onvif_configuration(uuid: str, capacity: int) -> dict[str, Any]:
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": "cams", "namespace": "default"},
        "spec": {
            "discoveryHandler": {
                "name": "onvif",
                "discoveryDetails": (
                    "interfaces: [lo]\ndiscoveryTimeoutSeconds: 0.5\nprobeIntervalSeconds: 2\n"
                    f"uuids: {{action: Include, items: [{uuid}]}}\n"
                ),
            },
            "capacity": capacity,
        },
    }


async def test_a_camera_shared_by_two_nodes_never_over_capacity(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    camera = FakeCamera(uuid=str(uuid_module.uuid4()))
    await camera.start()
    api.create(onvif_configuration(camera.uuid, capacity=2))
    a = await start_dp_node(api, "node-a", tmp_path)
    b = await start_dp_node(api, "node-b", tmp_path)
    try:
        device_id = f"{camera.xaddr}-{camera.uuid}"
        name = f"cams-{hashlib.blake2b(device_id.encode(), digest_size=3).hexdigest()}"
        resource = f"akri.sh/{name}"
        await eventually(
            lambda: (
                name in api_instances(api)
                and set(api_instances(api)[name].nodes) == {"node-a", "node-b"}
            ),
            within=20,
            what="one shared Instance joined by both nodes",
        )
        instance = api_instances(api)[name]
        assert instance.shared and instance.capacity == 2
        assert instance.broker_properties["ONVIF_DEVICE_UUID"] == camera.uuid
        for node in (a, b):
            await node.kubelet.wait_registered(resource, timeout=20)
            await eventually(
                lambda node=node: node.kubelet.allocatable(resource) == 2,
                within=20,
                what=f"{resource} listed on {node.name}",
            )
        on_a = await a.kubelet.admit_pod("default", "viewer-a", [("c", {resource: 1})])
        assert on_a.admitted, on_a.message
        # node-b's kubelet hears that slot is taken before it admits (as it would be scheduled)
        await eventually(lambda: b.kubelet.allocatable(resource) == 1, what="b sees a's claim")
        on_b = await b.kubelet.admit_pod("default", "viewer-b", [("c", {resource: 1})])
        assert on_b.admitted, on_b.message
        assert on_a.container("c").envs["ONVIF_DEVICE_SERVICE_URL"] == camera.xaddr
        usage = api_instances(api)[name].device_usage
        assert sorted(v for v in usage.values() if v) == ["node-a", "node-b"]
        # the camera is fully used: neither node offers a third slot
        await eventually(lambda: a.kubelet.allocatable(resource) == 1, what="a: own slot only")
        await eventually(lambda: b.kubelet.allocatable(resource) == 1, what="b: own slot only")
        third = await b.kubelet.admit_pod("default", "viewer-c", [("c", {resource: 1})])
        assert not third.admitted
        assert_never_over_capacity(api)
    finally:
        await a.stop()
        await b.stop()
        await camera.stop(bye=False)
