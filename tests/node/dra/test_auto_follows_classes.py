"""``--extended-resources auto`` converges without a restart (issue 33.4, seen on the real
cluster): installed in the README's order, the agent starts before akri controller has written
any DeviceClass, takes device plugins, and used to stay there until restarted while pods
created right away could be served through DRA claims. It now follows the DeviceClasses and
moves to DRA in place once one carries ``extendedResourceName``, keeping every held slot, and
says so as the choice at the start does (log, Event on the Node, metric, slice label)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.deviceclasses import configuration_class, instance_class
from agent.core.kube import make_kube_client
from agent.core.model.keys import ObjectKey
from agent.node.dra.extended import DEVICE_PLUGINS, DRA, follow_device_classes
from agent.node.dra.slices import PATH_LABEL
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import schedule_extended_resources
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.harness.node_pods import post_node_status
from tests.node.dra.test_claim_status import agent_rules
from tests.node.dra.test_dra_extended_resources import create_pod
from tests.node.dra.test_name_paths import slot_attributes

CAM = ObjectKey("default", "cam")
SLICES = "resourceslices.resource.k8s.io"
AGENT = "system:serviceaccount:akri:akri-agent"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def node_object(api: ApiServerDouble) -> None:
    api.create(
        {"apiVersion": "v1", "kind": "Node",
         "metadata": {"name": "node-a", "labels": {"kubernetes.io/hostname": "node-a"}}}
    )  # fmt: skip
    node = api.get("nodes", "node-a") or {}
    info = {"kubeletVersion": "v1.36.2", "containerRuntimeVersion": "containerd://2.1.0"}
    api.store.update(
        api.resource("nodes"), "v1", None, "node-a", {**node, "status": {"nodeInfo": info}},
        subresource="status",
    )  # fmt: skip


def path_events(api: ApiServerDouble) -> list[dict[str, Any]]:
    events = [e for e in api.list("events") if e["reason"] == "ExtendedResourcePath"]
    return sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"]))


async def test_auto_moves_to_dra_once_the_classes_appear_keeping_held_slots(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    node_object(api)
    api.add_user("agent-a", AGENT, agent_rules(), node="node-a")  # deploy/base's RBAC
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node: DpNode | None = None
    kubelet: DraKubeletDouble | None = None
    try:
        # the README's order: the agent starts before the controller wrote any class
        node = await start_dp_node(api, "node-a", tmp_path, dra=True, token="agent-a")
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        assert "no DeviceClass with an extendedResourceName yet" in (
            node.agent.extended_resource_reason
        )
        il = "akri.sh/cam-8120fe"
        await eventually(lambda: node is not None and node.kubelet.allocatable(il) == 2,
                         within=10, what="the plugin offers both slots")  # fmt: skip
        admitted = await node.kubelet.admit_pod("default", "dp-pod", [("c", {il: 1})])
        assert admitted.error is None
        held = dict(api_instances(api)["cam-8120fe"].device_usage)
        assert sorted(held.values()) == ["", "node-a"]

        # akri controller writes the classes: the agent moves to DRA, no restart
        api.create(configuration_class(CAM))
        api.create(instance_class(CAM, "cam-8120fe"))
        await eventually(lambda: node is not None and node.agent.extended_resource_path == DRA,
                         within=10, what="the agent on DRA")  # fmt: skip
        assert "switched from device-plugins without a restart" in caplog.text
        await eventually(lambda: len(path_events(api)) == 2, within=10, what="a second Event")
        assert "on node node-a: DRA" in path_events(api)[-1]["message"]
        metrics = node.agent.metrics_text().decode()
        assert 'akri_extended_resource_path{path="dra"} 1.0' in metrics
        await eventually(lambda: node is not None and node.kubelet.allocatable(il) == 0
                         and node.kubelet.allocatable("akri.sh/cam") == 0,
                         within=10, what="its plugins gone")  # fmt: skip
        await eventually(
            lambda: {s["metadata"]["labels"].get(PATH_LABEL) for s in api.list(SLICES)
                     if s["spec"].get("nodeName") == "node-a"} == {DRA}
            and slot_attributes(api, "cam-8120fe") == {(True, True)},
            within=10, what="its slices say DRA, its free slot in the classes",
        )  # fmt: skip
        await eventually(lambda: node is not None and node.agent.allocated_claims is None,
                         within=10, what="no plugin left: claims no longer followed")  # fmt: skip
        assert api_instances(api)["cam-8120fe"].device_usage == held  # the pod keeps its slot

        # a new pod's limit goes through DRA (kubelet keeps the name at allocatable 0)
        kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
        await kubelet.start()
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        post_node_status(api, "node-a", node.kubelet)
        create_pod(api, "dra-pod", {il: "1"})
        claim = schedule_extended_resources(api, "default", "dra-pod", "node-a")
        assert claim is not None
        await kubelet.prepare_pod(api.get("pods", "dra-pod", "default") or {})
        uid = claim["metadata"]["uid"]
        usage = api_instances(api)["cam-8120fe"].device_usage
        assert sorted(usage.values()) == sorted(["node-a", f"D:{uid}:node-a"])
        # everything it asked for, deploy/base/rbac.yaml allowed
        assert [r.status for r in api.requests if r.status in (401, 403)] == []
    finally:
        if kubelet is not None:
            await kubelet.stop()
        if node is not None:
            await node.stop()


async def test_without_watch_the_classes_are_listed_again(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """An older install's RBAC (``deviceclasses``: list only): the agent lists them again
    every ``poll`` seconds instead of watching."""
    rules = [r for r in agent_rules() if "deviceclasses" not in r["resources"]]
    rules.append({"apiGroups": ["resource.k8s.io"], "resources": ["deviceclasses"],
                  "verbs": ["list"]})  # fmt: skip
    api.add_user("old", AGENT, rules, node="node-a")
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig", token="old")))
    seen: list[int] = []

    def found(classes: list[Any]) -> bool:
        seen.append(len(classes))
        return any((c.get("spec") or {}).get("extendedResourceName") for c in classes)

    try:
        following = asyncio.create_task(follow_device_classes(client, found, poll=0.1))
        await eventually(lambda: len(seen) >= 1, within=10, what="the first list")
        foreign = {**configuration_class(ObjectKey("default", "other")),
                   "metadata": {"name": "theirs", "labels": {"team": "x"}}}  # fmt: skip
        api.create(foreign)  # not ours (no managed-by label): not listed
        api.create(configuration_class(CAM))
        await asyncio.wait_for(following, 10)
        assert seen[-1] == 1
        assert {r.status for r in api.requests_for(verb="watch", resource="deviceclasses")} == {403}
    finally:
        await client.close()
