"""Per (node, resource name), not per node (agent/node/dra/name_paths.py, issue 33.4 follow-up):
on a mixed cluster a node on DRA serves through its device plugins exactly the names of devices
it shares with a device-plugin node, through DRA the rest; no slot a node's device plugin offers
for a name matches that name's DeviceClass; a name moves between the paths when the nodes of an
Instance change, and the slots held through the other path stay held."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.deviceclasses import configuration_class, instance_class
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import DRAINING_ANNOTATION
from agent.node.dra.name_paths import (
    DEVICE_PLUGINS,
    DRA,
    NodeNamePaths,
    configuration_dra_nodes,
    configuration_on_dra,
    instance_on_dra,
    slot_eligibility,
)
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import (
    AllocationError,
    class_selector,
    schedule_extended_resources,
)
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.harness.node_pods import post_node_status
from tests.node.dra.test_dra_extended_resources import create_pod

SLICES = "resourceslices.resource.k8s.io"
CAM = ObjectKey("default", "cam")


def inst(name: str, *nodes: str, configuration: str = "cam") -> Instance:
    return Instance(
        name=name,
        configuration_name=configuration,
        capacity=2,
        shared=len(nodes) > 1,
        nodes=nodes,
        device_usage={f"{name}-0": "", f"{name}-1": ""},
    )


# --------------------------------------------------------------------------- the rule, pure

LOCAL_A = inst("cam-aaaaaa", "a")  # a's own device
AB = inst("cam-ababab", "a", "b")  # shared with b (device plugins)
AC = inst("cam-acacac", "a", "c")  # shared with c (DRA)
CD = inst("cam-cdcdcd", "c", "d")
ONLY_C = inst("other-cccccc", "c", "e", configuration="other")
MODES = {"a": DRA, "b": DEVICE_PLUGINS, "c": DRA, "d": DRA, "e": DRA}


def test_an_instance_goes_through_dra_only_when_every_node_of_it_does() -> None:
    assert instance_on_dra(LOCAL_A, MODES) and instance_on_dra(AC, MODES)
    assert not instance_on_dra(AB, MODES)  # b would get the slot through DRA
    assert not instance_on_dra(inst("x-1", "a", "z"), MODES)  # z said nothing: device plugins
    draining = inst("cam-abdrain", "a", "b").evolve(annotations={DRAINING_ANNOTATION: "b"})
    assert instance_on_dra(draining, MODES)  # b only drains it: its pool no longer serves b


def test_the_configuration_name_follows_the_group_of_linked_nodes() -> None:
    everything = [LOCAL_A, AB, AC, CD]
    # a-b (AB), a-c (AC), c-d (CD): one group with b in it: device plugins on all of them
    assert configuration_dra_nodes(everything, MODES) == frozenset()
    for node in "abcd":
        assert not configuration_on_dra(node, everything, MODES)
    # without the device shared with b: the group a, c, d is all on DRA
    rest = [LOCAL_A, AC, CD]
    assert configuration_dra_nodes(rest, MODES) == {"a", "c", "d"}
    # two groups: {a, b} has b, {c, d} does not
    split = [LOCAL_A, AB, CD]
    assert configuration_dra_nodes(split, MODES) == {"c", "d"}
    assert configuration_on_dra("c", split, MODES) and not configuration_on_dra("a", split, MODES)
    # a node on DRA that serves none of the Configuration's Instances is its own group
    assert configuration_on_dra("e", split, MODES)
    assert not configuration_on_dra("b", [LOCAL_A], MODES)  # b is on device plugins


def test_each_slot_says_which_names_it_may_serve() -> None:
    eligibility = slot_eligibility([LOCAL_A, AB, AC, CD, ONLY_C], MODES)
    shown = {i.name: (eligibility(i).instance, eligibility(i).configuration)
             for i in (LOCAL_A, AB, AC, CD, ONLY_C)}  # fmt: skip
    assert shown == {
        # a's own device: akri.sh/<instance> through DRA on a; akri.sh/cam is a device-plugin
        # name on a (a shares cam-ababab with b), so not through DRA
        "cam-aaaaaa": (True, False),
        "cam-ababab": (False, False),
        "cam-acacac": (True, False),
        "cam-cdcdcd": (True, False),  # c is linked to a, a to b
        "other-cccccc": (True, True),  # another Configuration: its own groups
    }
    eligibility = slot_eligibility([LOCAL_A, AC, CD], MODES)
    assert all(eligibility(i).configuration for i in (LOCAL_A, AC, CD))


def test_a_node_on_dra_serves_through_its_plugins_only_the_names_shared_with_plugins() -> None:
    modes = dict(MODES)
    mode = {"a": DRA}
    paths = NodeNamePaths("a", lambda: mode["a"], lambda: {**modes, "a": mode["a"]})
    assert paths.instance_on_plugins(AB) and not paths.instance_on_plugins(AC)
    assert not paths.instance_on_plugins(LOCAL_A)
    assert paths.configuration_on_plugins([LOCAL_A, AB, AC])
    assert not paths.configuration_on_plugins([LOCAL_A, AC])
    assert "shared with b" in paths.why_instance(AB)
    # this node's mode is the one it has now, whatever the publisher has seen of it (the
    # switch of auto: the plugins must not start for a moment before the label follows)
    switching = NodeNamePaths("a", lambda: DRA, lambda: {**modes, "a": DEVICE_PLUGINS})
    assert not switching.instance_on_plugins(LOCAL_A)
    mode["a"] = DEVICE_PLUGINS  # a node on device plugins serves every name through them
    assert all(paths.instance_on_plugins(i) for i in (LOCAL_A, AB, AC))
    assert paths.configuration_on_plugins([LOCAL_A, AC])


def test_no_slot_of_a_device_plugin_name_matches_its_class() -> None:
    """The window: a node serving a name through a device plugin whose resource kubelet has
    not posted yet; the scheduler would take DRA for it there. No slot the node can use
    matches the name's class, for the instance-level and the configuration-level name."""
    from agent.node.dra.slices import desired_pools, extended_eligibility

    everything = [LOCAL_A, AB, AC, CD]
    pools = desired_pools(everything, "a", (), extended_of=extended_eligibility(everything, MODES))
    slice_ = {"spec": {"driver": "akri.sh"}}
    by_config = class_selector(configuration_class(CAM))
    devices = [d for pool in pools for d in pool.devices]
    assert devices and not any(by_config(d, slice_) for d in devices)  # akri.sh/cam: plugins
    for pool in pools:
        for device in pool.devices:
            name = device["attributes"]["instance"]["string"]
            matched = class_selector(instance_class(CAM, name))(device, slice_)
            assert matched == (name != "cam-ababab"), name


