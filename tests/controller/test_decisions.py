"""The controller's pure decisions: broker Pods and Jobs, Services, dead nodes, eviction."""

from __future__ import annotations

from typing import Any

from agent.controller import brokers, services, slices
from agent.controller.nodes import NodeWatch, may_hold_slots
from agent.core.ledger.decisions import decide_evict_node
from agent.core.ledger.node_standing import (
    OUT_OF_SERVICE_TAINT,
    NodeFacts,
    decide_free,
    may_join,
    node_serves,
)
from agent.core.model.configuration import parse_configuration
from agent.core.model.instance import Instance
from agent.core.model.naming import DRAINING_ANNOTATION, OFFLINE_ANNOTATION
from tests.controller.conftest import broker_pod_spec, configuration

NOW = 1_800_000_000.0


def _instance(
    nodes: tuple[str, ...] = ("node-a", "node-b"),
    usage: dict[str, str] | None = None,
    capacity: int = 2,
    shared: bool = True,
    **changes: Any,
) -> Instance:
    device_usage = {f"cams-8120fe-{i}": "" for i in range(capacity)}
    device_usage.update(usage or {})
    return Instance(
        name="cams-8120fe",
        configuration_name="cams",
        capacity=capacity,
        nodes=nodes,
        device_usage=device_usage,
        shared=shared,
        uid="uid-1",
        **changes,
    )


def _config(**changes: Any) -> Any:
    return parse_configuration(configuration(**changes))


def _pod(name: str, node: str, spec: str, phase: str = "Running", age: float = 10.0) -> Any:
    return brokers.ObservedPod(name, f"uid-{name}", node, spec, phase, NOW - age)


# -- decide_evict_node ---------------------------------------------------------------------


def test_evict_frees_only_the_dead_nodes_values() -> None:
    instance = _instance(
        nodes=("node-a", "node-b"),
        capacity=5,
        usage={
            "cams-8120fe-0": "node-a",
            "cams-8120fe-1": "C:cams-0:node-a",
            "cams-8120fe-2": "D:claim-1:node-a",
            "cams-8120fe-3": "node-b",
            "cams-8120fe-4": "C:cams-1:node-b",
        },
    )
    eviction = decide_evict_node(instance, "node-a")
    assert eviction is not None and not eviction.delete
    assert eviction.freed == ("cams-8120fe-0", "cams-8120fe-1", "cams-8120fe-2")
    assert eviction.instance.nodes == ("node-b",)
    assert dict(eviction.instance.device_usage) == {
        "cams-8120fe-0": "",
        "cams-8120fe-1": "",
        "cams-8120fe-2": "",
        "cams-8120fe-3": "node-b",
        "cams-8120fe-4": "C:cams-1:node-b",
    }


def test_evict_keeps_unknown_values_and_a_node_named_like_a_prefix() -> None:
    instance = _instance(
        nodes=("node-a", "node-a2"),
        capacity=3,
        usage={"cams-8120fe-0": "node-a2", "cams-8120fe-1": "C:x", "cams-8120fe-2": "node-a"},
    )
    eviction = decide_evict_node(instance, "node-a")
    assert eviction is not None
    assert eviction.freed == ("cams-8120fe-2",)
    assert eviction.instance.device_usage["cams-8120fe-0"] == "node-a2"
    assert eviction.instance.device_usage["cams-8120fe-1"] == "C:x"


def test_evict_drops_the_marks_and_deletes_when_no_node_is_left() -> None:
    instance = _instance(
        nodes=("node-a",),
        usage={"cams-8120fe-1": "node-a"},
        annotations={DRAINING_ANNOTATION: "node-a", OFFLINE_ANNOTATION: "node-a"},
    )
    eviction = decide_evict_node(instance, "node-a")
    assert eviction is not None and eviction.delete
    assert eviction.instance.annotations == {}
    assert eviction.freed == ("cams-8120fe-1",)


