"""A node's own offline marks on shared Instances (issue 33.1): their names, how the Instance
reads them, flap damping, which marks a pass writes, and the ledger's write of them (the local
store's membership write; the Kubernetes one is covered with several agents in
tests/node/dra/test_dra_shared_offline.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent.core.ledger.decisions import Drain, Leave, decide_leave
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import OFFLINE_ANNOTATION, offline_annotation
from agent.core.store.local import LocalInstanceStore
from agent.node.discovery.offline_marks import OfflineDamper, OfflineMarks, mark_changes


def shared(*nodes: str, **annotations: str) -> Instance:
    return Instance(
        name="cam-8120fe",
        configuration_name="cam",
        capacity=2,
        shared=True,
        nodes=nodes,
        device_usage={"cam-8120fe-0": "", "cam-8120fe-1": ""},
        annotations=annotations,
    )


def test_every_node_gets_a_valid_key_of_its_own() -> None:
    """``akri.sh/offline.<node>``; a node name too long (or not fit) for an annotation key's
    63-character name part is cut and suffixed with a digest, so two long names that share a
    prefix still get different keys."""
    assert offline_annotation("node-a") == "akri.sh/offline.node-a"
    long_a, long_b = "n" * 60 + ".a", "n" * 60 + ".b"
    key_a, key_b = offline_annotation(long_a), offline_annotation(long_b)
    assert key_a != key_b
    for key in (key_a, key_b, offline_annotation("Node_With.Odd-"), offline_annotation("-")):
        prefix, name = key.split("/")
        assert prefix == "akri.sh" and 0 < len(name) <= 63
        assert name[0].isalnum() and name[-1].isalnum()


def test_the_instance_reads_each_members_mark_and_an_earlier_agents_list() -> None:
    instance = shared(
        "node-a",
        "node-b",
        "node-c",
        **{offline_annotation("node-b"): "2026-01-01T00:00:00Z", OFFLINE_ANNOTATION: "node-c"},
    )
    assert instance.offline_nodes == ("node-b", "node-c")
    assert instance.offline_since("node-b") == "2026-01-01T00:00:00Z"
    # a mark of a node no longer listed says nothing about the pool
    assert shared("node-a", **{offline_annotation("node-x"): "t"}).offline_nodes == ()
    cleared = instance.without_offline_mark("node-b").without_offline_mark("node-c")
    assert cleared.offline_nodes == () and dict(cleared.annotations) == {}


def test_a_leave_or_a_drain_clears_the_nodes_own_mark() -> None:
    marked = shared("node-a", "node-b", **{offline_annotation("node-a"): "t"})
    left = decide_leave(marked, "node-a")
    assert isinstance(left, Leave)
    assert offline_annotation("node-a") not in left.instance.annotations
    held = marked.evolve(device_usage={"cam-8120fe-0": "node-a", "cam-8120fe-1": ""})
    drain = decide_leave(held, "node-a")
    assert isinstance(drain, Drain) and drain.instance is not None
    assert drain.instance.offline_nodes == () and drain.instance.draining_nodes == ("node-a",)


def test_offline_at_once_online_after_a_hold_that_doubles_while_it_blinks() -> None:
    damper = OfflineDamper(first=1.0, longest=8.0, quiet=30.0)
    assert damper.update({"cam"}, now=0.0, wall=0.0) is None
    assert damper.published == {"cam"} and damper.since("cam") == "1970-01-01T00:00:00Z"
    # back at once: held offline until the first hold is over
    assert damper.update(set(), now=0.1, wall=0.1) == 1.0
    assert damper.published == {"cam"}
    damper.update(set(), now=1.0, wall=1.0)
    assert damper.published == frozenset()
    # gone again soon after: the hold doubles, and blinks within it change nothing
    damper.update({"cam"}, now=1.5, wall=1.5)
    assert damper.update(set(), now=1.6, wall=1.6) == 3.5
    damper.update({"cam"}, now=2.0, wall=2.0)
    damper.update(set(), now=3.0, wall=3.0)
    assert damper.published == {"cam"}
    damper.update(set(), now=3.5, wall=3.5)
    assert damper.published == frozenset()
    for start in (4.0, 9.0, 20.0):  # 4 s, 8 s, then capped at 8 s
        damper.update({"cam"}, now=start, wall=start)
        deadline = damper.update(set(), now=start + 0.1, wall=start)
    assert deadline == 28.0
    # quiet for long enough: the next loss starts again with the first hold
    damper.update(set(), now=28.0, wall=28.0)
    damper.update({"cam"}, now=70.0, wall=70.0)
    assert damper.update(set(), now=70.1, wall=70.1) == 71.0


def test_which_marks_a_pass_writes() -> None:
    damper = OfflineDamper()
    damper.update({"cam-8120fe"}, now=0.0, wall=0.0)
    mine = offline_annotation("node-a")
    plain = shared("node-a", "node-b")
    # offline here, not marked: mark it (not while draining, not when not a member)
    since = damper.since(plain.name)
    assert mark_changes([plain], "node-a", damper, set(), set()) == [(plain, since)]
    assert mark_changes([plain], "node-a", damper, set(), {"cam-8120fe"}) == []
    assert mark_changes([shared("node-b")], "node-a", damper, set(), set()) == []
    local = plain.evolve(shared=False)
    assert mark_changes([local], "node-a", damper, set(), set()) == []
    # marked, and still offline: nothing; seen again (held no longer): clear it
    marked = shared("node-a", "node-b", **{mine: "t"})
    assert mark_changes([marked], "node-a", damper, set(), set()) == []
    online = OfflineDamper()
    assert mark_changes([marked], "node-a", online, {"cam-8120fe"}, set()) == [(marked, None)]
    # not reported by discovery (its handler has not listed since the start): left as it is
    assert mark_changes([marked], "node-a", online, set(), set()) == []
    # a mark left behind by a node that is no longer a member goes
    gone = shared("node-b", **{mine: "t"})
    assert mark_changes([gone], "node-a", online, set(), set()) == [(gone, None)]


async def test_the_ledger_marks_and_clears_through_the_membership_write(tmp_path: Path) -> None:
    """On the local store: one write each, no resourceVersion precondition, the node's entry
    kept; a leave then takes the entry and the mark in one membership write."""
    store = LocalInstanceStore(tmp_path / "state")
    await store.start()
    try:
        created = await store.create(shared("node-a", "node-b"))
        key = created.key
        ledger = SlotLedger(store, "node-a")
        assert await ledger.mark_offline(key, "2026-01-01T00:00:00Z")
        stored = await store.get(key)
        assert stored.offline_nodes == ("node-a",) and stored.nodes == ("node-a", "node-b")
        assert not await ledger.mark_offline(key, "2026-01-01T00:00:05Z")  # marked already
        assert await ledger.mark_offline(key, None)
        assert (await store.get(key)).offline_nodes == ()
        await ledger.mark_offline(key, "2026-01-01T00:00:10Z")
        version = (await store.get(key)).resource_version
        left = await ledger.leave(key)
        stored = await store.get(key)
        assert left.left and stored.nodes == ("node-b",) and stored.annotations == {}
        assert int(stored.resource_version or 0) == int(version or 0) + 1  # one write
        # node-b is not node-a's to mark; an Instance node-a is not in is not marked
        assert not await ledger.mark_offline(key, "2026-01-01T00:00:20Z")
        assert not await ledger.mark_offline(ObjectKey("default", "nope"), "t")
    finally:
        await store.close()


async def test_a_pass_marks_the_damped_set_and_tells_the_publisher(tmp_path: Path) -> None:
    store = LocalInstanceStore(tmp_path / "state")
    await store.start()
    try:
        created = await store.create(shared("node-a", "node-b"))
        raw: set[str] = {created.name}
        now = [0.0]
        told: list[frozenset[str]] = []
        marks = OfflineMarks(
            store,
            SlotLedger(store, "node-a"),
            "node-a",
            store.list_cached,
            lambda: raw,
            lambda: set() if raw else {created.name},
            set,
            clock=lambda: now[0],
            wall=lambda: 1_800_000_000.0,
        )
        marks.add_listener(lambda: told.append(marks.offline()))
        await marks.sync()
        assert told == [{created.name}] and marks.writes == 1
        assert store.get_cached(created.key).offline_since("node-a") == "2027-01-15T08:00:00Z"
        raw.clear()
        assert await marks.sync() == 1.0  # held until then
        assert marks.writes == 1
        now[0] = 1.0
        await marks.sync()
        assert told[-1] == frozenset() and marks.writes == 2
        assert store.get_cached(created.key).offline_nodes == ()
        await asyncio.sleep(0)
    finally:
        await store.close()


async def test_a_failing_write_is_retried_later_and_does_not_hold_the_others(
    tmp_path: Path,
) -> None:
    """The API server fails a mark's write: one warning, that Instance is retried after a
    pause, and the pass stops there (each of the others would wait out its own timeout);
    the next pass writes the others."""
    from agent.core.store.base import StoreError

    store = LocalInstanceStore(tmp_path / "state")
    await store.start()
    try:
        first = await store.create(shared("node-a", "node-b"))
        second = await store.create(shared("node-a", "node-b").evolve(name="cam-a19705"))
        ledger = SlotLedger(store, "node-a")
        calls: list[str] = []
        real = ledger.mark_offline

        async def flaky(key: ObjectKey, since: str | None) -> bool:
            calls.append(key.name)
            if len(calls) == 1:
                raise StoreError("the API server did not answer")
            return await real(key, since)

        ledger.mark_offline = flaky  # type: ignore[method-assign]
        now = [0.0]
        marks = OfflineMarks(
            store,
            ledger,
            "node-a",
            store.list_cached,
            lambda: {first.name, second.name},
            set,
            set,
            clock=lambda: now[0],
        )
        assert await marks.sync() == 1.0  # retry the failed one then
        assert calls == [first.name] and marks.writes == 0
        await marks.sync()  # the failed one waits; the other is written
        assert calls == [first.name, second.name] and marks.writes == 1
        now[0] = 1.0
        await marks.sync()
        assert calls[-1] == first.name and marks.writes == 2
        assert all(i.offline_nodes == ("node-a",) for i in store.list_cached())
    finally:
        await store.close()
