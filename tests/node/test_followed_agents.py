"""The agents an agent follows (issue 39.4): the agent Pods of its own node and of the nodes
its shared Instances list, found by its DaemonSet's selector and read one node at a time
(labelSelector + fieldSelector spec.nodeName); whether each node's agent is there (a Pod
Ready and not being deleted). Whatever cannot be read counts as there."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.kube import make_kube_client
from agent.core.model.agent_pods import agent_there, selector_string
from agent.node.followed_agents import FollowedAgents
from tests.controller.conftest import eventually, set_status
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS

NS = "akri"
ENV = {"POD_NAME": "agent-a", "POD_NAMESPACE": NS}
LABELS = {"app.kubernetes.io/name": "akri-agent"}


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def _daemonset(api: ApiServerDouble) -> dict[str, Any]:
    return api.create({"apiVersion": "apps/v1", "kind": "DaemonSet",
                       "metadata": {"name": "akri-agent", "namespace": NS},
                       "spec": {"selector": {"matchLabels": LABELS}}})  # fmt: skip


def _pod(api: ApiServerDouble, name: str, node: str, ready: bool, owner: str | None) -> None:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": {**LABELS, "x": name}}
    if owner is not None:
        reference = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "akri-agent",
                     "uid": owner, "controller": True}  # fmt: skip
        meta["ownerReferences"] = [reference]
    api.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": node}})
    _ready(api, name, ready)


def _ready(api: ApiServerDouble, name: str, ready: bool) -> None:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    set_status(api, "pods", name, {"conditions": [condition]}, NS)


def test_the_rule_and_the_selector() -> None:
    ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    deleting = {**ready, "metadata": {"deletionTimestamp": "2026-11-28T21:00:00Z"}}
    unready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert agent_there([unready, ready]) and not agent_there([deleting, unready])
    assert not agent_there([]) and not agent_there([{}])
    assert selector_string({"matchLabels": {"b": "2", "a": "1"}}) == "a=1,b=2"
    expressions = [{"key": "k", "operator": "In", "values": ["y", "x"]},
                   {"key": "n", "operator": "NotIn", "values": ["z"]},
                   {"key": "e", "operator": "Exists"},
                   {"key": "d", "operator": "DoesNotExist"}]  # fmt: skip
    assert selector_string({"matchExpressions": expressions}) == "k in (x,y),n notin (z),e,!d"
    assert selector_string({}) is None and selector_string(None) is None  # would select all
    assert selector_string({"matchExpressions": [{"key": "k", "operator": "Odd"}]}) is None


async def test_the_agents_of_this_node_and_of_the_nodes_it_shares_with(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    uid = _daemonset(api)["metadata"]["uid"]
    _pod(api, "agent-a", "node-a", True, uid)
    _pod(api, "agent-b", "node-b", True, uid)
    _pod(api, "other", "node-b", True, None)  # another Pod the selector matches: it counts
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    agents = FollowedAgents(client, "node-a")
    changes: list[frozenset[str]] = []
    agents.listeners.append(lambda: changes.append(agents.absent()))
    try:
        agents.start(ENV)
        await eventually(lambda: agents.ready.is_set() and agents.known("node-a"), "own read")
        assert agents.selector == "app.kubernetes.io/name=akri-agent"
        agents.want({"node-b", "node-c"})  # node-c: no agent Pod there (not scheduled)
        await eventually(lambda: agents.absent() == {"node-c"}, "node-c has no agent")
        api.delete("pods", "other", NS)
        _ready(api, "agent-b", False)
        await eventually(lambda: agents.absent() == {"node-c"}, "other still Ready")
        api.delete("pods", "agent-b", NS)
        await eventually(lambda: agents.absent() == {"node-b", "node-c"}, "node-b's agent gone")
        _ready(api, "agent-a", False)
        await eventually(lambda: "node-a" in agents.absent(), "own agent not Ready")
        _ready(api, "agent-a", True)
        await eventually(lambda: agents.absent() == {"node-b", "node-c"}, "own agent back")
        assert changes == [frozenset({"node-c"}), frozenset({"node-b", "node-c"}),
                           frozenset({"node-a", "node-b", "node-c"}),
                           frozenset({"node-b", "node-c"})]  # fmt: skip
        agents.want(())  # no shared Instance lists them any more: forgotten
        assert agents.absent() == frozenset()
        reads = [r for r in api.requests_for(resource="pods") if r.info.verb in ("list", "watch")]
        assert reads and all(
            r.query.get("labelSelector") == "app.kubernetes.io/name=akri-agent"
            and r.query.get("fieldSelector", "").startswith("spec.nodeName=")
            and r.info.namespace == NS
            for r in reads
        )
        assert {r.info.verb for r in api.requests_for(resource="pods")} == {"get", "list", "watch"}
    finally:
        await agents.close()
        await client.close()


@pytest.mark.parametrize("case", ["no pod environment", "no daemonset", "rbac refused"])
async def test_what_cannot_be_read_counts_as_there(
    api: ApiServerDouble, tmp_path: Path, case: str
) -> None:
    uid = _daemonset(api)["metadata"]["uid"]
    _pod(api, "agent-a", "node-a", False, None if case == "no daemonset" else uid)
    if case == "rbac refused":
        api.fail(403, verb="list", resource="pods", times=None)
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    agents = FollowedAgents(client, "node-a", retry=(0.05, 0.1))
    try:
        agents.start({} if case == "no pod environment" else ENV)
        await eventually(lambda: agents.ready.is_set(), "decided")
        agents.want({"node-b"})
        await eventually(lambda: agents.unknown_why is not None, "unknown")
        assert agents.there("node-a") and agents.absent() == frozenset()
        if case == "no pod environment":
            assert api.requests_for(resource="pods") == []  # local mode, a harness: nothing
    finally:
        await agents.close()
        await client.close()
