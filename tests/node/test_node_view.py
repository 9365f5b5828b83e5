"""A node pays for its own devices, not for the cluster's (issue 41, DESIGN invariant 11).

An agent watches only the Instances that concern its node (label ``node.akri.sh/<hash>``,
kept by every write of ours), finds a shared Instance other nodes created by its name, and
labels Instances written without the labels (Akri's agent, earlier versions) when it touches
them or, at start, when they list it. Against the API-server double, which filters watches by
label selector as kube-apiserver's watch cache does."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import akri_digest, instance_name
from agent.core.model.node_labels import (
    LABELLED,
    NODE_LABEL_PREFIX,
    concerned_nodes_of,
    labels_current,
    node_label,
    with_node_labels,
)
from agent.core.store.base import EventType
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import (
    CRDS,
    debug_echo_configuration,
    eventually,
    start_node,
)

INSTANCES = "instances.akri.sh"
SHARED = instance_name("cam", akri_digest("foo0"))  # debugEcho's device foo0, shared


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def foreign(index: int, configuration: str = "cam") -> dict[str, Any]:
    """Another node's local camera, as our agent on that node writes it."""
    name = f"{configuration}-{index:07x}"
    instance = Instance(
        name=name,
        configuration_name=configuration,
        capacity=1,
        nodes=(f"other-{index}",),
        device_usage={f"{name}-0": ""},
    )
    body = with_node_labels(instance.to_dict())
    body["apiVersion"], body["kind"] = "akri.sh/v0", "Instance"
    return body


def akri_written(
    name: str, nodes: list[str], usage: dict[str, str] | None = None
) -> dict[str, Any]:
    """An Instance as Akri's agent (or an earlier version of ours) writes it: no labels."""
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "configurationName": "cam",
            "capacity": 2,
            "shared": True,
            "nodes": nodes,
            "deviceUsage": usage or {f"{name}-0": "", f"{name}-1": ""},
            "brokerProperties": {},
            "cdiName": f"akri.sh/cam={name[-6:]}",
        },
    }


# -- the labels --------------------------------------------------------------------------------


def test_a_node_label_is_a_valid_label_key_for_any_node_name() -> None:
    """A node name is a DNS subdomain of up to 253 characters; a label key's name part holds
    63: the key carries a hash of it."""
    import re

    for node in ("a", "node-a", "x" * 253, "edge-7.factory.example.com"):
        key = node_label(node)
        prefix, name = key.split("/")
        assert prefix + "/" == NODE_LABEL_PREFIX
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9_.]*[a-z0-9])?", name) and len(name) <= 63
    assert node_label("node-a") != node_label("node-b")


def test_labels_follow_the_nodes_listed_and_the_slot_holders() -> None:
    """A node that left but still holds a slot keeps seeing the Instance (its slot must be
    freed); other labels stay as they are."""
    obj = akri_written("cam-aaaaaa", ["node-a"], {"cam-aaaaaa-0": "C:0:node-b", "cam-aaaaaa-1": ""})
    obj["metadata"]["labels"] = {"akri.sh/configuration": "cam", node_label("gone"): ""}
    assert concerned_nodes_of(obj) == {"node-a", "node-b"}
    assert not labels_current(obj)
    labelled = with_node_labels(obj)
    assert labelled["metadata"]["labels"] == {
        "akri.sh/configuration": "cam",
        node_label("node-a"): "",
        node_label("node-b"): "",
        LABELLED: "v1",
    }
    assert labels_current(labelled)


# -- what a node pays for the rest of the cluster ---------------------------------------------


