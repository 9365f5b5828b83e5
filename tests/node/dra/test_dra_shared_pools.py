"""Shared pools follow their nodes on an API server that behaves like the real one (issue 33.1,
issue 36): several DRA agents, shared devices every node sees, nodes joining in a burst and
the pool's publisher changing. The API-server double writes a write's watch events before its
answer (a real API server gives no order; docs/testing-apiserver-double.md), which is what
froze a publisher's view of its slices on the real cluster: its own write echoed early, then
another node's write skipped as "older" for 30 s, while it retried a stale resourceVersion
every 20 ms (hundreds of 409s per phase, issue 36).

Each test checks the end state the scheduler needs — each shared pool in one slice whose
nodeSelector lists exactly the nodes that serve the device — and counts the ResourceSlice
conflicts (409) against the successful writes."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_e2e import SLICES

NODES = ("node-a", "node-b", "node-c")
DEVICES = ("foo0", "foo1")


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def add_nodes(api: ApiServerDouble, names: Iterable[str]) -> None:
    for name in names:  # kubelet registers each Node with its hostname label
        api.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            }
        )


async def offline_dra_node(api: ApiServerDouble, name: str) -> DpNode:
    """A DRA agent whose debugEcho devices are offline until :meth:`DpNode.offline` (False)."""
    base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
    (base / "avail").write_text("OFFLINE")
    return await start_dp_node(api, name, Path(base), dra=True, base=base)


def shared_slices(api: ApiServerDouble) -> dict[str, list[dict[str, Any]]]:
    """The akri.sh slices of shared pools, by pool."""
    pools: dict[str, list[dict[str, Any]]] = {}
    for obj in api.list(SLICES):
        spec = obj["spec"]
        if spec.get("driver") == "akri.sh" and "nodeSelector" in spec:
            pools.setdefault(spec["pool"]["name"], []).append(obj)
    return pools


def selected(obj: dict[str, Any]) -> list[str]:
    (term,) = obj["spec"]["nodeSelector"]["nodeSelectorTerms"]
    (requirement,) = term["matchExpressions"]
    return list(requirement["values"])


def pools_select(api: ApiServerDouble, nodes: Iterable[str]) -> bool:
    """Every shared Instance's pool is one slice selecting exactly ``nodes``, and no other
    shared pool exists."""
    wanted = sorted(nodes)
    instances = {name for name, i in api_instances(api).items() if i.shared}
    pools = shared_slices(api)
    return (
        bool(instances)
        and set(pools) == instances
        and all(len(objs) == 1 and selected(objs[0]) == wanted for objs in pools.values())
    )


def slice_writes(api: ApiServerDouble, since: int = 0) -> dict[str, int]:
    """ResourceSlice writes since request ``since``: successful ones, and 409s."""
    writes = [
        r
        for r in api.requests[since:]
        if r.info.resource == "resourceslices" and r.verb in ("create", "update", "delete")
    ]
    return {
        "ok": sum(1 for r in writes if r.status is not None and r.status < 300),
        "conflicts": sum(1 for r in writes if r.status == 409),
    }


async def stop_all(nodes: Iterable[DpNode]) -> None:
    for node in nodes:
        await node.stop()


async def test_shared_pools_select_every_node_after_a_burst_join(api: ApiServerDouble) -> None:
    """Three agents see two shared devices at the same moment: each pool ends up as one slice
    selecting all three nodes, with at most one conflict per successful slice write. Before
    (on this double, as on the real cluster): a pool kept selecting one or two nodes, or
    the publisher retried a stale version every 20 ms."""
    add_nodes(api, NODES)
    api.create(debug_echo_configuration("cam", DEVICES, 2))
    nodes = [await offline_dra_node(api, name) for name in NODES]
    try:
        mark = len(api.requests)
        for node in nodes:
            node.offline(False)
        await eventually(
            lambda: (
                len(api_instances(api)) == len(DEVICES)
                and all(sorted(i.nodes) == list(NODES) for i in api_instances(api).values())
            ),
            what="every node in every Instance",
        )
        await eventually(
            lambda: pools_select(api, NODES), within=20, what="each pool selects every node"
        )
        counts = slice_writes(api, mark)
        assert counts["conflicts"] <= counts["ok"], counts
        assert api.internal_errors == []
    finally:
        await stop_all(nodes)


async def test_the_pool_follows_when_its_publisher_loses_the_device(
    api: ApiServerDouble,
) -> None:
    """node-a (the first name: the publisher) loses both devices and leaves the Instances:
    node-b takes the pools over in place and they select node-b and node-c; then node-a sees
    them again and takes them back. Every slice stays (no gap) and is never duplicated."""
    add_nodes(api, NODES)
    api.create(debug_echo_configuration("cam", DEVICES, 2))
    nodes = [await offline_dra_node(api, name) for name in NODES]
    try:
        for node in nodes:
            node.offline(False)
        await eventually(lambda: pools_select(api, NODES), within=20, what="all three")
        names = {obj["metadata"]["name"] for objs in shared_slices(api).values() for obj in objs}
        mark = len(api.requests)
        nodes[0].offline(True)
        await eventually(
            lambda: pools_select(api, NODES[1:]), within=20, what="node-b and node-c only"
        )
        nodes[0].offline(False)
        await eventually(lambda: pools_select(api, NODES), within=20, what="all three again")
        kept = {obj["metadata"]["name"] for objs in shared_slices(api).values() for obj in objs}
        assert kept == names  # rewritten in place by each new publisher
        counts = slice_writes(api, mark)
        assert counts["conflicts"] <= counts["ok"], counts
        slice_requests = [r for r in api.requests[mark:] if r.info.resource == "resourceslices"]
        assert [r for r in slice_requests if r.verb == "delete"] == []
    finally:
        await stop_all(nodes)
