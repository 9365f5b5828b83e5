"""A slot a pod took through a device plugin before its node switched to DRA is freed when
that pod ends (docs/dra.md: "pods that got a slot through a device plugin keep it ... the
device-plugin reclaimer runs on both paths and frees those slots only when the pods end").

Seen on the real 1.36.2 cluster (main 5e50af9, the verifier's acceptance pass, finding F1): after
the switch no device plugin ran on the node, so the reclaimer's nudge (a plugin re-sending its
list, agent/node/deviceplugin/manager.py ``nudge_kubelet``) could not make kubelet rewrite its
device-manager checkpoint; the ended pod stayed in that file, the slot counted as in use, and it
was never freed (the Instance of a deleted Configuration then never went). Fixed by the holding
plugin (agent/node/deviceplugin/plugins.py ``HoldingPlugin``; docs/device-plugins.md, "A name
nobody serves any more"): the name stays registered, offering no device, while slots are held
under it."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.deviceclasses import configuration_class, instance_class
from agent.core.model.keys import ObjectKey
from agent.node.dra.extended import DEVICE_PLUGINS, DRA
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import schedule_extended_resources
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.harness.node_pods import post_node_status
from tests.node.dra.test_auto_follows_classes import node_object
from tests.node.dra.test_dra_extended_resources import create_pod
from tests.node.dra.test_extended_path import install_classes


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


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


async def test_slots_held_through_both_plugins_are_freed_after_auto_moves_to_dra(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """The in-place switch (auto, once akri controller's classes appear) with an
    instance-level and a configuration-level slot held: both names keep a plugin registered
    that offers nothing (kubelet's allocatable 0), a new pod's limit for the instance-level
    name goes through DRA meanwhile, and when the device-plugin pods end their slots are
    freed, the holding plugins go, the DRA claim's slot stays."""
    node_object(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 3))
    il, cl = "akri.sh/cam-8120fe", "akri.sh/cam"
    node: DpNode | None = None
    kubelet: DraKubeletDouble | None = None
    try:
        node = await start_dp_node(api, "node-a", tmp_path, dra=True)
        assert node.agent.extended_resource_path == DEVICE_PLUGINS  # no class yet
        plugins = node.kubelet
        await eventually(lambda: plugins.allocatable(il) == 3 and plugins.allocatable(cl) == 1,
                         within=10, what="both plugins offer")  # fmt: skip
        for pod, resource in (("il-pod", il), ("cl-pod", cl)):
            admitted = await plugins.admit_pod("default", pod, [("c", {resource: 1})])
            assert admitted.error is None, admitted.error
        held = sorted(v for v in api_instances(api)["cam-8120fe"].device_usage.values() if v)
        assert held == ["C:cam-0:node-a", "node-a"]

        api.create(configuration_class(ObjectKey("default", "cam")))
        api.create(instance_class(ObjectKey("default", "cam"), "cam-8120fe"))
        await eventually(lambda: node is not None and node.agent.extended_resource_path == DRA,
                         within=10, what="the agent on DRA")  # fmt: skip
        await eventually(lambda: node is not None and set(node.plugins.holding_plugins) == {il, cl}
                         and plugins.devices(il) == {} and plugins.devices(cl) == {},
                         within=10, what="both names held, offering nothing")  # fmt: skip
        assert node.plugins.serving_endpoints() == []
        assert node.agent.allocated_claims is None  # no plugin offers a slot: no following

        # the scheduler sees allocatable 0: a new pod's limit goes through DRA
        kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
        await kubelet.start()
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        post_node_status(api, "node-a", plugins)
        create_pod(api, "dra-pod", {il: "1"})
        claim = schedule_extended_resources(api, "default", "dra-pod", "node-a")
        assert claim is not None
        await kubelet.prepare_pod(api.get("pods", "dra-pod", "default") or {})
        dra_slot = f"D:{claim['metadata']['uid']}:node-a"

        for pod in ("il-pod", "cl-pod"):
            assert await plugins.delete_pod("default", pod)
        await eventually(
            lambda: (
                sorted(v for v in api_instances(api)["cam-8120fe"].device_usage.values() if v)
                == [dra_slot]
            ),
            within=30,
            what="both device-plugin slots freed, the claim's kept",
        )
        await eventually(lambda: node is not None and not node.plugins.holding_plugins
                         and plugins.endpoint_stopped(il) and plugins.endpoint_stopped(cl),
                         within=10, what="the holding plugins gone")  # fmt: skip
    finally:
        if kubelet is not None:
            await kubelet.stop()
        if node is not None:
            await node.stop()