def test_evict_a_node_neither_listed_nor_holding_is_nothing() -> None:
    assert decide_evict_node(_instance(nodes=("node-b",)), "node-a") is None
    # not listed any more but still holding (left a value behind): freed
    held = _instance(nodes=("node-b",), usage={"cams-8120fe-0": "D:c:node-a"})
    eviction = decide_evict_node(held, "node-a")
    assert eviction is not None and eviction.freed == ("cams-8120fe-0",)


def test_evict_beyond_capacity_drops_the_key() -> None:
    instance = _instance(nodes=("node-a", "node-b"), capacity=1,
                         usage={"cams-8120fe-3": "node-a"})  # fmt: skip
    eviction = decide_evict_node(instance, "node-a")
    assert eviction is not None
    assert "cams-8120fe-3" not in eviction.instance.device_usage


# -- dead nodes ------------------------------------------------------------------------------


def _node(ready: bool) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_a_not_ready_node_with_none_of_its_pods_left_is_dead_after_the_grace() -> None:
    watch = NodeWatch(grace=300)
    watch.observe("node-a", _node(True), 0)
    assert not watch.is_dead("node-a", 1000)
    watch.observe("node-a", _node(False), 100)
    assert not watch.is_dead("node-a", 1000)  # its pods not counted yet: kept
    watch.set_pods("node-a", 0)
    assert not watch.is_dead("node-a", 399)
    assert watch.next_deadline(["node-a"], 200) == 400
    watch.observe("node-a", _node(True), 390)  # back just before the grace ends
    watch.observe("node-a", _node(False), 395)
    watch.set_pods("node-a", 0)
    assert not watch.is_dead("node-a", 600)
    assert watch.is_dead("node-a", 695)
    assert watch.dead_among(["node-a", "node-b"], 695) == {"node-a"}  # b: no Node, pods?
    watch.note_unserving("node-b", 600)
    watch.set_pods("node-b", 0)  # none of node-b's pods holds a slot
    assert watch.dead_among(["node-a", "node-b"], 695) == {"node-a", "node-b"}


def test_a_node_whose_pods_remain_keeps_its_slots_for_ever_unless_the_timer_is_opted_in() -> None:
    for free_after in (None, 600.0):
        watch = NodeWatch(grace=300, free_after=free_after)
        watch.observe("node-a", _node(False), 0)
        watch.set_pods("node-a", 1)
        assert not watch.is_dead("node-a", 599)
        verdict = watch.verdict("node-a", 10**6)
        assert verdict.free is (free_after is not None)
        assert verdict.forced is (free_after is not None)
        assert watch.next_deadline(["node-a"], 10) == (None if free_after is None else 600)
        watch.set_pods("node-a", None)  # cannot be listed: the same
        assert watch.verdict("node-a", 10**6).free is (free_after is not None)


def test_a_deleted_or_out_of_service_node_is_dead_as_soon_as_its_pods_are_gone() -> None:
    watch = NodeWatch(grace=300)
    watch.observe("node-a", _node(True), 0)
    watch.observe("node-a", None, 5)
    assert not watch.is_dead("node-a", 5)  # its pods not counted yet (issue 34.7)
    watch.set_pods("node-a", 2)
    assert not watch.is_dead("node-a", 10**6)  # never on a timer alone
    assert watch.next_deadline(["node-a"], 10) is None  # only a pod event changes it
    watch.set_pods("node-a", 0)
    assert watch.is_dead("node-a", 6)
    tainted = _node(True)
    tainted["spec"] = {"taints": [{"key": OUT_OF_SERVICE_TAINT, "effect": "NoExecute"}]}
    watch.observe("node-b", tainted, 10)
    assert not watch.serves("node-b") and watch.is_ready("node-b")
    watch.set_pods("node-b", 1)
    assert not watch.is_dead("node-b", 11)
    watch.set_pods("node-b", 0)
    assert watch.is_dead("node-b", 11)
    watch.observe("node-b", _node(True), 12)  # the taint removed: it serves, all forgotten
    assert not watch.is_dead("node-b", 10**6) and "node-b" not in watch.pods
    watch.set_pods("node-b", 0)  # a count for a node that serves is not kept
    assert "node-b" not in watch.pods
    watch.observe("node-c", {"status": {}}, 10)
    assert not watch.is_ready("node-c") and not watch.is_dead("node-c", 10**6)
    watch.forget([])  # no Instance names them any more: the gone one is forgotten
    assert "node-a" not in watch.unserving_since and watch.pods == {}


