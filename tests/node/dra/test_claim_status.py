"""ResourceClaim ``status.devices`` (KEP-4817): what the agent writes after a prepare, and that
the API-server double's ``validateDeviceStatus`` port accepts it and refuses what upstream
refuses."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.kube import make_kube_client
from agent.core.model.instance import Instance
from agent.node.dra.checkpoint import PreparedClaim, PreparedDevice
from agent.node.dra.claim_status import (
    DATA_MAX_LENGTH,
    ClaimStatusWriter,
    device_data,
    device_statuses,
    host_address,
    merged_devices,
    network_data,
)
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.apiserver.resource_validation import validate_resource
from tests.doubles.dra_scheduler import allocate_claim, create_claim, resource_slice
from tests.harness.k8s_nodes import CRDS

CLAIMS = "resourceclaims.resource.k8s.io"


def camera(name: str = "cam-123456", **properties: str) -> Instance:
    return Instance.from_dict(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Instance",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "configurationName": "cam",
                "capacity": 2,
                "shared": True,
                "nodes": ["node-a"],
                "deviceUsage": {f"{name}-0": "", f"{name}-1": ""},
                "brokerProperties": properties,
            },
        }
    )


def prepared(uid: str, name: str, *devices: tuple[str, str, str, str]) -> PreparedClaim:
    return PreparedClaim(
        uid,
        "default",
        name,
        tuple(
            PreparedDevice(("req",), pool, device, instance, slot, (f"k8s.akri.sh/device={uid}",))
            for pool, device, instance, slot in devices
        ),
    )


# --------------------------------------------------------------------------- pure parts


def test_network_data_of_onvif_mdns_and_mqtt_devices() -> None:
    onvif = {"ONVIF_DEVICE_IP_ADDRESS": "10.0.0.7", "ONVIF_DEVICE_MAC_ADDRESS": "aa:bb:cc:dd:ee:ff"}
    assert network_data(onvif) == {"ips": ["10.0.0.7/32"], "hardwareAddress": "aa:bb:cc:dd:ee:ff"}
    mdns = {"MDNS_ADDRESSES": "192.168.1.5, FE80::0001,not-an-ip,192.168.1.5"}
    assert network_data(mdns) == {"ips": ["192.168.1.5/32", "fe80::1/128"]}
    assert network_data({"MQTT_IP": "::ffff:10.1.2.3", "MQTT_MAC": "01:02"}) == {
        "ips": ["10.1.2.3/32"],
        "hardwareAddress": "01:02",
    }
    assert network_data({"DEBUG_ECHO_DESCRIPTION": "foo0"}) is None  # not a network device
    many = {"MDNS_ADDRESSES": ",".join(f"10.0.0.{i}" for i in range(40))}
    assert len(network_data(many)["ips"]) == 16  # type: ignore[index]
    assert network_data({"ONVIF_DEVICE_MAC_ADDRESS": "x" * 129}) is None  # over 128: left out
    assert host_address("fe80::1%eth0") == "fe80::1/128"


def test_data_names_the_device_and_stays_under_10_kib() -> None:
    instance = camera(ONVIF_DEVICE_IP_ADDRESS="10.0.0.7", MODEL="X1")
    assert device_data(instance, "cam-123456-1") == {
        "configuration": "cam",
        "instance": "cam-123456",
        "slot": "cam-123456-1",
        "properties": {"MODEL": "X1", "ONVIF_DEVICE_IP_ADDRESS": "10.0.0.7"},
    }
    big = camera(SMALL="s", HUGE="h" * 20000, LARGE="l" * 6000)
    data = device_data(big, "cam-123456-0")
    assert len(json.dumps(data, separators=(",", ":"))) <= DATA_MAX_LENGTH
    assert data["truncated"] is True
    assert data["properties"] == {"LARGE": "l" * 6000, "SMALL": "s"}  # the largest left out


def test_statuses_echo_share_ids_and_keep_other_drivers() -> None:
    claim = PreparedClaim(
        "u1",
        "default",
        "c1",
        (
            PreparedDevice(
                ("req",),
                "cam-123456",
                "cam-123456-0",
                "cam-123456",
                "cam-123456-0",
                (),
                share_id="7b3f0a4e-0000-4000-8000-000000000001",
            ),
            PreparedDevice(("req",), "node-a", "gone-0", "gone", "gone-0", ()),
        ),
    )
    ours = device_statuses(claim, {"cam-123456": camera(ONVIF_DEVICE_IP_ADDRESS="10.0.0.7")})
    assert ours[0]["shareID"] == "7b3f0a4e-0000-4000-8000-000000000001"
    assert ours[0]["networkData"] == {"ips": ["10.0.0.7/32"]}
    assert ours[1] == {"driver": "akri.sh", "pool": "node-a", "device": "gone-0"}
    other = {"driver": "gpu.example.com", "pool": "p", "device": "d"}
    stale = {"driver": "akri.sh", "pool": "x", "device": "y"}
    assert merged_devices([other, stale], ours) == [other, *ours]


# --------------------------------------------------------------------------- the API double


def claim_with_status(devices: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(new, old) ResourceClaims allocated one akri.sh device, the new one with ``devices``."""
    old = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c1", "namespace": "default", "uid": "u1"},
        "spec": {
            "devices": {"requests": [{"name": "req", "exactly": {"deviceClassName": "akri.sh"}}]}
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "req", "driver": "akri.sh", "pool": "p1", "device": "d-0"}
                    ]
                }
            }
        },
    }
    new = copy.deepcopy(old)
    new["status"]["devices"] = devices
    return new, old


