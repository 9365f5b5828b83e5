"""Dead nodes: a Node NotReady past the grace, or deleted, loses exactly its own slots and its
place in every Instance — never a live node's, whatever its Ready condition did before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.controller.reconcile import Reconciler
from agent.controller.watched import HOLDS_SLOTS
from agent.core.model.naming import SLOTS_FINALIZER
from agent.core.store.cas import STATS
from tests.controller.conftest import (
    FakeClock,
    add_node,
    configuration,
    eventually,
    instance,
    reconciler_for,
    running_controller,
    set_ready,
    set_status,
)
from tests.doubles.apiserver import ApiServerDouble

USAGE = {
    "cams-8120fe-0": "node-a",
    "cams-8120fe-1": "C:cams-0:node-b",
    "cams-8120fe-2": "D:claim-1:node-a",
    "cams-8120fe-3": "node-b",
}


def _stored(api: ApiServerDouble, name: str = "cams-8120fe") -> dict[str, Any] | None:
    return api.get("instances.akri.sh", name)


async def _sees(reconciler: Reconciler, node: str, ready: bool | None) -> None:
    """Wait until the controller's Node cache shows ``node`` so (None: gone)."""
    if ready is None:
        await eventually(lambda: node not in reconciler.nodes.ready, f"{node} gone")
    else:
        await eventually(
            lambda: reconciler.nodes.ready.get(node) is ready, f"{node} seen Ready={ready}"
        )


async def test_flapping_node_keeps_everything_until_not_ready_for_the_whole_grace(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=4))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=4, usage=USAGE)
    before = _stored(api)
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock, node_grace=300) as reconciler:
        await _sees(reconciler, "node-a", True)
        for _ in range(3):  # NotReady for most of the grace, then back
            set_ready(api, "node-a", False)
            await _sees(reconciler, "node-a", False)
            clock.advance(299)
            await reconciler.reconcile_once()
            set_ready(api, "node-a", True)
            await _sees(reconciler, "node-a", True)
            clock.advance(100)
            await reconciler.reconcile_once()
            assert _stored(api) == before
        # the same for node-b while node-a is NotReady: b's values are never touched
        set_ready(api, "node-a", False)
        set_ready(api, "node-b", False)
        await _sees(reconciler, "node-a", False)
        await _sees(reconciler, "node-b", False)
        clock.advance(150)
        set_ready(api, "node-b", True)
        await _sees(reconciler, "node-b", True)
        clock.advance(150)  # node-a: 300 s NotReady in one stretch
        await reconciler.reconcile_once()
        stored = _stored(api)
        assert stored is not None
        assert stored["spec"]["nodes"] == ["node-b"]
        assert stored["spec"]["deviceUsage"] == {
            "cams-8120fe-0": "",
            "cams-8120fe-1": "C:cams-0:node-b",
            "cams-8120fe-2": "",
            "cams-8120fe-3": "node-b",
        }
        assert reconciler.stats.nodes_cleaned == 1
        assert reconciler.stats.slots_freed == 2
        assert STATS.per_operation()["evict"].writes >= 1
        # node-a comes back: the controller writes nothing (its agent re-joins by itself)
        version = stored["metadata"]["resourceVersion"]
        set_ready(api, "node-a", True)
        await _sees(reconciler, "node-a", True)
        await reconciler.reconcile_once()
        assert (_stored(api) or {})["metadata"]["resourceVersion"] == version
    events = [e for e in api.list("events") if e.get("reason") == "DeadNodeRemoved"]
    assert events and "node-a" in events[0]["message"]


async def test_a_deleted_node_is_removed_at_once_and_an_instance_left_without_nodes_goes(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=4))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=4, usage=USAGE)
    # the agents' akri.sh/slots finalizer (issue 30): a delete waits for the slots held
    instance(
        api,
        "cams-a19705",
        ["node-a"],
        capacity=1,
        usage={"cams-a19705-0": "node-a"},
        finalizers=[SLOTS_FINALIZER],
    )
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock) as reconciler:
        api.delete("nodes", "node-a")
        await _sees(reconciler, "node-a", None)
        await reconciler.reconcile_once()
    # deleted, its dead node's slot freed and the finalizer released: gone, not stuck
    assert _stored(api, "cams-a19705") is None
    stored = _stored(api)
    assert stored is not None and stored["spec"]["nodes"] == ["node-b"]
    # each slot counted once (the deleted Instance's second write, its finalizer, frees nothing
    # more; the log said "4 slot(s) freed" for 2 on a real cluster)
    assert (reconciler.stats.slots_freed, reconciler.stats.nodes_cleaned) == (3, 1)


