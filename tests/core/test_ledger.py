"""SlotLedger: claims through CAS writes, retries on conflict, never double-allocates."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from agent.core.ledger.decisions import Owner, SlotConflict, SlotsInUse, held_count
from agent.core.ledger.ledger import SlotLedger, SlotRefusedError, SlotWriteTimeoutError
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import ConflictError
from agent.core.store.cas import RetriesExhaustedError, RetryPolicy, cas_update
from agent.core.store.local import LocalInstanceStore
from tests.doubles.kubelet_fakes import ScriptedKubelet

NAME = "cfg-abcdef"
KEY = ObjectKey("default", NAME)


def make(capacity: int = 2) -> Instance:
    return Instance(
        name=NAME,
        configuration_name="cfg",
        capacity=capacity,
        nodes=("node-a", "node-b", "node-c"),
        shared=True,
        device_usage={f"{NAME}-{i}": "" for i in range(capacity)},
    )


@pytest.fixture
async def stores(tmp_path: Path) -> list[LocalInstanceStore]:
    """Three stores on one state dir: three 'nodes' with their own caches."""
    result = [LocalInstanceStore(tmp_path, poll_interval=0.05) for _ in range(3)]
    for store in result:
        await store.start()
    yield result  # type: ignore[misc]
    for store in result:
        await store.close()


async def test_claim_release_round_trip(stores: list[LocalInstanceStore]) -> None:
    await stores[0].create(make())
    ledger = SlotLedger(stores[0], "node-a")
    owner = Owner.instance_level("node-a")
    result = await ledger.claim(KEY, f"{NAME}-0", owner)
    assert result.changed and result.instance.device_usage[f"{NAME}-0"] == "node-a"
    again = await ledger.claim(KEY, f"{NAME}-0", owner)
    assert not again.changed
    assert await ledger.release(KEY, f"{NAME}-0", owner)
    assert not await ledger.release(KEY, f"{NAME}-0", owner)
    assert (await stores[0].get(KEY)).device_usage[f"{NAME}-0"] == ""


async def test_stale_cache_conflict_is_redecided(stores: list[LocalInstanceStore]) -> None:
    await stores[0].create(make())
    await stores[1].get(KEY)  # node-b caches the fresh Instance
    a = SlotLedger(stores[0], "node-a")
    b = SlotLedger(stores[1], "node-b")
    await a.claim(KEY, f"{NAME}-0", Owner.instance_level("node-a"))
    # node-b's cache still says slot 0 is free: the CAS write conflicts, it re-reads,
    # re-decides and is refused instead of overwriting node-a's claim
    with pytest.raises(SlotRefusedError) as info:
        await b.claim(KEY, f"{NAME}-0", Owner.instance_level("node-b"))
    assert info.value.reason == "SlotInUse"
    assert "node-a" in str(info.value)
    got = await b.claim_any(KEY, Owner.instance_level("node-b"))
    assert got.slot == f"{NAME}-1"


async def test_refusals_carry_reasons(stores: list[LocalInstanceStore]) -> None:
    await stores[0].create(make(capacity=1))
    ledger = SlotLedger(stores[0], "node-a")
    with pytest.raises(SlotRefusedError) as unknown:
        await ledger.claim(
            ObjectKey("default", "missing-abcdef"),
            "missing-abcdef-0",
            Owner.instance_level("node-a"),
        )
    assert unknown.value.reason == "UnknownInstance"
    with pytest.raises(SlotRefusedError) as slot:
        await ledger.claim(KEY, f"{NAME}-7", Owner.instance_level("node-a"))
    assert slot.value.reason == "UnknownSlot"
    await ledger.claim_any(KEY, Owner.claim("uid-1", "node-a"))
    with pytest.raises(SlotRefusedError) as full:
        await ledger.claim_any(KEY, Owner.instance_level("node-a"))
    assert full.value.reason == "CapacityReached"


async def test_release_values_only_own_node(stores: list[LocalInstanceStore]) -> None:
    await stores[0].create(make())
    ledger = SlotLedger(stores[0], "node-a")
    await ledger.claim(KEY, f"{NAME}-0", Owner.configuration_level("cfg-0", "node-a"))
    with pytest.raises(ValueError):
        await ledger.release_values(KEY, {"C:cfg-0:node-b"})
    assert await ledger.release_values(KEY, {"C:cfg-0:node-a"}) == (f"{NAME}-0",)


async def test_many_nodes_contending_never_exceed_capacity(
    stores: list[LocalInstanceStore],
) -> None:
    capacity = 3
    await stores[0].create(make(capacity=capacity))
    for store in stores[1:]:
        await store.get(KEY)
    nodes = ["node-a", "node-b", "node-c"]
    ledgers = [SlotLedger(store, node) for store, node in zip(stores, nodes, strict=True)]
    rng = random.Random(7)
    owners = [
        (ledger, Owner.claim(f"uid-{i}", ledger.node))
        for i, ledger in enumerate(rng.choice(ledgers) for _ in range(12))
    ]
    results = await asyncio.gather(
        *(ledger.claim_any(KEY, owner) for ledger, owner in owners), return_exceptions=True
    )
    granted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, SlotRefusedError)]
    assert len(granted) == capacity
    assert len(refused) == len(owners) - capacity
    final = await stores[0].get(KEY)
    assert held_count(final) == capacity
    holders = [v for v in final.device_usage.values() if v]
    assert len(set(holders)) == capacity  # every slot a different claim
    granted_slots = [r.slot for r in granted]  # type: ignore[union-attr]
    assert len(set(granted_slots)) == capacity


async def test_cas_update_gives_up_after_bounded_conflicts(
    stores: list[LocalInstanceStore],
) -> None:
    created = await stores[0].create(make())
    calls = 0

    def always_stale(instance: Instance) -> Instance:
        nonlocal calls
        calls += 1
        return instance.evolve(resource_version="999999")  # never current

    policy = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.002)
    with pytest.raises(RetriesExhaustedError):
        await cas_update(stores[0], created.key, always_stale, policy=policy)
    assert calls == 4
    with pytest.raises(ConflictError):
        await stores[0].update(created.evolve(resource_version="999999"))


async def test_release_keeps_slots_granted_after_the_evidence(
    stores: list[LocalInstanceStore],
) -> None:
    import time

    await stores[0].create(make())
    ledger = SlotLedger(stores[0], "node-a")
    owner = Owner.instance_level("node-a")
    await ledger.claim(KEY, f"{NAME}-0", owner)
    evidence = time.monotonic()  # "unused" observed now...
    await ledger.claim(KEY, f"{NAME}-0", owner)  # ...then re-granted (idempotent, no write)
    assert ledger.last_granted(KEY, f"{NAME}-0") is not None
    kept = await ledger.release_values(KEY, {"node-a"}, unless_granted_since=evidence)
    assert kept == ()
    freed = await ledger.release_values(KEY, {"node-a"}, unless_granted_since=time.monotonic() + 1)
    assert freed == (f"{NAME}-0",)


async def test_reclaimer_keeps_a_slot_re_granted_during_its_check(
    stores: list[LocalInstanceStore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the benchmark (premature releases under load): kubelet re-offers a slot this
    node still holds for a deleted pod; the idempotent re-grant writes nothing, so a reclaim
    decision based on an older pod-resources answer must not free it."""
    from agent.node.deviceplugin.reclaimer import SlotReclaimer

    await stores[0].create(make())
    ledger = SlotLedger(stores[0], "node-a")
    owner = Owner.instance_level("node-a")
    await ledger.claim(KEY, f"{NAME}-0", owner)  # held for a pod that is now gone
    now = [100.0]
    calls = 0

    async def stale_list() -> dict[str, frozenset[str]]:
        nonlocal calls
        calls += 1
        if calls == 2:
            # kubelet admits a new pod with the same device while our List is in flight
            await ledger.claim(KEY, f"{NAME}-0", owner)
        return {}  # the answer predates that admission

    kubelet = ScriptedKubelet(stale_list, clock=lambda: now[0])
    reclaimer = SlotReclaimer(
        ledger, stores[0].list_cached, kubelet, grace=3.0, clock=lambda: now[0]
    )
    monkeypatch.setattr("agent.core.ledger.ledger.time.monotonic", lambda: now[0])
    assert await reclaimer.reclaim_once() == []  # first seen unused at t=100
    now[0] = 104.0  # grace over
    assert await reclaimer.reclaim_once() == []  # but re-granted at t=104: kept
    assert (await stores[0].get(KEY)).device_usage[f"{NAME}-0"] == "node-a"
    now[0] = 105.0
    assert await reclaimer.reclaim_once() == []  # a new observation starts
    now[0] = 108.0
    freed = await reclaimer.reclaim_once()  # unused for the whole grace since: freed
    assert [h.slot for h in freed] == [f"{NAME}-0"]


