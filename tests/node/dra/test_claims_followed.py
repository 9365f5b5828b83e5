"""ResourceClaims are followed only where device plugins and DRA serve the same slots, and then
narrowly (issue 33.5): a node on the DRA path registers no device plugin, so nothing there could
take a slot the scheduler allocated — it neither lists nor watches claims; a device-plugin node
keeps of the cluster's claims only those with ``akri.sh`` results (agent/node/dra/allocated.py),
whatever other drivers' claims come and go."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.kube import make_kube_client
from agent.core.ledger.reservations import Reservations
from agent.core.model.keys import ObjectKey
from agent.node.dra.allocated import AllocatedClaims, compact
from agent.node.dra.extended import DEVICE_PLUGINS, DRA
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_scheduler import create_claim
from tests.harness.dp_nodes import start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_units import inst
from tests.node.dra.test_extended_path import install_classes, node_object

CLAIMS = "resourceclaims.resource.k8s.io"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def claim_requests(api: ApiServerDouble) -> list[str]:
    return [r.info.verb for r in api.requests if r.info.resource == "resourceclaims"]


async def test_a_dra_node_follows_no_claims(api: ApiServerDouble, tmp_path: Path) -> None:
    node_object(api, "v1.36.2")  # kubelet 1.36, containerd 2.1: DRA
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        assert node.agent.extended_resource_path == DRA
        assert node.agent.allocated_claims is None
        assert claim_requests(api) == []  # before: a list of every claim, then a watch
    finally:
        await node.stop()


async def test_a_device_plugin_node_with_dra_follows_them(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    node_object(api, "v1.36.2", "containerd://1.6.20")  # no CDI: device plugins
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        assert node.agent.allocated_claims is not None
        assert "list" in claim_requests(api)
    finally:
        await node.stop()


def allocated(api: ApiServerDouble, name: str, driver: str, pool: str, device: str) -> None:
    claim = create_claim(api, "default", name)
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "req", "driver": driver, "pool": pool, "device": device}]
            }
        }
    }
    rt = api.resource(CLAIMS)
    api.store.update(rt, "v1", "default", name, claim, subresource="status")


async def test_only_akri_claims_are_kept(api: ApiServerDouble, tmp_path: Path) -> None:
    for i in range(60):
        allocated(api, f"gpu-{i}", "gpu.example.com", "gpus", f"gpu-{i}")
    allocated(api, "cam", "akri.sh", "n1", "cams-aaaaaa-0")
    instance = inst("cams-aaaaaa", False, ("n1",), 2)
    reservations = Reservations()
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    claims = AllocatedClaims(client, "n1", lambda: [instance], reservations)
    key = ObjectKey("default", "cams-aaaaaa")
    try:
        await claims.start()
        # the cache holds the akri.sh claim only, compact: not the 60 others
        assert list(claims._informer.cache) == ["default/cam"]
        assert reservations.slots(key) == {"cams-aaaaaa-0"}
        # other drivers' claims come and go: nothing is kept of them
        for i in range(60, 90):
            allocated(api, f"gpu-{i}", "gpu.example.com", "gpus", f"gpu-{i}")
        allocated(api, "cam2", "akri.sh", "n1", "cams-aaaaaa-1")
        await eventually(lambda: reservations.slots(key) == {"cams-aaaaaa-0", "cams-aaaaaa-1"})
        assert sorted(claims._informer.cache) == ["default/cam", "default/cam2"]
        # a claim deallocated leaves the cache and its reservation ends
        stored: Any = api.get(CLAIMS, "cam", "default")
        stored["status"] = {}
        api.store.update(api.resource(CLAIMS), "v1", "default", "cam", stored, subresource="status")
        await eventually(lambda: reservations.slots(key) == {"cams-aaaaaa-1"})
        assert list(claims._informer.cache) == ["default/cam2"]
        # the resourceVersion still moves on with the other drivers' events
        await asyncio.sleep(0)
        assert int(claims._informer.resource_version) >= api.resource_version - 1
    finally:
        await claims.close()
        await client.close()


def test_compact_keeps_identity_and_akri_results_only() -> None:
    claim = {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                     "labels": {"x": "y"}, "managedFields": [{}]},
        "spec": {"devices": {"requests": [{"name": "req"}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "req", "driver": "akri.sh", "pool": "p", "device": "d"},
                        {"request": "req", "driver": "gpu.example.com", "pool": "g", "device": "g"},
                    ]
                },
                "nodeSelector": {"nodeSelectorTerms": []},
            },
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pu"}],
        },
    }  # fmt: skip
    ours = {"driver": "akri.sh", "pool": "p", "device": "d"}
    assert compact(claim) == {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u", "resourceVersion": "7"},
        "status": {"allocation": {"devices": {"results": [ours]}}},
    }
