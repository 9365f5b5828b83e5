"""The ``akri.sh/slots`` finalizer (issue 30, 1): pure decisions, the local store's API-server
semantics for finalizers and ``deletionTimestamp``, and the ledger keeping a deleted Instance
until its last held slot is released."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.ledger.decisions import Owner
from agent.core.ledger.finalizer import (
    decide_release_share,
    finalizer_done,
    release_finalizer_share,
    settle_finalizer,
)
from agent.core.ledger.ledger import SlotLedger, SlotRefusedError
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import DRAINING_ANNOTATION, SLOTS_FINALIZER
from agent.core.store.base import NotFoundError, StoreError
from agent.core.store.local import LocalInstanceStore

NAME = "cfg-abcdef"
KEY = ObjectKey("default", NAME)
SLOT0, SLOT1 = f"{NAME}-0", f"{NAME}-1"


def make(**changes: object) -> Instance:
    base = Instance(
        name=NAME,
        configuration_name="cfg",
        capacity=2,
        nodes=("node-a", "node-b"),
        shared=True,
        device_usage={SLOT0: "", SLOT1: ""},
    )
    return base.evolve(**changes)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LocalInstanceStore]:
    result = LocalInstanceStore(tmp_path, poll_interval=0.05)
    await result.start()
    yield result
    await result.close()


# -- pure ----------------------------------------------------------------------------------


def test_a_live_instance_gets_the_finalizer_once() -> None:
    settled = settle_finalizer(make(finalizers=("other",)))
    assert settled.finalizers == ("other", SLOTS_FINALIZER)
    assert settle_finalizer(settled) is settled


def test_a_terminating_instance_keeps_it_while_a_slot_is_held() -> None:
    held = make(
        finalizers=(SLOTS_FINALIZER,),
        deletion_timestamp="2026-01-01T00:00:00Z",
        device_usage={SLOT0: "node-a", SLOT1: ""},
    )
    assert not finalizer_done(held)
    assert settle_finalizer(held) is held
    free = held.evolve(device_usage={SLOT0: "", SLOT1: ""})
    assert finalizer_done(free)
    assert settle_finalizer(free).finalizers == ()
    # never added to a terminating object (the API server refuses that)
    assert settle_finalizer(free.evolve(finalizers=())).finalizers == ()


def test_a_dead_nodes_share_is_released() -> None:
    terminating = make(
        finalizers=(SLOTS_FINALIZER,),
        deletion_timestamp="2026-01-01T00:00:00Z",
        device_usage={SLOT0: "node-b", SLOT1: "D:uid-1:node-a"},
        annotations={DRAINING_ANNOTATION: "node-a,node-b"},
    )
    after_b = decide_release_share(terminating, "node-b")
    assert after_b is not None
    assert after_b.device_usage == {SLOT0: "", SLOT1: "D:uid-1:node-a"}  # node-a's untouched
    assert after_b.nodes == ("node-a",) and after_b.draining_nodes == ("node-a",)
    assert after_b.finalizers == (SLOTS_FINALIZER,)  # node-a still holds one
    after_a = decide_release_share(after_b, "node-a")
    assert after_a is not None and after_a.finalizers == ()
    assert decide_release_share(make(), "node-a") is None  # a live Instance: not here
    assert decide_release_share(after_a, "node-c") is None


# -- local store ------------------------------------------------------------------------------


async def test_local_store_honours_finalizers_like_the_api_server(
    store: LocalInstanceStore,
) -> None:
    created = await store.create(
        make(finalizers=(SLOTS_FINALIZER,), deletion_timestamp="2020-01-01T00:00:00Z")
    )
    assert created.deletion_timestamp is None  # a server field: not taken from a create
    await store.delete(KEY)
    terminating = await store.get(KEY)
    assert terminating.deletion_timestamp is not None
    assert store.get_cached(KEY) == terminating
    await store.delete(KEY)  # again: nothing changes
    assert (await store.get(KEY)).resource_version == terminating.resource_version
    with pytest.raises(StoreError, match="no new finalizers"):
        await store.update(terminating.evolve(finalizers=(SLOTS_FINALIZER, "more")))
    # an update cannot clear deletionTimestamp either
    kept = await store.update(terminating.evolve(deletion_timestamp=None, labels={"a": "b"}))
    assert kept.deletion_timestamp == terminating.deletion_timestamp
    await store.update(kept.evolve(finalizers=()))
    with pytest.raises(NotFoundError):
        await store.get(KEY)
    assert store.get_cached(KEY) is None


async def test_local_store_deletes_at_once_without_finalizers(store: LocalInstanceStore) -> None:
    await store.create(make())
    await store.delete(KEY)
    with pytest.raises(NotFoundError):
        await store.get(KEY)


# -- ledger -----------------------------------------------------------------------------------


async def test_ledger_keeps_a_deleted_instance_until_its_last_slot_is_released(
    store: LocalInstanceStore,
) -> None:
    a, b = SlotLedger(store, "node-a"), SlotLedger(store, "node-b")
    created = await a.create_instance(make())
    assert created.finalizers == (SLOTS_FINALIZER,)
    owner_a, owner_b = Owner.instance_level("node-a"), Owner.instance_level("node-b")
    await a.claim(KEY, SLOT0, owner_a)
    await b.claim(KEY, SLOT1, owner_b)
    await store.delete(KEY)
    # terminating: no new slot, but kubelet re-asking for a held one is granted
    with pytest.raises(SlotRefusedError) as refused:
        await a.claim_any(KEY, Owner.configuration_level("vdev", "node-a"))
    assert refused.value.reason in ("Deleting", "CapacityReached")
    assert not (await a.claim(KEY, SLOT0, owner_a)).changed
    await a.release(KEY, SLOT0, owner_a)
    assert (await store.get(KEY)).finalizers == (SLOTS_FINALIZER,)  # node-b still holds one
    await b.release(KEY, SLOT1, owner_b)  # the last one: the finalizer goes in this write
    with pytest.raises(NotFoundError):
        await store.get(KEY)


async def test_settle_removes_the_finalizer_of_a_free_terminating_instance(
    store: LocalInstanceStore,
) -> None:
    ledger = SlotLedger(store, "node-a")
    await ledger.create_instance(make())
    await ledger.claim(KEY, SLOT0, Owner.instance_level("node-a"))
    assert not await ledger.settle_finalizer(KEY)  # live: nothing to settle
    await store.delete(KEY)
    assert not await ledger.settle_finalizer(KEY)  # a slot is held
    # freed by someone else's write (e.g. an Akri agent), not through a release here
    current = await store.get(KEY)
    await store.update(current.evolve(device_usage={SLOT0: "", SLOT1: ""}))
    assert await ledger.settle_finalizer(KEY)
    assert store.get_cached(KEY) is None


async def test_existing_instances_get_the_finalizer_on_join(store: LocalInstanceStore) -> None:
    await store.create(make())  # written by an older agent (or Akri): no finalizer
    ledger = SlotLedger(store, "node-a")
    await ledger.join_instance(KEY, lambda current: None, check_evidence=True)
    assert (await store.get(KEY)).finalizers == (SLOTS_FINALIZER,)


async def test_release_finalizer_share_for_the_controller(store: LocalInstanceStore) -> None:
    a = SlotLedger(store, "node-a")
    await a.create_instance(make())
    await a.claim(KEY, SLOT0, Owner.instance_level("node-a"))
    await store.create(make(name="cfg-live00", finalizers=(SLOTS_FINALIZER,)))
    await store.delete(KEY)
    # node-a died holding slot 0: the controller's cleanup releases its share
    assert await release_finalizer_share(store, "node-a") == [KEY]
    with pytest.raises(NotFoundError):
        await store.get(KEY)
    # a live Instance is left to the cleanup's own decisions
    assert (await store.get(ObjectKey("default", "cfg-live00"))).nodes == ("node-a", "node-b")


async def test_local_mode_log_lines_speak_of_files_not_finalizers(
    store: LocalInstanceStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 34.15: local mode has no API server and no finalizer for a user to know of; the
    line says what happened in its terms. Another store (the API server's) keeps the word."""
    import logging

    ledger = SlotLedger(store, "node-a")
    await ledger.create_instance(make())
    await ledger.claim(KEY, SLOT0, Owner.instance_level("node-a"))
    await store.delete(KEY)  # kept: a slot is held
    current = await store.get(KEY)  # freed by another agent's write
    await store.update(current.evolve(device_usage={SLOT0: "", SLOT1: ""}))
    with caplog.at_level(logging.INFO, logger="agent"):
        assert await ledger.settle_finalizer(KEY)
    lines = [r.getMessage() for r in caplog.records if NAME in r.getMessage()]
    assert any("no slot is held any more; deleted as asked" in line for line in lines), lines
    assert not [line for line in lines if "finalizer" in line], lines

    caplog.clear()
    store.local = False  # as the API server's store is: the same write, in its terms
    await ledger.create_instance(make())
    await ledger.claim(KEY, SLOT0, Owner.instance_level("node-a"))
    await store.delete(KEY)
    current = await store.get(KEY)
    await store.update(current.evolve(device_usage={SLOT0: "", SLOT1: ""}))
    with caplog.at_level(logging.INFO, logger="agent"):
        assert await ledger.settle_finalizer(KEY)
    assert any("its finalizer is removed" in r.getMessage() for r in caplog.records)
