"""DRA pure logic: typed attributes, device names, pools, CDI specs, checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.instance import Instance
from agent.core.model.naming import DRAINING_ANNOTATION, is_dns_label
from agent.core.store.base import CorruptStateError
from agent.node.deviceplugin.container_env import ContainerEdits
from agent.node.dra.cdi import (
    CdiDevice,
    CdiWriter,
    cdi_device_name,
    qualified,
    safe_token,
    spec_for,
)
from agent.node.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from agent.node.dra.slices import (
    MAX_ATTRIBUTES,
    attribute_name,
    desired_pools,
    device_attributes,
    device_name,
    slot_for_device,
    typed_attribute,
)
from discovery_handlers.base import DeviceSpec, Mount


def inst(
    name: str, shared: bool, nodes: tuple[str, ...], capacity: int = 2, **usage: str
) -> Instance:
    mapping = {f"{name}-{i}": "" for i in range(capacity)}
    mapping.update({f"{name}-{k[1:]}": v for k, v in usage.items()})
    return Instance(
        name=name,
        configuration_name="cams",
        capacity=capacity,
        shared=shared,
        nodes=nodes,
        device_usage=mapping,
        broker_properties={"FPS": "30", "COLOR": "true", "FW": "1.2.3", "MODEL": "X-100"},
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("30", {"int": 30}),
        ("-7", {"int": -7}),
        ("true", {"bool": True}),
        ("False", {"bool": False}),
        ("1.2.3", {"version": "1.2.3"}),
        ("2.0.0-rc.1+build.5", {"version": "2.0.0-rc.1+build.5"}),
        ("1.2", {"string": "1.2"}),
        ("x" * 64, {"string": "x" * 64}),
        ("x" * 65, None),
        ("99999999999999999999", {"string": "99999999999999999999"}),
    ],
)
def test_typed_attributes(value: str, expected: object) -> None:
    assert typed_attribute(value) == expected


def test_attribute_names_are_c_identifiers() -> None:
    assert attribute_name("DEBUG_ECHO_DESCRIPTION") == "DEBUG_ECHO_DESCRIPTION"
    assert attribute_name("a-b.c") == "a_b_c"
    assert attribute_name("9x") == "_9x"
    assert attribute_name("x" * 33) is None


def test_device_attributes_reserved_first_and_limited() -> None:
    instance = inst("cams-aaaaaa", True, ("n1",)).evolve(
        broker_properties={f"P{i:02d}": str(i) for i in range(40)}
    )
    attributes = device_attributes(instance, 1)
    assert attributes["configuration"] == {"string": "cams"}
    assert attributes["slot"] == {"int": 1} and attributes["shared"] == {"bool": True}
    assert len(attributes) == MAX_ATTRIBUTES


def test_device_names_are_dns_labels() -> None:
    assert device_name("cams-aaaaaa-0") == "cams-aaaaaa-0"
    dotted = device_name("cams.lobby-aaaaaa-0")
    assert is_dns_label(dotted) and dotted != device_name("cams-lobby-aaaaaa-0")


def test_pools_local_and_shared_with_single_publisher() -> None:
    local = inst("cams-llllll", False, ("n1",), s0="n1")  # IL-held slot leaves the slice
    shared = inst("cams-ssssss", True, ("n2", "n1"), s1="D:uid:n2")  # DRA-held stays
    gone = inst("cams-oooooo", True, ("n1",))
    pools = desired_pools([local, shared, gone], "n1", offline={"cams-oooooo"})
    by_name = {p.name: p for p in pools}
    assert by_name["n1"].node_name == "n1"
    assert [d["name"] for d in by_name["n1"].devices] == ["cams-llllll-1"]
    assert [d["name"] for d in by_name["cams-ssssss"].devices] == ["cams-ssssss-0", "cams-ssssss-1"]
    spec = by_name["cams-ssssss"].slice_specs()[0]
    (term,) = spec["nodeSelector"]["nodeSelectorTerms"]  # the API allows exactly one term
    assert term == {
        "matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n1", "n2"]}
        ]
    }
    # offline (grace period): still published, tainted so the scheduler skips the slots
    offline = by_name["cams-oooooo"].devices
    assert [d["name"] for d in offline] == ["cams-oooooo-0", "cams-oooooo-1"]
    assert all(
        d["taints"] == [{"key": "akri.sh/offline", "value": "n1", "effect": "NoSchedule"}]
        for d in offline
    )
    # n2 is not the publisher of the shared pool (n1 sorts first)
    assert [p.name for p in desired_pools([shared], "n2", set())] == ["n2"]


def test_big_pools_split_into_slices_of_128() -> None:
    many = [inst(f"cams-{i:06x}", False, ("n1",), capacity=10) for i in range(30)]
    (pool,) = desired_pools(many, "n1", set())
    specs = pool.slice_specs()
    assert [len(s["devices"]) for s in specs] == [128, 128, 44]
    empty = desired_pools([], "n1", set())[0].slice_specs()
    assert empty == [{"driver": "akri.sh", "devices": [], "nodeName": "n1"}]


def test_device_resolution() -> None:
    local = inst("cams-llllll", False, ("n1",))
    shared = inst("cams-ssssss", True, ("n1", "n2"))
    instances = {i.name: i for i in (local, shared)}
    assert slot_for_device("n1", "cams-llllll-1", instances, "n1") == (local, "cams-llllll-1")
    assert slot_for_device("cams-ssssss", "cams-ssssss-0", instances, "n2") == (
        shared,
        "cams-ssssss-0",
    )
    assert slot_for_device("n1", "nope", instances, "n1") is None
    assert slot_for_device("other-node", "cams-llllll-1", instances, "n1") is None


def test_cdi_spec_and_safe_paths(tmp_path: Path) -> None:
    edits = ContainerEdits(
        envs={"A": "1"},
        device_specs=[DeviceSpec("/dev/video0", "/dev/video0", "rw")],
        mounts=[Mount("/data", "/host", True)],
    )
    name = cdi_device_name("0a1b-uid", "cams-aaaaaa-0")
    spec = spec_for([CdiDevice(name, edits)])
    assert spec["kind"] == "k8s.akri.sh/device" and spec["cdiVersion"] == "0.5.0"
    device = spec["devices"][0]
    assert device["containerEdits"]["env"] == ["A=1"]
    assert device["containerEdits"]["deviceNodes"][0]["hostPath"] == "/dev/video0"
    assert qualified(name) == f"k8s.akri.sh/device={name}"
    writer = CdiWriter(tmp_path / "cdi")
    for hostile in ["../../etc/passwd", "a/b", "..", "x" * 300, "\x00"]:
        path = writer.path_for(hostile)
        assert path.parent == (tmp_path / "cdi").resolve()
        assert safe_token(hostile).startswith("h")
    written = writer.write("uid-1", [CdiDevice(name, edits)])
    assert json.loads(written.read_text()) == spec
    writer.remove("uid-1")
    assert not written.exists()
    writer.remove("uid-1")  # idempotent


def test_checkpoint_round_trip_and_corruption(tmp_path: Path) -> None:
    path = tmp_path / "cp" / "checkpoint.json"
    checkpoint = Checkpoint(path)
    claim = PreparedClaim(
        "uid-1",
        "ns",
        "c",
        (PreparedDevice(("req",), "n1", "cams-a-0", "cams-a", "cams-a-0", ("k=x",)),),
    )
    checkpoint.claims["uid-1"] = claim
    checkpoint.save()
    again = Checkpoint(path)
    again.load()
    assert again.claims == {"uid-1": claim}
    path.write_text("{broken")
    broken = Checkpoint(path)
    # never "starting empty": that would leave the claims' D: slots untraceable for good
    with pytest.raises(CorruptStateError, match=str(path)):
        broken.load()


def test_an_empty_pool_stored_without_devices_is_unchanged() -> None:
    """A real API server stores ``devices: []`` as absent: the publisher must neither
    rewrite the slice on every sync nor report dropped fields (issue 12)."""
    from agent.node.dra.slices import Pool, same_slice_content

    wanted = Pool(name="node-a", node_name="node-a").slice_specs()[0]
    assert wanted["devices"] == []
    stored = {k: v for k, v in wanted.items() if k != "devices"}
    stored["pool"] = {"name": "node-a", "generation": 1, "resourceSliceCount": 1}
    assert same_slice_content(stored, wanted)
    assert not same_slice_content({**stored, "devices": [{"name": "x"}]}, wanted)


def test_a_draining_node_publishes_none_of_the_instances_slots() -> None:
    """The stored draining mark counts even when the offline set does not list the Instance
    (adopted draining after another node re-created it)."""
    local = inst("cams-llllll", False, ("n1",), s0="n1").with_node_mark(
        DRAINING_ANNOTATION, "n1", True
    )
    shared = inst("cams-ssssss", True, ("n1", "n2"), s0="n1").with_node_mark(
        DRAINING_ANNOTATION, "n1", True
    )
    by_name = {p.name: p for p in desired_pools([local, shared], "n1", offline=set())}
    assert by_name["n1"].devices == ()
    assert "cams-ssssss" not in by_name  # the shared pool: see the test below
    # draining on another node does not hide the slots n1 publishes for its own pool
    other = inst("cams-mmmmmm", False, ("n1",)).with_node_mark(DRAINING_ANNOTATION, "n2", True)
    assert len(desired_pools([other], "n1", offline=set())[0].devices) == 2


def test_a_shared_pool_is_published_by_and_for_its_serving_nodes() -> None:
    """A node that only drains a shared Instance (it lost the device, a pod still holds its
    slot there) neither publishes the pool nor is in its nodeSelector: the first serving node
    publishes the free slots for the serving nodes. Before: the draining node, sorting
    first, kept publishing the pool empty for every node until its pod ended (issue 33.1)."""
    shared = inst("cams-ssssss", True, ("n1", "n2", "n3"), s0="n1").with_node_mark(
        DRAINING_ANNOTATION, "n1", True
    )
    assert [p.name for p in desired_pools([shared], "n1", offline=set())] == ["n1"]
    assert [p.name for p in desired_pools([shared], "n3", offline=set())] == ["n3"]
    pool = {p.name: p for p in desired_pools([shared], "n2", offline=set())}["cams-ssssss"]
    assert pool.nodes == ("n2", "n3")
    assert [d["name"] for d in pool.devices] == ["cams-ssssss-1"]
    # every node drains: the first one keeps the pool, empty, for all of them
    both = shared.with_node_mark(DRAINING_ANNOTATION, "n2", True).with_node_mark(
        DRAINING_ANNOTATION, "n3", True
    )
    pool = {p.name: p for p in desired_pools([both], "n1", offline=set())}["cams-ssssss"]
    assert (pool.nodes, pool.devices) == (("n1", "n2", "n3"), ())


def test_a_shared_pool_follows_the_nodes_that_see_the_device() -> None:
    """Each node records its own offline grace in the Instance (``akri.sh/offline.<node>``):
    the pool selects the serving nodes without a mark, untainted, published by the first of
    them; only when every one is offline does it list them all, tainted (issue 33.1). Before:
    the first node decided alone from its own view and tainted the pool for every node."""
    from agent.core.model.naming import offline_annotation

    def marked(*offline: str) -> Instance:
        instance = inst("cams-ssssss", True, ("n1", "n2", "n3"))
        return instance.evolve(annotations={offline_annotation(n): "t" for n in offline})

    def pools(
        instance: Instance, node: str, offline: frozenset[str] = frozenset()
    ) -> dict[str, Any]:
        found = desired_pools([instance], node, offline)
        return {p.name: p for p in found if p.node_name is None}

    # n1, the first, lost the device and said so: n2 publishes for n2 and n3, untainted
    one = marked("n1")
    assert pools(one, "n1") == {} and pools(one, "n3") == {}
    pool = pools(one, "n2")["cams-ssssss"]
    assert pool.nodes == ("n2", "n3")
    assert [d.get("taints") for d in pool.devices] == [None, None]
    # n1 before its mark reached the Instance: it steps back at once, n2 does not know yet
    assert pools(marked(), "n1", frozenset({"cams-ssssss"})) == {}
    assert pools(marked(), "n2") == {}
    # n1 sees it again, its mark not yet cleared: it stays out until the others know too
    assert pools(one, "n1") == {}
    # every node offline: the first publishes for all of them, tainted
    everyone = marked("n1", "n2", "n3")
    pool = pools(everyone, "n1")["cams-ssssss"]
    assert pool.nodes == ("n1", "n2", "n3")
    taint = {"key": "akri.sh/offline", "value": "n1", "effect": "NoSchedule"}
    assert [d["taints"] for d in pool.devices] == [[taint], [taint]]
    assert pools(everyone, "n2") == {} and pools(everyone, "n3") == {}
    # the last node to lose it, before its mark lands: the others still see it there
    assert pools(marked("n1", "n2"), "n3", frozenset({"cams-ssssss"})) == {}
    assert pools(marked("n1", "n2"), "n1") == {}
    assert pools(marked("n1", "n2"), "n3")["cams-ssssss"].nodes == ("n3",)


def test_selected_nodes_reads_back_both_stored_forms() -> None:
    """A pool written before the selector changed form (matchFields metadata.name, in one or
    several terms) is read back like the current form (one hostname-label term), so its new
    publisher recognises and adopts it."""
    from agent.node.dra.slices import selected_nodes, shared_node_selector

    current = {"nodeSelector": shared_node_selector(["n2", "n1", "n1"])}
    assert current["nodeSelector"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [
        "n1",
        "n2",
    ]
    assert selected_nodes(current) == {"n1", "n2"}
    legacy = {
        "nodeSelector": {
            "nodeSelectorTerms": [
                {
                    "matchFields": [
                        {"key": "metadata.name", "operator": "In", "values": ["n1", "n3"]}
                    ]
                },
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n4"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["n9"]}]},
            ]
        }
    }
    assert selected_nodes(legacy) == {"n1", "n3", "n4"}
    assert selected_nodes({"nodeName": "n1"}) == set()


def test_a_shared_pool_is_published_by_the_first_node_whose_node_serves() -> None:
    """Issue 39.4: a node whose Node is NotReady (deleted, out-of-service) neither publishes
    a shared pool nor is selected by it — also in its own view, so that a partitioned node's
    still-running agent steps back — and when none of its nodes serves, nobody publishes it
    (the controller deletes what is left)."""
    shared = inst("cams-ssssss", True, ("n1", "n2", "n3"), s0="n1")

    def pools(node: str, unready: frozenset[str]) -> dict[str, Any]:
        found = desired_pools([shared], node, set(), unready=unready)
        return {p.name: p for p in found if p.node_name is None}

    assert pools("n1", frozenset())["cams-ssssss"].nodes == ("n1", "n2", "n3")
    for node in ("n1", "n3"):
        assert pools(node, frozenset({"n1"})) == {}
    pool = pools("n2", frozenset({"n1"}))["cams-ssssss"]
    assert pool.nodes == ("n2", "n3")
    assert [d["name"] for d in pool.devices] == ["cams-ssssss-1"]  # n1's slot stays held
    assert all(pools(n, frozenset({"n1", "n2", "n3"})) == {} for n in ("n1", "n2", "n3"))
