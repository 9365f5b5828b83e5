"""DRA end to end: agent pieces + API double + DRA kubelet double + scheduler emulator."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.ledger.decisions import Owner, held_count
from agent.core.model.keys import ObjectKey
from agent.node.dra.cdi import CdiWriter
from agent.node.dra.checkpoint import Checkpoint
from agent.node.dra.state import ClaimRef, DraState
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.cdi_validate import validate_cdi_file
from tests.doubles.dra_kubelet import DraKubeletDouble, PrepareError
from tests.doubles.dra_scheduler import AllocationError, allocate_claim, create_claim
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.paths import REPO

SLICES = "resourceslices.resource.k8s.io"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def published(api: ApiServerDouble) -> dict[str, list[str]]:
    """pool -> device names, at each pool's highest generation."""
    best: dict[str, tuple[int, list[str]]] = {}
    for obj in api.list(SLICES):
        pool = obj["spec"]["pool"]
        names = [d["name"] for d in obj["spec"].get("devices", [])]
        current = best.get(pool["name"])
        if current is None or pool["generation"] > current[0]:
            best[pool["name"]] = (pool["generation"], names)
        elif pool["generation"] == current[0]:
            current[1].extend(names)
    return {pool: sorted(names) for pool, (_, names) in best.items()}


async def dra_node(api: ApiServerDouble, name: str, tmp: Path) -> tuple[DpNode, DraKubeletDouble]:
    node = await start_dp_node(api, name, tmp, dra=True)
    kubelet = DraKubeletDouble(node.registry_dir, name, api)
    await kubelet.start()
    await kubelet.wait_for_registration("akri.sh", timeout=30)
    return node, kubelet


async def claim_and_prepare(
    api: ApiServerDouble, kubelet: DraKubeletDouble, node: str, name: str, **selector: Any
) -> tuple[str, dict[str, Any]]:
    claim = create_claim(api, "default", name)
    uid = claim["metadata"]["uid"]
    allocate_claim(api, "default", name, node, pod_name=f"pod-{name}", pod_uid=f"pod-{name}")
    results = await kubelet.prepare(f"pod-{name}", [("default", uid, name)])
    return uid, results


async def test_slices_follow_free_slots(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    try:
        await eventually(
            lambda: published(api).get("cam-8120fe") == ["cam-8120fe-0", "cam-8120fe-1"]
        )
        assert published(api)["node-a"] == []  # the node's (empty) pool exists
        slice_ = next(s for s in api.list(SLICES) if s["spec"]["pool"]["name"] == "cam-8120fe")
        device = slice_["spec"]["devices"][0]
        assert device["attributes"]["configuration"] == {"string": "cam"}
        assert device["attributes"]["slot"] == {"int": 0}
        assert device["attributes"]["shared"] == {"bool": True}
        assert device["attributes"]["DEBUG_ECHO_DESCRIPTION"] == {"string": "foo0"}
        assert slice_["spec"]["nodeSelector"] == {
            "nodeSelectorTerms": [
                {
                    "matchExpressions": [
                        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}
                    ]
                }
            ]
        }
        # a slot taken through the IL device plugin leaves the slice promptly
        await node.ledger.claim(
            ObjectKey("default", "cam-8120fe"), "cam-8120fe-0", Owner.instance_level("node-a")
        )
        await eventually(lambda: published(api)["cam-8120fe"] == ["cam-8120fe-1"])
        await node.ledger.release(
            ObjectKey("default", "cam-8120fe"), "cam-8120fe-0", Owner.instance_level("node-a")
        )
        await eventually(lambda: len(published(api)["cam-8120fe"]) == 2)
    finally:
        await kubelet.stop()
        await node.stop()


