"""Issue 36: deleting a shared Configuration on many nodes at once, without a write storm.

Its Instances are deleted by Kubernetes' garbage collector (here the API-server double's port of
it) and kept terminating by the ``akri.sh/slots`` finalizer while a slot is held. The nodes do
not leave them one by one, and only one node (the settler: the first of ``nodes``) removes the
finalizer of an Instance that holds nothing; a held slot keeps its Instance until it is freed,
and that release removes the finalizer. Before, every node left every Instance and removed
the finalizer at the same moment: N writes per Instance, all but one of them conflicting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import agent.core.ledger.finalizer as finalizer_module
import agent.node.discovery.retirement as retirement_module
import agent.node.finalizers as settle_module
from agent.core.ledger.decisions import Drain, decide_leave, held_count
from agent.core.ledger.finalizer import SETTLE_STEP, settle_delay
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import SLOTS_FINALIZER
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually

CONFIGURATION = ObjectKey("default", "cam")
A, B = "cam-8120fe", "cam-a19705"  # the Instances of devices foo0 and foo1


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server
    assert server.internal_errors == []


def instance_writes(api: ApiServerDouble, name: str | None = None) -> list[int | None]:
    """Statuses of the Instance writes (not reads) sent since the last ``clear_requests``."""
    return [
        r.status
        for verb in ("update", "patch", "delete")
        for r in api.requests_for(verb=verb, resource="instances", name=name)
    ]


async def answered(api: ApiServerDouble) -> None:
    """Until every recorded Instance request has its answer (the double records the status
    once the response is sent, a moment after the object changed)."""
    await eventually(
        lambda: all(r.status is not None for r in api.requests_for(resource="instances")),
        10,
        "every request answered",
    )


def conflicts(api: ApiServerDouble) -> int:
    return sum(1 for r in api.requests_for(resource="instances") if r.status == 409)


async def start_nodes(
    api: ApiServerDouble, tmp_path: Path, names: list[str], capacity: int = 2
) -> list[DpNode]:
    api.create(debug_echo_configuration("cam", ("foo0", "foo1"), capacity))
    nodes = [await start_dp_node(api, name, tmp_path) for name in names]
    await eventually(
        lambda: (
            {name: sorted(i.nodes) for name, i in api_instances(api).items()}
            == {A: sorted(names), B: sorted(names)}
        ),
        30,
        "every node in both Instances",
    )
    return nodes


def retired(node: DpNode) -> bool:
    """The node is done with the deleted Configuration (or only drains held slots)."""
    retirement = node.discovery.retirements.get(CONFIGURATION)
    return retirement is None or (not retirement.collecting and bool(retirement.draining))


# -- pure ------------------------------------------------------------------------------------


def test_a_terminating_instance_is_not_left_nor_marked() -> None:
    terminating = Instance(
        A,
        "cam",
        2,
        nodes=("node-a", "node-b"),
        shared=True,
        device_usage={f"{A}-0": "node-b", f"{A}-1": ""},
        finalizers=(SLOTS_FINALIZER,),
        deletion_timestamp="2026-01-01T00:00:00Z",
    )
    assert decide_leave(terminating, "node-a") is None  # nothing to write: it goes as a whole
    assert decide_leave(terminating, "node-b") == Drain((f"{A}-0",), None)  # held: no mark
    live = terminating.evolve(deletion_timestamp=None)
    drain = decide_leave(live, "node-b")
    assert isinstance(drain, Drain) and drain.instance is not None  # a live one is marked


def test_one_settler_then_the_others_in_turn() -> None:
    instance = Instance(A, "cam", 1, nodes=("node-c", "node-a", "node-b"), shared=True)
    delays = {node: settle_delay(instance, node) for node in ("node-a", "node-b", "node-c")}
    assert delays == {"node-a": 0.0, "node-b": SETTLE_STEP, "node-c": 2 * SETTLE_STEP}
    outsider = settle_delay(instance, "node-z")
    assert outsider > delays["node-c"]
    assert settle_delay(instance, "node-z") == outsider  # the same on every node


# -- on the API-server double ---------------------------------------------------------------


async def test_nodes_deleting_together_write_once_per_instance_without_conflicts(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Five nodes, a slot of A held on one of them: deleting the Configuration removes B with
    one write (its settler's) and keeps A, untouched, until its pod ends; the release of that
    slot removes the finalizer too. No 409 at any point. Before, the same deletion took 11
    Instance writes: every node left A or marked it draining (6), and every node wrote B,
    four of them finding it gone (404)."""
    names = [f"node-{c}" for c in "abcde"]
    nodes = await start_nodes(api, tmp_path, names)
    holder = nodes[2]
    il = f"akri.sh/{A}"
    try:
        await eventually(lambda: holder.kubelet.allocatable(il) == 2, 15, "offered")
        assert (await holder.kubelet.admit_pod("default", "pod", [("c", {il: 1})])).admitted
        await eventually(lambda: held_count(api_instances(api)[A]) == 1, 10, "slot held")
        api.clear_requests()

        api.delete("configurations.akri.sh", "cam")

        await eventually(lambda: B not in api_instances(api), 15, "B gone")
        for node in nodes:
            await eventually(lambda n=node: retired(n), 15, f"{node.name} retired")
        await asyncio.sleep(0.3)  # anything still on its way (there should be nothing)
        await answered(api)
        kept = api_instances(api)[A]
        assert kept.deletion_timestamp is not None and held_count(kept) == 1
        assert kept.device_usage[f"{A}-0"] == holder.name
        assert sorted(kept.nodes) == names  # nobody left it: it goes as a whole
        assert instance_writes(api, A) == []
        assert instance_writes(api, B) == [200]  # the settler's removal of the finalizer
        assert conflicts(api) == 0

        await holder.kubelet.delete_pod("default", "pod")
        await eventually(lambda: A not in api_instances(api), 15, "A gone after its pod")
        await answered(api)
        assert instance_writes(api, A) == [200]  # the release, which removed the finalizer
        assert conflicts(api) == 0
    finally:
        for node in nodes:
            await node.stop()


