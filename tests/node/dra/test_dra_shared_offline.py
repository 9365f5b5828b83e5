"""A shared device's DRA pool follows the nodes that see it (issue 33.1): three DRA agents on the
API-server double, one shared debugEcho device every node sees, a 300 s offline grace (the
default for shared devices).

Before, the pool's publisher (the first node) decided alone from its own view: once *it* lost
sight of the device, it tainted the whole pool ``akri.sh/offline:NoSchedule`` for every node —
the device was unschedulable for the whole cluster for up to 5 minutes while two nodes still
saw it — and a node that had lost the device stayed in the pool's ``nodeSelector``. Now each
node records its own offline state in the Instance (``akri.sh/offline.<node>``, applied with
its own field manager: no conflicts), the pool lists only the nodes that see the device, its
first one publishes, and the pool is tainted only when every node is offline.

Each test counts the Instance and ResourceSlice writes and their conflicts (409)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

import pytest

from agent.core.kube import make_kube_client
from agent.core.model.naming import offline_annotation
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.node.app import Agent
from agent.node.discovery.manager import GraceSettings
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_shared_pools import add_nodes, selected, shared_slices, stop_all

NODES = ("node-a", "node-b", "node-c")
GRACE = GraceSettings(local=0, shared=300)


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def start_nodes(api: ApiServerDouble) -> list[DpNode]:
    """The three agents, the device seen by all, the pool selecting all three."""
    add_nodes(api, NODES)
    api.create(debug_echo_configuration("cam", ("cam0",), 2))
    nodes = []
    for name in NODES:
        base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
        (base / "avail").write_text("ONLINE")
        nodes.append(await start_dp_node(api, name, base, dra=True, base=base, grace=GRACE))
    await eventually(lambda: pool(api) == (list(NODES), False), within=20, what="all three")
    return nodes


def pool(api: ApiServerDouble) -> tuple[list[str], bool] | None:
    """The shared pool as the scheduler sees it: (the nodes it selects, whether its devices
    are tainted akri.sh/offline); None unless there is exactly one pool in one slice."""
    pools = shared_slices(api)
    if len(pools) != 1:
        return None
    (objs,) = pools.values()
    if len(objs) != 1:
        return None
    devices = objs[0]["spec"].get("devices") or []
    if not devices:
        return None
    tainted = [
        any(t.get("key") == "akri.sh/offline" for t in d.get("taints") or []) for d in devices
    ]
    if len(set(tainted)) != 1:
        return None  # some devices tainted, others not: never a state we publish
    return selected(objs[0]), tainted[0]


def marked(api: ApiServerDouble) -> list[str]:
    """The nodes whose offline mark the (one) Instance carries."""
    (instance,) = api_instances(api).values()
    return sorted(n for n in NODES if offline_annotation(n) in instance.annotations)


async def answered(api: ApiServerDouble, since: int) -> None:
    """Until every write since request ``since`` has its answer recorded (the double applies a
    write, and shows it, before it answers)."""
    await eventually(
        lambda: all(
            r.status is not None
            for r in api.requests[since:]
            if r.verb in ("create", "update", "patch", "delete")
        ),
        within=30,
        what="every write answered",
    )


def writes(api: ApiServerDouble, resource: str, since: int) -> dict[str, int]:
    """Writes of ``resource`` since request ``since``: successful ones and 409s."""
    done = [
        r
        for r in api.requests[since:]
        if r.info.resource == resource and r.verb in ("create", "update", "patch", "delete")
    ]
    return {
        "ok": sum(1 for r in done if r.status is not None and r.status < 300),
        "conflicts": sum(1 for r in done if r.status == 409),
    }


def set_offline(nodes: Iterable[DpNode], value: bool) -> None:
    for node in nodes:
        node.offline(value)


async def test_the_publisher_losing_the_device_does_not_taint_the_pool(
    api: ApiServerDouble,
) -> None:
    """node-a publishes the pool and loses the device (the others still see it): within
    seconds the pool, untainted, selects node-b and node-c and node-b publishes it; node-a
    stays in the Instance for its grace, marked offline. Back online, the pool selects all
    three again. Before: node-a tainted the whole pool for every node (selector unchanged)."""
    nodes = await start_nodes(api)
    try:
        mark = len(api.requests)
        b_writes = nodes[1].publisher.writes if nodes[1].publisher else 0
        nodes[0].offline(True)
        await eventually(
            lambda: pool(api) == (["node-b", "node-c"], False),
            within=30,
            what="the pool without node-a, untainted",
        )
        assert marked(api) == ["node-a"]
        (instance,) = api_instances(api).values()
        assert sorted(instance.nodes) == list(NODES)  # node-a keeps it for its grace
        # node-b wrote it (the double shows a write before its answer reaches the writer)
        publisher = nodes[1].publisher
        assert publisher is not None
        await eventually(lambda: publisher.writes > b_writes, within=30, what="node-b wrote it")
        nodes[0].offline(False)
        await eventually(
            lambda: pool(api) == (list(NODES), False) and marked(api) == [],
            within=30,
            what="all three again",
        )
        await answered(api, mark)
        instance_writes = writes(api, "instances", mark)
        # node-a's mark, then its removal; nothing else, and no conflict
        assert instance_writes == {"ok": 2, "conflicts": 0}, instance_writes
        slice_writes = writes(api, "resourceslices", mark)
        assert slice_writes["conflicts"] == 0 and slice_writes["ok"] <= 4, slice_writes
        assert api.internal_errors == []
    finally:
        await stop_all(nodes)


async def test_the_pool_is_tainted_only_once_every_node_is_offline(
    api: ApiServerDouble,
) -> None:
    """The device goes offline on node-a, then node-b, then node-c: the pool selects the
    nodes that still see it, untainted, and only when none does lists all three, tainted
    (claims that tolerate the taint can still have it). Then the device comes back on every
    node at once: the pool selects all three, untainted. Each node writes its own mark once
    per transition, and no write conflicts. Before: tainted from node-a's loss on."""
    nodes = await start_nodes(api)
    try:
        mark = len(api.requests)
        steps = [(["node-b", "node-c"], False), (["node-c"], False), (list(NODES), True)]
        for node, expected in zip(nodes, steps, strict=True):
            node.offline(True)
            await eventually(lambda e=expected: pool(api) == e, within=30, what=str(expected))
        assert marked(api) == list(NODES)
        set_offline(nodes, False)
        await eventually(
            lambda: pool(api) == (list(NODES), False) and marked(api) == [],
            within=30,
            what="all three again, untainted",
        )
        await answered(api, mark)
        instance_writes = writes(api, "instances", mark)
        assert instance_writes == {"ok": 6, "conflicts": 0}, instance_writes
        slice_writes = writes(api, "resourceslices", mark)
        assert slice_writes["conflicts"] <= 1 and slice_writes["ok"] <= 8, slice_writes
        assert api.internal_errors == []
    finally:
        await stop_all(nodes)