async def test_a_node_caches_none_of_a_thousand_foreign_instances_and_ignores_their_churn(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: every agent listed, cached and logged every Instance of the cluster (one INFO
    line per foreign update). Now the API server sends it only its own."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    for index in range(1000):
        api.create(foreign(index))
    caplog.set_level(logging.INFO)
    node = await start_node(api, "node-a", tmp_path)
    events = node.store.subscribe_instances()
    try:
        await eventually(
            lambda: node.store.get_cached(ObjectKey("default", SHARED)) is not None,
            what="node-a's own Instance",
        )
        assert [i.name for i in node.store.list_cached()] == [SHARED]
        assert list(node.store._instance_informer.cache) == [f"default/{SHARED}"]
        while events.pending():
            await events.__anext__()
        # the other nodes' churn: their Instances change, one is deleted, one is added
        caplog.clear()
        mark = len(api.requests)
        for index in range(0, 1000, 10):
            obj = api.get(INSTANCES, f"cam-{index:07x}", "default")
            assert obj is not None
            obj["spec"]["deviceUsage"][f"cam-{index:07x}-0"] = f"other-{index}"
            api.apply(obj)
        api.delete(INSTANCES, f"cam-{1:07x}", "default")
        api.create(foreign(5000))
        # the node's own Instance changes after them: once it is seen, all of them were sent
        own = api.get(INSTANCES, SHARED, "default")
        assert own is not None
        own["metadata"].setdefault("annotations", {})["marker"] = "after the churn"
        api.apply(own)
        await eventually(
            lambda: (
                "marker"
                in getattr(node.store.get_cached(ObjectKey("default", SHARED)), "annotations", {})
            ),
            what="node-a's own change",
        )
        seen = []
        while events.pending():
            seen.append(await events.__anext__())
        assert [(e.type, e.instance.name) for e in seen] == [(EventType.MODIFIED, SHARED)]
        assert [r for r in api.requests[mark:] if r.verb != "watch"] == []
        assert not [r for r in caplog.records if "cam-0" in r.getMessage()]
        assert node.store.relabelled == 0
    finally:
        events.close()
        await node.stop()


async def test_a_node_joins_a_shared_instance_other_nodes_created_by_its_name(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its view does not show the Instance (it does not list the node yet): the create is
    refused (AlreadyExists) and the node joins with its membership apply at once — two
    requests, no read — and then sees it."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node_b = await start_node(api, "node-b", tmp_path)
    try:
        await eventually(lambda: api.get(INSTANCES, SHARED, "default") is not None)
        mark = len(api.requests)
        node_a = await start_node(api, "node-a", tmp_path)
        try:
            await eventually(
                lambda: node_a.store.get_cached(ObjectKey("default", SHARED)) is not None,
                what="node-a joined and sees it",
            )
            stored = api.get(INSTANCES, SHARED, "default")
            assert stored is not None and sorted(stored["spec"]["nodes"]) == ["node-a", "node-b"]
            assert labels_current(stored)
            writes = [
                (r.verb, r.status)
                for r in api.requests[mark:]
                if r.info.resource == "instances"
                and r.info.name in ("", SHARED)
                and r.verb not in ("list", "watch")
            ]
            assert writes == [("create", 409), ("patch", 200)]
            # node-b's view shows node-a's join (its own Instance changed)
            await eventually(
                lambda: "node-a" in node_b.store.get_cached(ObjectKey("default", SHARED)).nodes
            )
            # leaving takes node-a's label with its entry: its view drops the Instance (said
            # as such, not as a deletion)
            caplog.set_level(logging.INFO, logger="agent.instances")
            node_a.offline()
            await eventually(
                lambda: node_a.store.get_cached(ObjectKey("default", SHARED)) is None,
                what="node-a left and no longer sees it",
            )
            left = api.get(INSTANCES, SHARED, "default")
            assert left is not None and left["spec"]["nodes"] == ["node-b"]
            assert node_label("node-a") not in left["metadata"]["labels"]
            lines = [r.getMessage() for r in caplog.records if r.name == "agent.instances"]
            assert any(
                line.startswith(f"instance {SHARED}: ") and "no longer concerns this node" in line
                for line in lines
            )
            assert f"instance {SHARED} deleted" not in lines
            # it left it itself: known to exist without asking (the DRA publisher asks
            # before it deletes a shared pool whose Instance its view no longer shows)
            mark = len(api.requests)
            assert await node_a.store.instance_exists(SHARED)
            assert await node_a.store.instance_exists("cam-abcdef") is False
            asked = [r for r in api.requests[mark:] if r.verb != "watch"]
            assert [(r.verb, r.query.get("fieldSelector")) for r in asked] == [
                ("list", "metadata.name=cam-abcdef")
            ]
        finally:
            await node_a.stop()
    finally:
        await node_b.stop()


async def test_an_instance_of_another_device_with_the_same_name_is_not_joined(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """A digest collision with an Instance this node's view does not show: the membership
    apply carries the device's fingerprint, the other device's refuses it (a field manager
    conflict), and the device gets the next candidate name."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    other = akri_written(SHARED, ["node-b"])
    other["metadata"]["annotations"] = {"akri.sh/device-digest": "f" * 32}
    other["metadata"]["labels"] = {node_label("node-b"): "", LABELLED: "v1"}
    api.create(other)
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(
            lambda: any(i.name != SHARED and "node-a" in i.nodes for i in node.store.list_cached()),
            what="node-a's Instance under another name",
        )
        untouched = api.get(INSTANCES, SHARED, "default")
        assert untouched is not None and untouched["spec"]["nodes"] == ["node-b"]
    finally:
        await node.stop()


# -- Instances written without the labels -----------------------------------------------------


async def test_an_akri_written_shared_instance_is_joined_and_labelled(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Akri's agent on node-b created the shared Instance (no labels): node-a, which sees the
    device, joins it and labels it, and node-b's label is there too (from its content)."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    api.create(akri_written(SHARED, ["node-b"]))
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(
            lambda: node.store.get_cached(ObjectKey("default", SHARED)) is not None,
            what="node-a joined the Akri-written Instance",
        )
        stored = api.get(INSTANCES, SHARED, "default")
        assert stored is not None and sorted(stored["spec"]["nodes"]) == ["node-a", "node-b"]
        assert labels_current(stored)
        assert {node_label("node-a"), node_label("node-b")} <= set(stored["metadata"]["labels"])
    finally:
        await node.stop()


async def test_an_unlabelled_instance_listing_the_node_is_found_at_start(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """An earlier version of ours left node-a in an Instance whose device node-a no longer
    sees (no labels): the start lists the unlabelled Instances (``!akri.sh/node-labels``),
    labels those that concern it — and node-a leaves it as it would have before."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    gone = instance_name("cam", akri_digest("gone-device"))
    api.create(akri_written(gone, ["node-a", "node-b"]))
    api.create(akri_written("cam-0000000", ["node-c"]))  # not node-a's: left as it is
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(
            lambda: api.get(INSTANCES, gone, "default")["spec"]["nodes"] == ["node-b"],
            what="node-a left the Instance of a device it does not see",
        )
        assert node.store.relabelled >= 1
        lists = [r.query.get("labelSelector") for r in api.requests if r.verb == "list"]
        assert "!akri.sh/node-labels" in lists
        others = api.get(INSTANCES, "cam-0000000", "default")
        assert others is not None and "labels" not in others["metadata"]
    finally:
        await node.stop()
