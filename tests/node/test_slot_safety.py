"""Issue 11: nothing frees, deletes or re-creates a slot that a live container holds.

Each test is one way the agent itself used to give away the slot of a running container:
an invalid Configuration at start, a same-named Configuration in another namespace, an init
container, a deleted Configuration or unplugged device, and a deleted Instance. Every node
runs the real agent wiring against the API-server double with its own kubelet double.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from agent.core.kube import make_kube_client
from agent.core.ledger.decisions import held_count
from agent.core.ledger.ledger import EvidenceUnavailableError, SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.node_labels import with_node_labels
from agent.core.store.base import InstanceStore
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.node.app import Agent
from agent.node.kubelet.evidence import NodeEvidence
from agent.node.kubelet.state import KubeletState
from agent.protos.podresources.v1 import api_pb2 as pr_pb2
from agent.protos.podresources.v1 import api_pb2_grpc as pr_grpc
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.dp_nodes import DpNode, assert_never_over_capacity, start_dp_node
from tests.harness.k8s_nodes import (
    CRDS,
    akri_configuration_crd,
    debug_echo_configuration,
    eventually,
)

IL = "akri.sh/cam-8120fe"  # shared debugEcho device "foo0" of configuration "cam"
INSTANCES = "instances.akri.sh"
CONFIGURATIONS = "configurations.akri.sh"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


@pytest.fixture
async def akri_crd_api(tmp_path: Path) -> AsyncIterator[ApiServerDouble]:
    """A cluster with Akri's own Configuration CRD: it accepts values (here a capacity of 0
    or above 1000) that this agent refuses."""
    async with ApiServerDouble(crds=[akri_configuration_crd(tmp_path), CRDS[1]]) as server:
        yield server


def in_namespace(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    result = copy.deepcopy(obj)
    result["metadata"]["namespace"] = namespace
    return result


def force_delete(api: ApiServerDouble, name: str, namespace: str = "default") -> None:
    """Remove the Instance at once, ``akri.sh/slots`` finalizer or not — an operator clearing
    the finalizer by hand, or lost state: the paths that re-create an Instance under live pods.
    (A plain delete now only marks it terminating while a slot is held: test_delete_drains.)"""
    rt = api.resource(INSTANCES)
    api.store.patch(
        rt,
        "v0",
        namespace,
        name,
        "application/merge-patch+json",
        {"metadata": {"finalizers": None}},
    )
    api.delete(INSTANCES, name, namespace)


def instance_in(api: ApiServerDouble, name: str, namespace: str = "default") -> Instance | None:
    obj = api.get(INSTANCES, name, namespace)
    return Instance.from_dict(obj) if obj is not None else None


def events(api: ApiServerDouble, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.list("events") if e.get("reason") == reason]


async def admitted(node: DpNode, pod: str, resource: str = IL, **kwargs: Any) -> None:
    result = await node.kubelet.admit_pod("default", pod, [("c", {resource: 1})], **kwargs)
    assert result.admitted, result.message


async def ready(node: DpNode, resource: str = IL, devices: int = 1) -> None:
    await node.kubelet.wait_registered(resource, timeout=10)
    await eventually(
        lambda: node.kubelet.allocatable(resource) >= devices, what=f"{resource} on {node.name}"
    )


async def reclaim_passes(node: DpNode, count: int) -> None:
    """Wait until the reclaimer has asked kubelet ``count`` more times."""
    target = node.reclaimer.passes + count
    await eventually(lambda: node.reclaimer.passes >= target, within=10, what="reclaim passes")


# -- case 1: an invalid Configuration at start ------------------------------------------------


async def test_an_invalid_configuration_at_start_leaves_its_instances_as_they_are(
    akri_crd_api: ApiServerDouble, tmp_path: Path
) -> None:
    """Before: the orphan sweep counted only Configurations that parsed, so this node left
    the Instance (freeing its slot) and, being the last node, deleted it."""
    api = akri_crd_api
    api.create(debug_echo_configuration("cam", ("foo0",), 0))  # Akri allows it; we do not
    held = Instance(
        name="cam-8120fe",
        configuration_name="cam",
        capacity=2,
        shared=True,
        nodes=("node-a",),
        device_usage={"cam-8120fe-0": "node-a", "cam-8120fe-1": ""},
    )
    api.create(held.to_dict())
    before = api.get(INSTANCES, "cam-8120fe", "default")
    assert before is not None
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: events(api, "InstancesKept") != [], what="InstancesKept Event")
        message = events(api, "InstancesKept")[0]["message"]
        assert "default/cam is invalid" in message and "spec.capacity" in message
        assert "left exactly as they are" in message
        after = api.get(INSTANCES, "cam-8120fe", "default")
        # no leave, no delete, no slot change; only the node labels its view needs (issue
        # 41: written by an agent without them, it is labelled at start)
        assert after is not None and after["spec"] == before["spec"]
        assert after["metadata"]["labels"] == with_node_labels(before)["metadata"]["labels"]
        assert node.discovery.retirements == {} and node.discovery.runners == {}
        # fixed: it runs again and the held slot is still held
        fixed = api.get(CONFIGURATIONS, "cam", "default")
        assert fixed is not None
        fixed["spec"]["capacity"] = 2
        api.apply(fixed)
        await ready(node)
        instance = instance_in(api, "cam-8120fe")
        assert instance is not None and instance.device_usage["cam-8120fe-0"] == "node-a"
        assert held_count(instance) == 1
    finally:
        await node.stop()


# -- case 2: two namespaces, one name -----------------------------------------------------------


async def test_a_same_named_configuration_in_another_namespace_is_refused(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Before: Configurations and Instances were kept by bare name, so ``other/cam`` created
    then deleted made the agent delete every Instance of ``default/cam``."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await ready(node, devices=2)
        await admitted(node, "user")
        owned = instance_in(api, "cam-8120fe")
        assert owned is not None and held_count(owned) == 1
        api.create(in_namespace(debug_echo_configuration("cam", ("foo0",), 2), "other"))
        await eventually(lambda: events(api, "NameConflict") != [], what="NameConflict Event")
        conflict = events(api, "NameConflict")[0]
        assert conflict["involvedObject"]["namespace"] == "other"
        assert "namespace 'default'" in conflict["message"]
        assert ObjectKey("other", "cam") in node.discovery.refused
        assert api.list(INSTANCES, namespace="other") == []
        api.delete(CONFIGURATIONS, "cam", "other")
        await eventually(lambda: ObjectKey("other", "cam") not in node.discovery.refused)
        # a full reconcile later, default/cam is exactly as it was
        runner = node.discovery.runners[ObjectKey("default", "cam")]
        await runner.reconcile_once()
        after = instance_in(api, "cam-8120fe")
        assert after is not None and after.device_usage == owned.device_usage
        assert after.nodes == ("node-a",)
        assert node.kubelet.capacity(IL) == 2
    finally:
        await node.stop()


async def test_the_namespace_with_instances_keeps_the_name_until_they_are_gone(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """The device plugin serves only the owner's Instances; the refused namespace's
    same-named Instance on this node is retired — draining, its slot kept while kubelet
    assigns that device id to a container (whichever namespace it came from), then left and
    deleted once no container does; deletion (the owner drains, then the other namespace's
    Configuration starts)."""
    stray = Instance(
        name="cam-8120fe",
        namespace="other",
        configuration_name="cam",
        capacity=1,
        shared=True,
        nodes=("node-a",),
        device_usage={"cam-8120fe-0": "node-a"},  # written by someone else
    )
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await ready(node, devices=2)
        await admitted(node, "user")
        api.create(with_node_labels(stray.to_dict()))  # as our agents write it
        api.create(in_namespace(debug_echo_configuration("cam", ("foo0",), 1), "other"))
        await eventually(lambda: ObjectKey("other", "cam") in node.discovery.refused)
        # the plugin serves default's Instance (2 slots), never the stray one
        assert node.kubelet.capacity(IL) == 2
        await eventually(
            lambda: "node-a" in (instance_in(api, "cam-8120fe", "other") or stray).draining_nodes,
            what="the stray Instance drains",
        )
        used = instance_in(api, "cam-8120fe")
        assert used is not None and used.device_usage["cam-8120fe-0"] == "node-a"
        await reclaim_passes(node, 2)  # kubelet assigns cam-8120fe-0 (to default's pod)
        kept = instance_in(api, "cam-8120fe", "other")
        assert kept is not None and kept.device_usage == {"cam-8120fe-0": "node-a"}
        await node.kubelet.delete_pod("default", "user")
        await eventually(
            lambda: held_count(instance_in(api, "cam-8120fe") or stray) == 0,
            what="default's slot reclaimed",
        )
        await eventually(
            lambda: instance_in(api, "cam-8120fe", "other") is None,
            what="the stray Instance freed, left and deleted",
        )
        # default/cam goes: its Instance is left and deleted; then other/cam, the only
        # namespace with Instances of that name, owns it and runs
        api.delete(CONFIGURATIONS, "cam", "default")
        await eventually(lambda: instance_in(api, "cam-8120fe") is None, what="default left")
        await eventually(
            lambda: ObjectKey("other", "cam") in node.discovery.runners, what="other/cam runs"
        )
        assert ObjectKey("other", "cam") not in node.discovery.refused
        adopted = instance_in(api, "cam-8120fe", "other")
        assert adopted is not None and adopted.nodes == ("node-a",)
        assert_never_over_capacity(api)
    finally:
        await node.stop()


# -- case 3: init containers --------------------------------------------------------------------


async def test_an_init_containers_slot_is_kept_until_its_pod_ends(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """kubelet's pod-resources List leaves non-restartable init containers out; before, their
    slots were reclaimed while they ran. kubelet's checkpoint lists them."""
    api.create(debug_echo_configuration("cam", ("foo0",), 1))
    node = await start_dp_node(api, "node-a", tmp_path, reclaim_grace=0.3)
    try:
        await ready(node)
        pod = await node.kubelet.admit_pod(
            "default", "init", [("app", {})], init_containers=[("setup", {IL: 1})]
        )
        assert pod.admitted, pod.message
        listed = node.kubelet.pod_resources_list()
        assert all(not c.devices for p in listed.pod_resources for c in p.containers)
        await reclaim_passes(node, 8)  # well past the 0.3 s grace
        instance = instance_in(api, "cam-8120fe")
        assert instance is not None and instance.device_usage["cam-8120fe-0"] == "node-a"
        await node.kubelet.delete_pod("default", "init")
        await eventually(
            lambda: held_count(instance_in(api, "cam-8120fe") or instance) == 0,
            what="slot freed once the pod ended",
        )
        assert node.reclaimer.nudges >= 1  # kubelet was asked to rewrite its checkpoint
    finally:
        await node.stop()