def test_the_agent_joins_only_while_the_controller_would_free_nothing() -> None:
    """The shared rule: whatever a Node says, the controller frees a node's slots only
    when the agent may not join (so neither undoes the other)."""
    tainted = {**_node(True), "spec": {"taints": [{"key": OUT_OF_SERVICE_TAINT}]}}
    for obj in (_node(True), _node(False), tainted, {"status": {}}, None):
        serves = node_serves(obj)
        for pods in (None, 0, 3):
            facts = NodeFacts(serves=serves, gone=obj is None, unserving_for=10**6,
                              pods_holding=pods)  # fmt: skip
            for free_after in (None, 0.0):
                verdict = decide_free(facts, grace=0, free_after=free_after)
                assert not (verdict.free and may_join(obj))
    assert may_join(None, known=False)  # a Node that cannot be read: as before


def test_pods_that_may_hold_slots() -> None:
    def pod(phase: str = "Running", **spec: Any) -> dict[str, Any]:
        return {"spec": spec, "status": {"phase": phase}}

    def limits(*names: str, kind: str = "limits") -> list[dict[str, Any]]:
        return [{"name": "c", "resources": {kind: {name: "1" for name in names}}}]

    assert may_hold_slots(pod(containers=limits("akri.sh/cams-8120fe")))
    assert may_hold_slots(pod("Pending", initContainers=limits("akri.sh/cams", kind="requests")))
    assert may_hold_slots(pod(resourceClaims=[{"name": "cam"}], containers=limits()))
    extended = {"spec": {"containers": limits()}, "status": {"extendedResourceClaimStatus": {}}}
    extended["status"]["extendedResourceClaimStatus"] = {"resourceClaimName": "x"}
    assert may_hold_slots(extended)
    assert not may_hold_slots(pod(containers=limits("cpu", "nvidia.com/gpu")))
    assert not may_hold_slots(pod("Succeeded", containers=limits("akri.sh/cams-8120fe")))
    assert not may_hold_slots(pod("Failed", resourceClaims=[{"name": "cam"}]))
    assert not may_hold_slots({})


# -- broker Pods -----------------------------------------------------------------------------


def test_pod_names_labels_placeholder_and_affinity() -> None:
    config = _config(pod_spec=broker_pod_spec())
    plan = brokers.plan_pods(config, _instance(shared=False, nodes=("node.a",)), [],
                             {"node.a"}, NOW)  # fmt: skip
    (pod,) = plan.create
    assert pod["metadata"]["name"] == "cams-8120fe-pod"
    shared = brokers.plan_pods(config, _instance(nodes=("node.a",)), [], {"node.a"}, NOW)
    assert shared.create[0]["metadata"]["name"] == "node-a-cams-8120fe-pod"
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"akri.sh/cams-8120fe": "1"}


def test_user_affinity_terms_each_get_the_node() -> None:
    spec = broker_pod_spec()
    term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["x"]}]}
    spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term, dict(term)]}}}  # fmt: skip
    pod = brokers.broker_pod(_config(pod_spec=spec), _instance(), "node-a", "p")
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert len(terms) == 2
    for found in terms:
        assert found["matchFields"] == [
            {"key": "metadata.name", "operator": "In", "values": ["node-a"]}
        ]
        assert found["matchExpressions"][0]["key"] == "zone"


