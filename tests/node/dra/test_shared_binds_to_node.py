"""Shared devices are published with ``bindsToNode: true`` (issue 33.2): the scheduler then
pins a claim's allocation to the node it chose, so the agent of that node may write the claim's
``status.devices`` under 1.36's per-node status authorization. Where the API server drops the
field (its gates are off), the publisher says so once and publishes without it."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agent.node.dra.publisher import SlicePublisher
from agent.node.dra.slices import USABLE, SlotState, desired_pools, instance_devices
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_scheduler import allocate_claim, create_claim, resource_slice
from tests.node.dra.test_dra_publisher_sync import RecordingClient, versioned
from tests.node.dra.test_dra_units import inst

PINNED_TO_N2 = {
    "nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}
    ]
}


def test_only_shared_devices_bind_to_a_node() -> None:
    shared = inst("cams-aaaaaa", True, ("n1", "n2"), 2)
    local = inst("cams-bbbbbb", False, ("n1",), 2)
    assert {d.get("bindsToNode") for d in instance_devices(shared, SlotState(USABLE))} == {True}
    assert {d.get("bindsToNode") for d in instance_devices(local, SlotState(USABLE))} == {None}
    off = instance_devices(shared, SlotState(USABLE), binds_to_node=False)
    assert all("bindsToNode" not in d for d in off)
    pools = {p.name: p for p in desired_pools([shared, local], "n1", ())}
    assert all(d["bindsToNode"] for d in pools["cams-aaaaaa"].devices)


async def test_the_allocator_pins_a_claim_of_a_bound_device_to_its_node() -> None:
    async with ApiServerDouble() as api:
        (spec,) = desired_pools([inst("cams-aaaaaa", True, ("n1", "n2"), 1)], "n1", ())[
            1
        ].slice_specs()
        api.create(
            resource_slice(
                "s",
                pool="cams-aaaaaa",
                devices=spec["devices"],
                node_selector=spec["nodeSelector"],
            )
        )
        create_claim(api, "default", "c")
        claim = allocate_claim(api, "default", "c", "n2")
        assert claim["status"]["allocation"]["nodeSelector"] == PINNED_TO_N2


class DroppingBinds(RecordingClient):
    """An API server with DRADeviceBindingConditions off: devices are stored without
    ``bindsToNode``."""

    @staticmethod
    def _drop(body: dict[str, Any]) -> dict[str, Any]:
        devices = [
            {k: v for k, v in d.items() if k != "bindsToNode"}
            for d in body["spec"].get("devices") or []
        ]
        return {**body, "spec": {**body["spec"], "devices": devices}}

    async def create(self, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.sent = body
        return await super().create(path, self._drop(body), **kw)

    async def replace(self, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.sent = body
        return await super().replace(path, self._drop(body), **kw)


async def test_a_dropped_binds_to_node_is_said_once_and_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    instances = [versioned(inst("cams-aaaaaa", True, ("n1", "n2"), 2), 1)]
    client = DroppingBinds()
    pub = SlicePublisher(client, "n1", lambda: instances, lambda: ())  # type: ignore[arg-type]
    await pub.sync()
    assert not pub.binds_to_node_supported
    assert caplog.text.count("dropped bindsToNode") == 1
    client.writes.clear()
    await pub.sync()
    # what is stored (without the field) is what it would send now: nothing to rewrite
    assert client.writes == []
    instances[0] = versioned(inst("cams-aaaaaa", True, ("n1", "n2"), 3), 2)
    await pub.sync()
    assert client.writes and all("bindsToNode" not in d for d in client.sent["spec"]["devices"])
    assert "changed or dropped fields" not in caplog.text  # a known fallback, not an error