async def test_a_dead_node_never_keeps_a_terminating_instance(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """An Instance deleted (its Configuration gone) while a container of the node that then
    died held a slot: the finalizer waits for that slot, which only the controller frees."""
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=4))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=4, usage=USAGE,
             finalizers=[SLOTS_FINALIZER])  # fmt: skip
    api.delete("instances.akri.sh", "cams-8120fe")
    terminating = _stored(api)
    assert terminating is not None and terminating["metadata"]["deletionTimestamp"]
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock, node_grace=60) as reconciler:
        set_ready(api, "node-a", False)
        await _sees(reconciler, "node-a", False)
        clock.advance(60)
        await reconciler.reconcile_once()
        stored = _stored(api)
        assert stored is not None  # node-b's slots still held: it waits for them
        assert stored["spec"]["nodes"] == ["node-b"]
        assert sorted(v for v in stored["spec"]["deviceUsage"].values() if v) == [
            "C:cams-0:node-b",
            "node-b",
        ]
        assert reconciler.stats.slots_freed == 2
        # node-b dies too: nothing is held any more, the finalizer goes and so does the Instance
        set_ready(api, "node-b", False)
        await _sees(reconciler, "node-b", False)
        clock.advance(60)
        await reconciler.reconcile_once()
    assert _stored(api) is None


async def test_shared_slices_listing_only_dead_nodes_are_deleted(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=4))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=4, usage=USAGE)

    def shared_slice(name: str, nodes: list[str]) -> dict[str, Any]:
        requirement = {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {
                "driver": "akri.sh",
                "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
                "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]},
                "devices": [{"name": "slot-0"}],
            },
        }

    api.create(shared_slice("cams-8120fe", ["node-a", "node-b"]))
    api.create(shared_slice("cams-gone", ["node-a"]))  # its Instance went with node-a
    api.create(shared_slice("cams-other", ["node-b"]))
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock, node_grace=10) as reconciler:
        await eventually(lambda: len(reconciler.slice_cache.cache) == 3, "slices cached")
        set_ready(api, "node-a", False)
        await _sees(reconciler, "node-a", False)
        clock.advance(10)
        await reconciler.reconcile_once()
    # cams-8120fe lists live node-b, its publisher now: rewritten in place by node-b's agent
    names = sorted(s["metadata"]["name"] for s in api.list("resourceslices"))
    assert names == ["cams-8120fe", "cams-other"]


async def test_running_controller_frees_a_dead_nodes_slots_after_the_grace(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=4))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=4, usage=USAGE)
    async with running_controller(api, tmp_path, node_grace=0.5):
        set_ready(api, "node-b", False)
        await eventually(
            lambda: (_stored(api) or {}).get("spec", {}).get("nodes") == ["node-a"],
            "node-b removed after its grace",
        )
    stored = _stored(api)
    assert stored is not None
    assert stored["spec"]["deviceUsage"] == {
        "cams-8120fe-0": "node-a",
        "cams-8120fe-1": "",
        "cams-8120fe-2": "D:claim-1:node-a",
        "cams-8120fe-3": "",
    }


async def test_a_dead_holder_no_longer_listed_is_freed_too(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    add_node(api, "node-a")
    api.create(configuration(capacity=2))
    # node-c's value was left behind (an older agent, a hand edit); node-c has no Node at all
    instance(api, "cams-8120fe", ["node-a"], usage={"cams-8120fe-1": "C:cams-0:node-c"})
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock) as reconciler:
        await reconciler.reconcile_once()
    stored = _stored(api)
    assert stored is not None
    assert stored["spec"]["deviceUsage"] == {"cams-8120fe-0": "", "cams-8120fe-1": ""}
    assert stored["spec"]["nodes"] == ["node-a"]


async def test_nothing_is_freed_while_the_node_watch_is_down(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=4))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=4, usage=USAGE)
    before = _stored(api)
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock, node_grace=10) as reconciler:
        set_ready(api, "node-b", False)
        await _sees(reconciler, "node-b", False)
        reconciler.node_cache.informer.connected.clear()  # as the informer does on a failure
        clock.advance(10)
        await reconciler.reconcile_once()
        assert _stored(api) == before
        reconciler.node_cache.informer.connected.set()
        await reconciler.reconcile_once()
        assert (_stored(api) or {})["spec"]["nodes"] == ["node-a"]