def test_slots_per_broker_counts_containers_and_init_containers() -> None:
    spec = broker_pod_spec(slots=2)
    spec["containers"].append({"name": "side", "image": "x"})
    spec["initContainers"] = [
        {"name": "i", "image": "x", "resources": {"requests": {"{{PLACEHOLDER}}": "3"}}}
    ]
    assert brokers.slots_per_broker(spec) == 3
    assert brokers.slots_per_broker({"containers": [{"name": "n", "image": "x"}]}) == 0


def test_never_more_broker_pods_than_free_slots_pending_ones_reserve() -> None:
    config = _config(pod_spec=broker_pod_spec())
    nodes = ("node-a", "node-b", "node-c")
    instance = _instance(nodes=nodes, capacity=2)
    plan = brokers.plan_pods(config, instance, [], set(nodes), NOW)
    assert [p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchFields"][0]["values"][0] for p in plan.create] == [
        "node-a", "node-b"]  # fmt: skip
    assert plan.waiting == ("node-c",)
    # one broker Pending (not holding its slot yet): it still counts
    wanted = brokers.spec_hash(broker_pod_spec())
    pending = [_pod("node-a-cams-8120fe-pod", "node-a", wanted, "Pending")]
    plan = brokers.plan_pods(config, instance, pending, set(nodes), NOW)
    assert len(plan.create) == 1 and plan.waiting == ("node-c",)
    # a spec that does not ask for the device is not limited
    free = _config(pod_spec={"containers": [{"name": "b", "image": "x"}]})
    assert len(brokers.plan_pods(free, instance, [], set(nodes), NOW).create) == 3


def test_no_broker_on_a_not_ready_draining_or_offline_node() -> None:
    config = _config(pod_spec=broker_pod_spec())
    instance = _instance(
        nodes=("node-a", "node-b", "node-c"),
        capacity=3,
        annotations={DRAINING_ANNOTATION: "node-b", OFFLINE_ANNOTATION: "node-c"},
    )
    plan = brokers.plan_pods(config, instance, [], {"node-b", "node-c"}, NOW)
    assert plan.create == ()
    plan = brokers.plan_pods(config, instance, [], {"node-a"}, NOW)
    assert len(plan.create) == 1


def test_the_broker_of_a_node_that_lost_the_device_goes_and_an_offline_one_stays() -> None:
    """A node that lost a shared device past its grace drains: it stays in ``nodes`` only
    while slots are held there, and its broker holds one — so the broker must go, as Akri's
    does when the node leaves the Instance, or the node drains for good. A node in its
    offline grace keeps its broker (Akri keeps the node during the grace)."""
    config = _config(pod_spec=broker_pod_spec())
    wanted = brokers.spec_hash(broker_pod_spec())
    instance = _instance(
        nodes=("node-a", "node-b", "node-c"),
        capacity=3,
        usage={"cams-8120fe-0": "node-a", "cams-8120fe-1": "node-b", "cams-8120fe-2": "node-c"},
        annotations={DRAINING_ANNOTATION: "node-b", OFFLINE_ANNOTATION: "node-c"},
    )
    pods = [_pod(f"{n}-cams-8120fe-pod", n, wanted) for n in ("node-a", "node-b", "node-c")]
    plan = brokers.plan_pods(config, instance, pods, {"node-a", "node-b", "node-c"}, NOW)
    assert [(r.name, r.reason) for r in plan.remove] == [("node-b-cams-8120fe-pod", "NodeLeft")]
    assert plan.create == ()


