"""Nodes joining and leaving one shared Instance at the same moment do not conflict (issue 28):
the ledger writes a plain join or leave as the store's membership write (server-side apply of
the node's own ``spec.nodes`` entry on a Kubernetes API server; the set under the lock in the
local store), and every ``deviceUsage`` change stays a resourceVersion-checked write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.kube import make_kube_client
from agent.core.ledger.decisions import Owner
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import InstanceStore
from agent.core.store.cas import STATS, OperationStats
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.core.store.local import LocalInstanceStore
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS

KEY = ObjectKey("default", "cam-abcdef")
NODES = [f"node-{i:02d}" for i in range(20)]


def counted(operation: str) -> OperationStats:
    found = STATS.by_operation.get(operation, OperationStats())
    return OperationStats(found.writes, found.conflicts, found.gave_up)


def delta(before: OperationStats, operation: str) -> OperationStats:
    now = counted(operation)
    return OperationStats(
        now.writes - before.writes, now.conflicts - before.conflicts, now.gave_up - before.gave_up
    )


def joined(node: str):  # type: ignore[no-untyped-def]
    """Discovery's join: add ``node`` (nothing else)."""

    def change(instance: Instance) -> Instance | None:
        if node in instance.nodes:
            return None
        return instance.evolve(nodes=(*instance.nodes, node))

    return change


async def join_and_leave_all(stores: list[InstanceStore]) -> None:
    ledgers = [SlotLedger(store, node) for store, node in zip(stores, NODES, strict=True)]
    await ledgers[0].create_instance(
        Instance(
            name=KEY.name,
            namespace=KEY.namespace,
            configuration_name="cam",
            shared=True,
            capacity=2,
            nodes=(NODES[0],),
        )
    )
    for store in stores:  # every node's cache has it (a node joins what it has seen)
        await store.get(KEY)
    join, leave, claim = counted("join"), counted("leave"), counted("claim")

    await asyncio.gather(
        *(ledger.join_instance(KEY, joined(ledger.node)) for ledger in ledgers[1:])
    )
    stored = await stores[0].get(KEY)
    assert sorted(stored.nodes) == NODES
    assert delta(join, "join") == OperationStats(writes=len(NODES) - 1, conflicts=0, gave_up=0)

    # slot claims stay checked writes, and a claim racing the joins is never lost
    claimed = await ledgers[3].claim(KEY, f"{KEY.name}-0", Owner.instance_level(NODES[3]))
    assert claimed.instance.device_usage[f"{KEY.name}-0"] == NODES[3]
    assert delta(claim, "claim").writes == 1

    # everybody but the creator and the holder leaves at once: one write each, no conflict
    leaving = [ledger for ledger in ledgers[1:] if ledger.node != NODES[3]]
    results = await asyncio.gather(*(ledger.leave(KEY) for ledger in leaving))
    assert all(result.left for result in results)
    stored = await stores[0].get(KEY)
    assert sorted(stored.nodes) == [NODES[0], NODES[3]]
    assert stored.device_usage[f"{KEY.name}-0"] == NODES[3]  # untouched
    assert delta(leave, "leave") == OperationStats(writes=len(leaving), conflicts=0, gave_up=0)

    # the holder cannot leave: it drains (a checked write of its mark), nothing is freed
    drained = await ledgers[3].leave(KEY)
    assert not drained.left and drained.slots == (f"{KEY.name}-0",)
    # the creator leaves too (its entry may need a checked write: see apply_membership)
    assert (await ledgers[0].leave(KEY)).left
    assert (await stores[0].get(KEY)).nodes == (NODES[3],)


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def test_kubernetes_nodes_join_and_leave_without_conflicts(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "kc")
    stores: list[InstanceStore] = []
    for node in NODES:
        store = KubernetesInstanceStore(make_kube_client(str(kubeconfig)), KubernetesSettings(node))
        await store.start()
        stores.append(store)
    try:
        api.clear_requests()
        await join_and_leave_all(stores)
        patches = api.requests_for(verb="patch", resource="instances")
        assert patches and all(r.content_type == "application/apply-patch+yaml" for r in patches)
        # one apply per join and per leave, never refused; the checked writes (claim, drain,
        # the creator's leave) may meet a stale cache (409) and are retried
        assert len(patches) == 2 * (len(NODES) - 1)
        assert all(r.status == 200 for r in patches)
        writes = api.requests_for(verb="update", resource="instances")
        assert len([r for r in writes if r.status == 200]) == 3
    finally:
        for store in stores:
            await store.close()


