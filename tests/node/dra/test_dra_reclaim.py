"""DRA slots that no claim uses any more are freed; prepared ones survive restarts (issue 11).

Unit tests of the classification, then the agent (with its DRA driver) against the API
double and the DRA kubelet double: an interrupted prepare whose claim is deleted, one whose
claim is still allocated, a slot no checkpoint knows, and a restart that finds a prepared
claim's slot free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.core.ledger.decisions import Owner, held_count
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.local import LocalInstanceStore
from agent.node.deviceplugin.held_slots import HeldSlot
from agent.node.dra.checkpoint import Checkpoint, PendingClaim, PreparedClaim, PreparedDevice
from agent.node.dra.reclaim import ClaimSlotState, DraReclaimer, claim_slots_in, classify
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import allocate_claim, create_claim
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually

KEY = ObjectKey("default", "cam-8120fe")
CLAIMS = "resourceclaims.resource.k8s.io"


def held(slot: str = "cam-8120fe-0", uid: str = "u1") -> HeldSlot:
    return HeldSlot(KEY, slot, f"D:{uid}:node-a", "akri.sh", uid)


def checkpoint(tmp_path: Path) -> Checkpoint:
    return Checkpoint(tmp_path / "checkpoint.json")


def allocated(uid: str, device: str, pool: str = "cam-8120fe") -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "name": "c", "namespace": "default"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"driver": "akri.sh", "pool": pool, "device": device, "request": "r"}
                    ]
                }
            }
        },
    }


def test_claim_slots_are_this_nodes_d_values() -> None:
    instance = Instance(
        "cam-8120fe",
        "cam",
        4,
        device_usage={
            "cam-8120fe-0": "D:u1:node-a",
            "cam-8120fe-1": "D:u2:node-b",
            "cam-8120fe-2": "node-a",
            "cam-8120fe-3": "D:bad",
        },
    )
    assert claim_slots_in(instance, "node-a") == (held(),)


def test_classification(tmp_path: Path) -> None:
    book = checkpoint(tmp_path)
    pool = lambda _slot: "cam-8120fe"  # noqa: E731
    assert classify(held(), book, None, pool) is ClaimSlotState.UNTRACEABLE
    device = PreparedDevice(("r",), "cam-8120fe", "cam-8120fe-0", "cam-8120fe", "cam-8120fe-0", ())
    book.claims["u1"] = PreparedClaim("u1", "default", "c", (device,))
    assert classify(held(), book, None, pool) is ClaimSlotState.PREPARED
    # prepared, but on another slot: this one is left over
    assert classify(held("cam-8120fe-1"), book, None, pool) is ClaimSlotState.STALE
    del book.claims["u1"]
    book.pending["u1"] = PendingClaim("u1", "default", "c")
    assert classify(held(), book, None, pool) is ClaimSlotState.STALE  # claim gone
    claim = allocated("u1", "cam-8120fe-0")
    assert classify(held(), book, claim, pool) is ClaimSlotState.ALLOCATED
    assert classify(held(), book, allocated("u9", "cam-8120fe-0"), pool) is ClaimSlotState.STALE
    assert classify(held(), book, allocated("u1", "cam-8120fe-1"), pool) is ClaimSlotState.STALE
    unallocated = {"metadata": {"uid": "u1"}, "status": {}}
    assert classify(held(), book, unallocated, pool) is ClaimSlotState.STALE


def test_checkpoint_keeps_preparing_claims_and_reads_version_1(tmp_path: Path) -> None:
    book = checkpoint(tmp_path)
    book.pending["u1"] = PendingClaim("u1", "ns", "c")
    book.save()
    again = checkpoint(tmp_path)
    again.load()
    assert again.pending == {"u1": PendingClaim("u1", "ns", "c")}
    old = tmp_path / "v1.json"
    old.write_text(
        '{"version": 1, "preparedClaims": {"u2": {"uid": "u2", "namespace": "default", '
        '"name": "c2", "devices": [{"request_names": ["r"], "pool": "p", "device": "d", '
        '"instance": "i", "slot": "i-0", "cdi_device_ids": ["x"], "share_id": null}]}}}'
    )
    v1 = Checkpoint(old)
    v1.load()
    assert v1.claims["u2"].devices[0].namespace == "default" and v1.pending == {}


# -- the agent -----------------------------------------------------------------------------------


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def dra_node(api: ApiServerDouble, tmp_path: Path, **kwargs: Any) -> tuple[DpNode, Any]:
    node = await start_dp_node(api, "node-a", tmp_path, dra=True, **kwargs)
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    await kubelet.start()
    await kubelet.wait_for_registration("akri.sh", timeout=30)
    return node, kubelet


def published(api: ApiServerDouble) -> bool:
    """Some ResourceSlice offers a device (the scheduler emulator can allocate)."""
    return any(o["spec"].get("devices") for o in api.list("resourceslices.resource.k8s.io"))


async def interrupted_prepare(node: DpNode, uid: str, name: str, slot: str) -> None:
    """What an agent killed between claiming a slot and finishing the prepare leaves."""
    state = node.agent.dra_state
    assert state is not None
    state.checkpoint.pending[uid] = PendingClaim(uid, "default", name)
    state.checkpoint.save()
    await node.ledger.claim(KEY, slot, Owner.claim(uid, "node-a"))


async def dra_passes(node: DpNode, count: int) -> None:
    reclaimer = node.dra_reclaimer
    assert reclaimer is not None
    target = reclaimer.passes + count
    await eventually(lambda: reclaimer.passes >= target, within=10, what="DRA reclaim passes")


async def test_the_slot_of_an_interrupted_prepare_is_freed_once_its_claim_is_gone(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Before, ``D:`` slots were never reclaimed: a prepare cut short leaked its slot."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node, kubelet = await dra_node(api, tmp_path, reclaim_grace=0.3)
    try:
        await eventually(lambda: published(api), what="slices")
        claim = create_claim(api, "default", "c1")
        allocate_claim(api, "default", "c1", "node-a", pod_name="p", pod_uid="p")
        uid = claim["metadata"]["uid"]
        allocated_to = api.get(CLAIMS, "c1", "default")
        assert allocated_to is not None
        device = allocated_to["status"]["allocation"]["devices"]["results"][0]["device"]
        await interrupted_prepare(node, uid, "c1", device)
        await dra_passes(node, 6)  # still allocated to it: kept (kubelet retries the prepare)
        assert held_count(api_instances(api)["cam-8120fe"]) == 1
        api.delete(CLAIMS, "c1", "default")
        await eventually(
            lambda: held_count(api_instances(api)["cam-8120fe"]) == 0, what="slot freed"
        )
        state = node.agent.dra_state
        assert state is not None and uid not in state.checkpoint.pending
    finally:
        await kubelet.stop()
        await node.stop()


async def test_a_slot_no_checkpoint_knows_is_kept_and_reported_once(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node, kubelet = await dra_node(api, tmp_path, reclaim_grace=0.2)
    try:
        await eventually(lambda: "cam-8120fe" in api_instances(api))
        with caplog.at_level(logging.ERROR):
            await node.ledger.claim(KEY, "cam-8120fe-1", Owner.claim("lost-uid", "node-a"))
            await dra_passes(node, 6)
        reports = [r for r in caplog.records if "does not know" in r.getMessage()]
        assert len(reports) == 1 and "lost-uid" in reports[0].getMessage()
        assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-1"] == (
            "D:lost-uid:node-a"
        )
    finally:
        await kubelet.stop()
        await node.stop()


async def test_a_restart_takes_a_prepared_claims_slot_back(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """The Instance lost the claim's slot while the agent was down (re-created, edited): the
    restarted agent compares its checkpoint with the Instances and holds the slot again."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node, kubelet = await dra_node(api, tmp_path)
    try:
        await eventually(lambda: published(api), what="slices")
        claim = create_claim(api, "default", "c1")
        uid = claim["metadata"]["uid"]
        allocate_claim(api, "default", "c1", "node-a", pod_name="p", pod_uid="p")
        results = await kubelet.prepare("p", [("default", uid, "c1")])
        assert not results[uid].error, results[uid].error
        slot = next(
            s
            for s, v in api_instances(api)["cam-8120fe"].device_usage.items()
            if v.startswith("D:")
        )
        base = node.base
        await node.stop(keep_files=True)
        obj = api.get("instances.akri.sh", "cam-8120fe", "default")
        assert obj is not None
        obj["spec"]["deviceUsage"][slot] = ""  # lost while the agent was down
        api.apply(obj)
        node = await start_dp_node(api, "node-a", tmp_path, dra=True, base=base)
        assert api_instances(api)["cam-8120fe"].device_usage[slot] == f"D:{uid}:node-a"
    finally:
        await kubelet.stop()
        await node.stop()