# -- leaving and deleting wait for the slots ----------------------------------------------------


def draining_levels(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.levelname for r in caplog.records if "draining: " in r.getMessage()]


async def test_a_deleted_configuration_drains_then_goes(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent")
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await ready(node, devices=2)
        await admitted(node, "user")
        api.delete(CONFIGURATIONS, "cam", "default")
        await eventually(lambda: events(api, "Draining") != [], what="Draining Event")
        assert "draining: 1 slot(s) in use on node-a" in events(api, "Draining")[0]["message"]
        # the operator asked for it (every documented uninstall does it): INFO, not WARNING
        # (acceptance F5)
        assert draining_levels(caplog) and set(draining_levels(caplog)) == {"INFO"}
        instance = instance_in(api, "cam-8120fe")
        # deleted by the garbage collector, kept by the akri.sh/slots finalizer: terminating
        # already offers nothing, so no draining mark is written (issue 36: every node wrote
        # one, racing the others)
        assert instance is not None and instance.deletion_timestamp is not None
        assert instance.draining_nodes == ()
        assert instance.device_usage["cam-8120fe-0"] == "node-a"
        # it stops offering free slots at once
        await eventually(lambda: node.kubelet.allocatable(IL) == 0, what="all Unhealthy")
        assert "cam-8120fe" in node.discovery.offline_instances()
        await node.kubelet.delete_pod("default", "user")
        await eventually(lambda: instance_in(api, "cam-8120fe") is None, within=10)
        # the agent learns it from its write's answer, a moment after the API server
        await eventually(lambda: node.discovery.retirements == {}, what="retirement over")
    finally:
        await node.stop()


async def test_an_unplugged_device_with_a_live_pod_drains(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the default local grace of 0, an unplugged device used to be left (its slots
    freed) at once."""
    caplog.set_level(logging.INFO, logger="agent")
    api.create(debug_echo_configuration("cam", ("foo0",), 1))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await ready(node)
        await admitted(node, "user")
        node.offline()
        await eventually(lambda: events(api, "Draining") != [], what="Draining Event")
        # nobody asked for it: a device gone while a pod uses it stays a WARNING
        assert set(draining_levels(caplog)) == {"WARNING"}
        instance = instance_in(api, "cam-8120fe")
        assert instance is not None and instance.device_usage["cam-8120fe-0"] == "node-a"
        node.offline(False)  # plugged back: no longer draining, nothing was lost
        await eventually(lambda: (instance_in(api, "cam-8120fe") or instance).draining_nodes == ())
        node.offline()
        await node.kubelet.delete_pod("default", "user")
        await eventually(lambda: instance_in(api, "cam-8120fe") is None, within=10)
    finally:
        await node.stop()


async def test_an_instance_recreated_under_a_live_pod_starts_with_its_slot_held(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Someone deletes the Instance while a pod uses slot 0: discovery re-creates it with the
    slot kubelet lists held by this node, not free."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await ready(node, devices=2)
        await admitted(node, "user")
        used = node.kubelet.pod("default", "user")
        assert used is not None
        slot = used.devices(IL)[0]
        first = instance_in(api, "cam-8120fe")
        assert first is not None
        force_delete(api, "cam-8120fe")
        await eventually(
            lambda: (instance_in(api, "cam-8120fe") or first).uid != first.uid,
            what="re-created",
        )
        again = instance_in(api, "cam-8120fe")
        assert again is not None and again.device_usage[slot] == "node-a"
        assert held_count(again) == 1
    finally:
        await node.stop()


# -- joining an Instance another node (re-)created -----------------------------------------------

SLOT0 = "cam-8120fe-0"


async def two_nodes_sharing(api: ApiServerDouble, tmp_path: Path) -> tuple[DpNode, DpNode]:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    a = await start_dp_node(api, "node-a", tmp_path)
    b = await start_dp_node(api, "node-b", tmp_path)
    await eventually(
        lambda: set(getattr(instance_in(api, "cam-8120fe"), "nodes", ())) == {"node-a", "node-b"},
        what="both nodes joined",
    )
    await ready(a, devices=2)
    await ready(b, devices=2)
    return a, b


async def recreated_by(api: ApiServerDouble, node: str) -> Instance:
    """The user deletes the Instance; wait until ``node`` has created it again (first in
    ``nodes``; a node whose pod uses one of its slots but does not see the device may join
    it draining right after)."""
    first = instance_in(api, "cam-8120fe")
    assert first is not None
    force_delete(api, "cam-8120fe")

    def again() -> bool:
        current = instance_in(api, "cam-8120fe")
        return current is not None and current.uid != first.uid and current.nodes[:1] == (node,)

    await eventually(again, what=f"re-created by {node}")
    instance = instance_in(api, "cam-8120fe")
    assert instance is not None
    return instance


async def test_joining_an_instance_another_node_recreated_takes_the_slot_of_a_live_pod(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Before: node-b re-created the deleted Instance with only its own evidence (slot 0
    free); node-a then joined without asking its kubelet, so node-b handed slot 0 to a second
    pod while node-a's pod still used it. And while node-a did not see the device it never
    joined at all: now it joins draining with the slot its pod uses."""
    a, b = await two_nodes_sharing(api, tmp_path)
    try:
        await admitted(a, "user", choose={IL: [SLOT0]})
        # node-a stops seeing the device for a while: it stays in nodes, draining (slot 0 is
        # in use), so only node-b re-creates the deleted Instance
        a.offline()
        await eventually(
            lambda: "node-a" in getattr(instance_in(api, "cam-8120fe"), "draining_nodes", ()),
            what="node-a draining",
        )
        await recreated_by(api, "node-b")
        # node-a does not see the device, but its kubelet shows the pod on slot 0: it joins
        # the re-created Instance draining with that slot
        await eventually(
            lambda: (
                getattr(instance_in(api, "cam-8120fe"), "device_usage", {}).get(SLOT0) == "node-a"
            ),
            what="node-a's live slot recorded while it does not see the device",
        )
        draining = instance_in(api, "cam-8120fe")
        assert draining is not None and draining.draining_nodes == ("node-a",)
        await eventually(lambda: b.kubelet.allocatable(IL) == 1, what="slot 0 taken on node-b")
        a.offline(False)
        await eventually(
            lambda: "node-a" in getattr(instance_in(api, "cam-8120fe"), "nodes", ()),
            what="node-a joined",
        )
        joined = instance_in(api, "cam-8120fe")
        assert joined is not None and joined.device_usage[SLOT0] == "node-a"
        # node-b can hand out slot 1 only: never the slot node-a's pod uses
        await eventually(lambda: b.kubelet.allocatable(IL) == 1, what="slot 0 taken on node-b")
        await admitted(b, "other")
        other = b.kubelet.pod("default", "other")
        assert other is not None and other.devices(IL) == ["cam-8120fe-1"]
        third = await b.kubelet.admit_pod("default", "third", [("c", {IL: 1})])
        assert not third.admitted
        assert events(api, "SlotConflict") == []
        assert_never_over_capacity(api)
    finally:
        await a.stop()
        await b.stop()


async def test_an_agent_restarted_after_its_instance_was_recreated_takes_its_live_slot(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """node-a's agent is down while the Instance is deleted and node-b re-creates it; at start
    node-a joins it and must take back the slot its running pod uses."""
    a, b = await two_nodes_sharing(api, tmp_path)
    try:
        await admitted(a, "user", choose={IL: [SLOT0]})
        settings = a.agent.settings
        await a.agent.stop()  # kubelet and its pods stay
        recreated = await recreated_by(api, "node-b")
        assert recreated.device_usage[SLOT0] == ""
        store = KubernetesInstanceStore(
            make_kube_client(settings.kubeconfig), KubernetesSettings("node-a", request_timeout=5)
        )
        a.agent = Agent(settings, store, freeze_gc=False)
        await a.agent.start()
        await eventually(
            lambda: "node-a" in getattr(instance_in(api, "cam-8120fe"), "nodes", ()),
            what="node-a joined at start",
        )
        joined = instance_in(api, "cam-8120fe")
        assert joined is not None and joined.device_usage[SLOT0] == "node-a"
        await eventually(lambda: b.kubelet.allocatable(IL) == 1, what="slot 0 taken on node-b")
        await admitted(b, "other")
        other = b.kubelet.pod("default", "other")
        assert other is not None and other.devices(IL) == ["cam-8120fe-1"]
    finally:
        await a.stop()
        await b.stop()


async def test_a_joining_node_reports_a_slot_already_used_elsewhere_and_takes_nothing(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """node-b handed out slot 0 before node-a joined: both pods already use the device.
    Taking the slot would only hide the second user; node-a reports it (log + Event naming
    both holders) and leaves deviceUsage as it is."""
    a, b = await two_nodes_sharing(api, tmp_path)
    try:
        await admitted(a, "user", choose={IL: [SLOT0]})
        settings = a.agent.settings
        await a.agent.stop()  # kubelet and its pods stay; nothing records slot 0 meanwhile
        await recreated_by(api, "node-b")
        await ready(b, devices=2)
        await admitted(b, "early", choose={IL: [SLOT0]})
        store = KubernetesInstanceStore(
            make_kube_client(settings.kubeconfig), KubernetesSettings("node-a", request_timeout=5)
        )
        a.agent = Agent(settings, store, freeze_gc=False)
        await a.agent.start()
        await eventually(lambda: events(api, "SlotConflict") != [], what="SlotConflict Event")
        message = events(api, "SlotConflict")[0]["message"]
        assert SLOT0 in message and "node-a" in message and "'node-b'" in message
        joined = instance_in(api, "cam-8120fe")
        assert joined is not None and "node-a" in joined.nodes
        assert joined.device_usage[SLOT0] == "node-b"
    finally:
        await a.stop()
        await b.stop()


# -- configuration-level slots come back too ------------------------------------------------------

CL = "akri.sh/cam"


def configuration_level_values(api: ApiServerDouble) -> list[str]:
    instance = instance_in(api, "cam-8120fe")
    assert instance is not None
    return sorted(v for v in instance.device_usage.values() if v.startswith("C:"))


async def test_a_recreated_instance_keeps_the_slot_of_a_configuration_level_pod(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """kubelet lists a configuration-level container's virtual device, not the Instance; its
    checkpoint keeps the env vars our Allocate returned, suffixed with the Instance's digest.
    Before: the re-created Instance had every slot free under a running CL pod."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await ready(node, devices=2)
        await ready(node, CL, devices=1)
        await admitted(node, "user", CL)
        held = configuration_level_values(api)
        assert len(held) == 1 and held[0].endswith(":node-a")
        first = instance_in(api, "cam-8120fe")
        assert first is not None
        force_delete(api, "cam-8120fe")
        await eventually(
            lambda: (instance_in(api, "cam-8120fe") or first).uid != first.uid,
            what="re-created",
        )
        assert configuration_level_values(api) == held
        again = instance_in(api, "cam-8120fe")
        assert again is not None and held_count(again) == 1
        # still held after reclaim passes (the vdev is in use), freed once the pod ends
        await reclaim_passes(node, 3)
        assert configuration_level_values(api) == held
        await node.kubelet.delete_pod("default", "user")
        await eventually(lambda: configuration_level_values(api) == [], within=10)
    finally:
        await node.stop()


async def test_joining_an_instance_another_node_recreated_keeps_a_configuration_level_slot(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    a, b = await two_nodes_sharing(api, tmp_path)
    try:
        await ready(a, CL, devices=1)
        await admitted(a, "user", CL)
        held = configuration_level_values(api)
        assert len(held) == 1
        a.offline()
        await eventually(
            lambda: "node-a" in getattr(instance_in(api, "cam-8120fe"), "draining_nodes", ()),
            what="node-a draining",
        )
        await recreated_by(api, "node-b")
        a.offline(False)
        await eventually(
            lambda: "node-a" in getattr(instance_in(api, "cam-8120fe"), "nodes", ()),
            what="node-a joined",
        )
        assert configuration_level_values(api) == held
        # node-b has one slot left to give
        await eventually(lambda: b.kubelet.allocatable(IL) == 1, what="one slot on node-b")
        await admitted(b, "other")
        third = await b.kubelet.admit_pod("default", "third", [("c", {IL: 1})])
        assert not third.admitted
        assert_never_over_capacity(api)
    finally:
        await a.stop()
        await b.stop()


# -- evidence when kubelet's pod-resources List hangs ------------------------------------------


class _HangingLister(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc,unused-ignore]
    """A pod-resources server whose ``List`` never answers (counts the calls)."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()

    async def List(self, request: Any, context: Any) -> Any:
        self.calls += 1
        await self.release.wait()
        return pr_pb2.ListPodResourcesResponse()


async def test_a_hanging_list_is_asked_once_per_pass_not_once_per_instance(
    tmp_path: Path,
) -> None:
    """Before: every Instance of a pass waited the full rpc_timeout for its own List (1000
    Instances at start: 1000 x 5 s). Now the failed look stands for a short while: the other
    Instances fail at once (retried by the runner's backoff)."""
    socket = tmp_path / "pr.sock"
    lister = _HangingLister()
    server = grpc.aio.server()
    pr_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    now = [100.0]
    try:
        kubelet = KubeletState(
            socket, tmp_path / "checkpoint", rpc_timeout=0.2, clock=lambda: now[0]
        )
        ledger = SlotLedger(unused_store(), "node-a", evidence=NodeEvidence("node-a", kubelet))
        instances = [
            Instance(name=f"cam-{i:06x}", configuration_name="cam", capacity=1) for i in range(5)
        ]
        for instance in instances:
            with pytest.raises(EvidenceUnavailableError):
                await ledger._evidence_for(instance)
        assert lister.calls == 1
        now[0] += 2.5  # the retry deadline passed: the next question asks kubelet again
        with pytest.raises(EvidenceUnavailableError):
            await ledger._evidence_for(instances[0])
        assert lister.calls == 2
        lister.release.set()
        now[0] += 2.5
        assert not (await ledger._evidence_for(instances[0])).slots
    finally:
        lister.release.set()
        await server.stop(None)


def unused_store() -> InstanceStore:
    """The ledger's store is not used by ``_evidence_for``."""
    return cast(InstanceStore, object())


async def test_a_bug_in_the_evidence_is_not_taken_for_unavailable_evidence() -> None:
    """Before: any exception became EvidenceUnavailableError and was retried for ever."""

    class Broken:
        async def in_use(self, instance: Instance, not_before: float) -> Any:
            raise AttributeError("a programming error")

    ledger = SlotLedger(unused_store(), "node-a", evidence=Broken())
    with pytest.raises(AttributeError):
        await ledger._evidence_for(
            Instance(name="cam-000001", configuration_name="cam", capacity=1)
        )