# --------------------------------------------------------------------------- on the doubles


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def install_classes(api: ApiServerDouble, *instances: str) -> None:
    api.create(configuration_class(CAM))
    for name in instances:
        api.create(instance_class(CAM, name))


def node_object(api: ApiServerDouble, name: str) -> None:
    api.create(
        {"apiVersion": "v1", "kind": "Node",
         "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}
    )  # fmt: skip


def slot_attributes(api: ApiServerDouble, instance: str) -> set[tuple[bool, bool]]:
    """(extendedResources, configurationExtendedResources) of the published slots."""
    found = set()
    for item in api.list(SLICES):
        for device in item["spec"].get("devices") or []:
            attributes = device["attributes"]
            if attributes["instance"]["string"] == instance:
                found.add(
                    (
                        attributes["extendedResources"]["bool"],
                        attributes["configurationExtendedResources"]["bool"],
                    )
                )
    return found


def pool_nodes(api: ApiServerDouble, pool: str) -> set[str]:
    """The nodes a shared pool's slices select."""
    from agent.node.dra.slices import selected_nodes

    return {
        node
        for item in api.list(SLICES)
        if item["spec"]["pool"]["name"] == pool
        for node in selected_nodes(item["spec"])
    }


def pod(api: ApiServerDouble, name: str, resource: str) -> dict[str, Any]:
    return create_pod(api, name, {resource: "1"})


async def test_a_shared_device_moves_between_the_paths_and_keeps_its_slots(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        node_object(api, name)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    a: DpNode | None = None
    b: DpNode | None = None
    kubelet: DraKubeletDouble | None = None
    try:
        # node-b first: the device is seen by a device-plugin node from the start
        b = await start_dp_node(api, "node-b", tmp_path, dra=True,
                                changes={"extended_resources": DEVICE_PLUGINS})  # fmt: skip
        await eventually(lambda: "cam-8120fe" in api_instances(api), what="the Instance")
        install_classes(api, "cam-8120fe")
        a = await start_dp_node(api, "node-a", tmp_path, dra=True,
                                changes={"extended_resources": DRA})  # fmt: skip
        kubelet = DraKubeletDouble(a.registry_dir, "node-a", api)
        await kubelet.start()
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        both = {"node-a", "node-b"}
        await eventually(lambda: set(api_instances(api)["cam-8120fe"].nodes) == both)

        # the shared device on node-a (DRA): through its device plugins, both names
        await a.kubelet.wait_registered("akri.sh/cam-8120fe")
        await a.kubelet.wait_registered("akri.sh/cam")
        await eventually(lambda: pool_nodes(api, "cam-8120fe") == both, within=10,
                         what="the pool serves both nodes")  # fmt: skip
        assert slot_attributes(api, "cam-8120fe") == {(False, False)}  # out of the classes
        # the window before kubelet posts the resource: the name's class selects no slot
        pod(api, "early", "akri.sh/cam-8120fe")
        with pytest.raises(AllocationError, match="rejected by the selector"):
            schedule_extended_resources(api, "default", "early", "node-a")
        await eventually(lambda: a.kubelet.allocatable("akri.sh/cam-8120fe") == 2, within=10,
                         what="the plugin's devices reach kubelet")  # fmt: skip
        post_node_status(api, "node-a", a.kubelet)
        assert schedule_extended_resources(api, "default", "early", "node-a") is None  # plugin
        admitted = await a.kubelet.admit_pod("default", "early", [("c", {"akri.sh/cam-8120fe": 1})])
        assert admitted.error is None
        assert sorted(api_instances(api)["cam-8120fe"].device_usage.values()) == ["", "node-a"]
        assert a.agent.allocated_claims is not None  # a plugin runs: claims are followed

        # node-b loses the device and leaves the Instance: node-a alone sees it, on DRA —
        # its plugins go, the slots join the classes, the slot its pod holds stays held
        b.offline()
        await eventually(lambda: api_instances(api)["cam-8120fe"].nodes == ("node-a",),
                         what="node-b left")  # fmt: skip
        await eventually(lambda: a.kubelet.allocatable("akri.sh/cam-8120fe") == 0
                         and a.kubelet.allocatable("akri.sh/cam") == 0,
                         within=10, what="node-a's plugins gone")  # fmt: skip
        await eventually(lambda: pool_nodes(api, "cam-8120fe") == {"node-a"}
                         and slot_attributes(api, "cam-8120fe") == {(True, True)},
                         within=10, what="the free slot in the classes")  # fmt: skip
        await eventually(lambda: a.agent.allocated_claims is None, within=10,
                         what="no plugin: claims no longer followed")  # fmt: skip
        assert sorted(api_instances(api)["cam-8120fe"].device_usage.values()) == ["", "node-a"]
        # kubelet keeps the resource with allocatable 0: the scheduler takes DRA
        post_node_status(api, "node-a", a.kubelet)
        pod(api, "later", "akri.sh/cam-8120fe")
        claim = schedule_extended_resources(api, "default", "later", "node-a")
        assert claim is not None
        await kubelet.prepare_pod(api.get("pods", "later", "default") or {})
        uid = claim["metadata"]["uid"]
        usage = sorted(api_instances(api)["cam-8120fe"].device_usage.values())
        assert usage == sorted(["node-a", f"D:{uid}:node-a"])

        # node-b sees it again: the names go back to the device plugins, both slots stay
        b.offline(False)
        await eventually(lambda: set(api_instances(api)["cam-8120fe"].nodes) == both)
        await eventually(lambda: a.kubelet.connected("akri.sh/cam-8120fe"), within=10,
                         what="node-a's plugin again")  # fmt: skip
        assert a.agent.allocated_claims is not None
        # the DRA-held slot stays published (the scheduler's accounting), out of the classes
        await eventually(lambda: slot_attributes(api, "cam-8120fe") == {(False, False)},
                         within=10, what="slots out of the classes again")  # fmt: skip
        assert sorted(api_instances(api)["cam-8120fe"].device_usage.values()) == usage
    finally:
        if kubelet is not None:
            await kubelet.stop()
        for node in (a, b):
            if node is not None:
                await node.stop()
