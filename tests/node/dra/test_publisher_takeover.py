"""Issue 39.4: a shared pool outlives its publisher. One node publishes a shared device's
ResourceSlice pool (the first of its serving nodes); when that node's Node goes NotReady —
its kubelet dead, or the node cut off — another serving node takes the pool over within
moments, rewriting the slices in place without the NotReady node, and what it advertises
follows the Instance from then on (a slot taken through a device plugin leaves the pool).
Before, the pool stayed as the old publisher last wrote it until the controller's dead-node
cleanup (300 s by default). The agents watch only the Nodes their shared Instances list."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.controller.conftest import (
    add_node,
    more_passes,
    running_controller,
    set_ready,
    set_status,
)
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_e2e import SLICES

WITHIN = 20.0  # seconds: generous bound for a loaded CI machine


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server
    assert server.internal_errors == []


def _pool(api: ApiServerDouble, name: str) -> list[dict[str, Any]]:
    return [s for s in api.list(SLICES) if s["spec"]["pool"]["name"] == name]


def _selected(obj: dict[str, Any]) -> list[str]:
    (term,) = obj["spec"]["nodeSelector"]["nodeSelectorTerms"]
    (requirement,) = term["matchExpressions"]
    return list(requirement["values"])


def _devices(objs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["name"] for o in objs for d in o["spec"].get("devices") or [])


def _selects(api: ApiServerDouble, name: str, nodes: list[str]) -> bool:
    objs = _pool(api, name)
    return len(objs) == 1 and _selected(objs[0]) == nodes


async def _stop(nodes: list[DpNode]) -> None:
    for node in nodes:
        await node.stop()


async def test_a_pool_is_taken_over_when_its_publishers_node_goes_not_ready(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    nodes = [
        await start_dp_node(api, "node-a", tmp_path, dra=True),
        await start_dp_node(api, "node-b", tmp_path, dra=True),
    ]
    node_b = nodes[1]
    try:
        await eventually(
            lambda: (
                [sorted(i.nodes) for i in api_instances(api).values()] == [["node-a", "node-b"]]
            ),
            WITHIN,
            "one shared Instance on both nodes",
        )
        (name,) = api_instances(api)
        await eventually(lambda: _selects(api, name, ["node-a", "node-b"]), WITHIN, "pool")
        (before,) = _pool(api, name)
        assert len(_devices([before])) == 2
        # node-a's kubelet stops posting status (its agent still runs: a partition as the
        # control plane sees it): node-b publishes the pool, node-a's agent leaves it alone
        set_ready(api, "node-a", False)
        await eventually(
            lambda: _selects(api, name, ["node-b"]), WITHIN, "node-b took the pool over"
        )
        (after,) = _pool(api, name)
        assert after["metadata"]["name"] == before["metadata"]["name"]  # rewritten in place
        generation = after["spec"]["pool"]["generation"]
        assert generation > before["spec"]["pool"]["generation"]
        # a slot taken through node-b's device plugin leaves the pool node-b now publishes
        resource = f"akri.sh/{name}"
        await node_b.kubelet.wait_registered(resource, timeout=WITHIN)
        await eventually(lambda: node_b.kubelet.allocatable(resource) == 2, WITHIN, "offered")
        admitted = await node_b.kubelet.admit_pod("apps", "cam-app", [("app", {resource: 1})])
        assert admitted.admitted
        await eventually(
            lambda: len(_devices(_pool(api, name))) == 1 and _selects(api, name, ["node-b"]),
            WITHIN,
            "the taken slot no longer advertised",
        )
        # node-a Ready again: it is the first node again and takes the pool back in place
        set_ready(api, "node-a", True)
        await eventually(
            lambda: (
                _selects(api, name, ["node-a", "node-b"]) and len(_devices(_pool(api, name))) == 1
            ),
            WITHIN,
            "node-a publishes it again",
        )
        # invariant 11: each agent reads only the Nodes it needs, one by name each
        reads = [r for r in api.requests_for(resource="nodes") if r.info.verb in ("list", "watch")]
        assert reads and all(
            r.query.get("fieldSelector", "").startswith("metadata.name=") for r in reads
        )
    finally:
        await _stop(nodes)


# -- the publisher's agent goes while its Node stays Ready ------------------------------------
NS = "akri"
AGENT_LABELS = {"app.kubernetes.io/name": "akri-agent", "app.kubernetes.io/part-of": "akri"}


def _agent_daemonset(api: ApiServerDouble) -> dict[str, Any]:
    selector = {"matchLabels": {"app.kubernetes.io/name": "akri-agent"}}
    return api.create(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "akri-agent", "namespace": NS},
            "spec": {"selector": selector, "template": {"metadata": {"labels": AGENT_LABELS}}},
        }
    )


def _agent_pod(
    api: ApiServerDouble, daemonset: dict[str, Any], node: str, name: str, *, ready: bool
) -> None:
    """An agent Pod of ``daemonset`` on ``node`` (with kubelet's finalizer stand-in, so that a
    delete leaves it terminating, as a running container does), Ready or not."""
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "akri-agent",
             "uid": daemonset["metadata"]["uid"], "controller": True}  # fmt: skip
    metadata = {"name": name, "namespace": NS, "labels": {**AGENT_LABELS,
                "controller-revision-hash": "abc"}, "ownerReferences": [owner],
                "finalizers": ["tests.akri.sh/kubelet"]}  # fmt: skip
    spec = {"nodeName": node, "containers": [{"name": "agent", "image": "a"}]}
    api.create({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
    _set_pod_ready(api, name, ready)


def _set_pod_ready(api: ApiServerDouble, name: str, ready: bool) -> None:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    set_status(api, "pods", name, {"phase": "Running", "conditions": [condition]}, NS)


def _remove_pod(api: ApiServerDouble, name: str) -> None:
    """kubelet's part once the container stopped: the finalizer goes, and the Pod with it."""
    pod = api.get("pods", name, NS)
    assert pod is not None
    pod["metadata"]["finalizers"] = []
    api.apply(pod)


