"""Issue 23 item 2: one kubelet resource name, one meaning.

Configuration ``cam`` discovers device ``d0``: its Instance is ``cam-17ff2a`` and its
instance-level resource ``akri.sh/cam-17ff2a``. A Configuration *named* ``cam-17ff2a`` would
register the same name for its configuration-level plugin (and its vdev ids ``cam-17ff2a-0``
look like the slot ids of Instance ``cam-17ff2a``): kubelet keeps the last registration and a
pod asking for "this camera" got the other Configuration's device. The two collide, and a
name that serves keeps it (issue 34.4): the older of two new ones holds the names, a newcomer
is refused (log line, Event ``NameConflict``, ``akri status``) in the same or another
namespace, and a Configuration no agent can run claims nothing. End to end: API-server double,
kubelet double, the agent as ``akri agent`` wires it (docs/slot-model.md, "One resource name,
one meaning"; the rule: agent/core/name_claims.py).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.node.discovery.ownership import NameUser, decide_names
from agent.node.status import configurations_table
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.agent_process import AgentProcess, poll_until, read_status, run_status
from tests.harness.dp_nodes import DpNode, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually

INSTANCES = "instances.akri.sh"
CONFIGURATIONS = "configurations.akri.sh"
CAM_D0 = "cam-17ff2a"  # Instance of Configuration "cam" for the shared debugEcho device "d0"
NAME = "akri.sh/" + CAM_D0
SHAPED_LIKE_CAM = "has the shape of an Instance name of Configuration default/cam"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def configuration(name: str, device: str, namespace: str = "default") -> dict[str, Any]:
    obj = copy.deepcopy(debug_echo_configuration(name, (device,), 2))
    obj["metadata"]["namespace"] = namespace
    return obj


def instances(api: ApiServerDouble) -> dict[tuple[str, str], Instance]:
    result = {}
    for obj in api.list(INSTANCES):
        instance = Instance.from_dict(obj)
        result[(instance.namespace, instance.name)] = instance
    return result


def name_conflicts(api: ApiServerDouble, configuration_name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.list("events")
        if e.get("reason") == "NameConflict"
        and e.get("involvedObject", {}).get("name") == configuration_name
    ]


async def serving_cam_only(api: ApiServerDouble, node: DpNode, namespace: str) -> None:
    """``cam`` runs, ``cam-17ff2a`` is refused, and ``akri.sh/cam-17ff2a`` is ``cam``'s
    Instance: checked through kubelet, the API objects and a pod."""
    await node.kubelet.wait_registered(NAME, timeout=10)
    await node.kubelet.wait_registered("akri.sh/cam", timeout=10)
    await eventually(lambda: bool(name_conflicts(api, "cam-17ff2a")), what="NameConflict Event")
    (event,) = name_conflicts(api, "cam-17ff2a")
    assert event["involvedObject"]["namespace"] == namespace
    assert SHAPED_LIKE_CAM in event["message"]
    # only cam's Instance exists: the refused Configuration created none
    assert set(instances(api)) == {("default", CAM_D0)}
    # every registration of the name was the instance-level plugin: its two slots, and
    # kubelet never had a second endpoint for it
    registered = [r for r in node.kubelet.all_registrations if r.resource_name == NAME]
    assert len(registered) == 1
    slots = {f"{CAM_D0}-0": "Healthy", f"{CAM_D0}-1": "Healthy"}
    await eventually(lambda: node.kubelet.devices(NAME) == slots, what="cam-17ff2a's slots")
    assert node.plugins.configuration_plugins.keys() == {"cam"}
    # a pod asking for this camera gets d0 of Configuration cam, through its Instance
    pod = await node.kubelet.admit_pod("default", "user", [("c", {NAME: 1})])
    assert pod.admitted, pod.message
    assert pod.containers[0].envs["DEBUG_ECHO_DESCRIPTION"] == "d0"
    held = instances(api)[("default", CAM_D0)]
    assert sorted(held.device_usage.values()) == ["", node.name]


@pytest.mark.parametrize("namespace", ["default", "other"])
async def test_a_configuration_named_like_an_instance_is_refused(
    api: ApiServerDouble, tmp_path: Path, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 23's case, in the same namespace and in another one: ``cam`` is the older."""
    api.create(configuration("cam", "d0"))
    await asyncio.sleep(1.1)  # creationTimestamps have whole seconds
    api.create(configuration("cam-17ff2a", "d1", namespace))
    caplog.set_level(logging.ERROR, logger="agent.discovery")
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await serving_cam_only(api, node, namespace)
        assert any(
            "cam-17ff2a" in r.getMessage() and SHAPED_LIKE_CAM in r.getMessage()
            for r in caplog.records
        )
        # akri status shows the refusal, decided from the same objects
        table = configurations_table(api.list(CONFIGURATIONS), list(instances(api).values()))
        (row,) = [line for line in table.splitlines() if "cam-17ff2a " in line + " "]
        assert "refused" in row and SHAPED_LIKE_CAM in row
    finally:
        await node.stop()