async def test_a_blinking_device_does_not_make_a_write_storm(api: ApiServerDouble) -> None:
    """The device blinks on the publisher, node-a, 20 times in 4 s: node-a is taken out of
    the pool at the first blink and back in only once it has stayed online for its hold
    (doubling while it blinks), so a few writes follow, not one per blink; then the pool
    settles on all three nodes. Before: the pool was tainted and untainted at every blink
    (~40 slice writes)."""
    nodes = await start_nodes(api)
    try:
        mark = len(api.requests)
        for _ in range(20):
            nodes[0].offline(True)
            await asyncio.sleep(0.1)
            nodes[0].offline(False)
            await asyncio.sleep(0.1)
        await eventually(
            lambda: pool(api) == (list(NODES), False) and marked(api) == [],
            within=20,
            what="settled on all three",
        )
        await answered(api, mark)
        instance_writes = writes(api, "instances", mark)
        slice_writes = writes(api, "resourceslices", mark)
        assert instance_writes["conflicts"] == 0, instance_writes
        assert instance_writes["ok"] <= 8, instance_writes
        assert slice_writes["ok"] <= 10 and slice_writes["conflicts"] <= 2, slice_writes
        assert api.internal_errors == []
    finally:
        await stop_all(nodes)


async def restart(node: DpNode, meanwhile: Callable[[], None] = lambda: None) -> None:
    """Stop ``node``'s agent, do ``meanwhile``, start it again (kubelet and files stay)."""
    settings = node.agent.settings
    await node.agent.stop()
    meanwhile()
    client = make_kube_client(settings.kubeconfig)
    store = KubernetesInstanceStore(client, KubernetesSettings(node.name, request_timeout=5))
    node.agent = Agent(settings, store, freeze_gc=False)
    await node.agent.start()


async def test_a_restarted_agent_keeps_its_mark_while_offline_and_clears_it_when_back(
    api: ApiServerDouble,
) -> None:
    """node-b restarts while its device is offline: its mark stays, untouched (nothing is
    cleared before its handler has reported, nor written again); node-a's device comes back
    while its agent is down: its stale mark goes once the restarted handler reports the
    device, and the pool takes node-a back."""
    nodes = await start_nodes(api)
    try:
        nodes[0].offline(True)
        nodes[1].offline(True)
        await eventually(lambda: pool(api) == (["node-c"], False), within=30, what="node-c")
        await eventually(lambda: marked(api) == ["node-a", "node-b"], within=30, what="marks")
        mark = len(api.requests)
        await restart(nodes[1])
        runners = nodes[1].discovery.runners
        await eventually(
            lambda: bool(runners) and all(r.reconciled.is_set() for r in runners.values()),
            within=30,
            what="node-b's handler reported",
        )
        await asyncio.sleep(1.0)  # a few passes of its offline marks
        assert marked(api) == ["node-a", "node-b"]
        await answered(api, mark)
        assert writes(api, "instances", mark) == {"ok": 0, "conflicts": 0}
        await restart(nodes[0], lambda: nodes[0].offline(False))
        await eventually(
            lambda: pool(api) == (["node-a", "node-c"], False) and marked(api) == ["node-b"],
            within=30,
            what="node-a back after its restart",
        )
        assert api.internal_errors == []
    finally:
        await stop_all(nodes)
