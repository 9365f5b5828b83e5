"""DRA first, device plugins as the fallback: the per-node path for ``akri.sh/<name>`` limits
(agent/node/dra/extended.py), never both on one node, and a switch that keeps held slots."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.deviceclasses import InstanceRef, configuration_class, desired_device_classes
from agent.core.model.keys import ObjectKey
from agent.node.dra.extended import (
    DEVICE_PLUGINS,
    DRA,
    choose_path,
    kubelet_version,
    observed_paths,
    runtime_cdi,
)
from agent.node.settings import SettingsError
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import schedule_extended_resources
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_claim_status import agent_rules
from tests.node.test_settings import settings

CAM = ObjectKey("default", "cam")
KEPT = [configuration_class(CAM)]
DROPPED = [
    {**KEPT[0], "spec": {k: v for k, v in KEPT[0]["spec"].items() if k != "extendedResourceName"}}
]


@pytest.mark.parametrize(
    ("mode", "dra", "kubelet", "classes", "path", "why"),
    [
        ("device-plugins", True, "v1.36.2", KEPT, DEVICE_PLUGINS, "forced"),
        ("dra", True, "v1.30.0", None, DRA, "forced"),
        ("dra", False, "v1.36.0", KEPT, DEVICE_PLUGINS, "--no-dra"),
        ("auto", True, "v1.36.2", KEPT, DRA, "supports extended resources"),
        ("auto", True, "v1.37.0-alpha.1", KEPT, DRA, "support"),
        ("auto", True, "v1.35.4", KEPT, DEVICE_PLUGINS, "older than 1.36"),
        ("auto", True, None, KEPT, DEVICE_PLUGINS, "unknown"),
        ("auto", True, "v1.36.2", [], DEVICE_PLUGINS, "no DeviceClass"),
        ("auto", True, "v1.36.2", DROPPED, DEVICE_PLUGINS, "drops"),
        ("auto", True, "v1.36.2", None, DEVICE_PLUGINS, "could not be read"),
    ],
)
def test_choose_path(
    mode: str, dra: bool, kubelet: str | None, classes: Any, path: str, why: str
) -> None:
    runtime = runtime_cdi("containerd://2.1.0")  # injects CDI: the other conditions decide
    decision = choose_path(mode, dra_enabled=dra, kubelet=kubelet, classes=classes, runtime=runtime)
    assert decision.path == path and why in decision.reason


def test_kubelet_versions_and_the_flag() -> None:
    assert kubelet_version("v1.36.2") == (1, 36) and kubelet_version("1.9") == (1, 9)
    assert kubelet_version("garbage") is None
    assert settings([], {}).extended_resources == "auto"
    assert settings([], {"AKRI_EXTENDED_RESOURCES": "dra"}).extended_resources == "dra"
    assert settings(["--extended-resources", "device-plugins"], {}).extended_resources == (
        "device-plugins"
    )
    with pytest.raises(SettingsError, match="AKRI_EXTENDED_RESOURCES"):
        settings([], {"AKRI_EXTENDED_RESOURCES": "both"})
    with pytest.raises(SystemExit):  # a bad flag is a usage error (agent/ops/flags.py)
        settings(["--extended-resources", "both"], {})


def test_observed_paths_as_the_scheduler_sees_them() -> None:
    nodes = [
        {"metadata": {"name": "a"}, "status": {"allocatable": {"akri.sh/cam": "2"}}},
        {"metadata": {"name": "b"}, "status": {"allocatable": {"akri.sh/cam": "0"}}},
        {"metadata": {"name": "c"}, "status": {"allocatable": {"cpu": "4"}}},
    ]
    slices = [
        {"spec": {"driver": "akri.sh", "nodeName": "a"}},
        {"spec": {"driver": "akri.sh", "nodeName": "b"}},
    ]
    assert observed_paths(nodes, slices) == {"a": DEVICE_PLUGINS, "b": DRA}


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def node_object(
    api: ApiServerDouble,
    version: str,
    runtime: str = "containerd://2.1.0",
    labels: dict[str, str] | None = None,
) -> None:
    api.create(
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": labels or {}}}
    )
    node = api.get("nodes", "node-a") or {}
    info = {"kubeletVersion": version, "containerRuntimeVersion": runtime}
    api.store.update(
        api.resource("nodes"),
        "v1",
        None,
        "node-a",
        {**node, "status": {"nodeInfo": info}},
        subresource="status",
    )


def install_classes(api: ApiServerDouble) -> None:
    for device_class in desired_device_classes(
        [CAM], [InstanceRef("cam-8120fe", CAM)], lambda k: True
    ).values():
        api.create(device_class)


async def restart_with(node: DpNode, mode: str) -> None:
    await node.restart_agent(dataclasses.replace(node.agent.settings, extended_resources=mode))


async def test_auto_takes_dra_on_a_new_kubelet_and_registers_no_device_plugin(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    node_object(api, "v1.36.2")
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        await eventually(lambda: "cam-8120fe" in api_instances(api))
        assert node.agent.extended_resource_path == DRA
        assert "extended resources (akri.sh/*) on node node-a: DRA" in caplog.text
        metrics = node.agent.metrics_text().decode()
        assert 'akri_extended_resource_path{path="dra"} 1.0' in metrics
        assert 'akri_extended_resource_path{path="device-plugins"} 0.0' in metrics
        # never both: no akri.sh resource is advertised to kubelet on this node
        assert node.kubelet.resources() == []
    finally:
        await node.stop()


async def test_an_old_kubelet_keeps_device_plugins(api: ApiServerDouble, tmp_path: Path) -> None:
    node_object(api, "v1.35.0")
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        await node.kubelet.wait_registered("akri.sh/cam-8120fe")
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        assert "older than 1.36" in node.agent.extended_resource_reason
    finally:
        await node.stop()


async def test_switching_paths_keeps_held_slots(api: ApiServerDouble, tmp_path: Path) -> None:
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    kubelet: DraKubeletDouble | None = None
    try:
        # device plugins (no Node object: kubelet version unknown): a pod takes a slot
        await node.kubelet.wait_registered("akri.sh/cam-8120fe")
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        await eventually(lambda: node.kubelet.allocatable("akri.sh/cam-8120fe") == 2)
        admitted = await node.kubelet.admit_pod("default", "dp-pod", [("c", {"akri.sh/cam": 1})])
        assert admitted.error is None
        held = dict(api_instances(api)["cam-8120fe"].device_usage)
        assert sorted(v for v in held.values() if v) != []

        # switch this node to DRA: its device plugins go, the slot stays held
        await restart_with(node, "dra")
        assert node.agent.extended_resource_path == DRA
        await eventually(
            lambda: node.kubelet.allocatable("akri.sh/cam-8120fe") == 0, what="plugins gone"
        )
        assert api_instances(api)["cam-8120fe"].device_usage == held
        # a new pod's limits are served from the slices: the free slot only
        kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
        await kubelet.start()
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        api.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "dra-pod", "namespace": "default"},
                "spec": {
                    "containers": [{"name": "c", "resources": {"limits": {"akri.sh/cam": "1"}}}]
                },
            }
        )
        free = sorted(slot for slot, value in held.items() if not value)

        def published() -> list[str]:
            return sorted(
                d["name"]
                for s in api.list("resourceslices.resource.k8s.io")
                for d in s["spec"].get("devices") or []
            )

        # the device-plugin slot is not in the slices (only the free one)
        await eventually(lambda: published() == free, within=10, what="the free slot published")
        claim = schedule_extended_resources(api, "default", "dra-pod", "node-a")
        assert claim is not None
        await kubelet.prepare_pod(api.get("pods", "dra-pod", "default") or {})
        usage = api_instances(api)["cam-8120fe"].device_usage
        assert sorted(usage.values()) == sorted(
            [*[v for v in held.values() if v], f"D:{claim['metadata']['uid']}:node-a"]
        )
    finally:
        if kubelet is not None:
            await kubelet.stop()
        await node.stop()


def test_paths_table() -> None:
    from agent.node.dra.extended import paths_table

    table = paths_table({"node-b": DEVICE_PLUGINS, "node-a": DRA})
    assert table.splitlines() == [
        "NODE    EXTENDED RESOURCES",
        "node-a  DRA (ResourceSlices)",
        "node-b  device plugins",
    ]
    assert "not readable" in paths_table(None)


async def test_akri_status_says_which_path_each_node_is_on(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    import json

    from tests.node.test_cluster_status import akri

    for name, allocatable in (("node-a", {}), ("node-b", {"akri.sh/cam": "2"})):
        api.create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
        node = api.get("nodes", name) or {}
        api.store.update(
            api.resource("nodes"), "v1", None, name,
            {**node, "status": {"allocatable": allocatable}}, subresource="status",
        )  # fmt: skip
        api.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": f"akri.sh-{name}"},
                "spec": {
                    "driver": "akri.sh",
                    "nodeName": name,
                    "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                },
            }
        )
    kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig"))
    code, out, err = await akri("status", "--kubeconfig", kubeconfig)
    assert code == 0, err
    assert "node-a  DRA (ResourceSlices)" in out and "node-b  device plugins" in out
    code, out, err = await akri("status", "--kubeconfig", kubeconfig, "-o", "json")
    assert code == 0, err
    assert json.loads(out)["extendedResourcePaths"] == {"node-a": DRA, "node-b": DEVICE_PLUGINS}


def label_node(api: ApiServerDouble, value: str | None) -> None:
    node = api.get("nodes", "node-a") or {}
    labels = dict(node["metadata"].get("labels") or {})
    if value is None:
        labels.pop("akri.sh/runtime-cdi", None)
    else:
        labels["akri.sh/runtime-cdi"] = value
    node["metadata"]["labels"] = labels
    api.store.update(api.resource("nodes"), "v1", None, "node-a", node)


async def test_the_runtime_label_takes_effect_without_a_restart(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """containerd 1.7 (CDI off by default): device plugins. The operator labels the Node
    akri.sh/runtime-cdi=true after the install, as the README says: the agent, following its
    Node, moves to DRA in place (its device plugins go, a slot held through one stays held);
    set to false, it is back on device plugins. Before, both took a restart of the agent."""
    node_object(api, "v1.36.2", runtime="containerd://1.7.24")
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    il = "akri.sh/cam-8120fe"
    try:
        await node.kubelet.wait_registered(il)
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        assert "enable_cdi" in node.agent.extended_resource_reason
        await eventually(lambda: node.kubelet.allocatable(il) == 2, what="offered")
        assert (await node.kubelet.admit_pod("default", "dp-pod", [("c", {il: 1})])).admitted
        held = dict(api_instances(api)["cam-8120fe"].device_usage)

        label_node(api, "true")
        await eventually(lambda: node.agent.extended_resource_path == DRA, within=15, what="on DRA")
        assert "the Node changed after the start" in node.agent.extended_resource_reason
        assert node.agent.runtime_cdi.applies is True
        await eventually(lambda: node.kubelet.allocatable(il) == 0, what="plugins gone")
        assert api_instances(api)["cam-8120fe"].device_usage == held

        label_node(api, "false")
        await eventually(
            lambda: node.agent.extended_resource_path == DEVICE_PLUGINS,
            within=15,
            what="back on device plugins",
        )
        # registered again (kubelet counts the slot its own pod holds as allocatable)
        await eventually(lambda: node.kubelet.allocatable(il) == 2, what="offered again")
        assert api_instances(api)["cam-8120fe"].device_usage == held
        second = await node.kubelet.admit_pod("default", "dp-pod-2", [("c", {il: 1})])
        assert second.admitted, second.message  # the free slot, through the device plugin
        usage = api_instances(api)["cam-8120fe"].device_usage
        taken = {slot: holder for slot, holder in held.items() if holder}
        assert all(usage.values()) and taken.items() <= usage.items()
    finally:
        await node.stop()


@pytest.mark.parametrize("lists_nodes", [True, False], ids=["rbac.yaml", "older-rbac"])
async def test_following_the_node_as_the_agents_service_account(
    api: ApiServerDouble,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    lists_nodes: bool,
) -> None:
    """As the DaemonSet's ServiceAccount: deploy/base/rbac.yaml lets it watch its own Node
    (a label change takes effect at once); an older install's rules (Nodes: get only) are
    said once, and the start's path stays until a restart, as before."""
    caplog.set_level(logging.INFO)
    rules = agent_rules()
    if not lists_nodes:
        rules = [
            {**rule, "verbs": ["get"]} if rule.get("resources") == ["nodes"] else rule
            for rule in rules
        ]
    api.add_user("agent-a", "system:serviceaccount:akri:akri-agent", rules, node="node-a")
    node_object(api, "v1.36.2", runtime="containerd://1.7.24")
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True, token="agent-a")
    try:
        await node.kubelet.wait_registered("akri.sh/cam-8120fe")
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        label_node(api, "true")
        if lists_nodes:
            await eventually(
                lambda: node.agent.extended_resource_path == DRA, within=15, what="on DRA"
            )
            assert "cannot watch Node" not in caplog.text
        else:
            await eventually(
                lambda: "cannot watch Node node-a" in caplog.text, within=15, what="said"
            )
            await asyncio.sleep(0.5)
            assert node.agent.extended_resource_path == DEVICE_PLUGINS
            assert caplog.text.count("cannot watch Node node-a") == 1
    finally:
        await node.stop()


async def test_a_failing_decision_after_a_node_change_is_said_and_changes_nothing(
    api: ApiServerDouble,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug or an odd answer while deciding again is logged; the node keeps its path, the
    follower keeps following, and the agent stops cleanly (the task did not die with it)."""
    import agent.node.dra.path_follower as extended_module  # read_classes, as it calls it

    node_object(api, "v1.36.2", runtime="containerd://1.7.24")
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    calls: list[int] = []

    async def broken(client: Any) -> None:
        calls.append(1)
        raise RuntimeError("boom")

    try:
        await node.kubelet.wait_registered("akri.sh/cam-8120fe")
        monkeypatch.setattr(extended_module, "read_classes", broken)
        label_node(api, "true")
        await eventually(lambda: "after a change of Node node-a failed" in caplog.text, 15)
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        monkeypatch.undo()
        label_node(api, "yes-true")  # another change: followed again, now decided
        await eventually(lambda: len(calls) == 1 and node.agent.runtime_cdi is not None, 5)
        label_node(api, "true")
        await eventually(lambda: node.agent.extended_resource_path == DRA, 15, "on DRA")
    finally:
        await node.stop()
