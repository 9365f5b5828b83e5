"""``akri status`` and the per-name paths (issue 33.4 follow-up): kubelet keeps the ``akri.sh/*``
resources of a device plugin that went away at allocatable 0 until it restarts, so on a node
that serves a name through DRA that is no sign of an unhealthy device; and ``kubectl exec -n
akri ds/akri-agent -- akri status`` (the README's) works with the agent's own ServiceAccount,
which may get Nodes but not list them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.instance import Instance
from agent.node.dra.extended import observed_paths, paths_table
from agent.node.status import cluster_offline
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS
from tests.node.dra.test_claim_status import agent_rules
from tests.node.test_cluster_status import akri

AGENT = "system:serviceaccount:akri:akri-agent"
SLICES = "resourceslices.resource.k8s.io"


def instance(name: str, *nodes: str) -> Instance:
    return Instance(
        name=name,
        configuration_name="cam",
        capacity=2,
        shared=len(nodes) > 1,
        nodes=nodes,
        device_usage={f"{name}-0": "", f"{name}-1": ""},
    )


def node(name: str, resources: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """A Node whose kubelet shows ``resource: (capacity, allocatable)``."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {
            "capacity": {r: str(c) for r, (c, _) in resources.items()},
            "allocatable": {r: str(a) for r, (_, a) in resources.items()},
            "nodeInfo": {"containerRuntimeVersion": "containerd://2.1.0"},
        },
    }


def local_slice(name: str, mode: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"akri.sh-{name}", "labels": {"akri.sh/extended-resources": mode}},
        "spec": {
            "driver": "akri.sh",
            "nodeName": name,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
        },
    }


# node-a moved from device plugins to DRA: kubelet keeps its old resources at allocatable 0;
# it still serves the device it shares with node-b (device plugins) through its plugin
OWN_A = instance("cam-aaaaaa", "node-a")
SHARED = instance("cam-ababab", "node-a", "node-b")
OWN_B = instance("cam-bbbbbb", "node-b")
NODES = [
    node(
        "node-a",
        {"akri.sh/cam-aaaaaa": (2, 0), "akri.sh/cam-ababab": (2, 2), "akri.sh/cam": (4, 0)},
    ),
    node(
        "node-b",
        {"akri.sh/cam-ababab": (2, 2), "akri.sh/cam-bbbbbb": (2, 0), "akri.sh/cam": (4, 2)},
    ),
]
SLICE_OBJECTS = [local_slice("node-a", "dra"), local_slice("node-b", "device-plugins")]


def test_a_name_served_through_dra_is_not_unhealthy_at_allocatable_0() -> None:
    found = cluster_offline([OWN_A, SHARED, OWN_B], NODES, SLICE_OBJECTS)
    # node-a serves akri.sh/cam-aaaaaa through DRA: its stale resource says nothing; node-b
    # serves akri.sh/cam-bbbbbb through its plugin, which counts no slot healthy
    assert found == {OWN_B.key: ["unhealthy (node-b, kubelet)"]}
    # without node-a's label (an older agent, or not said yet): the check stays
    assert cluster_offline([OWN_A], NODES, []) == {OWN_A.key: ["unhealthy (node-a, kubelet)"]}


def test_the_table_says_which_names_a_dra_node_serves_through_plugins() -> None:
    paths = observed_paths(NODES, SLICE_OBJECTS)
    assert paths == {"node-a": "dra", "node-b": "device-plugins"}
    assert paths.plugin_names == {"node-a": ["akri.sh/cam-ababab"]}
    table = paths_table(paths)
    assert "node-a  DRA; device plugins for akri.sh/cam-ababab" in table
    assert "node-b  device plugins" in table


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def without_listing_nodes(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An older install's agent rules: Nodes get only (before the agent followed its Node)."""
    return [
        {**rule, "verbs": ["get"]} if rule.get("resources") == ["nodes"] else rule for rule in rules
    ]


@pytest.mark.parametrize("lists_nodes", [True, False], ids=["rbac.yaml", "older-rbac"])
async def test_status_as_the_agents_service_account(
    api: ApiServerDouble, tmp_path: Path, lists_nodes: bool
) -> None:
    """What ``kubectl exec -n akri ds/akri-agent -- akri status`` runs as: the agent's
    ServiceAccount with deploy/base/rbac.yaml (Nodes: get, list and watch; Events: create
    only), and with an older install's rules (Nodes: get only)."""
    rules = agent_rules() if lists_nodes else without_listing_nodes(agent_rules())
    api.add_user("agent-a", AGENT, rules, node="node-a")
    for obj in NODES:
        api.create({k: v for k, v in obj.items() if k != "status"})
        stored = api.get("nodes", obj["metadata"]["name"]) or {}
        api.store.update(
            api.resource("nodes"), "v1", None, obj["metadata"]["name"],
            {**stored, "status": obj["status"]}, subresource="status",
        )  # fmt: skip
    api.create(node("node-z", {}))  # a node no Instance or slice names: not read
    for item in SLICE_OBJECTS:
        api.create(item)
    api.create(
        {"apiVersion": "akri.sh/v0", "kind": "Configuration",
         "metadata": {"name": "cam", "namespace": "default"},
         "spec": {"discoveryHandler": {"name": "debugEcho", "discoveryDetails": ""},
                  "capacity": 2}}
    )  # fmt: skip
    for each in (OWN_A, SHARED, OWN_B):
        api.create(each.to_dict())
    kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig", token="agent-a"))
    api.clear_requests()
    code, out, err = await akri("status", "--kubeconfig", kubeconfig)
    assert code == 0, err
    assert "not readable" not in out
    assert "node-a  DRA; device plugins for akri.sh/cam-ababab" in out
    assert "node-b  device plugins" in out and "node-z" not in out
    assert "unhealthy (node-a, kubelet)" not in out and "unhealthy (node-b, kubelet)" in out
    listed = [r.status for r in api.requests_for(verb="list", resource="nodes")]
    got = sorted(r.info.name for r in api.requests_for(verb="get", resource="nodes"))
    if lists_nodes:
        assert (listed, got) == ([200], [])
    else:  # it listed what it may and got the Nodes it needs one by one
        assert (listed, got) == ([403], ["node-a", "node-b"])
        assert {r.status for r in api.requests_for(verb="get", resource="nodes")} == {200}
    code, out, err = await akri("status", "--kubeconfig", kubeconfig, "-o", "json")
    assert code == 0, err
    body = json.loads(out)
    assert body["extendedResourcePaths"] == {"node-a": "dra", "node-b": "device-plugins"}
    assert body["extendedResourcesThroughDevicePlugins"] == {"node-a": ["akri.sh/cam-ababab"]}
    assert body["offline"] == {"default/cam-bbbbbb": ["unhealthy (node-b, kubelet)"]}
