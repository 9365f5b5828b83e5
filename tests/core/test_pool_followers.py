"""Which nodes an agent follows to decide a shared pool (issue 41 after issue 39.4): the nodes
just before it in publisher order, back to the first that serves."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.model.resource_slices import (
    nodes_to_follow,
    publisher_order,
    shared_pool_nodes,
    shared_publisher,
)


@dataclass(frozen=True)
class Shared:
    nodes: tuple[str, ...]
    draining_nodes: tuple[str, ...] = ()
    offline_nodes: tuple[str, ...] = ()


FIFTY = Shared(tuple(f"node-{i:03d}" for i in range(50)))


def test_each_node_follows_the_node_before_it_and_the_publisher_none() -> None:
    assert nodes_to_follow(FIFTY, "node-030") == ("node-029",)
    assert nodes_to_follow(FIFTY, "node-001") == ("node-000",)
    assert nodes_to_follow(FIFTY, "node-000") == ()


def test_the_walk_goes_back_past_nodes_known_not_to_serve() -> None:
    assert nodes_to_follow(FIFTY, "node-030", unready={"node-029"}) == ("node-028", "node-029")
    assert nodes_to_follow(FIFTY, "node-030", unready={"node-029", "node-027"}) == (
        "node-028",
        "node-029",
    )
    # every node before it is down: it publishes, knowing all of them down
    down = {f"node-{i:03d}" for i in range(30)}
    assert nodes_to_follow(FIFTY, "node-030", unready=down) == FIFTY.nodes[:30]


def test_a_node_that_does_not_serve_the_pool_follows_none() -> None:
    draining = Shared(("a", "b", "c"), draining_nodes=("b",))
    assert nodes_to_follow(draining, "b") == ()
    assert nodes_to_follow(draining, "c") == ("a",)
    assert nodes_to_follow(Shared(("a", "b")), "z") == ()


def test_nodes_that_see_the_device_come_before_those_offline() -> None:
    instance = Shared(("a", "b", "c", "d"), offline_nodes=("a", "c"))
    assert publisher_order(instance) == ("b", "d", "a", "c")
    assert publisher_order(instance, "b", offline_here=True) == ("d", "a", "b", "c")
    assert nodes_to_follow(instance, "d") == ("b",)
    assert nodes_to_follow(instance, "b") == ()
    # a node offline follows none while another node sees the device: it cannot publish
    assert nodes_to_follow(instance, "a") == ()
    assert nodes_to_follow(instance, "a", unready={"b", "d"}) == ()
    assert nodes_to_follow(instance, "b", offline_here=True) == ()
    assert nodes_to_follow(instance, "d", offline_here=True) == ()


def test_the_nodes_offline_publish_only_when_none_sees_the_device() -> None:
    instance = Shared(("a", "b", "c", "d"), offline_nodes=("a", "c"))
    assert shared_pool_nodes(instance) == (("b", "d"), False)
    assert shared_pool_nodes(instance, unready={"b"}) == (("d",), False)
    # the nodes that see it are down: nobody publishes, the offline ones do not stand in
    assert shared_pool_nodes(instance, unready={"b", "d"}) == ((), False)
    assert shared_publisher(instance, "a", unready={"b", "d"}) is None
    # every node offline: the pool lists them all (tainted), the first that serves publishes
    gone = Shared(("a", "b", "c", "d"), offline_nodes=("a", "b", "c", "d"))
    assert shared_pool_nodes(gone, unready={"a"}) == (("b", "c", "d"), True)
    assert shared_publisher(gone, "c", unready={"a"}) == "b"
    assert nodes_to_follow(gone, "c") == ("b",)
    assert nodes_to_follow(gone, "c", unready={"b"}) == ("a", "b")


def test_a_change_of_order_moves_only_the_nodes_next_to_it() -> None:
    """node-000, the publisher, goes offline (its mark lands): node-001 publishes and follows
    none, node-000 still follows none (before: it then followed the last node); every other
    node keeps following the node it followed. Half the nodes losing the device moves none of
    the others but the new publisher."""
    offline = Shared(FIFTY.nodes, offline_nodes=("node-000",))
    moved = [n for n in FIFTY.nodes if nodes_to_follow(offline, n) != nodes_to_follow(FIFTY, n)]
    assert moved == ["node-001"]
    assert nodes_to_follow(offline, "node-000") == nodes_to_follow(offline, "node-001") == ()
    half = Shared(FIFTY.nodes, offline_nodes=FIFTY.nodes[:25])
    moved = [n for n in FIFTY.nodes[25:] if nodes_to_follow(half, n) != nodes_to_follow(FIFTY, n)]
    assert moved == ["node-025"]
    assert all(nodes_to_follow(half, n) == () for n in FIFTY.nodes[:25])


NAMES = st.sampled_from([f"n{i}" for i in range(6)])


@settings(max_examples=400, deadline=None)
@given(
    nodes=st.lists(NAMES, min_size=1, max_size=6, unique=True),
    draining=st.sets(NAMES),
    offline=st.sets(NAMES),
    unready=st.sets(NAMES),
    node=NAMES,
    offline_here=st.booleans(),
)
def test_following_only_those_nodes_decides_as_following_every_node(
    nodes: list[str],
    draining: set[str],
    offline: set[str],
    unready: set[str],
    node: str,
    offline_here: bool,
) -> None:
    """What a node knows of the nodes it follows and of itself (the others unknown, counted as
    serving)
    tells it whether it publishes exactly as knowing every node would."""
    instance = Shared(
        tuple(nodes),
        tuple(n for n in nodes if n in draining),
        tuple(n for n in nodes if n in offline),
    )
    followed = set(nodes_to_follow(instance, node, offline_here, unready))
    known_unready = unready & (followed | {node})  # a node always follows its own standing
    truth = shared_publisher(instance, node, offline_here, unready)
    seen = shared_publisher(instance, node, offline_here, known_unready)
    assert (seen == node) == (truth == node)
    if truth == node:
        # its pool leaves out the nodes it knows not to serve, and selects every node that
        # serves (the others are selected on the Instance's word)
        known, _ = shared_pool_nodes(instance, node, offline_here, known_unready)
        really, _ = shared_pool_nodes(instance, node, offline_here, unready)
        assert set(really) <= set(known)
        assert not set(known) & known_unready
    # the walk is a fixed point once every followed node is read: following what it names
    # with what is known of those gives the same nodes again
    assert set(nodes_to_follow(instance, node, offline_here, known_unready)) == followed
