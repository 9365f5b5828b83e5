"""Issue 30 (1): deleting a Configuration (or an Instance) while pods hold its slots drains it.

The Instance carries the ``akri.sh/slots`` finalizer, so Kubernetes' garbage collector (here the
API-server double's port of it) can only mark it terminating after its Configuration is deleted:
it offers nothing new (device plugins, ResourceSlices), keeps its held slots while their pods
run, and goes when the last one is freed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.ledger.decisions import held_count
from agent.core.model.instance import Instance
from agent.core.model.naming import SLOTS_FINALIZER
from agent.node.status import state
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import allocate_claim, create_claim
from tests.harness.dp_nodes import api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually

SLICES = "resourceslices.resource.k8s.io"
INSTANCE = "cam-8120fe"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server
    assert server.internal_errors == []


def published_devices(api: ApiServerDouble) -> list[str]:
    return sorted(d["name"] for s in api.list(SLICES) for d in s["spec"].get("devices", []) or [])


async def test_deleted_configuration_drains_il_cl_and_dra_slots_then_goes(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 4))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    await kubelet.start()
    il, cl = f"akri.sh/{INSTANCE}", "akri.sh/cam"
    try:
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        await node.kubelet.wait_registered(il, timeout=10)
        await node.kubelet.wait_registered(cl, timeout=10)
        await eventually(lambda: node.kubelet.allocatable(il) == 4, 10)
        stored = api_instances(api)[INSTANCE]
        assert SLOTS_FINALIZER in stored.finalizers
        assert [r["kind"] for r in stored.owner_references] == ["Configuration"]  # Akri's
        assert (await node.kubelet.admit_pod("default", "il", [("c", {il: 1})])).admitted
        assert (await node.kubelet.admit_pod("default", "cl", [("c", {cl: 1})])).admitted
        await eventually(lambda: len(published_devices(api)) == 2, 10)
        uid = create_claim(api, "default", "d1")["metadata"]["uid"]
        allocate_claim(api, "default", "d1", "node-a", pod_name="pod-d1", pod_uid="pod-d1")
        await kubelet.prepare("pod-d1", [("default", uid, "d1")])
        assert held_count(api_instances(api)[INSTANCE]) == 3

        api.delete("configurations.akri.sh", "cam")

        # the garbage collector could only mark it: the three slots stay with their pods
        terminating = api_instances(api)[INSTANCE]
        assert terminating.deletion_timestamp is not None
        assert held_count(terminating) == 3
        # ... and nothing new is offered: no device in the slices, no Healthy device
        await eventually(lambda: published_devices(api) == [], 10, "slices emptied")
        await eventually(lambda: node.kubelet.allocatable(il) == 0, 10, "IL unhealthy")
        assert not (await node.kubelet.admit_pod("default", "il2", [("c", {il: 1})])).admitted

        # the pods end one by one; the Instance stays until the last slot is freed
        await node.kubelet.delete_pod("default", "il")
        await eventually(lambda: held_count(api_instances(api)[INSTANCE]) == 2, 15, "IL freed")
        await node.kubelet.delete_pod("default", "cl")
        await eventually(lambda: held_count(api_instances(api)[INSTANCE]) == 1, 15, "CL freed")
        assert INSTANCE in api_instances(api)
        await kubelet.remove_pod("pod-d1")
        await eventually(lambda: INSTANCE not in api_instances(api), 15, "instance gone")
    finally:
        await kubelet.stop()
        await node.stop()


async def test_deleted_instance_without_held_slots_goes_at_once(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: INSTANCE in api_instances(api), 10)
        await eventually(lambda: SLOTS_FINALIZER in api_instances(api)[INSTANCE].finalizers, 10)
        first_uid = api_instances(api)[INSTANCE].uid
        api.delete("instances.akri.sh", INSTANCE)
        # nothing held: an agent removes the finalizer, the Instance goes, and discovery
        # (the device is still there) creates it again
        await eventually(
            lambda: (
                INSTANCE in api_instances(api) and api_instances(api)[INSTANCE].uid != first_uid
            ),
            15,
            "re-created",
        )
    finally:
        await node.stop()


async def test_deleted_instance_with_a_held_slot_drains_then_is_created_again(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """``kubectl delete instance`` while a pod uses a slot: before, the record went at once
    (the slot's holder with it); now the Instance stays terminating until the pod ends, then
    goes, and discovery (its device is still there) creates it again."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path)
    il = f"akri.sh/{INSTANCE}"
    try:
        await node.kubelet.wait_registered(il, timeout=10)
        await eventually(lambda: node.kubelet.allocatable(il) == 2, 10)
        assert (await node.kubelet.admit_pod("default", "il", [("c", {il: 1})])).admitted
        first = api_instances(api)[INSTANCE]
        api.delete("instances.akri.sh", INSTANCE)
        terminating = api_instances(api)[INSTANCE]
        assert terminating.deletion_timestamp is not None and held_count(terminating) == 1
        await eventually(lambda: node.kubelet.allocatable(il) == 0, 10, "nothing offered")
        await node.kubelet.delete_pod("default", "il")
        await eventually(
            lambda: (
                INSTANCE in api_instances(api) and api_instances(api)[INSTANCE].uid != first.uid
            ),
            15,
            "gone, then created again",
        )
        await eventually(lambda: node.kubelet.allocatable(il) == 2, 10, "offered again")
    finally:
        await node.stop()


def test_akri_status_says_terminating_with_the_slots_it_waits_for() -> None:
    held = Instance(
        "cam-8120fe",
        "cam",
        2,
        nodes=("node-a",),
        device_usage={"cam-8120fe-0": "node-a", "cam-8120fe-1": ""},
        finalizers=(SLOTS_FINALIZER,),
        deletion_timestamp="2026-01-01T00:00:00Z",
    )
    assert state(held) == "terminating: 1 slot in use"
    assert state(held.evolve(deletion_timestamp=None)) == "ok"