async def test_the_reconcile_loop_stops_when_cancelled_as_it_is_woken(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Python 3.11's asyncio.wait_for swallows a cancellation that arrives together with the
    event it waits for: the leader's stop (or a lost Lease) then never ended."""
    import asyncio

    import pytest

    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock) as reconciler:
        task = asyncio.create_task(reconciler.run())
        await eventually(lambda: reconciler.stats.passes >= 1, "a first pass")
        await asyncio.sleep(0.1)  # waiting for the next wake-up now
        reconciler.wake.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


def _pod(name: str, node: str, resources: dict[str, str], namespace: str = "apps") -> Any:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "app", "image": "app:1", "resources": {"limits": resources}}],
        },
    }


async def test_a_deleted_node_keeps_its_slots_while_its_pods_that_use_them_exist(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 34.7: ``kubectl delete node`` on a machine that still runs: the pod garbage
    collector deletes the node's pods only ~40 s later, and until then their containers may
    use the shared device — its slot must not be granted to another node meanwhile."""
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=4))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=4, usage=USAGE)
    api.create(_pod("camera-app", "node-a", {"akri.sh/cams-8120fe": "1"}))
    api.create(_pod("other", "node-a", {"cpu": "1"}))  # uses no device: does not count
    api.create(_pod("on-b", "node-b", {"akri.sh/cams": "1"}))  # another node's
    before = _stored(api)
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock, node_grace=300) as reconciler:
        api.delete("nodes", "node-a")
        await _sees(reconciler, "node-a", None)
        next_at = await reconciler.reconcile_once()
        assert _stored(api) == before  # camera-app still exists: nothing freed
        assert next_at is None  # no timer: only the pods' deletion (watched) changes it
        clock.advance(10_000)
        await reconciler.reconcile_once()
        assert _stored(api) == before
        # the pod garbage collector deletes node-a's pods: its slots are freed at once
        api.delete("pods", "camera-app", "apps")
        api.delete("pods", "other", "apps")
        await _pods_seen(reconciler, "node-a", 0)
        await reconciler.reconcile_once()
        stored = _stored(api)
        assert stored is not None and stored["spec"]["nodes"] == ["node-b"]
        assert stored["spec"]["deviceUsage"] == {
            "cams-8120fe-0": "",
            "cams-8120fe-1": "C:cams-0:node-b",
            "cams-8120fe-2": "",
            "cams-8120fe-3": "node-b",
        }
        assert reconciler.stats.slots_freed == 2


async def test_a_deleted_nodes_pods_that_never_go_keep_its_slots_for_ever(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Invariant 10: never on a timer alone (only --free-slots-of-unready-nodes-after, an
    opt-in, frees them: test_partitioned_nodes.py)."""
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=4))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=4, usage=USAGE)
    claim_pod = _pod("dra-app", "node-a", {})
    claim_pod["spec"]["resourceClaims"] = [{"name": "cam", "resourceClaimName": "claim-1"}]
    api.create(claim_pod)
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock, node_grace=300) as reconciler:
        api.delete("nodes", "node-a")
        await _sees(reconciler, "node-a", None)
        await reconciler.reconcile_once()
        clock.advance(100_000)
        await reconciler.reconcile_once()
        assert (_stored(api) or {})["spec"]["nodes"] == ["node-a", "node-b"]
        assert reconciler.stats.nodes_holding == 1


async def _pods_seen(reconciler: Reconciler, node: str, holding: int) -> None:
    """Wait until the controller's watch of ``node``'s pods counts ``holding`` of them."""
    await eventually(
        lambda: (
            reconciler.nodes.pods.get(node) == holding
            or (
                node in reconciler.node_pods
                and sum(1 for p in reconciler.node_pods[node].cache.values() if p.get(HOLDS_SLOTS))
                == holding
            )
        ),
        f"{holding} pod(s) of {node} seen",
    )


def _shared_slice(name: str, nodes: list[str]) -> dict[str, Any]:
    requirement = {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"akri.sh-{name}-0"},
        "spec": {
            "driver": "akri.sh",
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]},
            "devices": [{"name": "slot-0"}],
        },
    }