def causes_of(devices: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    new, old = claim_with_status(devices)
    return validate_resource("resource.k8s.io", "resourceclaims", new, old)


GOOD = {"driver": "akri.sh", "pool": "p1", "device": "d-0"}


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"data": "text"}, "status.devices[0].data", "must be a valid JSON object"),
        ({"data": {"x": "y" * 10240}}, "status.devices[0].data", "Too long"),
        ({"networkData": {"ips": ["10.0.0.7"]}}, "status.devices[0].networkData.ips[0]",
         "must be a valid address in CIDR form"),
        ({"networkData": {"ips": ["10.0.0.007/32"]}}, "status.devices[0].networkData.ips[0]",
         'must be in canonical form ("10.0.0.7/32")'),
        ({"networkData": {"ips": ["10.0.0.300/32"]}}, "status.devices[0].networkData.ips[0]",
         "must be a valid address in CIDR form"),
        ({"networkData": {"ips": ["FE80::1/128"]}}, "status.devices[0].networkData.ips[0]",
         'must be in canonical form ("fe80::1/128")'),
        ({"networkData": {"ips": ["10.0.0.7/32", "10.0.0.7/32"]}},
         "status.devices[0].networkData.ips[1]", "Duplicate value"),
        ({"networkData": {"ips": [f"10.0.0.{i}/32" for i in range(17)]}},
         "status.devices[0].networkData.ips", "Too many: 17"),
        ({"networkData": {"hardwareAddress": "a" * 129}},
         "status.devices[0].networkData.hardwareAddress", "Too long"),
        ({"networkData": {"interfaceName": "e" * 257}},
         "status.devices[0].networkData.interfaceName", "Too long"),
        ({"conditions": [{"type": f"T{i}"} for i in range(9)]},
         "status.devices[0].conditions", "Too many: 9"),
    ],
)  # fmt: skip
def test_device_status_rules(change: dict[str, Any], field: str, message: str) -> None:
    causes = causes_of([{**GOOD, **change}])
    assert any(f == field and message in m for _, f, m in causes), causes