async def test_a_serving_configuration_keeps_its_name_and_the_newcomer_waits(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """``other/cam-17ff2a`` serves, a pod holds one of its configuration-level vdevs. Then
    ``default/cam`` appears, whose device ``d0`` would be the Instance ``cam-17ff2a``: the
    newcomer is refused and ``akri.sh/cam-17ff2a`` keeps its meaning (kubelet never sees a
    second registration of it). Before (issue 34.4): "Instance names win" switched the
    running one off. Once ``cam-17ff2a`` is deleted and its last slot freed, ``cam`` starts
    by itself and its Instance ``cam-17ff2a`` serves ``d0`` under the name."""
    api.create(configuration("cam-17ff2a", "d1", "other"))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await node.kubelet.wait_registered(NAME, timeout=10)
        await eventually(lambda: node.kubelet.allocatable(NAME) == 1, what="one vdev")
        pod = await node.kubelet.admit_pod("other", "old", [("c", {NAME: 1})])
        assert pod.admitted, pod.message
        assert pod.containers[0].envs["DEBUG_ECHO_DESCRIPTION"] == "d1"
        first = [r for r in node.kubelet.all_registrations if r.resource_name == NAME]
        api.create(configuration("cam", "d0"))
        await eventually(lambda: bool(name_conflicts(api, "cam")), what="cam refused")
        (event,) = name_conflicts(api, "cam")
        holder = "include akri.sh/cam-17ff2a, the resource name of Configuration other/cam-17ff2a"
        assert holder in event["message"]
        assert not name_conflicts(api, "cam-17ff2a")
        assert {namespace for namespace, _ in instances(api)} == {"other"}  # cam made none
        assert [r for r in node.kubelet.all_registrations if r.resource_name == NAME] == first
        assert node.plugins.configuration_plugins.keys() == {"cam-17ff2a"}
        # the holder goes: once its slots are free, the newcomer starts by itself
        api.delete(CONFIGURATIONS, "cam-17ff2a", namespace="other")
        await node.kubelet.delete_pod("other", "old")
        await eventually(
            lambda: not any(i.namespace == "other" for i in instances(api).values()),
            within=60,
            what="the deleted Configuration's Instance drained and deleted",
        )
        await eventually(
            lambda: ("default", CAM_D0) in instances(api), within=60, what="cam's Instance"
        )
        await eventually(lambda: node.kubelet.allocatable(NAME) == 2, what="cam-17ff2a's slots")
        new = await node.kubelet.admit_pod("default", "new", [("c", {NAME: 1})])
        assert new.admitted, new.message
        assert new.containers[0].envs["DEBUG_ECHO_DESCRIPTION"] == "d0"
    finally:
        await node.stop()


# -- the decision itself (pure) ---------------------------------------------------------------
def key(name: str, namespace: str = "default") -> ObjectKey:
    return ObjectKey(namespace, name)


def test_a_name_shaped_like_an_instance_collides_and_the_older_holds() -> None:
    """``cam-17ff2a`` beside ``cam``: the older holds, in either namespace and either order; a
    serving one (with Instances) keeps its name against an older newcomer."""
    for created, holder in ((("1", "2"), "cam"), (("2", "1"), "cam-17ff2a")):
        for namespace in ("default", "other"):
            users = [NameUser(key("cam"), created[0]), NameUser(key(CAM_D0, namespace), created[1])]
            decision = decide_names(users)
            assert set(decision.owners) == {holder}
    decision = decide_names(
        [NameUser(key("cam"), "1"), NameUser(key("cam-17ff2a", "other"), "2", has_instances=True)]
    )
    assert decision.owners == {"cam-17ff2a": "other"}
    why = decision.refused[key("cam")]
    assert "akri.sh/cam-17ff2a, the resource name of Configuration other/cam-17ff2a" in why
    # only the Instance shape counts: cam-1 (not 6 hex) and cam-17ff2g are fine
    decision = decide_names([NameUser(key(n)) for n in ("cam", "cam-1", "cam-17ff2g")])
    assert decision.owners == {"cam": "default", "cam-1": "default", "cam-17ff2g": "default"}
    # a name in use only through Instances (its Configuration deleted, draining) counts too
    decision = decide_names([NameUser(key("cam"), has_instances=True), NameUser(key("cam-abcdef"))])
    assert set(decision.refused) == {key("cam-abcdef")}


def test_shortened_names_that_collide_are_one_name() -> None:
    """A name over 59 characters is cut to 50 + '-' + 8 hex for its resource name; a
    Configuration literally named like the result would share akri.sh/<name>."""
    long = "a" * 70
    from agent.core.model.naming import configuration_resource_name, instance_prefix

    literal = configuration_resource_name(long)
    assert literal != long and len(literal) == 59
    decision = decide_names([NameUser(key(long), "2"), NameUser(key(literal, "other"), "1")])
    assert decision.owners == {literal: "other"}
    assert "long names are shortened" in decision.refused[key(long)]
    # the same through the Instance prefix (52 characters)
    prefix = instance_prefix("b" * 55)
    decision = decide_names([NameUser(key("b" * 55), "1"), NameUser(key(prefix), "2")])
    assert decision.owners == {"b" * 55: "default"}
    assert set(decision.refused) == {key(prefix)}


def test_same_name_in_two_namespaces_keeps_the_namespace_rules() -> None:
    both = [NameUser(key("cam", "b"), "1"), NameUser(key("cam", "a"), "2")]
    assert decide_names(both).owners == {"cam": "b"}  # the oldest
    with_instances = [NameUser(key("cam", "b"), "1"), NameUser(key("cam", "a"), "2", True)]
    assert decide_names(with_instances).owners == {"cam": "a"}  # the one with Instances
    assert decide_names([NameUser(key("cam", "b")), NameUser(key("cam", "a"))]).owners == {
        "cam": "a"
    }


def test_a_local_agent_shows_the_refusal_in_akri_status(tmp_path: Path) -> None:
    """Local mode has no Events: ``akri status --state-dir`` says which Configuration is
    refused and why, and stops saying it once the other name is gone."""
    state = tmp_path / "state"
    configs = tmp_path / "configs"
    configs.mkdir()
    body = (
        "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata:\n  name: {name}\nspec:\n"
        "  discoveryHandler:\n    name: debugEcho\n    discoveryDetails: |+\n"
        '      descriptions: ["{device}"]\n  capacity: 1\n'
    )
    (configs / "cam.yaml").write_text(body.format(name="cam", device="d0"))
    (configs / "other.yaml").write_text(body.format(name="cam-17ff2a", device="d1"))
    agent = AgentProcess(
        ["--local", "--state-dir", str(state), "--config", str(configs), "--node-name", "lab",
         "--debug-echo-availability-file", str(tmp_path / "avail"), "--poll-interval", "0.2"],
    )  # fmt: skip
    try:

        def table() -> str:
            done = run_status(state, output="table")
            assert done.returncode in (0, 1), done.stderr
            return done.stdout

        line = "refused on lab: default/cam-17ff2a: akri.sh/cam-17ff2a has the shape of an"
        poll_until(lambda: line in table(), timeout=60, message=lambda: table() + agent.log_text())
        names = {item["metadata"]["name"] for item in read_status(state)}
        assert names == {CAM_D0}  # cam's Instance only
        (configs / "cam.yaml").unlink()  # the other name goes: cam-17ff2a may run
        poll_until(
            lambda: "refused" not in table() and "cam-17ff2a-" in table(),
            timeout=60,
            message=lambda: table() + agent.log_text(),
        )
    finally:
        agent.cleanup()


def no_agent_can_run(obj: dict[str, Any], why: str) -> dict[str, Any]:
    """``obj`` with a handler no agent embeds, or discoveryDetails its handler refuses."""
    handler = obj["spec"]["discoveryHandler"]
    if why == "unknown-handler":
        handler["name"] = "zigbee"
    else:
        handler["discoveryDetails"] = "{}"  # debugEcho: descriptions is required
    return obj


@pytest.mark.parametrize("why", ["unknown-handler", "bad-details"])
@pytest.mark.parametrize("order", ["newer", "older"])
async def test_a_configuration_no_agent_can_run_takes_no_name(
    api: ApiServerDouble, tmp_path: Path, why: str, order: str
) -> None:
    """Issue 34.4: ``tenant-b/cam``, which no agent can run, beside ``default/cam-202406``
    (whose name has the shape of ``cam``'s Instance names). Created after it (the reported
    case: it switched the running one off, its plugins stopped and new pods failed) or
    before it, it claims nothing: ``cam-202406`` serves, ``tenant-b/cam`` is the one refused."""
    serving = configuration("cam-202406", "d1")
    invalid = no_agent_can_run(configuration("cam", "d0", "tenant-b"), why)
    resource = "akri.sh/cam-202406"
    node: DpNode | None = None
    try:
        if order == "older":
            api.create(invalid)
            await asyncio.sleep(1.1)  # creationTimestamps have whole seconds
        api.create(serving)
        node = await start_dp_node(api, "node-a", tmp_path)
        await node.kubelet.wait_registered(resource, timeout=30)
        await eventually(lambda: node is not None and node.kubelet.allocatable(resource) == 1,
                         what="cam-202406's vdev")  # fmt: skip
        first = [r for r in node.kubelet.all_registrations if r.resource_name == resource]
        if order == "newer":
            api.create(invalid)
        await eventually(lambda: bool(name_conflicts(api, "cam")), what="tenant-b/cam refused")
        (event,) = name_conflicts(api, "cam")
        assert event["involvedObject"]["namespace"] == "tenant-b"
        assert "the resource name of Configuration default/cam-202406" in event["message"]
        assert not name_conflicts(api, "cam-202406")
        assert node.discovery.ownership.owns(ObjectKey("default", "cam-202406"))
        assert [r for r in node.kubelet.all_registrations if r.resource_name == resource] == first
        pod = await node.kubelet.admit_pod("default", "user", [("c", {resource: 1})])
        assert pod.admitted, pod.message
        assert pod.containers[0].envs["DEBUG_ECHO_DESCRIPTION"] == "d1"
    finally:
        if node is not None:
            await node.stop()