def test_pod_actions_follow_akri_grace_periods() -> None:
    config = _config(pod_spec=broker_pod_spec())
    wanted = brokers.spec_hash(broker_pod_spec())
    instance = _instance(nodes=("node-a",), capacity=3)
    cases = {
        "Running": (),
        "Failed": ("Failed",),
        "Succeeded": ("Failed",),
    }
    for phase, reasons in cases.items():
        pods = [_pod("node-a-cams-8120fe-pod", "node-a", wanted, phase)]
        plan = brokers.plan_pods(config, instance, pods, {"node-a"}, NOW)
        assert tuple(r.reason for r in plan.remove) == reasons, phase
        # replaced on a later pass, once the old one is gone (Akri's name)
        assert plan.create == ()
    young = [_pod("node-a-cams-8120fe-pod", "node-a", wanted, "Pending", age=299)]
    plan = brokers.plan_pods(config, instance, young, {"node-a"}, NOW)
    assert plan.remove == () and plan.next_check == NOW + 1
    old = [_pod("node-a-cams-8120fe-pod", "node-a", wanted, "Pending", age=300)]
    plan = brokers.plan_pods(config, instance, old, {"node-a"}, NOW)
    assert [r.reason for r in plan.remove] == ["PendingTooLong"]
    gone = [_pod("node-b-cams-8120fe-pod", "node-b", wanted)]
    plan = brokers.plan_pods(config, instance, gone, {"node-a", "node-b"}, NOW)
    assert [r.reason for r in plan.remove] == ["NodeLeft"]


def test_rollover_surges_when_a_slot_is_free_else_makes_room() -> None:
    config = _config(pod_spec=broker_pod_spec("example/broker:2"))
    old_hash = brokers.spec_hash(broker_pod_spec("example/broker:1"))
    new_hash = brokers.spec_hash(broker_pod_spec("example/broker:2"))
    old = _pod("node-a-cams-8120fe-pod", "node-a", old_hash)
    roomy = _instance(nodes=("node-a",), capacity=2, usage={"cams-8120fe-0": "node-a"})
    plan = brokers.plan_pods(config, roomy, [old], {"node-a"}, NOW)
    assert plan.remove == ()
    assert plan.create[0]["metadata"]["name"] == f"node-a-cams-8120fe-{new_hash[:5]}-pod"
    new = _pod(f"node-a-cams-8120fe-{new_hash[:5]}-pod", "node-a", new_hash, "Pending")
    assert brokers.plan_pods(config, roomy, [old, new], {"node-a"}, NOW).remove == ()
    running = _pod(new.name, "node-a", new_hash)
    plan = brokers.plan_pods(config, roomy, [old, running], {"node-a"}, NOW)
    assert [(r.name, r.reason) for r in plan.remove] == [(old.name, "RolledOver")]
    full = _instance(nodes=("node-a",), capacity=1, usage={"cams-8120fe-0": "node-a"})
    plan = brokers.plan_pods(config, full, [old], {"node-a"}, NOW)
    assert plan.create == () and [r.reason for r in plan.remove] == ["MakeRoom"]


def test_jobs_one_per_generation_and_only_with_a_free_slot() -> None:
    job_spec = {"template": {"spec": broker_pod_spec()}}
    raw = configuration(job_spec=job_spec)
    raw["metadata"]["generation"] = 4
    config = parse_configuration(raw)
    plan = brokers.plan_job(config, _instance(), [])
    assert plan.create is not None
    assert plan.create["metadata"]["name"] == "cams-8120fe-4-job"
    assert plan.create["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "akri.sh/cams-8120fe": "1"
    }
    existing = [_pod("cams-8120fe-4-job", "", "x")]
    assert brokers.plan_job(config, _instance(), existing).create is None
    full = _instance(usage={"cams-8120fe-0": "node-a", "cams-8120fe-1": "node-b"})
    assert brokers.plan_job(config, full, []) == brokers.JobPlan(waiting=True)


# -- Services --------------------------------------------------------------------------------