def test_what_the_agent_writes_passes_validation() -> None:
    instance = camera(ONVIF_DEVICE_IP_ADDRESS="10.0.0.7", ONVIF_DEVICE_MAC_ADDRESS="aa:bb")
    claim = prepared("u1", "c1", ("p1", "d-0", "cam-123456", "cam-123456-0"))
    assert causes_of(device_statuses(claim, {"cam-123456": instance})) == []


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def allocated_claim(api: ApiServerDouble, name: str) -> tuple[str, dict[str, Any]]:
    """A claim allocated (by the scheduler emulator) from a slice with one camera slot."""
    api.create(
        resource_slice(f"slice-{name}", pool=f"pool-{name}", devices=["d-0"], node_name="node-a")
    )
    claim = create_claim(api, "default", name)
    allocate_claim(api, "default", name, "node-a", pod_name="p", pod_uid="p-uid")
    stored = api.get(CLAIMS, name, "default")
    assert stored is not None
    return claim["metadata"]["uid"], stored


async def test_writer_fills_status_devices_through_the_status_subresource(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    uid, stored = await allocated_claim(api, "c1")
    result = stored["status"]["allocation"]["devices"]["results"][0]
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    instance = camera(ONVIF_DEVICE_IP_ADDRESS="10.0.0.7", ONVIF_DEVICE_MAC_ADDRESS="aa:bb")
    writer = ClaimStatusWriter(client, lambda: [instance])
    api.clear_requests()
    api.fail(409, verb="update", resource="resourceclaims", subresource="status")  # a race
    try:
        writer.prepared(
            prepared(uid, "c1", (result["pool"], result["device"], "cam-123456", "cam-123456-0"))
        )
        await writer.wait()
    finally:
        await client.close()
    claim = api.get(CLAIMS, "c1", "default")
    assert claim is not None
    (device,) = claim["status"]["devices"]
    assert device["driver"] == "akri.sh" and device["device"] == result["device"]
    assert device["data"]["instance"] == "cam-123456"
    assert device["networkData"] == {"ips": ["10.0.0.7/32"], "hardwareAddress": "aa:bb"}
    assert claim["status"]["allocation"] == stored["status"]["allocation"]  # untouched
    writes = [r for r in api.requests if r.info.verb == "update" and r.info.subresource == "status"]
    assert len(writes) == 2 and writer.written == 1  # the conflict was read again and retried


async def test_a_refused_status_write_is_logged_not_fatal(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uid, stored = await allocated_claim(api, "c2")
    result = stored["status"]["allocation"]["devices"]["results"][0]
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    writer = ClaimStatusWriter(client, lambda: [camera()])
    api.fail(403, verb="update", resource="resourceclaims", subresource="status", times=None)
    try:
        writer.prepared(
            prepared(uid, "c2", (result["pool"], result["device"], "cam-123456", "cam-123456-0"))
        )
        await writer.wait()
    finally:
        await client.close()
    assert writer.refused == 1 and writer.written == 0
    assert "status.devices not written (HTTP 403" in caplog.text
    claim = api.get(CLAIMS, "c2", "default")
    assert claim is not None and "devices" not in claim["status"]


def agent_rules() -> list[dict[str, Any]]:
    """Every rule deploy/base/rbac.yaml grants the agent (its ClusterRole and Role)."""
    import yaml

    from tests.paths import REPO

    documents = yaml.safe_load_all((REPO / "deploy/base/rbac.yaml").read_text())
    return [r for d in documents if d and d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]


async def test_prepare_through_kubelet_fills_the_claim_status(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As on a real 1.36 cluster: the agent is its DaemonSet's service account (its token
    names its node), allowed what deploy/base/rbac.yaml grants, and the API server authorizes
    status.devices per node. debugEcho devices are shared: before their slices carried
    bindsToNode, the claim's allocation kept the pool's hostname selector and the write was
    refused with 422 (issue 33.2)."""
    from tests.doubles.dra_kubelet import DraKubeletDouble
    from tests.harness.dp_nodes import start_dp_node
    from tests.harness.k8s_nodes import debug_echo_configuration, eventually

    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    api.add_user("agent-a", "system:serviceaccount:akri:akri-agent", agent_rules(), node="node-a")
    node = await start_dp_node(api, "node-a", tmp_path, dra=True, token="agent-a")
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    try:
        await kubelet.start()
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        await eventually(
            lambda: any(
                s["spec"].get("devices") for s in api.list("resourceslices.resource.k8s.io")
            ),
            within=10,
        )
        claim = create_claim(api, "default", "c1")
        uid = claim["metadata"]["uid"]
        allocated = allocate_claim(api, "default", "c1", "node-a", pod_name="p1", pod_uid="p1")
        assert allocated["status"]["allocation"]["nodeSelector"] == {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
            ]
        }  # a shared pool's device, bound to the node the scheduler chose
        await kubelet.prepare("p1", [("default", uid, "c1")])

        def written() -> list[dict[str, Any]]:
            stored = api.get(CLAIMS, "c1", "default") or {}
            return list((stored.get("status") or {}).get("devices") or [])

        def refused() -> bool:
            return "status.devices not written" in caplog.text

        await eventually(
            lambda: written() != [] or refused(), within=10, what="status.devices written"
        )
        assert not refused(), caplog.text
        (device,) = written()
        assert device["driver"] == "akri.sh"
        assert (device["pool"], device["device"]) == ("cam-8120fe", "cam-8120fe-0")
        assert device["data"]["instance"] == "cam-8120fe"
        assert device["data"]["properties"]["DEBUG_ECHO_DESCRIPTION"] == "foo0"
        assert "networkData" not in device  # debugEcho devices have no address
    finally:
        await kubelet.stop()
        await node.stop()


async def test_deallocation_drops_the_status_entries(api: ApiServerDouble, tmp_path: Path) -> None:
    """The API server removes status.devices of devices leaving the allocation
    (dropDeallocatedStatusDevices): deallocating needs no knowledge of the drivers' entries."""
    from tests.doubles.dra_scheduler import release_claim

    uid, stored = await allocated_claim(api, "c3")
    result = stored["status"]["allocation"]["devices"]["results"][0]
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    writer = ClaimStatusWriter(client, lambda: [camera()])
    try:
        writer.prepared(
            prepared(uid, "c3", (result["pool"], result["device"], "cam-123456", "cam-123456-0"))
        )
        await writer.wait()
    finally:
        await client.close()
    assert (api.get(CLAIMS, "c3", "default") or {})["status"]["devices"]
    claim = release_claim(api, "default", "c3")
    assert "devices" not in claim["status"] and "allocation" not in claim["status"]


async def test_a_refusal_names_its_cause_and_what_is_missing(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim allocated from a shared pool whose devices lack bindsToNode (published by an
    older agent, or the API server drops the field) keeps the pool's hostname selector: the
    node's agent may not write its status.devices (422, cause status.devices Forbidden)."""
    selector = {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}
                ]
            }
        ]
    }
    api.create(resource_slice("s", pool="cam-123456", devices=["d-0"], node_selector=selector))
    claim = create_claim(api, "default", "c4")
    stored = allocate_claim(api, "default", "c4", "node-a", pod_name="p", pod_uid="p-uid")
    assert stored["status"]["allocation"]["nodeSelector"] == selector
    api.add_user("agent-a", "system:serviceaccount:akri:akri-agent", agent_rules(), node="node-a")
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc", token="agent-a")))
    writer = ClaimStatusWriter(client, lambda: [camera()])
    try:
        writer.prepared(
            prepared(
                claim["metadata"]["uid"], "c4", ("cam-123456", "d-0", "cam-123456", "cam-123456-0")
            )
        )
        await writer.wait()
    finally:
        await client.close()
    assert writer.refused == 1
    assert "status.devices: Forbidden: changing status.devices requires" in caplog.text
    assert "the claim's allocation is not pinned to one node" in caplog.text