async def test_a_pool_none_of_whose_nodes_is_ready_goes_at_once_while_the_slots_stay(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 39.4: the publisher's node goes NotReady and no other node of the pool serves:
    nobody would rewrite the pool, which would go on offering what it last said; it is deleted
    without waiting for the grace — while the node's slots stay held (its pod remains)."""
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=2))
    instance(api, "cams-8120fe", ["node-a"], usage={"cams-8120fe-0": "node-a"})
    instance(api, "cams-a19705", ["node-a", "node-b"])
    api.create(_pod("camera-app", "node-a", {"akri.sh/cams-8120fe": "1"}))
    api.create(_shared_slice("cams-8120fe", ["node-a"]))
    api.create(_shared_slice("cams-a19705", ["node-a", "node-b"]))  # node-b takes it over
    before = _stored(api)
    clock = FakeClock()
    async with reconciler_for(api, tmp_path, clock, node_grace=300) as reconciler:
        await eventually(lambda: len(reconciler.slice_cache.cache) == 2, "slices cached")
        await reconciler.reconcile_once()
        assert len(api.list("resourceslices")) == 2  # everyone Ready: nothing to do
        set_ready(api, "node-a", False)
        await _sees(reconciler, "node-a", False)
        await reconciler.reconcile_once()
        names = [s["metadata"]["name"] for s in api.list("resourceslices")]
        assert names == ["akri.sh-cams-a19705-0"]
        assert _stored(api) == before  # the slot and the node's place stay


def _agent_pod(api: ApiServerDouble, node: str, ready: bool, labels: dict[str, str]) -> None:
    name = f"akri-agent-{node}"
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "akri", "labels": labels},
           "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "a"}]}}  # fmt: skip
    if api.get("pods", name, "akri") is None:
        api.create(pod)
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    set_status(api, "pods", name, {"phase": "Running", "conditions": [condition]}, "akri")


AGENT = {"app.kubernetes.io/name": "akri-agent"}


async def test_a_pool_none_of_whose_nodes_has_its_agent_there_goes_at_once(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 39.4, the agent half: node-a's Node stays Ready but its agent is not there (its
    Pod not Ready, then gone): a pool only node-a publishes would go on offering what it
    last said; it is deleted at once, slots untouched. A pool node-b (agent Ready) can take
    over stays. The agents' Pods are read with one label-selected watch."""
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(configuration(capacity=2))
    instance(api, "cams-8120fe", ["node-a"], usage={"cams-8120fe-0": "node-a"})
    instance(api, "cams-a19705", ["node-a", "node-b"])
    api.create(_shared_slice("cams-8120fe", ["node-a"]))
    api.create(_shared_slice("cams-a19705", ["node-a", "node-b"]))
    _agent_pod(api, "node-a", True, AGENT)
    _agent_pod(api, "node-b", True, AGENT)
    before = _stored(api)
    clock = FakeClock()
    async with reconciler_for(
        api, tmp_path, clock, agent_selector="app.kubernetes.io/name=akri-agent"
    ) as reconciler:
        assert reconciler.agent_cache is not None
        agents = reconciler.agent_cache
        await eventually(lambda: len(reconciler.slice_cache.cache) == 2, "slices cached")
        await reconciler.reconcile_once()
        assert len(api.list("resourceslices")) == 2  # every agent Ready: nothing to do
        _agent_pod(api, "node-a", False, AGENT)
        await eventually(
            lambda: "False" in str(agents.cache.get("akri/akri-agent-node-a")), "seen not Ready"
        )
        await reconciler.reconcile_once()
        names = [s["metadata"]["name"] for s in api.list("resourceslices")]
        assert names == ["akri.sh-cams-a19705-0"]
        assert _stored(api) == before  # the slot and the node's place stay
        reads = [r for r in api.requests_for(resource="pods") if r.info.verb in ("list", "watch")]
        assert all(r.query.get("labelSelector") for r in reads)  # never every Pod


async def test_agents_labelled_otherwise_are_unknown_and_delete_nothing(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """An install whose agents the selector does not find (other labels): every node's agent
    counts as there, so no pool is deleted on that account."""
    add_node(api, "node-a")
    api.create(configuration(capacity=2))
    instance(api, "cams-8120fe", ["node-a"])
    api.create(_shared_slice("cams-8120fe", ["node-a"]))
    _agent_pod(api, "node-a", True, {"app": "my-akri-agent"})
    clock = FakeClock()
    async with reconciler_for(
        api, tmp_path, clock, agent_selector="app.kubernetes.io/name=akri-agent"
    ) as reconciler:
        await eventually(lambda: len(reconciler.slice_cache.cache) == 1, "slice cached")
        await reconciler.reconcile_once()
        assert len(api.list("resourceslices")) == 1