def test_services_are_created_replaced_and_deleted() -> None:
    ports = {"ports": [{"port": 80}]}
    config = _config(pod_spec=broker_pod_spec(), instance_service=ports,
                     configuration_service=ports)  # fmt: skip
    wanted = services.instance_service(config, _instance())
    assert wanted is not None and wanted["metadata"]["name"] == "cams-8120fe-svc"
    plan = services.plan_services([wanted], {})
    assert plan.create == (wanted,)
    stored = {**wanted, "spec": {**wanted["spec"], "clusterIP": "10.0.0.9"}}
    assert services.plan_services([wanted], {"default/cams-8120fe-svc": stored}) == (
        services.ServicePlan()
    )
    edited = services.instance_service(
        _config(pod_spec=broker_pod_spec(), instance_service={"ports": [{"port": 81}]}),
        _instance(),
    )
    assert edited is not None
    plan = services.plan_services([edited], {"default/cams-8120fe-svc": stored})
    assert plan.replace[0]["spec"]["clusterIP"] == "10.0.0.9"
    assert plan.replace[0]["spec"]["ports"] == [{"port": 81}]
    stored["metadata"] = {**stored["metadata"], "uid": "u1"}
    plan = services.plan_services([], {"default/cams-8120fe-svc": stored})
    assert plan.delete == (("default/cams-8120fe-svc", "u1"),)
    # its owner (the Instance, uid of _instance()) exists: deleted here; gone: left to the
    # garbage collector, which deletes it with its owner (acceptance F10: both sent a DELETE)
    (owner,) = stored["metadata"]["ownerReferences"]
    assert owner["uid"]
    kept = services.plan_services([], {"default/cams-8120fe-svc": stored}, {owner["uid"]})
    assert kept.delete == (("default/cams-8120fe-svc", "u1"),)
    assert services.plan_services([], {"default/cams-8120fe-svc": stored}, set()).delete == ()
    # no owner left (orphaned: its Configuration deleted with propagationPolicy Orphan): ours
    orphan = {**stored, "metadata": {**stored["metadata"], "ownerReferences": None}}
    assert services.plan_services([], {"default/x-svc": orphan}, set()).delete == (
        ("default/x-svc", "u1"),
    )


# -- ResourceSlices --------------------------------------------------------------------------