async def test_prepare_writes_valid_cdi_and_unprepare_frees(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(published(api).get("cam-8120fe", [])) == 2)
        uid, results = await claim_and_prepare(api, kubelet, "node-a", "c1")
        (device,) = results[uid].devices
        assert device.pool_name == "cam-8120fe" and device.device_name == "cam-8120fe-0"
        assert list(device.request_names) == ["req"]
        (cdi_id,) = device.cdi_device_ids
        assert cdi_id == f"k8s.akri.sh/device={uid}-cam-8120fe-0"
        usage = api_instances(api)["cam-8120fe"].device_usage
        assert usage["cam-8120fe-0"] == f"D:{uid}:node-a"
        files = list(node.cdi_dir.glob("*.json"))
        assert len(files) == 1 and validate_cdi_file(files[0]) == []
        spec = json.loads(files[0].read_text())
        env = spec["devices"][0]["containerEdits"]["env"]
        assert "DEBUG_ECHO_DESCRIPTION=foo0" in env and "DEBUG_ECHO_DESCRIPTION_8120FE=foo0" in env
        # the DRA-held slot stays published (the scheduler accounts for it via the claim)
        assert published(api)["cam-8120fe"] == ["cam-8120fe-0", "cam-8120fe-1"]
        # a repeated prepare (kubelet retry) gives the same answer and claims nothing more
        again = await kubelet.node_prepare_resources([("default", uid, "c1")])
        assert again.claims[uid] == results[uid]
        assert held_count(api_instances(api)["cam-8120fe"]) == 1
        await kubelet.remove_pod("pod-c1")
        assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == ""
        assert list(node.cdi_dir.glob("*.json")) == []
    finally:
        await kubelet.stop()
        await node.stop()


async def test_mixed_il_cl_dra_never_exceed_capacity(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 3))
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    il, cl = "akri.sh/cam-8120fe", "akri.sh/cam"
    try:
        await node.kubelet.wait_registered(il, timeout=30)
        await node.kubelet.wait_registered(cl, timeout=30)
        await eventually(lambda: node.kubelet.allocatable(il) == 3)
        # the configuration-level list comes on its own stream: on a loaded machine it can
        # arrive after the instance-level one (kubelet then has nothing to admit from)
        await eventually(lambda: node.kubelet.allocatable(cl) == 1)
        assert (await node.kubelet.admit_pod("default", "il", [("c", {il: 1})])).admitted
        assert (await node.kubelet.admit_pod("default", "cl", [("c", {cl: 1})])).admitted
        await eventually(lambda: len(published(api).get("cam-8120fe", [])) == 1)
        await claim_and_prepare(api, kubelet, "node-a", "d1")
        instance = api_instances(api)["cam-8120fe"]
        assert held_count(instance) == 3
        assert sorted(v.split(":")[0] for v in instance.device_usage.values()) == [
            "C",
            "D",
            "node-a",
        ]
        # full: neither the device plugins nor DRA can give more
        await eventually(lambda: node.kubelet.allocatable(il) == 1)  # only its own slot
        assert not (await node.kubelet.admit_pod("default", "il2", [("c", {il: 1})])).admitted
        create_claim(api, "default", "d2")
        with pytest.raises(AllocationError):
            allocate_claim(api, "default", "d2", "node-a", pod_name="p2", pod_uid="p2")
        assert held_count(api_instances(api)["cam-8120fe"]) == 3
    finally:
        await kubelet.stop()
        await node.stop()


async def test_prepare_of_a_slot_taken_meanwhile_names_the_holder(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 1))
    a, kubelet_a = await dra_node(api, "node-a", tmp_path)
    b = await start_dp_node(api, "node-b", tmp_path)
    try:
        await eventually(lambda: len(api_instances(api)["cam-8120fe"].nodes) == 2)
        await eventually(lambda: published(api).get("cam-8120fe") == ["cam-8120fe-0"])
        claim = create_claim(api, "default", "late")
        uid = claim["metadata"]["uid"]
        allocate_claim(api, "default", "late", "node-a", pod_name="p", pod_uid="p")
        # between scheduling and prepare, node-b's device plugin takes the slot
        await b.ledger.claim(
            ObjectKey("default", "cam-8120fe"), "cam-8120fe-0", Owner.instance_level("node-b")
        )
        with pytest.raises(PrepareError) as info:
            await kubelet_a.prepare("p", [("default", uid, "late")])
        assert "node-b" in str(info.value)
        assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == "node-b"
        assert list(a.cdi_dir.glob("*.json")) == []
    finally:
        await kubelet_a.stop()
        await a.stop()
        await b.stop()


