"""A slot a pod took through a device plugin before its node switched to DRA is freed when
that pod ends (docs/dra.md: "pods that got a slot through a device plugin keep it ... the
device-plugin reclaimer runs on both paths and frees those slots only when the pods end").

Seen on the real 1.36.2 cluster (main 5e50af9, the verifier's acceptance pass, finding F1): after
the switch no device plugin runs on the node, so the reclaimer's nudge (a plugin re-sending its
list, agent/node/deviceplugin/manager.py ``nudge_kubelet``) cannot make kubelet rewrite its
device-manager checkpoint; the ended pod stays in that file, the slot counts as in use, and it
is never freed (the Instance of a deleted Configuration then never goes). With the checkpoint
rewritten by hand (``update_allocated_devices`` + ``write_checkpoint`` on the double) the test
passes. Strict xfail until fixed: remove the mark with the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.node.dra.extended import DEVICE_PLUGINS, DRA
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_extended_path import install_classes


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


@pytest.mark.xfail(
    strict=True,
    reason="F1 (ACCEPTANCE.md): on the DRA path no device plugin runs to make kubelet rewrite "
    "its checkpoint, so the ended pod stays in it and the slot is never freed",
)
async def test_a_device_plugin_slot_is_freed_after_a_switch_to_dra(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        await node.kubelet.wait_registered("akri.sh/cam-8120fe")
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        await eventually(lambda: node.kubelet.allocatable("akri.sh/cam-8120fe") == 2)
        admitted = await node.kubelet.admit_pod(
            "default", "dp-pod", [("c", {"akri.sh/cam-8120fe": 1})]
        )
        assert admitted.error is None
        await eventually(
            lambda: any(api_instances(api)["cam-8120fe"].device_usage.values()), what="held"
        )

        settings = dataclasses.replace(node.agent.settings, extended_resources="dra")
        await node.restart_agent(settings)
        assert node.agent.extended_resource_path == DRA
        await eventually(
            lambda: node.kubelet.allocatable("akri.sh/cam-8120fe") == 0, what="plugins gone"
        )
        assert any(api_instances(api)["cam-8120fe"].device_usage.values())

        assert await node.kubelet.delete_pod("default", "dp-pod")
        await eventually(
            lambda: not any(api_instances(api)["cam-8120fe"].device_usage.values()),
            within=30,
            what="the ended pod's device-plugin slot freed on the DRA path",
        )
    finally:
        await node.stop()