async def test_nodes_write_no_offline_mark_while_the_collector_is_on_its_way(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """On a real cluster the collector deletes a deleted Configuration's Instances a moment
    after the agents have seen the Configuration go (here: the double's collector lags 1 s).
    Meanwhile each node reports their slots Unhealthy, but it does not record them as offline
    in the Instance (``akri.sh/offline.<node>``): nothing schedules from a pool being deleted,
    and those marks were one write per node per Instance, some of them 409s (acceptance
    finding F11 on the 1.36.2 cluster). The only writes are the settler's, one per Instance."""
    nodes = await start_nodes(api, tmp_path, ["node-a", "node-b", "node-c"])
    try:
        api.store.gc.delay = 1.0
        api.clear_requests()
        api.delete("configurations.akri.sh", "cam")
        for node in nodes:
            await eventually(
                lambda n=node: CONFIGURATION in n.discovery.retirements, 10, f"{node.name} retiring"
            )
        await asyncio.sleep(0.5)  # the marks' passes, had they anything to write
        assert set(api_instances(api)) == {A, B}  # the collector has not come yet
        await eventually(lambda: not api_instances(api), 15, "both gone")
        await answered(api)
        marks = [
            r.status
            for r in api.requests_for(verb="patch", resource="instances")
            if b"akri.sh/offline" in r.body
        ]
        assert marks == []
        assert instance_writes(api) == [200, 200]  # the settler's, one per Instance
        assert conflicts(api) == 0
    finally:
        for node in nodes:
            await node.stop()


async def test_a_gone_settler_delays_the_deletion_only(
    api: ApiServerDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settler's agent is gone (and nothing took it out of ``nodes``): the next node
    removes the finalizer one step later."""
    monkeypatch.setattr(finalizer_module, "SETTLE_STEP", 0.5)
    nodes = await start_nodes(api, tmp_path, ["node-a", "node-b", "node-c"])
    try:
        await nodes[0].agent.stop()  # node-a, first of every Instance's nodes
        api.clear_requests()
        api.delete("configurations.akri.sh", "cam")
        await eventually(lambda: not api_instances(api), 15, "both gone")
        await answered(api)
        assert instance_writes(api) == [200, 200]
        assert conflicts(api) == 0
    finally:
        for node in nodes[1:]:
            await node.stop()
        await nodes[0].kubelet.stop()


async def test_without_the_garbage_collector_the_nodes_leave_after_the_wait(
    api: ApiServerDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deleted Configuration whose Instances no collector deletes (here: the double's
    collector off; in a cluster, kube-controller-manager down): after the wait for it, the
    nodes leave as before and the last one deletes each Instance."""
    monkeypatch.setattr(retirement_module, "COLLECTION_WAIT", 0.5)
    nodes = await start_nodes(api, tmp_path, ["node-a", "node-b"])
    try:
        api.store.gc.enabled = False
        api.delete("configurations.akri.sh", "cam")
        await asyncio.sleep(0.2)
        assert set(api_instances(api)) == {A, B}  # not collected: waiting for the collector
        await eventually(lambda: not api_instances(api), 15, "left, then deleted")
    finally:
        api.store.gc.enabled = True
        for node in nodes:
            await node.stop()


async def test_an_instance_without_owner_reference_is_left_at_once(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """An Instance that does not name its Configuration as owner is not collected: the nodes
    leave it without waiting, as before."""
    nodes = await start_nodes(api, tmp_path, ["node-a", "node-b"])
    try:
        for name in (A, B):
            stored = api.get("instances.akri.sh", name, "default")
            assert stored is not None
            stored["metadata"]["ownerReferences"] = []
            api.apply(stored)
        await eventually(
            lambda: all(not i.owner_references for i in api_instances(api).values()),
            10,
            "references gone",
        )
        api.delete("configurations.akri.sh", "cam")
        await eventually(lambda: not api_instances(api), 15, "left, then deleted")
    finally:
        for node in nodes:
            await node.stop()


async def test_the_settler_removes_the_finalizers_of_several_instances_at_once(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A deleted Configuration's Instances go together: the settler's writes are in flight at
    the same time (before, one after the other: at N = 50 on a loaded host the last of five
    went 1.5 s after the first)."""
    nodes = await start_nodes(api, tmp_path, ["node-a", "node-b"])
    try:
        api.clear_requests()
        held = api.hang(verb="update", resource="instances")
        api.delete("configurations.akri.sh", "cam")
        await eventually(lambda: held.held == 2, 15, "both writes in flight at once")
        # ... and not because the first one was given up (a write waits for its answer up to
        # the client's request timeout, 5 s here, before the next one is sent)
        assert not [r for r in caplog.records if "removing its finalizer failed" in r.getMessage()]
        held.release()
        await eventually(lambda: not api_instances(api), 15, "both gone")
        await answered(api)
        assert conflicts(api) == 0
    finally:
        api.clear_faults()
        for node in nodes:
            await node.stop()


async def test_a_failed_removal_is_retried(
    api: ApiServerDouble,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(settle_module, "RETRY_DELAY", 0.2)
    nodes = await start_nodes(api, tmp_path, ["node-a"])
    try:
        api.clear_requests()
        api.fail(503, verb="update", resource="instances", times=4)
        api.delete("configurations.akri.sh", "cam")
        await eventually(lambda: not api_instances(api), 30, "gone after the failures")
        await answered(api)
        assert [r.status for r in api.requests_for(verb="update", resource="instances")].count(
            503
        ) == 4
        retried = [r for r in caplog.records if "removing its finalizer failed" in r.getMessage()]
        assert 1 <= len(retried) <= 2  # once per Instance, not per attempt
    finally:
        for node in nodes:
            await node.stop()