async def test_reclaimer_frees_only_the_stale_il_slot(
    stores: list[LocalInstanceStore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the benchmark: IL values are just the node name, so two IL slots of one
    Instance held by this node share a value; freeing the stale one must not free the other."""
    from agent.node.deviceplugin.reclaimer import SlotReclaimer

    await stores[0].create(make())
    ledger = SlotLedger(stores[0], "node-a")
    owner = Owner.instance_level("node-a")
    await ledger.claim(KEY, f"{NAME}-0", owner)  # live pod
    await ledger.claim(KEY, f"{NAME}-1", owner)  # pod gone
    import time

    now = [time.monotonic() + 1]  # same clock as the ledger's grant times, after the grants
    kubelet = ScriptedKubelet(
        lambda: {f"akri.sh/{NAME}": frozenset({f"{NAME}-0"})}, clock=lambda: now[0]
    )
    reclaimer = SlotReclaimer(
        ledger, stores[0].list_cached, kubelet, grace=1.0, clock=lambda: now[0]
    )
    assert await reclaimer.reclaim_once() == []
    now[0] += 2
    freed = await reclaimer.reclaim_once()
    assert [h.slot for h in freed] == [f"{NAME}-1"]
    usage = (await stores[0].get(KEY)).device_usage
    assert usage == {f"{NAME}-0": "node-a", f"{NAME}-1": ""}


def test_regranted_takes_one_time_or_a_time_per_slot() -> None:
    from agent.core.ledger.decisions import regranted

    granted = {"s0": 5.0, "s1": 1.0, "s2": 3.0}
    assert regranted(granted, 3.0) == {"s0", "s2"}
    # each slot's own evidence time; a slot without one is not guarded
    assert regranted(granted, {"s0": 6.0, "s1": 1.0}) == {"s1"}


async def test_release_slots_frees_many_in_one_write_keeping_regranted_ones(
    stores: list[LocalInstanceStore],
) -> None:
    """The reclaimer releases all due slots of an Instance together; each slot carries the
    time its own evidence of non-use started."""
    from agent.core.store.cas import STATS

    await stores[0].create(make(capacity=3))
    now = [10.0]
    ledger = SlotLedger(stores[0], "node-a", clock=lambda: now[0])
    owner = Owner.instance_level("node-a")
    for index in range(3):
        await ledger.claim(KEY, f"{NAME}-{index}", owner)
    now[0] = 20.0
    await ledger.claim(KEY, f"{NAME}-1", owner)  # re-granted at 20 (writes nothing)
    assert ledger.last_granted(KEY, f"{NAME}-1") == 20.0
    writes = STATS.writes
    freed = await ledger.release_slots(
        KEY,
        {f"{NAME}-0": "node-a", f"{NAME}-1": "node-a", f"{NAME}-2": "node-a"},
        unless_granted_since={f"{NAME}-0": 15.0, f"{NAME}-1": 15.0, f"{NAME}-2": 15.0},
    )
    assert freed == (f"{NAME}-0", f"{NAME}-2")
    assert STATS.writes == writes + 1
    usage = (await stores[0].get(KEY)).device_usage
    assert usage == {f"{NAME}-0": "", f"{NAME}-1": "node-a", f"{NAME}-2": ""}
    # freed slots forget their grant: the next holder is granted (and recorded) anew
    assert ledger.last_granted(KEY, f"{NAME}-0") is None
    assert ledger.last_granted(KEY, f"{NAME}-1") == 20.0


async def test_release_slots_redecides_after_a_conflict(stores: list[LocalInstanceStore]) -> None:
    """A stale cache makes the batched release conflict: it re-reads and frees only the slots
    that still hold the expected value."""
    from agent.core.store.cas import STATS

    await stores[0].create(make(capacity=3))
    a = SlotLedger(stores[0], "node-a")
    await a.claim(KEY, f"{NAME}-0", Owner.instance_level("node-a"))
    await a.claim(KEY, f"{NAME}-1", Owner.instance_level("node-a"))
    cached = stores[0].get_cached(KEY)
    assert cached is not None
    # another writer frees slot 1 and node-b takes it; node-a's cache does not know yet
    current = await stores[1].get(KEY)
    usage = dict(current.device_usage)
    usage[f"{NAME}-1"] = "node-b"
    await stores[1].update(current.evolve(device_usage=usage))
    stores[0]._cache.put(cached)  # keep node-a's view stale until its write conflicts
    conflicts = STATS.conflicts
    freed = await a.release_slots(KEY, {f"{NAME}-0": "node-a", f"{NAME}-1": "node-a"})
    assert STATS.conflicts == conflicts + 1
    assert freed == (f"{NAME}-0",)
    final = await stores[0].get(KEY)
    assert final.device_usage == {f"{NAME}-0": "", f"{NAME}-1": "node-b", f"{NAME}-2": ""}


class CountingEvidence:
    """Evidence that node-a's kubelet shows slot 0 in use; counts the questions."""

    def __init__(self, in_use: SlotsInUse) -> None:
        self.answer = in_use
        self.asked = 0

    async def in_use(self, instance: Instance, not_before: float) -> SlotsInUse:
        self.asked += 1
        return self.answer


async def test_join_takes_the_free_slots_the_evidence_shows_in_use(
    stores: list[LocalInstanceStore],
) -> None:
    """Another node created the Instance (it could not see node-a's pod on slot 0)."""
    await stores[0].create(make().evolve(nodes=("node-b",)))
    evidence = CountingEvidence(SlotsInUse({f"{NAME}-0": "node-a"}))
    ledger = SlotLedger(stores[0], "node-a", evidence=evidence)

    def join(inst: Instance) -> Instance:
        return inst.evolve(nodes=(*inst.nodes, "node-a"))

    result = await ledger.join_instance(KEY, join)
    assert result.checked and result.adopted == ((f"{NAME}-0", "node-a"),)
    stored = await stores[0].get(KEY)
    assert stored.nodes == ("node-b", "node-a")
    assert stored.device_usage[f"{NAME}-0"] == "node-a"
    assert ledger.last_granted(KEY, f"{NAME}-0") is not None  # the reclaimer's guard
    # a member joining again does not ask kubelet, unless told to (the first join at start)
    again = await ledger.join_instance(KEY, lambda inst: None)
    assert not again.checked and evidence.asked == 1
    at_start = await ledger.join_instance(KEY, lambda inst: None, check_evidence=True)
    assert at_start.checked and at_start.adopted == () and evidence.asked == 2


async def test_rejoin_at_start_takes_a_slot_freed_while_the_agent_was_down(
    stores: list[LocalInstanceStore],
) -> None:
    await stores[0].create(make())  # node-a is a member, its slot shows free
    evidence = CountingEvidence(SlotsInUse({f"{NAME}-1": "node-a"}))
    ledger = SlotLedger(stores[0], "node-a", evidence=evidence)
    result = await ledger.join_instance(KEY, lambda inst: None, check_evidence=True)
    assert result.adopted == ((f"{NAME}-1", "node-a"),)
    assert (await stores[0].get(KEY)).device_usage[f"{NAME}-1"] == "node-a"


async def test_join_never_takes_a_slot_another_holder_has(
    stores: list[LocalInstanceStore],
) -> None:
    held = make().evolve(nodes=("node-b",), device_usage={f"{NAME}-0": "node-b", f"{NAME}-1": ""})
    await stores[0].create(held)
    ledger = SlotLedger(
        stores[0], "node-a", evidence=CountingEvidence(SlotsInUse({f"{NAME}-0": "node-a"}))
    )
    result = await ledger.join_instance(KEY, lambda inst: inst.evolve(nodes=("node-b", "node-a")))
    assert result.adopted == ()
    assert result.conflicts == (SlotConflict(f"{NAME}-0", "node-a", "node-b"),)
    stored = await stores[0].get(KEY)
    assert stored.device_usage == held.device_usage and "node-a" in stored.nodes


async def test_join_redecides_the_adoption_after_a_conflict(
    stores: list[LocalInstanceStore],
) -> None:
    """node-b takes slot 0 between node-a's read and its write: the retried write sees it and
    reports it instead of overwriting it."""
    await stores[0].create(make().evolve(nodes=("node-b",)))
    ledger_a = SlotLedger(
        stores[0], "node-a", evidence=CountingEvidence(SlotsInUse({f"{NAME}-0": "node-a"}))
    )
    await stores[0].get(KEY)  # node-a's cache: slot 0 free
    await SlotLedger(stores[1], "node-b").claim(KEY, f"{NAME}-0", Owner.instance_level("node-b"))
    result = await ledger_a.join_instance(
        KEY, lambda inst: inst.evolve(nodes=(*inst.nodes, "node-a"))
    )
    assert result.adopted == ()
    assert result.conflicts == (SlotConflict(f"{NAME}-0", "node-a", "node-b"),)
    assert (await stores[1].get(KEY)).device_usage[f"{NAME}-0"] == "node-b"


# -- evidence gathered on one version, written over another ---------------------------------------


def cl_checkpoint(path: Path, vdev: str, digest: str) -> None:
    """kubelet's checkpoint with one configuration-level container on ``vdev`` whose
    Allocate answer names the Instance with ``digest`` (env ``P`` and ``P_<DIGEST>``)."""
    import base64
    import json

    from agent.protos.deviceplugin.v1beta1 import api_pb2

    envs = {"P": "x", f"P_{digest.upper()}": "x"}
    alloc = base64.b64encode(api_pb2.ContainerAllocateResponse(envs=envs).SerializeToString())
    entry = {
        "PodUID": "pod",
        "ContainerName": "c",
        "ResourceName": "akri.sh/cam",
        "DeviceIDs": {"-1": [vdev]},
        "AllocResp": alloc.decode(),
    }
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": [entry]}, "Checksum": 0}))


async def test_join_adopts_on_an_instance_recreated_during_the_evidence_read(
    stores: list[LocalInstanceStore], tmp_path: Path
) -> None:
    """node-a holds a slot of the shared Instance as ``C:cam-0:node-a`` (version u1). Its
    first join at start reads kubelet's evidence on u1, where that container is already
    represented; meanwhile the Instance is deleted and node-b re-creates it with every slot
    free (u2). The join's write lands on u2: it must take a slot for the container there,
    or node-b hands out the slot the container uses."""
    from agent.node.kubelet.evidence import NodeEvidence
    from agent.node.kubelet.state import KubeletState

    name, value = "cam-8120fe", "C:cam-0:node-a"
    key = ObjectKey("default", name)
    free = {f"{name}-0": "", f"{name}-1": ""}
    old = Instance(
        name=name,
        configuration_name="cam",
        capacity=2,
        nodes=("node-a", "node-b"),
        shared=True,
        device_usage={**free, f"{name}-1": value},
    )
    u1 = await stores[0].create(old)
    checkpoint = tmp_path / "kubelet_internal_checkpoint"
    cl_checkpoint(checkpoint, "cam-0", "8120fe")
    kubelet = KubeletState(tmp_path / "no-pod-resources.sock", checkpoint)
    node_evidence = NodeEvidence("node-a", kubelet)
    recreated: list[Instance] = []

    class RecreatedWhileReading:
        async def in_use(self, instance: Instance, not_before: float) -> SlotsInUse:
            found = await node_evidence.in_use(instance, not_before)
            if recreated:
                return found
            assert instance.uid == u1.uid  # the evidence was read on u1
            await stores[1].delete(key)
            recreated.append(
                await stores[1].create(old.evolve(nodes=("node-b",), device_usage=free, uid=None))
            )
            return found

    ledger = SlotLedger(stores[0], "node-a", evidence=RecreatedWhileReading())
    result = await ledger.join_instance(
        key,
        lambda inst: None if "node-a" in inst.nodes else inst.evolve(nodes=(*inst.nodes, "node-a")),
        check_evidence=True,
    )
    assert recreated and recreated[0].uid != u1.uid
    stored = await stores[0].get(key)
    assert stored.uid == recreated[0].uid and stored.nodes == ("node-b", "node-a")
    assert list(stored.device_usage.values()).count(value) == 1, stored.device_usage
    assert result.instance.uid == stored.uid and result.adopted == ((f"{name}-1", value),)
    # and on the version it was read for, the represented container is not taken twice
    again = await ledger.join_instance(key, lambda inst: None, check_evidence=True)
    assert again.adopted == ()


async def test_evidence_parses_an_unchanged_checkpoint_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the pod-resources socket every Instance's evidence reads the checkpoint; an
    agent starting with many Instances must not parse the same file for each of them (before:
    twice per Instance). A changed file is parsed again."""
    from agent.node.kubelet import state as kubelet_state
    from agent.node.kubelet.evidence import NodeEvidence
    from agent.node.kubelet.state import KubeletState

    parsed: list[int] = []
    real = kubelet_state._checkpoint_entries

    def counting(raw: bytes) -> list[dict[str, object]]:
        parsed.append(len(raw))
        return real(raw)

    monkeypatch.setattr(kubelet_state, "_checkpoint_entries", counting)
    checkpoint = tmp_path / "kubelet_internal_checkpoint"
    cl_checkpoint(checkpoint, "cam-0", "8120fe")
    evidence = NodeEvidence("node-a", KubeletState(tmp_path / "absent.sock", checkpoint))
    found = []
    for digest in ["8120fe", *(f"{n:06x}" for n in range(100))]:
        instance = Instance(name=f"cam-{digest}", configuration_name="cam", capacity=1)
        found.append(await evidence.in_use(instance, 0.0))
    assert len(parsed) == 1
    assert found[0].anywhere == ("C:cam-0:node-a",) and not any(found[1:])
    cl_checkpoint(checkpoint, "cam-1", "8120fe")
    again = await evidence.in_use(
        Instance(name="cam-8120fe", configuration_name="cam", capacity=1), 0.0
    )
    assert len(parsed) == 2 and again.anywhere == ("C:cam-1:node-a",)


class _HangingStore(LocalInstanceStore):
    """Its next ``update`` never answers (and is never applied): a write lost in a hang."""

    hang_next = False

    async def update(self, instance: Instance) -> Instance:
        if self.hang_next:
            self.hang_next = False
            await asyncio.Future()
        return await super().update(instance)


async def test_a_timed_out_claim_that_never_lands_is_settled_without_a_write(
    tmp_path: Path,
) -> None:
    """Issue 30 (3): the claim fails at the deadline and its slot is held back (reserved)
    until a re-read settles it: here the write never landed and the Instance moved on (another
    node's claim), so the slot is simply offered again."""
    store = _HangingStore(tmp_path, poll_interval=0.05)
    await store.start()
    try:
        await store.create(make(capacity=3))
        a = SlotLedger(store, "node-a", claim_timeout=0.2)
        b = SlotLedger(store, "node-b")
        store.hang_next = True
        with pytest.raises(SlotWriteTimeoutError):
            await a.claim(KEY, f"{NAME}-0", Owner.instance_level("node-a"))
        assert a.unsettled(KEY) == {f"{NAME}-0"}
        assert a.reservations.slots(KEY) == {f"{NAME}-0"}
        # a device plugin of this node may not take it meanwhile
        with pytest.raises(SlotRefusedError) as refused:
            await a.claim(KEY, f"{NAME}-0", Owner.instance_level("node-a"))
        assert refused.value.reason == "Reserved"
        await b.claim(KEY, f"{NAME}-1", Owner.instance_level("node-b"))  # a newer version
        for _ in range(200):
            if not a.unsettled(KEY):
                break
            await asyncio.sleep(0.05)
        assert not a.unsettled(KEY) and not a.reservations.slots(KEY)
        assert (await store.get(KEY)).device_usage[f"{NAME}-0"] == ""
        await a.close()
    finally:
        await store.close()