def _writes(nodes: list[DpNode]) -> int:
    return sum(n.publisher.writes for n in nodes if n.publisher is not None)


async def test_a_pool_is_taken_over_when_its_publishers_agent_goes(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 39.4, the agent half: node-a's Node stays Ready while its agent is not there —
    its Pod not Ready (a stuck or starting agent), being deleted (a rollout, an eviction) or
    gone. node-b takes the pool over in place, a slot taken meanwhile through node-b's
    device plugin is not advertised, and node-a takes it back once its agent is Ready again;
    one pool write per change of publisher, and the agents read only their peers' agent
    Pods, by label and node."""
    for name in ("node-a", "node-b"):
        add_node(api, name)
    daemonset = _agent_daemonset(api)
    _agent_pod(api, daemonset, "node-a", "akri-agent-a", ready=True)
    _agent_pod(api, daemonset, "node-b", "akri-agent-b", ready=True)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    nodes = [
        await start_dp_node(api, "node-a", tmp_path, dra=True,
                            pod_environ={"POD_NAME": "akri-agent-a", "POD_NAMESPACE": NS}),
        await start_dp_node(api, "node-b", tmp_path, dra=True,
                            pod_environ={"POD_NAME": "akri-agent-b", "POD_NAMESPACE": NS}),
    ]  # fmt: skip
    node_b = nodes[1]
    try:
        await eventually(
            lambda: (
                [sorted(i.nodes) for i in api_instances(api).values()] == [["node-a", "node-b"]]
            ),
            WITHIN,
            "one shared Instance on both nodes",
        )
        (name,) = api_instances(api)
        await eventually(lambda: _selects(api, name, ["node-a", "node-b"]), WITHIN, "pool")
        (before,) = _pool(api, name)
        writes = _writes(nodes)
        # node-a's agent Pod is no longer Ready (its readiness probe fails: a stuck agent)
        _set_pod_ready(api, "akri-agent-a", False)
        await eventually(lambda: _selects(api, name, ["node-b"]), WITHIN, "node-b took over")
        (after,) = _pool(api, name)
        assert after["metadata"]["name"] == before["metadata"]["name"]  # rewritten in place
        assert after["spec"]["pool"]["generation"] > before["spec"]["pool"]["generation"]
        # a slot taken through node-b's device plugin leaves the pool node-b now publishes
        resource = f"akri.sh/{name}"
        await node_b.kubelet.wait_registered(resource, timeout=WITHIN)
        await eventually(lambda: node_b.kubelet.allocatable(resource) == 2, WITHIN, "offered")
        admitted = await node_b.kubelet.admit_pod("apps", "cam-app", [("app", {resource: 1})])
        assert admitted.admitted
        await eventually(
            lambda: len(_devices(_pool(api, name))) == 1 and _selects(api, name, ["node-b"]),
            WITHIN,
            "the taken slot no longer advertised",
        )
        # node-a's agent Ready again: node-a is the first node again and takes the pool back
        _set_pod_ready(api, "akri-agent-a", True)
        await eventually(
            lambda: (
                _selects(api, name, ["node-a", "node-b"]) and len(_devices(_pool(api, name))) == 1
            ),
            WITHIN,
            "node-a publishes it again",
        )
        # a rollout: node-a's agent Pod deleted (terminating while the old agent stops), gone,
        # and its successor Ready a moment later
        api.delete("pods", "akri-agent-a", NS)
        await eventually(lambda: _selects(api, name, ["node-b"]), WITHIN, "taken over again")
        _remove_pod(api, "akri-agent-a")
        _agent_pod(api, daemonset, "node-a", "akri-agent-a2", ready=False)
        _set_pod_ready(api, "akri-agent-a2", True)
        await eventually(
            lambda: _selects(api, name, ["node-a", "node-b"]), WITHIN, "node-a back after it"
        )
        (last,) = _pool(api, name)
        assert last["metadata"]["name"] == before["metadata"]["name"]
        assert len(_devices([last])) == 1
        # five changes of the pool (taken over, the taken slot, back, taken over, back): a
        # write each, and a few more at most where the two nodes' views crossed — no storm
        assert _writes(nodes) - writes <= 10, _writes(nodes) - writes
        # invariant 11: each agent reads its own Pod once, then only agent Pods by label
        # and node
        reads = [r for r in api.requests_for(resource="pods") if r.info.verb in ("list", "watch")]
        assert reads and all(
            r.query.get("labelSelector") == "app.kubernetes.io/name=akri-agent"
            and r.query.get("fieldSelector", "").startswith("spec.nodeName=")
            for r in reads
        )
    finally:
        await _stop(nodes)


# -- what each agent follows: the nodes before it up to the first that serves ----------------
def _lists_of(api: ApiServerDouble, resource: str, selector: str) -> int:
    """List requests for ``resource`` whose fieldSelector is ``selector``."""
    return sum(
        1
        for r in api.requests_for(verb="list", resource=resource)
        if r.query.get("fieldSelector") == selector
    )


async def test_each_node_follows_the_node_before_it_and_takeover_walks_back(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Four nodes share a device node-a found first, joining in turn. Each follows the Node
    and agent Pod of the node just before it (node-b node-a's, node-c node-b's, node-d
    node-c's), the publisher node-a none. When node-a and then node-b go NotReady, node-b
    takes the pool over, then node-c walks back to node-a and publishes, in place, without
    either. Before, every node followed every other: each Node and agent Pod was listed by
    all four agents (quadratic in the nodes of a pool)."""
    names = ("node-a", "node-b", "node-c", "node-d")
    for name in names:
        add_node(api, name)
    daemonset = _agent_daemonset(api)
    for name in names:
        _agent_pod(api, daemonset, name, f"akri-agent-{name[-1]}", ready=True)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    nodes: list[DpNode] = []
    try:
        for index, node in enumerate(names):
            environ = {"POD_NAME": f"akri-agent-{node[-1]}", "POD_NAMESPACE": NS}
            nodes.append(await start_dp_node(api, node, tmp_path, dra=True, pod_environ=environ))
            joined = sorted(names[: index + 1])
            await eventually(
                lambda joined=joined: (
                    [sorted(i.nodes) for i in api_instances(api).values()] == [joined]
                ),
                WITHIN,
                f"{node} joined",
            )
        (name,) = api_instances(api)
        await eventually(lambda: _selects(api, name, list(names)), WITHIN, "pool of all four")

        def counts() -> dict[str, tuple[int, int]]:
            return {
                n: (
                    _lists_of(api, "nodes", f"metadata.name={n}"),
                    _lists_of(api, "pods", f"spec.nodeName={n}"),
                )
                for n in names
            }

        # each Node and agent Pod by its own agent (the Node twice: its extended-resource
        # path too, agent/node/dra/extended.py) and by the next node's; node-d's by no other
        expected = {"node-a": (3, 2), "node-b": (3, 2), "node-c": (3, 2), "node-d": (2, 1)}
        await eventually(lambda: counts() == expected, WITHIN, f"the follows {expected}")
        # node-a NotReady: node-b publishes; then node-b too: node-c walks back and publishes
        set_ready(api, "node-a", False)
        await eventually(
            lambda: _selects(api, name, ["node-b", "node-c", "node-d"]), WITHIN, "node-b"
        )
        set_ready(api, "node-b", False)
        await eventually(lambda: _selects(api, name, ["node-c", "node-d"]), WITHIN, "node-c")
        assert len(_pool(api, name)) == 1  # rewritten in place
        set_ready(api, "node-a", True)
        set_ready(api, "node-b", True)
        await eventually(lambda: _selects(api, name, list(names)), WITHIN, "node-a again")
    finally:
        await _stop(nodes)


async def test_a_pool_whose_only_agent_goes_is_deleted_and_published_again_once_it_is_back(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 39.4: no other node can take the pool over (the device is seen by node-a alone)
    and node-a's agent is not there while its Node stays Ready: akri controller deletes the
    pool, which would go on offering what it last said; node-a's agent does not publish it
    while it is not Ready, and publishes it again once it is — and the controller leaves that
    alone: one delete, one create, no fight."""
    add_node(api, "node-a")
    daemonset = _agent_daemonset(api)
    _agent_pod(api, daemonset, "node-a", "akri-agent-a", ready=True)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    environ = {"POD_NAME": "akri-agent-a", "POD_NAMESPACE": NS}
    node = await start_dp_node(api, "node-a", tmp_path, dra=True, pod_environ=environ)
    try:
        await eventually(lambda: len(api_instances(api)) == 1, WITHIN, "the shared Instance")
        (name,) = api_instances(api)
        await eventually(lambda: _selects(api, name, ["node-a"]), WITHIN, "pool")
        (before,) = _pool(api, name)
        async with running_controller(api, tmp_path) as running:
            reconciler = running.controller.reconciler
            await more_passes(reconciler, 1)
            assert _selects(api, name, ["node-a"])  # its agent is there: the pool stays
            _set_pod_ready(api, "akri-agent-a", False)
            await eventually(lambda: _pool(api, name) == [], WITHIN, "the controller deleted it")
            assert node.publisher is not None
            await node.publisher.sync()
            assert _pool(api, name) == []  # an agent that is not Ready does not publish it
            _set_pod_ready(api, "akri-agent-a", True)
            await eventually(lambda: _selects(api, name, ["node-a"]), WITHIN, "published again")
            await more_passes(reconciler, 2)
            (after,) = _pool(api, name)
            assert after["metadata"]["name"] == before["metadata"]["name"]
            assert reconciler.stats.slices_handed_over == 1  # deleted once, never the new one
    finally:
        await node.stop()