# -- quiet when idle (issue 17) --------------------------------------------------------------


class _Counted:
    """An ``asyncio.sleep`` stand-in that counts calls and sets ``slept``."""

    def __init__(self) -> None:
        self.calls = 0
        self.slept = asyncio.Event()

    async def sleep(self, _seconds: float) -> None:
        self.calls += 1
        self.slept.set()
        await asyncio.Future()  # park: one pass is all this test needs


async def test_no_pass_and_no_timer_while_this_node_holds_no_claim_slot(tmp_path: Path) -> None:
    """It used to wake every second even with nothing held; now an Instance event that
    gives this node a ``D:`` slot is what starts the passes."""
    store = LocalInstanceStore(tmp_path / "state")
    await store.start()
    await store.create(Instance("cam-8120fe", "cam", 2, nodes=("node-a",)))
    state = SimpleNamespace(
        ledger=SlotLedger(store, "node-a"),
        node="node-a",
        checkpoint=Checkpoint(tmp_path / "checkpoint.json"),  # no release pending
    )
    timer = _Counted()

    async def no_claims(_namespace: str, _name: str) -> None:
        return None

    reclaimer = DraReclaimer(
        state,  # type: ignore[arg-type]
        store.subscribe_instances,
        no_claims,
        store.get_cached,
        sleep=timer.sleep,
    )
    task = asyncio.create_task(reclaimer.run())
    try:
        await asyncio.wait_for(reclaimer.idle.wait(), 10)
        assert timer.calls == 0 and reclaimer.passes == 0
        current = store.get_cached(KEY)
        assert current is not None
        await store.update(
            current.evolve(device_usage={**current.device_usage, "cam-8120fe-0": "D:u1:node-a"})
        )
        await asyncio.wait_for(timer.slept.wait(), 10)
        assert reclaimer.passes == 1 and not reclaimer.idle.is_set()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()


