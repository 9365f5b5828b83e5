"""DRA with a Configuration and an Instance of the same name in a second namespace (issue 11
case 2): DRA device and pool names are node-global, so the ResourceSlices publish only the
owner namespace's Instance; the other namespace's Configuration is refused with an Event, and
its same-named Instance is neither published nor, when it goes, taken for the owner's."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.node_labels import with_node_labels
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually

SLICES = "resourceslices.resource.k8s.io"
INSTANCES = "instances.akri.sh"
CONFIGURATIONS = "configurations.akri.sh"
CAM = "cam-8120fe"  # the shared debugEcho device "foo0" of Configuration "cam"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def in_namespace(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    result = copy.deepcopy(obj)
    result["metadata"]["namespace"] = namespace
    return result


def pools(api: ApiServerDouble) -> dict[str, list[str]]:
    """pool name -> the device names its slices publish."""
    result: dict[str, list[str]] = {}
    for item in api.list(SLICES):
        spec = item["spec"]
        devices = result.setdefault(spec["pool"]["name"], [])
        devices.extend(d["name"] for d in spec.get("devices") or [])
    return {name: sorted(devices) for name, devices in result.items()}


def conflicts(api: ApiServerDouble) -> list[dict[str, Any]]:
    return [e for e in api.list("events") if e.get("reason") == "NameConflict"]


async def test_slices_publish_only_the_owner_namespace_s_instance(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        await eventually(
            lambda: pools(api).get(CAM) == [f"{CAM}-0", f"{CAM}-1"], what="default's slice"
        )
        # the same name in "other": a Configuration (3 slots) and an Instance of it written
        # elsewhere, on this node, with a slot more than the owner's
        stray = Instance(
            name=CAM,
            namespace="other",
            configuration_name="cam",
            capacity=3,
            shared=True,
            nodes=("node-a",),
        )
        api.create(with_node_labels(stray.to_dict()))  # as our agents write it
        api.create(in_namespace(debug_echo_configuration("cam", ("foo0",), 3), "other"))
        await eventually(lambda: conflicts(api) != [], what="NameConflict Event")
        (event,) = conflicts(api)
        assert event["involvedObject"]["namespace"] == "other"
        assert event["involvedObject"]["name"] == "cam"
        assert "namespace 'default'" in event["message"]
        assert ObjectKey("other", "cam") in node.discovery.refused
        # a barrier: a later Configuration's slice is published by a pass that saw the stray
        api.create(debug_echo_configuration("mic", ("bar0",), 1))
        await eventually(lambda: any(p.startswith("mic-") for p in pools(api)), what="mic")
        assert pools(api)[CAM] == [f"{CAM}-0", f"{CAM}-1"]  # default's 2 slots, never 3
        # the refused namespace's Instance holds no slot of this node: the node leaves it at
        # once and, the last node, deletes it (docs/slot-model.md, Namespaces); then its
        # Configuration goes too. The owner's pool, of the same name, stays
        await eventually(
            lambda: api.get(INSTANCES, CAM, "other") is None, what="other/cam's Instance gone"
        )
        api.delete(CONFIGURATIONS, "cam", "other")
        api.delete(CONFIGURATIONS, "mic", "default")  # a barrier again: mic's pool goes
        await eventually(lambda: not any(p.startswith("mic-") for p in pools(api)), what="mic")
        assert pools(api)[CAM] == [f"{CAM}-0", f"{CAM}-1"]
        assert api.get(INSTANCES, CAM, "default") is not None
    finally:
        await node.stop()