async def test_agent_restart_between_prepare_and_unprepare(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(published(api).get("cam-8120fe", [])) == 2)
        uid, first = await claim_and_prepare(api, kubelet, "node-a", "c1")
        assert node.dra is not None and node.base is not None
        # a new driver state from the same checkpoint (the agent restarted)
        checkpoint = Checkpoint(node.base / "dra" / "checkpoint.json")
        checkpoint.load()
        fresh = DraState(
            node.ledger,
            node.store.list_cached,
            node.discovery.device_for,
            node.store.read_resource_claim,
            CdiWriter(node.cdi_dir),
            checkpoint,
        )
        repeated = await fresh.prepare(ClaimRef("default", uid, "c1"))
        assert [d.cdi_device_ids for d in repeated.devices] == [
            tuple(d.cdi_device_ids) for d in first[uid].devices
        ]
        assert held_count(api_instances(api)["cam-8120fe"]) == 1  # not claimed twice
        await fresh.unprepare(ClaimRef("default", uid, "c1"))
        assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == ""
        await fresh.unprepare(ClaimRef("default", uid, "c1"))  # unknown now: success
        await fresh.unprepare(ClaimRef("default", "never-seen", "x"))
    finally:
        await kubelet.stop()
        await node.stop()


async def test_kubelet_restart_republishes_slices(api: ApiServerDouble, tmp_path: Path) -> None:
    local = debug_echo_configuration("loc", ("bar0",), 1)
    api.create(local)
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: "node-a" in published(api))
        kubelet.wipe_node_slices()
        await eventually(lambda: "node-a" in published(api), within=3, what="node pool back")
        await kubelet.restart()
        await kubelet.wait_for_registration("akri.sh", timeout=30)
        await eventually(lambda: "node-a" in published(api))
    finally:
        await kubelet.stop()
        await node.stop()


async def test_hostile_device_ids_stay_inside_the_cdi_dir(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("evil", ("../../../etc/passwd", "a/b c;rm -rf"), 1))
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(api_instances(api)) == 2)
        await eventually(
            lambda: sum(len(v) for k, v in published(api).items() if k != "node-a") == 2
        )
        for index in range(2):
            uid, _ = await claim_and_prepare(api, kubelet, "node-a", f"h{index}")
            assert uid
        files = sorted(node.cdi_dir.glob("*"))
        assert len(files) == 2
        assert all(f.parent == node.cdi_dir for f in files)
        assert all(validate_cdi_file(f) == [] for f in files)
        assert not Path("/etc/passwd.json").exists()
    finally:
        await kubelet.stop()
        await node.stop()


async def test_v1beta1_service_works_too(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 1))
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: published(api).get("cam-8120fe") == ["cam-8120fe-0"])
        claim = create_claim(api, "default", "b1")
        uid = claim["metadata"]["uid"]
        allocate_claim(api, "default", "b1", "node-a", pod_name="p", pod_uid="p")
        results = await kubelet.prepare_v1beta1("p", [("default", uid, "b1")])
        assert results[uid].devices[0].device_name == "cam-8120fe-0"
        assert kubelet.registration("akri.sh").service == "v1.DRAPlugin"  # first listed
        await asyncio.sleep(0)
    finally:
        await kubelet.stop()
        await node.stop()