async def test_a_slot_unprepared_while_a_pass_waited_is_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30 (6): a pass that built its slot index, then waited for the DRA state's lock
    while an unprepare freed the slot and forgot the claim, took the freed slot for one of a
    claim the checkpoint does not know, and logged an ERROR telling the operator to hand-edit
    ``deviceUsage``. The index is brought up to date under the lock and the slot re-checked."""
    store = LocalInstanceStore(tmp_path / "state")
    await store.start()
    await store.create(
        Instance("cam-8120fe", "cam", 2, nodes=("node-a",), device_usage={"cam-8120fe-0": ""})
    )
    ledger = SlotLedger(store, "node-a")
    owner = Owner.claim("u1", "node-a")
    await ledger.claim(KEY, "cam-8120fe-0", owner)
    book = checkpoint(tmp_path)
    device = PreparedDevice(("r",), "cam-8120fe", "cam-8120fe-0", "cam-8120fe", "cam-8120fe-0", ())
    book.record_prepared(PreparedClaim("u1", "default", "c", (device,)))
    lock = asyncio.Lock()
    state = SimpleNamespace(ledger=ledger, node="node-a", checkpoint=book, lock=lambda: lock)

    async def no_claims(_namespace: str, _name: str) -> None:
        return None

    reclaimer = DraReclaimer(
        state,  # type: ignore[arg-type]
        store.subscribe_instances,
        no_claims,
        store.get_cached,
        grace=0.0,
    )
    assert await reclaimer.reclaim_once() == []  # prepared: kept; the index has the slot
    with caplog.at_level(logging.ERROR):
        async with lock:  # an unprepare in progress
            waiting = asyncio.create_task(reclaimer.reclaim_once())
            await asyncio.sleep(0.05)  # the pass refreshed its index and waits for the lock
            assert not waiting.done()
            await ledger.release(KEY, "cam-8120fe-0", owner)
            book.forget(["u1"])
        assert await waiting == []
    assert [r for r in caplog.records if "does not know" in r.getMessage()] == []
    await store.close()


async def test_a_failing_release_backs_off_and_is_logged_rarely(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30 (7), DRA side: during an outage the stale slot's release was tried, and
    logged, at every pass. Now it backs off (1 s doubling) and is logged at most every 30 s."""
    from agent.core.store.base import StoreUnavailableError

    store = LocalInstanceStore(tmp_path / "state")
    await store.start()
    await store.create(
        Instance("cam-8120fe", "cam", 2, nodes=("node-a",), device_usage={"cam-8120fe-0": ""})
    )
    now = [50.0]
    ledger = SlotLedger(store, "node-a", clock=lambda: now[0])
    await ledger.claim(KEY, "cam-8120fe-0", Owner.claim("u1", "node-a"))  # granted at 50
    now[0] = 100.0
    book = checkpoint(tmp_path)
    book.record_preparing(PendingClaim("u1", "default", "c"))  # its claim is gone: stale
    lock = asyncio.Lock()
    state = SimpleNamespace(ledger=ledger, node="node-a", checkpoint=book, lock=lambda: lock)

    async def no_claims(_namespace: str, _name: str) -> None:
        return None

    reclaimer = DraReclaimer(
        state,  # type: ignore[arg-type]
        store.subscribe_instances,
        no_claims,
        store.get_cached,
        grace=0.0,
        clock=lambda: now[0],
    )
    attempts: list[float] = []
    real_update = store.update

    async def unavailable(instance: Instance) -> Instance:
        attempts.append(now[0])
        raise StoreUnavailableError("connection refused")

    store.update = unavailable  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="agent.node.dra.reclaim"):
        for _ in range(20):  # a pass a second
            await reclaimer.reclaim_once()
            now[0] += 1.0
    assert attempts == [100.0, 101.0, 103.0, 107.0, 115.0]
    assert len([r for r in caplog.records if "cannot free DRA slot" in r.getMessage()]) == 1
    store.update = real_update  # type: ignore[method-assign]
    now[0] = 131.0
    assert [s.slot for s in await reclaimer.reclaim_once()] == ["cam-8120fe-0"]
    await store.close()
