"""The Nodes an agent follows (issue 39.1, 39.4): its own and those its shared Instances list,
one ``fieldSelector metadata.name=<node>`` watch each; whether each serves, told to the
listeners on each change of it (not on every status heartbeat)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.kube import make_kube_client
from agent.node.followed_nodes import FollowedNodes
from tests.controller.conftest import add_node, eventually, set_ready
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def test_standing_of_this_node_and_of_the_nodes_it_shares_with(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    add_node(api, "node-a")
    add_node(api, "node-b")
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    nodes = FollowedNodes(client, "node-a")
    changes: list[frozenset[str]] = []
    nodes.listeners.append(lambda: changes.append(nodes.unserving()))
    try:
        nodes.start()
        await eventually(lambda: nodes.known("node-a"), "own Node read")
        assert nodes.may_join() and nodes.unserving() == frozenset()
        nodes.want({"node-b", "node-gone"})
        await eventually(lambda: nodes.known("node-b"), "node-b read")
        # an Instance lists node-gone but its Node is not there: deleted, it does not serve
        await eventually(lambda: nodes.unserving() == {"node-gone"}, "node-gone unserving")
        set_ready(api, "node-b", False)
        await eventually(lambda: nodes.unserving() == {"node-b", "node-gone"}, "node-b down")
        set_ready(api, "node-b", False)  # a heartbeat that changes nothing: no listener call
        set_ready(api, "node-a", False)
        await eventually(lambda: not nodes.may_join(), "own Node NotReady")
        set_ready(api, "node-a", True)
        await eventually(lambda: nodes.may_join(), "own Node Ready again")
        distinct = [c for i, c in enumerate(changes) if i == 0 or changes[i - 1] != c]
        assert distinct == [
            frozenset(),  # the first reads
            frozenset({"node-gone"}),
            frozenset({"node-b", "node-gone"}),
            frozenset({"node-a", "node-b", "node-gone"}),
            frozenset({"node-b", "node-gone"}),
        ]
        assert len(changes) == 6  # a first read each (3), then one call per change of standing
        nodes.want(())  # no shared Instance lists them any more: forgotten
        assert nodes.unserving() == frozenset()
        reads = [r for r in api.requests_for(resource="nodes") if r.info.verb in ("list", "watch")]
        assert reads and all(r.query.get("fieldSelector", "").startswith("metadata.name=")
                             for r in reads)  # fmt: skip
    finally:
        await nodes.close()
        await client.close()


async def test_an_unregistered_own_node_or_no_rbac_counts_as_serving(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    nodes = FollowedNodes(client, "node-a")
    try:
        nodes.start()
        await eventually(lambda: nodes.ready.is_set(), "first read done")
        assert nodes.may_join() and not nodes.known("node-a")  # not registered yet: as before
        add_node(api, "node-a", ready=False)
        await eventually(lambda: not nodes.may_join(), "registered NotReady")
    finally:
        await nodes.close()
    api.fail(403, verb="list", resource="nodes")
    refused = FollowedNodes(client, "node-a")
    try:
        refused.start()
        await eventually(lambda: refused.refused, "refused")
        assert refused.may_join() and refused.unserving() == frozenset()
    finally:
        await refused.close()
        await client.close()
