"""Offline devices tainted rather than hidden (KEP-5055) and consumable capacity (KEP-5075):
slice content, the scheduler emulator's handling, the publisher's fallback when the API server
drops the fields, and prepare through the DRA kubelet double."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.device_usage import ClaimUsage, parse_usage
from agent.core.model.instance import Instance
from agent.core.model.naming import DRAINING_ANNOTATION
from agent.node.discovery.manager import GraceSettings
from agent.node.dra.publisher import SlicePublisher
from agent.node.dra.slices import (
    DRAINING,
    OFFLINE,
    DeviceOptions,
    Pool,
    SlotState,
    consumed_slots,
    desired_pools,
    device_options,
    instance_devices,
    slots_capacity,
)
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import (
    AllocationError,
    allocate_claim,
    claim_object,
    create_claim,
    request_consumption,
    resource_slice,
    tolerates,
)
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_publisher_sync import RecordingClient, versioned
from tests.node.dra.test_dra_units import inst

SLICES = "resourceslices.resource.k8s.io"
CONSUMABLE = DeviceOptions(consumable=True)
TOLERATE_OFFLINE = [{"key": "akri.sh/offline", "operator": "Exists", "effect": "NoSchedule"}]


# --------------------------------------------------------------------------- pure: slices


def test_offline_slots_stay_tainted_and_draining_ones_go() -> None:
    instance = inst("cams-aaaaaa", True, ("n1",), 3, s1="n1", s2="D:uid:n1")
    offline = instance_devices(instance, SlotState(OFFLINE, node="n1"))
    # the free slot and the DRA-held one stay; the device-plugin slot is not DRA's
    assert [d["name"] for d in offline] == ["cams-aaaaaa-0", "cams-aaaaaa-2"]
    assert {d["taints"][0]["effect"] for d in offline} == {"NoSchedule"}
    assert instance_devices(instance, SlotState(DRAINING, node="n1")) == ()
    evicting = instance_devices(instance, SlotState(DRAINING, DeviceOptions(evict=True), node="n1"))
    # after the grace, with eviction on: only the DRA-held slot, NoExecute (its pods go)
    assert [d["name"] for d in evicting] == ["cams-aaaaaa-2"]
    assert evicting[0]["taints"] == [
        {"key": "akri.sh/offline", "value": "n1", "effect": "NoExecute"}
    ]
    # a node name that is not a label value (> 63 characters) leaves the value out
    (taint,) = instance_devices(instance, SlotState(OFFLINE, node="n" * 64))[0]["taints"]
    assert "value" not in taint


def test_draining_mark_and_offline_set_decide_the_state() -> None:
    drained = inst("cams-dddddd", False, ("n1",), 2).with_node_mark(DRAINING_ANNOTATION, "n1", True)
    offline = inst("cams-oooooo", False, ("n1",), 2)
    (pool,) = desired_pools(
        [drained, offline],
        "n1",
        offline={"cams-dddddd", "cams-oooooo"},
        options_of=lambda i: DeviceOptions(),
    )
    assert [d["name"] for d in pool.devices] == ["cams-oooooo-0", "cams-oooooo-1"]


def test_slices_with_taints_hold_at_most_64_devices() -> None:
    many = [inst(f"cams-{i:06x}", False, ("n1",), capacity=10) for i in range(10)]
    (pool,) = desired_pools(many, "n1", offline={m.name for m in many})
    assert [len(s["devices"]) for s in pool.slice_specs()] == [64, 36]
    (untainted,) = desired_pools(many, "n1", offline=set())
    assert [len(s["devices"]) for s in untainted.slice_specs()] == [100]


def test_one_consumable_device_per_instance() -> None:
    instance = inst("cams-cccccc", False, ("n1",), 4, s0="n1", s1="D:uid:n1")
    (device,) = instance_devices(instance, SlotState(options=CONSUMABLE, node="n1"))
    assert device["name"] == "cams-cccccc"
    assert device["allowMultipleAllocations"] is True
    # slot 0 is a device plugin's: 3 slots to give (the DRA-held one is accounted for by
    # its claim's consumedCapacity)
    assert device["capacity"] == slots_capacity(3)
    assert device["capacity"]["slots"]["requestPolicy"] == {
        "default": "1",
        "validRange": {"min": "1", "max": "3", "step": "1"},
    }
    assert "slot" not in device["attributes"] and "instance" in device["attributes"]
    full = inst("cams-ffffff", False, ("n1",), 1, s0="n1")
    assert instance_devices(full, SlotState(options=CONSUMABLE)) == ()


def test_options_from_annotations_and_consumed_slots() -> None:
    assert device_options({"akri.sh/dra-consumable-capacity": "True"}) == CONSUMABLE
    assert device_options({"akri.sh/dra-offline-evict": "true"}) == DeviceOptions(evict=True)
    assert device_options({"akri.sh/dra-consumable-capacity": "yes"}) == DeviceOptions()
    assert consumed_slots({"consumedCapacity": {"slots": "3"}}) == 3
    assert consumed_slots({}) == 1
    with pytest.raises(ValueError):
        consumed_slots({"consumedCapacity": {"slots": "500m"}})


# --------------------------------------------------------------------------- scheduler emulator


def test_tolerations_match_like_upstream() -> None:
    taint = {"key": "akri.sh/offline", "value": "n1", "effect": "NoSchedule"}
    assert tolerates({"operator": "Exists"}, taint)
    assert tolerates({"key": "akri.sh/offline", "operator": "Exists"}, taint)
    assert tolerates({"key": "akri.sh/offline", "value": "n1"}, taint)  # Equal by default
    assert not tolerates({"key": "akri.sh/offline", "value": "n2"}, taint)
    assert not tolerates(
        {"key": "akri.sh/offline", "operator": "Exists", "effect": "NoExecute"}, taint
    )


def test_request_consumption_rounds_to_the_policy() -> None:
    device = {"capacity": {"slots": {"value": "8", "requestPolicy": {
        "default": "1", "validRange": {"min": "2", "max": "6", "step": "2"}}}}}  # fmt: skip
    assert request_consumption(device, {}) == {"slots": 2}  # default 1 -> min 2
    assert request_consumption(device, {"capacity": {"requests": {"slots": "3"}}}) == {"slots": 4}
    with pytest.raises(AllocationError):
        request_consumption(device, {"capacity": {"requests": {"slots": "7"}}})
    assert request_consumption({"capacity": {"slots": {"value": "5"}}}, {}) == {"slots": 5}


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def test_emulator_skips_tainted_devices_unless_tolerated(api: ApiServerDouble) -> None:
    tainted = {"name": "d-0", "taints": [{"key": "akri.sh/offline", "effect": "NoSchedule"}]}
    api.create(resource_slice("s1", pool="p1", devices=[tainted], node_name="n1"))
    create_claim(api, "default", "c1")
    with pytest.raises(AllocationError, match="1 tainted"):
        allocate_claim(api, "default", "c1", "n1")
    claim = allocate_claim(api, "default", "c1", "n1", tolerations=TOLERATE_OFFLINE)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "d-0" and result["tolerations"] == TOLERATE_OFFLINE


def test_emulator_shares_a_consumable_device_within_its_capacity(api: ApiServerDouble) -> None:
    device = {"name": "cam", "allowMultipleAllocations": True, "capacity": slots_capacity(3)}
    api.create(resource_slice("s1", pool="p1", devices=[device], node_name="n1"))
    claim_for_slots(api, "two", 2)
    first = allocate_claim(api, "default", "two", "n1")
    (result,) = first["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"slots": "2"} and result["shareID"]
    create_claim(api, "default", "one")
    second = allocate_claim(api, "default", "one", "n1")
    assert second["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] == {
        "slots": "1"
    }
    create_claim(api, "default", "more")
    with pytest.raises(AllocationError, match="1 without enough capacity left"):
        allocate_claim(api, "default", "more", "n1")


# --------------------------------------------------------------------------- publisher fallback


class DroppingClient(RecordingClient):
    """An API server whose DRAConsumableCapacity and DRADeviceTaints gates are off: it
    stores devices without ``allowMultipleAllocations``, ``requestPolicy`` and ``taints``."""

    @staticmethod
    def _drop(body: dict[str, Any]) -> dict[str, Any]:
        devices = []
        for device in body["spec"].get("devices") or []:
            device = {
                k: v for k, v in device.items() if k not in ("allowMultipleAllocations", "taints")
            }
            if "capacity" in device:
                device["capacity"] = {
                    n: {"value": c["value"]} for n, c in device["capacity"].items()
                }
            devices.append(device)
        return {**body, "spec": {**body["spec"], "devices": devices}}

    async def create(self, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return await super().create(path, self._drop(body), **kw)

    async def replace(self, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return await super().replace(path, self._drop(body), **kw)


async def test_dropped_fields_fall_back_to_slots_and_withdrawal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    instances = [
        versioned(inst("cam-c", False, ("n1",), 2), 1),
        versioned(inst("cam-o", False, ("n1",), 2), 1),
    ]
    pub = SlicePublisher(
        DroppingClient(),  # type: ignore[arg-type]
        "n1",
        lambda: instances,
        lambda: {"cam-o"},
        options_of=lambda i: CONSUMABLE if i.name == "cam-c" else DeviceOptions(),
    )
    await pub.sync()
    assert not pub.consumable_supported and not pub.taints_supported
    assert "DRAConsumableCapacity feature gate is off" in caplog.text
    assert "DRADeviceTaints feature gate is off" in caplog.text
    await pub.sync()
    (stored,) = pub._informer.cache.values()
    # one device per slot for cam-c; cam-o's offline slots withdrawn, not published untainted
    assert [d["name"] for d in stored["spec"]["devices"]] == ["cam-c-0", "cam-c-1"]


async def test_kept_taints_do_not_rewrite_the_slice_each_sync() -> None:
    """The API server stamps timeAdded on taints sent without one: still unchanged."""

    class Stamping(RecordingClient):
        async def create(self, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
            stamped = {**body, "spec": {**body["spec"], "devices": [
                {**d, "taints": [{**t, "timeAdded": "2026-11-25T16:00:00Z"} for t in d["taints"]]}
                for d in body["spec"]["devices"]]}}  # fmt: skip
            return await super().create(path, stamped, **kw)

    instances = [versioned(inst("cam-o", False, ("n1",), 2), 1)]
    client = Stamping()
    pub = SlicePublisher(client, "n1", lambda: instances, lambda: {"cam-o"})  # type: ignore[arg-type]
    await pub.sync()
    client.writes.clear()
    await pub.sync()
    assert client.writes == [] and pub.taints_supported


# --------------------------------------------------------------------------- end to end


def claim_for_slots(api: ApiServerDouble, name: str, slots: int) -> dict[str, Any]:
    """A claim whose request consumes ``slots`` slots (the spec is immutable: set at create)."""
    claim = claim_object("default", name)
    claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {
        "requests": {"slots": str(slots)}
    }
    return api.create(claim)


def annotated(name: str, capacity: int, **annotations: str) -> dict[str, Any]:
    configuration = debug_echo_configuration(name, ("foo0",), capacity)
    configuration["metadata"]["annotations"] = annotations
    return configuration


async def start(
    api: ApiServerDouble, tmp: Path, grace: GraceSettings | None = None
) -> tuple[DpNode, DraKubeletDouble]:
    node = await start_dp_node(
        api, "node-a", tmp, dra=True, grace=grace or GraceSettings(local=0, shared=0)
    )
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    await kubelet.start()
    await kubelet.wait_for_registration("akri.sh", timeout=10)
    return node, kubelet


def pool_devices(api: ApiServerDouble, pool: str) -> list[dict[str, Any]]:
    return [
        d
        for s in api.list(SLICES)
        if s["spec"]["pool"]["name"] == pool
        for d in s["spec"].get("devices") or []
    ]


def claim_holders(api: ApiServerDouble, instance: str) -> list[str]:
    usage = api_instances(api)[instance].device_usage
    return sorted(
        parsed.claim_uid
        for value in usage.values()
        if value and isinstance(parsed := parse_usage(value), ClaimUsage)
    )


async def test_consumable_capacity_end_to_end(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(annotated("cam", 3, **{"akri.sh/dra-consumable-capacity": "true"}))
    node, kubelet = await start(api, tmp_path)
    try:
        await eventually(
            lambda: [d["name"] for d in pool_devices(api, "cam-8120fe")] == ["cam-8120fe"]
        )
        two = claim_for_slots(api, "two", 2)
        allocate_claim(api, "default", "two", "node-a", pod_name="p2", pod_uid="p2")
        results = await kubelet.prepare("p2", [("default", two["metadata"]["uid"], "two")])
        (device,) = results[two["metadata"]["uid"]].devices  # one device for two slots
        assert device.device_name == "cam-8120fe" and device.share_id
        one = create_claim(api, "default", "one")
        allocate_claim(api, "default", "one", "node-a", pod_name="p1", pod_uid="p1")
        await kubelet.prepare("p1", [("default", one["metadata"]["uid"], "one")])
        uid2, uid1 = two["metadata"]["uid"], one["metadata"]["uid"]
        assert claim_holders(api, "cam-8120fe") == sorted([uid2, uid2, uid1])
        create_claim(api, "default", "more")
        with pytest.raises(AllocationError):
            allocate_claim(api, "default", "more", "node-a")
        await kubelet.remove_pod("p2")
        assert claim_holders(api, "cam-8120fe") == [uid1]
    finally:
        await kubelet.stop()
        await node.stop()


async def test_offline_device_tainted_and_a_tolerating_claim_still_gets_it(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node, kubelet = await start(api, tmp_path, GraceSettings(local=0, shared=600))
    try:
        await eventually(lambda: len(pool_devices(api, "cam-8120fe")) == 2)
        node.offline()
        await eventually(
            lambda: (
                all(d.get("taints") for d in pool_devices(api, "cam-8120fe"))
                and len(pool_devices(api, "cam-8120fe")) == 2
            ),
            within=10,
            what="offline slots tainted",
        )
        create_claim(api, "default", "plain")
        with pytest.raises(AllocationError, match="2 tainted"):
            allocate_claim(api, "default", "plain", "node-a")
        claim = create_claim(api, "default", "tolerant")
        allocate_claim(
            api, "default", "tolerant", "node-a", pod_name="pt", pod_uid="pt",
            tolerations=TOLERATE_OFFLINE,
        )  # fmt: skip
        await kubelet.prepare("pt", [("default", claim["metadata"]["uid"], "tolerant")])
        assert claim_holders(api, "cam-8120fe") == [claim["metadata"]["uid"]]
        node.offline(False)
        await eventually(
            lambda: not any(d.get("taints") for d in pool_devices(api, "cam-8120fe")),
            within=10,
            what="taints removed when the device is back",
        )
    finally:
        await kubelet.stop()
        await node.stop()


async def test_slice_size_figures_are_reproducible() -> None:
    """The benchmark's slice sizes for capacity 1,000 (one Instance) without and with
    consumable capacity: 1,000 devices in 8 slices vs one device in one slice."""
    instance = inst("cams-bbbbbb", False, ("n1",), 1000)
    (per_slot,) = desired_pools([instance], "n1", set())
    (consumable,) = desired_pools([instance], "n1", set(), options_of=lambda i: CONSUMABLE)
    assert [len(s["devices"]) for s in per_slot.slice_specs()] == [128] * 7 + [104]
    assert [len(s["devices"]) for s in consumable.slice_specs()] == [1]
    assert isinstance(per_slot, Pool) and isinstance(instance, Instance)


async def test_evict_option_keeps_held_slots_tainted_no_execute_after_the_grace(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """akri.sh/dra-offline-evict: once the grace is over and the node only drains, the slot a
    claim holds stays in the slice tainted NoExecute (its pods get evicted); the free one goes.
    Without the option both leave (test_pools_local_and_shared_with_single_publisher)."""
    api.create(annotated("cam", 2, **{"akri.sh/dra-offline-evict": "true"}))
    node, kubelet = await start(api, tmp_path, GraceSettings(local=0, shared=0))
    try:
        await eventually(lambda: len(pool_devices(api, "cam-8120fe")) == 2)
        claim = create_claim(api, "default", "held")
        allocate_claim(api, "default", "held", "node-a", pod_name="ph", pod_uid="ph")
        await kubelet.prepare("ph", [("default", claim["metadata"]["uid"], "held")])
        held = next(
            slot for slot, value in api_instances(api)["cam-8120fe"].device_usage.items() if value
        )
        node.offline()
        await eventually(
            lambda: (
                [(d["name"], d.get("taints")) for d in pool_devices(api, "cam-8120fe")]
                == [(held, [{"key": "akri.sh/offline", "value": "node-a", "effect": "NoExecute"}])]
            ),
            within=10,
            what="only the held slot, tainted NoExecute",
        )
        assert "node-a" in api_instances(api)["cam-8120fe"].draining_nodes
    finally:
        await kubelet.stop()
        await node.stop()