def test_stale_shared_slices_are_those_listing_the_dead_node_and_no_live_one() -> None:
    """A shared slice that still lists a live node is that node's to rewrite in place (the
    pool's publisher, issue 36: no gap for the scheduler); one listing only dead nodes has
    nobody left to delete it."""

    def slice_(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": name, "resourceVersion": "7"},
                "spec": {"driver": "akri.sh", **spec}}  # fmt: skip

    def hostnames(*nodes: str) -> dict[str, Any]:
        requirement = {"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}
        return {"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]}}

    dead = {"node-a", "node-c"}
    found = slices.stale_shared_slices(
        [
            slice_("shared-1", hostnames("node-a", "node-b")),  # node-b rewrites it
            slice_("shared-2", hostnames("node-b")),
            slice_("shared-3", hostnames("node-a", "node-c")),  # nobody alive lists it
            slice_("local-a", {"nodeName": "node-a"}),
            {"metadata": {"name": "other"}, "spec": {"driver": "x", **hostnames("node-a")}},
        ],
        "node-a",
        lambda node: node in dead,
    )
    assert found == [("shared-3", "7")]


def test_a_slice_a_live_node_of_its_instance_will_rewrite_is_not_stale() -> None:
    """A shared pool lists only the nodes that see its device (issue 33.1): node-b, alive but
    in its offline grace, is not in the slice its dead peer published, yet it is in the
    Instance and, once the dead node is out, publishes the pool for itself (tainted) in
    place. Only a pool whose Instance lists no live node is the controller's to delete."""
    requirement = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}
    obj = {
        "metadata": {"name": "akri.sh-cam-8120fe-0", "resourceVersion": "9"},
        "spec": {
            "driver": "akri.sh",
            "pool": {"name": "cam-8120fe", "generation": 1, "resourceSliceCount": 1},
            "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]},
        },
    }
    instances = {"cam-8120fe": {"node-b"}}

    def dead(node: str) -> bool:
        return node == "node-a"

    assert slices.stale_shared_slices([obj], "node-a", dead, lambda p: instances.get(p, ())) == []
    assert slices.stale_shared_slices([obj], "node-a", dead, lambda p: ()) == [
        ("akri.sh-cam-8120fe-0", "9")
    ]
    assert slices.stale_shared_slices([obj], "node-a", dead, lambda p: {"node-a"}) == [
        ("akri.sh-cam-8120fe-0", "9")
    ]


def test_a_pool_only_offline_nodes_could_serve_is_deleted() -> None:
    """The agents' rule (``pool_candidates``): the nodes offline do not stand in for the nodes
    that see the device, so when those are all down nobody publishes the pool; the controller
    deletes it as it does any pool none of whose nodes serves. Once every node is offline, the
    pool is theirs (tainted)."""
    from agent.core.model.naming import offline_annotation

    requirement = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}
    obj = {
        "metadata": {"name": "akri.sh-cams-8120fe-0", "resourceVersion": "9"},
        "spec": {
            "driver": "akri.sh",
            "pool": {"name": "cams-8120fe", "generation": 1, "resourceSliceCount": 1},
            "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]},
        },
    }
    b_offline = _instance(annotations={offline_annotation("node-b"): "1"})
    assert b_offline.offline_nodes == ("node-b",)
    members = slices.pool_members([b_offline])
    assert members == {"cams-8120fe": {"node-a"}}

    def serves(node: str) -> bool:
        return node == "node-b"  # node-a NotReady

    found = slices.unpublished_shared_slices([obj], serves, lambda p: members.get(p, ()))
    assert found == [("akri.sh-cams-8120fe-0", "9")]
    both = _instance(annotations={offline_annotation(n): "1" for n in ("node-a", "node-b")})
    members = slices.pool_members([both])
    assert members == {"cams-8120fe": {"node-a", "node-b"}}
    assert slices.unpublished_shared_slices([obj], serves, lambda p: members.get(p, ())) == []


def test_the_broker_example_plans_one_pod_per_node_and_both_services() -> None:
    import yaml

    from tests.paths import REPO

    raw = yaml.safe_load((REPO / "examples" / "debug-echo-broker.yaml").read_text())
    raw["metadata"]["namespace"] = "default"
    config = parse_configuration(raw)
    assert brokers.broker_kind(config) == "pod"
    instance = _instance(nodes=("node-a", "node-b"), capacity=2).evolve(
        configuration_name="akri-debug-echo-broker"
    )
    plan = brokers.plan_pods(config, instance, [], {"node-a", "node-b"}, NOW)
    assert [p["metadata"]["name"] for p in plan.create] == [
        "node-a-cams-8120fe-pod",
        "node-b-cams-8120fe-pod",
    ]
    resources = plan.create[0]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["akri.sh/cams-8120fe"] == "1"
    assert "{{PLACEHOLDER}}" not in resources["requests"]
    assert services.instance_service(config, instance) is not None
    assert services.configuration_service(config) is not None


def test_brokers_go_with_a_terminating_instance_or_a_removed_spec() -> None:
    wanted = brokers.spec_hash(broker_pod_spec())
    pods = [_pod("node-a-cams-8120fe-pod", "node-a", wanted)]
    terminating = _instance(nodes=("node-a",)).evolve(deletion_timestamp="2026-11-25T00:00:00Z")
    plan = brokers.plan_pods(
        _config(pod_spec=broker_pod_spec()), terminating, pods, {"node-a"}, NOW
    )
    assert [r.reason for r in plan.remove] == ["InstanceGone"] and plan.create == ()
    plan = brokers.plan_pods(_config(), _instance(nodes=("node-a",)), pods, {"node-a"}, NOW)
    assert [r.reason for r in plan.remove] == ["NoBrokerPodSpec"]