async def test_local_nodes_join_and_leave_without_conflicts(tmp_path: Path) -> None:
    """Several agents sharing one state directory (simulated nodes): the same semantics."""
    stores: list[InstanceStore] = []
    for _ in NODES:
        store = LocalInstanceStore(tmp_path / "state")
        await store.start()
        stores.append(store)
    try:
        await join_and_leave_all(stores)
    finally:
        for store in stores:
            await store.close()


async def test_a_recreated_instance_is_not_joined_by_membership(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The membership write names the Instance the decision was made on (its uid): one
    deleted and re-created meanwhile refuses it — a real API server answers 422 "field is
    immutable" (kubernetes/kubernetes#127625), as the double does — and the join is decided
    again on a fresh read; applies stay on (issue 34.6: they were switched off for good,
    with an RBAC hint)."""
    import logging

    kubeconfig = api.write_kubeconfig(tmp_path / "kc")
    store = KubernetesInstanceStore(make_kube_client(str(kubeconfig)), KubernetesSettings("n1"))
    await store.start()
    caplog.set_level(logging.WARNING, logger="agent.core.store.kubernetes")
    try:
        first = await store.create(
            Instance(
                name=KEY.name, configuration_name="cam", capacity=1, shared=True, nodes=("n0",)
            )
        )
        api.delete("instances.akri.sh", KEY.name, "default")
        api.create(
            {
                "apiVersion": "akri.sh/v0",
                "kind": "Instance",
                "metadata": {"name": KEY.name, "namespace": "default"},
                "spec": {"configurationName": "cam", "shared": True, "nodes": ["n2"]},
            }
        )
        from agent.core.store.base import ConflictError

        api.clear_requests()
        with pytest.raises(ConflictError):
            await store.apply_membership(KEY, "n1", True, uid=first.uid)
        assert api.get("instances.akri.sh", KEY.name, "default")["spec"]["nodes"] == ["n2"]
        assert [r.status for r in api.requests_for(verb="patch", resource="instances")] == [422]
        # re-read (a GET after the refused apply); the new Instance does not list n1, so n1's
        # view does not keep it (issue 41), and the next apply is sent on it
        assert [r.verb for r in api.requests_for(resource="instances")][-1] == "get"
        assert store.get_cached(KEY) is None
        fresh = await store.get(KEY)
        assert fresh.uid != first.uid
        joined_now = await store.apply_membership(KEY, "n1", True, uid=fresh.uid)
        assert joined_now is not None and sorted(joined_now.nodes) == ["n1", "n2"]
        assert not [r for r in caplog.records if "refused a server-side apply" in r.message]
        # the Instance gone altogether: 409 "uid mismatch" (an apply naming a uid creates
        # nothing), and the re-read drops it from the cache
        api.delete("instances.akri.sh", KEY.name, "default")
        with pytest.raises(ConflictError):
            await store.apply_membership(KEY, "n1", False, uid=fresh.uid)
        assert store.get_cached(KEY) is None
    finally:
        await store.close()


async def test_a_configuration_edit_is_written_once_per_shared_instance(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Every node learns of an edit at once; before, each wrote it (N-1 conflicts and re-reads
    per Instance). Now the node that sorts first in ``nodes`` writes it, the others find it
    done in their cache."""
    from tests.harness.k8s_nodes import (
        debug_echo_configuration,
        edited,
        eventually,
        instances,
        start_node,
        summary,
    )

    config = debug_echo_configuration()
    api.create(config)
    names = ("node-a", "node-b", "node-c", "node-d")
    nodes = [await start_node(api, name, tmp_path) for name in names]
    try:
        await eventually(
            lambda: summary(api) == {n: list(names) for n in ("echo-8120fe", "echo-a19705")},
            what="every node in both Instances",
        )
        # the last join's answer may still be on its way (the double, like a real API
        # server, may send a write's watch event before its answer): count from after it
        await eventually(
            lambda: all(r.status is not None for r in api.requests if r.verb != "watch"),
            what="all answered",
        )
        await asyncio.sleep(0.2)
        api.clear_requests()
        join = counted("join")  # discovery's writes of an Instance it is in count as joins
        api.apply(edited(config, capacity=3))
        await eventually(
            lambda: all(o["spec"]["capacity"] == 3 for o in instances(api)), what="resized"
        )
        # every node has seen the edit and had its chance to write
        for node in nodes:
            runner = node.manager.runners[ObjectKey("default", "echo")]
            await eventually(lambda r=runner: r.configuration.capacity == 3, what="edit seen")
        await asyncio.sleep(0.5)
        writes = api.requests_for(verb="update", resource="instances")
        assert len(writes) == 2 and all(r.status == 200 for r in writes)
        assert delta(join, "join") == OperationStats(writes=2, conflicts=0, gave_up=0)
    finally:
        for node in nodes:
            await node.stop()


async def test_a_conflict_of_a_leave_is_counted(api: ApiServerDouble, tmp_path: Path) -> None:
    """Before, the leave loop's conflicts reached no metric (only the API error counter)."""
    kubeconfig = api.write_kubeconfig(tmp_path / "kc")
    store = KubernetesInstanceStore(make_kube_client(str(kubeconfig)), KubernetesSettings("n1"))
    await store.start()
    try:
        ledger = SlotLedger(store, "n1")
        await ledger.create_instance(
            Instance(
                name=KEY.name, configuration_name="cam", capacity=1, shared=True, nodes=("n1",)
            )
        )
        leave = counted("leave")
        api.fail(409, verb="delete", resource="instances", times=1)
        assert (await ledger.leave(KEY)).left  # the last node: a checked delete, retried
        assert delta(leave, "leave").conflicts == 1
        assert api.get("instances.akri.sh", KEY.name, "default") is None
    finally:
        await store.close()


async def test_a_cluster_without_patch_rights_falls_back_to_checked_writes(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RBAC deployed before 'patch' was granted: the apply is 403. The join still happens (a
    checked write), the applies stop after the first refusal, one warning says why."""
    import logging

    kubeconfig = api.write_kubeconfig(tmp_path / "kc")
    stores = []
    for node in ("n0", "n1"):
        store = KubernetesInstanceStore(make_kube_client(str(kubeconfig)), KubernetesSettings(node))
        await store.start()
        stores.append(store)
    try:
        creator, joiner = SlotLedger(stores[0], "n0"), SlotLedger(stores[1], "n1")
        await creator.create_instance(
            Instance(
                name=KEY.name, configuration_name="cam", capacity=1, shared=True, nodes=("n0",)
            )
        )
        await stores[1].get(KEY)
        api.fail(403, verb="patch", resource="instances", times=None)
        with caplog.at_level(logging.WARNING, logger="agent.core.store.kubernetes"):
            result = await joiner.join_instance(KEY, joined("n1"))
            assert set(result.instance.nodes) == {"n0", "n1"}
            assert (await joiner.leave(KEY)).left
        assert (await stores[0].get(KEY)).nodes == ("n0",)
        assert len(api.requests_for(verb="patch", resource="instances")) == 1
        assert len([r for r in caplog.records if "refused a server-side apply" in r.message]) == 1
    finally:
        for store in stores:
            await store.close()


async def test_joining_an_instance_without_the_slots_finalizer_adds_it(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """An Instance written by an older agent (or Akri) has no akri.sh/slots finalizer; a
    node's first join writes it (a checked write: the membership apply would not)."""
    api.create(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Instance",
            "metadata": {"name": KEY.name, "namespace": "default"},
            "spec": {
                "configurationName": "cam",
                "capacity": 1,
                "shared": True,
                "nodes": ["n0"],
                "deviceUsage": {f"{KEY.name}-0": ""},  # complete: only the finalizer is missing
            },
        }
    )
    kubeconfig = api.write_kubeconfig(tmp_path / "kc")
    store = KubernetesInstanceStore(make_kube_client(str(kubeconfig)), KubernetesSettings("n1"))
    await store.start()
    try:
        await store.get(KEY)
        result = await SlotLedger(store, "n1").join_instance(KEY, joined("n1"))
        assert set(result.instance.nodes) == {"n0", "n1"}
        stored = api.get("instances.akri.sh", KEY.name, "default")
        assert "akri.sh/slots" in stored["metadata"]["finalizers"]
        assert api.requests_for(verb="patch", resource="instances") == []
    finally:
        await store.close()