async def test_every_dra_request_is_allowed_by_rbac(api: ApiServerDouble, tmp_path: Path) -> None:
    import yaml

    documents = yaml.safe_load_all((REPO / "deploy/base/rbac.yaml").read_text())
    role = next(d for d in documents if d["kind"] == "ClusterRole")
    allowed = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}})
    api.clear_requests()
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(published(api).get("cam-8120fe", [])) == 2)
        await claim_and_prepare(api, kubelet, "node-a", "r1")

        def status_written() -> bool:
            claim = api.get("resourceclaims.resource.k8s.io", "r1", "default") or {}
            return bool((claim.get("status") or {}).get("devices"))

        # written in the background after the prepare
        await eventually(status_written, what="status.devices written")
        await kubelet.remove_pod("pod-r1")
        api.delete("configurations.akri.sh", "cam", "default")
        await eventually(lambda: "cam-8120fe" not in published(api), what="orphan pool removed")
    finally:
        await kubelet.stop()
        await node.stop()
    # the test, the scheduler emulator and the DRA kubelet double use the double's Python
    # API, so every recorded HTTP request is the agent's
    used = {
        (
            r.info.group or "",
            r.info.resource + (f"/{r.info.subresource}" if r.info.subresource else ""),
            r.info.verb,
        )
        for r in api.requests
        if r.info.resource
    }
    assert ("resource.k8s.io", "resourceslices", "create") in used
    assert ("resource.k8s.io", "resourceclaims", "get") in used
    assert ("resource.k8s.io", "resourceclaims", "watch") in used  # allocated, unprepared
    # status.devices after the prepare: the status subresource, PUT only
    assert ("resource.k8s.io", "resourceclaims/status", "update") in used
    assert used <= allowed, sorted(used - allowed)


async def test_removed_registration_socket_is_served_again(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 1))
    node, kubelet = await dra_node(api, "node-a", tmp_path)
    try:
        assert node.dra is not None
        removed_at = time.monotonic()
        node.dra.registration_socket.unlink()
        await eventually(lambda: node.dra is not None and node.dra.re_registrations == 1)
        await eventually(lambda: node.dra is not None and node.dra.registration_socket.exists())
        # wait for the *new* registration. The old one may still be listed when the agent has
        # already re-served (the double polls its registry): a prepare sent then went out on
        # the old registration's channel, which the double's next poll closed under the call
        # (it forgets the old registration before it registers the new one), and grpc.aio
        # ends a call whose channel is closed with CancelledError: the flake under load
        await kubelet.wait_for(
            lambda: (
                (reg := kubelet.registration("akri.sh")) is not None
                and reg.registered_at > removed_at
            ),
            timeout=30,
            what="akri.sh to register again",
        )
        await eventually(lambda: published(api).get("cam-8120fe") == ["cam-8120fe-0"], within=30)
        uid, results = await claim_and_prepare(api, kubelet, "node-a", "after")
        assert results[uid].devices[0].device_name == "cam-8120fe-0"
    finally:
        await kubelet.stop()
        await node.stop()


async def test_an_empty_pool_is_no_false_alarm(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found on a real cluster: every start logged "the API server changed or dropped fields
    of ResourceSlice pool <node> ... sent [], stored null" (it stores [] as absent; the API
    double now does too)."""
    with caplog.at_level("ERROR"):
        node, kubelet = await dra_node(api, "node-a", tmp_path)
        try:
            await eventually(lambda: "node-a" in published(api), what="the empty node pool")
            stored = [o for o in api.list(SLICES) if o["spec"]["pool"]["name"] == "node-a"]
            assert "devices" not in stored[0]["spec"]
            assert node.publisher is not None
            publisher = node.publisher
            # the slice is stored before its write's answer is counted: wait for the count,
            # or a sync that ran meanwhile is taken for a rewrite (seen once under CI load)
            await eventually(lambda: publisher.writes >= 1, what="the pool's write counted")
            writes = publisher.writes
            await publisher.sync()
            slice_writes = [
                (r.method, r.info.name)
                for r in api.requests_for(resource="resourceslices")
                if r.method in ("POST", "PUT", "PATCH", "DELETE")
            ]
            # unchanged: not rewritten
            assert publisher.writes == writes, f"slice writes: {slice_writes}"
        finally:
            await kubelet.stop()
            await node.stop()
    assert not [r for r in caplog.records if "dropped fields" in r.getMessage()]
