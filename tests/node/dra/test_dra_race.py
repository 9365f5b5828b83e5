"""Issue 30 (2): a device-plugin pod and a DRA claim racing for one slot no longer starve the
DRA pod. The claim's allocation is fixed (its pod can run nowhere else), a device-plugin pod can
take any free slot: once the scheduler has allocated a slot to a claim, the device plugins stop
offering it, place nothing on it, and refuse an Allocate that names it; the claim is prepared at
once while the other slots serve the device-plugin pods. Against the API-server double, the DRA
scheduler emulator, the DRA kubelet double and the device-plugin kubelet double."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.core.model.keys import ObjectKey
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import allocate_claim, create_claim
from tests.harness.dp_nodes import api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually

INSTANCE = "cam-8120fe"
KEY = ObjectKey("default", INSTANCE)
IL, CL = f"akri.sh/{INSTANCE}", "akri.sh/cam"
CLAIMS = "resourceclaims.resource.k8s.io"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server
    assert server.internal_errors == []


def published(api: ApiServerDouble) -> list[str]:
    return sorted(
        d["name"]
        for s in api.list("resourceslices.resource.k8s.io")
        for d in s["spec"].get("devices", []) or []
    )


def allocated_device(api: ApiServerDouble, name: str) -> str:
    claim: Any = api.get(CLAIMS, name, "default")
    return str(claim["status"]["allocation"]["devices"]["results"][0]["device"])


async def test_a_slot_allocated_to_a_claim_goes_to_the_claim(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 3))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    await kubelet.start()
    try:
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        await node.kubelet.wait_registered(IL, timeout=10)
        await node.kubelet.wait_registered(CL, timeout=10)
        await eventually(lambda: len(published(api)) == 3, 10, "3 devices published")
        await eventually(lambda: node.kubelet.allocatable(IL) == 3, 10)
        uid = create_claim(api, "default", "d1")["metadata"]["uid"]
        allocate_claim(api, "default", "d1", "node-a", pod_name="pod-d1", pod_uid="pod-d1")
        slot = allocated_device(api, "d1")

        # the agent sees the allocation: the slot is no longer offered to device plugins
        await eventually(lambda: node.ledger.reservations.slots(KEY) == {slot}, 10, "slot reserved")
        await eventually(lambda: node.kubelet.allocatable(IL) == 2, 10, "IL list updated")
        # kubelet asking for exactly that slot (the race: its list was a moment old) loses
        raced = await node.kubelet.admit_pod(
            "default", "il-raced", [("c", {IL: 1})], choose={IL: [slot]}
        )
        assert not raced.admitted
        assert raced.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
        assert "reserved" in (raced.grpc_details or "")
        # device-plugin pods get the other slots, IL and CL alike
        il = await node.kubelet.admit_pod("default", "il", [("c", {IL: 1})])
        cl = await node.kubelet.admit_pod("default", "cl", [("c", {CL: 1})])
        assert il.admitted and cl.admitted
        usage = api_instances(api)[INSTANCE].device_usage
        assert usage[slot] == ""
        assert sorted(v.split(":")[0] for v in usage.values() if v) == ["C", "node-a"]

        # ... and the DRA pod is prepared at once (before: refused until the other pod ended)
        await kubelet.prepare("pod-d1", [("default", uid, "d1")])
        assert api_instances(api)[INSTANCE].device_usage[slot] == f"D:{uid}:node-a"

        # the claim ends: the reservation goes with its allocation
        await kubelet.remove_pod("pod-d1")
        api.delete(CLAIMS, "d1", "default")
        await eventually(lambda: not node.ledger.reservations.slots(KEY), 10, "released")
        await node.kubelet.delete_pod("default", "il")
        await node.kubelet.delete_pod("default", "cl")
        await eventually(lambda: node.kubelet.allocatable(IL) == 3, 15, "all offered again")
    finally:
        await kubelet.stop()
        await node.stop()


async def test_without_rbac_to_list_claims_the_agent_runs_without_reservations(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older deploy/base/rbac.yaml (resourceclaims: get only): one warning, no crash, the
    device plugins and the DRA driver work as before (the CAS alone arbitrates)."""
    import logging

    api.fail(403, verb="list", resource="resourceclaims", times=None)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    with caplog.at_level(logging.WARNING, logger="agent.node.dra.allocated"):
        node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        claims = node.agent.allocated_claims
        assert claims is not None and not claims.available
        assert any("cannot be followed" in r.getMessage() for r in caplog.records)
        await node.kubelet.wait_registered(IL, timeout=10)
        await eventually(lambda: node.kubelet.allocatable(IL) == 2, 10)
        assert (await node.kubelet.admit_pod("default", "il", [("c", {IL: 1})])).admitted
    finally:
        await node.stop()
