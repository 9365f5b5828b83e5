"""SlotReclaimer timing and release batching, on a fake clock (no wall-time assertions).

kubelet's pod-resources ``List`` is replaced by a script; the Instances live in a real
:class:`LocalInstanceStore` whose ``update`` is counted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from agent.core.ledger.decisions import Owner
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import EventType, InstanceEvent
from agent.core.store.local import LocalInstanceStore
from agent.node.deviceplugin.held_slots import HeldIndex, HeldSlot
from agent.node.deviceplugin.reclaimer import (
    SlotReclaimer,
    by_instance,
    next_tick_after,
    plan_reclaim,
    wake_time,
)
from agent.node.kubelet.state import KubeletView

NODE = "node-a"
START = 100.0
Listing = dict[str, frozenset[str]]


def K(name: str) -> ObjectKey:
    return ObjectKey("default", name)


def make(name: str, capacity: int = 4, **held: str) -> Instance:
    """Instance ``name`` of configuration ``cfg``; ``held`` maps slot index ("s0") to value."""
    usage = {f"{name}-{i}": "" for i in range(capacity)}
    for key, value in held.items():
        usage[f"{name}-{key.removeprefix('s')}"] = value
    return Instance(
        name=name,
        configuration_name="cfg",
        capacity=capacity,
        nodes=(NODE, "node-b"),
        shared=True,
        device_usage=usage,
    )


class FakeTime:
    """A clock that moves only when the reclaimer sleeps. Past ``limit`` the sleep parks."""

    def __init__(self) -> None:
        self.now = START
        self.limit = float("inf")
        self.parked = asyncio.Event()
        self.on_wake: Callable[[float], Awaitable[None]] | None = None

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds > 0
        if self.now + seconds > self.limit:
            self.parked.set()
            await asyncio.Future()  # until cancelled
        self.now += seconds
        if self.on_wake is not None:
            await self.on_wake(self.now)
        await asyncio.sleep(0)


class CountingStore(LocalInstanceStore):
    """Counts Instance writes and how many were in flight at once; stamps them with ``clock``."""

    def __init__(self, state_dir: Path, clock: Callable[[], float]) -> None:
        super().__init__(state_dir, poll_interval=0.05)
        self.clock = clock
        self.writes: list[tuple[float, Instance]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.write_delay = 0.0

    async def update(self, instance: Instance) -> Instance:
        self.writes.append((self.clock(), instance))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.write_delay:
                # every concurrent release reaches this point before any of them goes on
                await asyncio.sleep(self.write_delay)
            return await super().update(instance)
        finally:
            self.in_flight -= 1

    def reset(self) -> None:
        self.writes.clear()
        self.max_in_flight = 0


class Kubelet:
    """Scripted kubelet: ``answer(now)`` gives the device ids ``List`` shows,
    ``checkpoint(now)`` those in its checkpoint; ``identity`` is its socket's."""

    def __init__(self, fake: FakeTime, answer: Callable[[float], Listing] | None = None) -> None:
        self.fake = fake
        self.answer = answer or (lambda now: {})
        self.checkpoint: Callable[[float], Listing] = lambda now: {}
        self.calls: list[float] = []
        self.identity: tuple[int, int] | None = (1, 1)

    def available(self) -> bool:
        return True

    def socket_identity(self) -> tuple[int, int] | None:
        return self.identity

    async def view(self) -> KubeletView:
        self.calls.append(self.fake.now)
        now = self.fake.now
        return KubeletView(self.answer(now), self.checkpoint(now), now)


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


@pytest.fixture
async def store(tmp_path: Path, fake: FakeTime) -> CountingStore:
    result = CountingStore(tmp_path / "state", fake.clock)
    await result.start()
    yield result  # type: ignore[misc]
    await result.close()


@pytest.fixture
def kubelet(fake: FakeTime) -> Kubelet:
    return Kubelet(fake)


def reclaimer_for(
    store: CountingStore,
    fake: FakeTime,
    tmp_path: Path,
    *,
    interval: float = 1.0,
    grace: float = 3.0,
    concurrency: int = 8,
    list_instances: Callable[[], list[Instance]] | None = None,
    kubelet: Kubelet | None = None,
    nudge: Callable[[], object] = lambda: None,
) -> SlotReclaimer:
    ledger = SlotLedger(store, NODE, clock=fake.clock)
    return SlotReclaimer(
        ledger,
        list_instances or store.list_cached,
        kubelet or Kubelet(fake),
        nudge=nudge,
        interval=interval,
        grace=grace,
        clock=fake.clock,
        sleep=fake.sleep,
        events=store.subscribe_instances,
        concurrency=concurrency,
    )


async def run_until(reclaimer: SlotReclaimer, fake: FakeTime, limit: float) -> None:
    """Run the reclaimer's loop on the fake clock until it would sleep past ``limit``, or
    waits (with no timer at all) for this node to hold a slot again."""
    fake.limit = limit
    task = asyncio.create_task(reclaimer.run())
    parked = asyncio.ensure_future(fake.parked.wait())
    idle = asyncio.ensure_future(_idle_after_start(reclaimer, fake))
    try:
        done, _ = await asyncio.wait({parked, idle}, timeout=30, return_when="FIRST_COMPLETED")
        assert done, "the reclaimer neither parked nor went idle"
    finally:
        for waiter in (parked, idle, task):
            waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _idle_after_start(reclaimer: SlotReclaimer, fake: FakeTime) -> None:
    """The reclaimer waits for a slot, having run at least one pass (or none was needed)."""
    while True:
        await reclaimer.idle.wait()
        await asyncio.sleep(0)
        if reclaimer.idle.is_set():
            return
        await asyncio.sleep(0.001)


def usage(store: CountingStore, name: str) -> dict[str, str]:
    instance = store.get_cached(K(name))
    assert instance is not None
    return dict(instance.device_usage)


# -- pure decisions ---------------------------------------------------------------------------


def test_plan_gives_each_unused_slot_its_own_deadline() -> None:
    a = HeldSlot(K("i"), "i-0", NODE, "akri.sh/i", "i-0")
    b = HeldSlot(K("i"), "i-1", NODE, "akri.sh/i", "i-1")
    since: dict[tuple[ObjectKey, str], float] = {}
    plan = plan_reclaim([a], {}, since, now=10.0, grace=3.0)
    assert plan.due == () and plan.next_deadline == 13.0
    plan = plan_reclaim([a, b], {}, since, now=11.5, grace=3.0)
    assert plan.due == () and plan.next_deadline == 13.0  # b: 14.5
    plan = plan_reclaim([a, b], {}, since, now=13.0, grace=3.0)
    assert plan.due == (a,) and plan.next_deadline == 14.5
    # in use in the answer taken at the deadline: b starts over, nothing is due
    plan = plan_reclaim([a, b], {"akri.sh/i": frozenset({"i-1"})}, since, now=14.5, grace=3.0)
    assert plan.due == (a,) and plan.next_deadline is None and (b.key not in since)
    assert by_instance([a, b, HeldSlot(K("j"), "j-0", NODE, "akri.sh/j", "j-0")]) == {
        K("i"): [a, b],
        K("j"): [HeldSlot(K("j"), "j-0", NODE, "akri.sh/j", "j-0")],
    }


def test_schedule_is_fixed_rate_and_merges_a_deadline_just_after_a_tick() -> None:
    slack = 0.1
    assert wake_time(101.0, None, slack) == 101.0
    assert wake_time(101.0, 100.5, slack) == 100.5  # deadline first
    assert wake_time(101.0, 101.05, slack) == 101.05  # just after the tick: one pass for both
    assert wake_time(101.0, 101.5, slack) == 101.0
    # start to start: a pass at the tick schedules the next one interval later
    assert next_tick_after(100.0, 100.0, 1.0, slack) == 101.0
    assert next_tick_after(100.3, 100.0, 1.0, slack) == 101.0
    # a deadline pass well before the tick leaves the schedule alone; one just before or
    # just after it takes the tick's place
    assert next_tick_after(100.5, 101.0, 1.0, slack) == 101.0
    assert next_tick_after(100.95, 101.0, 1.0, slack) == 102.0
    assert next_tick_after(101.05, 101.0, 1.0, slack) == 102.0
    # an overrun skips the missed ticks instead of catching up with a burst
    assert next_tick_after(103.5, 101.0, 1.0, slack) == 104.0


def test_held_index_follows_instance_events() -> None:
    index = HeldIndex(NODE)
    first = make("cam-aaaaaa", s0=NODE, s1="C:cfg-1:node-a", s2="node-b", s3="D:uid:node-a")
    index.apply(InstanceEvent(EventType.ADDED, first))
    assert [(h.slot, h.resource, h.device_id) for h in index] == [
        ("cam-aaaaaa-0", "akri.sh/cam-aaaaaa", "cam-aaaaaa-0"),
        ("cam-aaaaaa-1", "akri.sh/cfg", "cfg-1"),
    ]
    index.apply(InstanceEvent(EventType.MODIFIED, make("cam-aaaaaa", s2="node-b"), first))
    assert not index and len(index) == 0
    index.apply(InstanceEvent(EventType.ADDED, make("cam-bbbbbb", s3=NODE)))
    assert [h.slot for h in index] == ["cam-bbbbbb-3"]
    index.apply(InstanceEvent(EventType.DELETED, make("cam-bbbbbb", s3=NODE)))
    assert not index
    index.sync([make("cam-cccccc", s0=NODE), make("cam-dddddd")])
    assert [h.slot for h in index] == ["cam-cccccc-0"]
    index.sync([make("cam-dddddd", s1=NODE)])
    assert [h.slot for h in index] == ["cam-dddddd-1"]


# -- fixed rate ---------------------------------------------------------------------------------


async def test_passes_run_at_a_fixed_rate_start_to_start(
    store: CountingStore, fake: FakeTime, tmp_path: Path
) -> None:
    """Found in docs/performance.md: sleeping ``interval`` after each pass stretched the period
    to 1 s + pass time (about 1.4 s), which rounded the 3 s grace up to 4.2 s."""
    await store.create(make("cam-aaaaaa", s0=NODE))  # passes run only while a slot is held
    reclaimer = reclaimer_for(store, fake, tmp_path)
    starts: list[float] = []

    async def slow_pass() -> list[HeldSlot]:
        starts.append(fake.now)
        fake.now += 0.4  # the pass takes 0.4 s
        return []

    reclaimer.reclaim_once = slow_pass  # type: ignore[method-assign]
    await run_until(reclaimer, fake, START + 5.5)
    assert starts == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]


async def test_an_overrunning_pass_skips_missed_ticks(
    store: CountingStore, fake: FakeTime, tmp_path: Path
) -> None:
    await store.create(make("cam-aaaaaa", s0=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path)
    starts: list[float] = []

    async def one_long_pass() -> list[HeldSlot]:
        starts.append(fake.now)
        fake.now += 2.5 if len(starts) == 1 else 0.1
        return []

    reclaimer.reclaim_once = one_long_pass  # type: ignore[method-assign]
    await run_until(reclaimer, fake, START + 5.5)
    # 101 and 102 were missed: one pass at once, then back on the schedule
    assert starts == [100.0, 102.5, 103.0, 104.0, 105.0]


# -- batching and concurrency -------------------------------------------------------------------


async def test_due_slots_of_one_instance_are_released_in_one_write(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """Found in docs/performance.md: one CAS write per slot, one after the other (17.6 ms
    each) put a 20-slot pass at 0.3-0.5 s."""
    await store.create(make("cam-aaaaaa", s0=NODE, s1=NODE, s2="C:cfg-7:node-a", s3="node-b"))
    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet)
    store.reset()
    assert await reclaimer.reclaim_once() == []  # first seen unused
    fake.now += 3.0
    freed = await reclaimer.reclaim_once()
    assert [h.slot for h in freed] == ["cam-aaaaaa-0", "cam-aaaaaa-1", "cam-aaaaaa-2"]
    assert len(store.writes) == 1
    assert usage(store, "cam-aaaaaa") == {
        "cam-aaaaaa-0": "",
        "cam-aaaaaa-1": "",
        "cam-aaaaaa-2": "",
        "cam-aaaaaa-3": "node-b",
    }
    assert reclaimer.freed == 3


async def test_instances_are_released_concurrently_within_a_bound(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    names = [f"cam-{c * 6}" for c in "abcde"]
    for name in names:
        await store.create(make(name, s0=NODE, s1=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet, concurrency=3)
    store.reset()
    store.write_delay = 0.01
    assert await reclaimer.reclaim_once() == []
    fake.now += 3.0
    freed = await reclaimer.reclaim_once()
    assert len(freed) == 10
    assert len(store.writes) == 5  # one per Instance
    assert store.max_in_flight == 3  # concurrent, but at most ``concurrency`` at once
    assert all(v == "" for name in names for v in usage(store, name).values())


async def test_a_failed_release_does_not_block_the_others(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    await store.create(make("cam-aaaaaa", s0=NODE))
    await store.create(make("cam-bbbbbb", s0=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet)
    real_update = store.update

    async def failing_update(instance: Instance) -> Instance:
        if instance.name == "cam-aaaaaa":
            raise OSError("disk full")
        return await real_update(instance)

    store.update = failing_update  # type: ignore[method-assign]
    await reclaimer.reclaim_once()
    fake.now += 3.0
    assert [h.instance.name for h in await reclaimer.reclaim_once()] == ["cam-bbbbbb"]
    store.update = real_update  # type: ignore[method-assign]
    fake.now += 1.0
    # still seen unused since the first pass: released at the next pass
    assert [h.instance.name for h in await reclaimer.reclaim_once()] == ["cam-aaaaaa"]


# -- deadlines ----------------------------------------------------------------------------------


async def test_slot_is_released_at_its_deadline_not_at_the_next_pass(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    await store.create(make("cam-aaaaaa", s0=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet, grace=2.5)
    store.reset()
    await run_until(reclaimer, fake, START + 4.5)
    assert [when for when, _ in store.writes] == [102.5]  # first seen at 100, grace 2.5
    assert usage(store, "cam-aaaaaa")["cam-aaaaaa-0"] == ""
    # confirmed by a List at the deadline; none after: the node holds nothing any more, and
    # no pass runs at all until it does again
    assert kubelet.calls == [100.0, 101.0, 102.0, 102.5]
    assert fake.now < 103.0, "passes went on with nothing held"


async def test_a_deadline_just_after_a_pass_is_confirmed_in_that_pass(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    await store.create(make("cam-aaaaaa", s0=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet, grace=3.05)
    store.reset()
    await run_until(reclaimer, fake, START + 5.5)
    # the 103 pass waits for the 103.05 deadline instead of asking kubelet twice
    assert kubelet.calls == [100.0, 101.0, 102.0, 103.05]
    assert [when for when, _ in store.writes] == [103.05]


async def test_the_deadline_check_asks_kubelet_again_and_keeps_a_reused_slot(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """The confirmation must come from an answer obtained at or after the deadline: here the
    device is listed again at the deadline (a pod uses it), so the slot is not freed although
    every earlier answer showed it unused."""
    await store.create(make("cam-aaaaaa", s0=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet, grace=2.5)
    in_use = {"akri.sh/cam-aaaaaa": frozenset({"cam-aaaaaa-0"})}
    kubelet.answer = lambda now: in_use if 102.4 <= now <= 102.6 else {}
    store.reset()
    await run_until(reclaimer, fake, START + 6.0)
    # 102.5: listed, kept; 103: unused again, a new deadline at 105.5
    assert kubelet.calls[:5] == [100.0, 101.0, 102.0, 102.5, 103.0]
    assert [when for when, _ in store.writes] == [105.5]


async def test_a_slot_granted_again_before_its_deadline_is_kept(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """kubelet re-offers the slot to a new pod (an idempotent re-grant that writes nothing)
    while its answers still predate that pod: the deadline check must not free it."""
    await store.create(make("cam-aaaaaa", s0=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet, grace=2.5)

    async def regrant(now: float) -> None:
        if now == 101.0:
            await reclaimer.ledger.claim(
                K("cam-aaaaaa"), "cam-aaaaaa-0", Owner.instance_level(NODE)
            )

    fake.on_wake = regrant
    store.reset()
    await run_until(reclaimer, fake, START + 6.0)
    # kept at 102.5 (its evidence started at 100, before the grant at 101); seen unused again
    # from the 103 pass on, so released at 105.5
    assert 102.5 in kubelet.calls
    assert [when for when, _ in store.writes] == [105.5]
    assert reclaimer.ledger.last_granted(K("cam-aaaaaa"), "cam-aaaaaa-0") is None  # freed since


# -- idle cost ----------------------------------------------------------------------------------


async def test_nothing_held_means_no_list_call_and_no_instance_scan(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """Found in docs/performance.md: every pass sorted every Instance and parsed every slot
    (64 % of the idle CPU at 1000 Instances), and asked kubelet even with nothing held."""
    for c in "abc":
        await store.create(make(f"cam-{c * 6}", s3="node-b"))

    def no_scans() -> list[Instance]:
        raise AssertionError("the index follows Instance events: no full list per pass")

    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet, list_instances=no_scans)
    for _ in range(3):
        assert await reclaimer.reclaim_once() == []
        fake.now += 1
    assert kubelet.calls == []
    ledger = reclaimer.ledger
    await ledger.claim(K("cam-bbbbbb"), "cam-bbbbbb-1", Owner.instance_level(NODE))
    kubelet.answer = lambda now: {"akri.sh/cam-bbbbbb": frozenset({"cam-bbbbbb-1"})}
    await reclaimer.reclaim_once()
    assert kubelet.calls == [103.0]
    await ledger.release(K("cam-bbbbbb"), "cam-bbbbbb-1", Owner.instance_level(NODE))
    fake.now += 1
    await reclaimer.reclaim_once()
    assert kubelet.calls == [103.0]
    assert reclaimer.skipped == 4 and reclaimer.passes == 1


# -- kubelet's checkpoint, restarts, served Instances (issue 11) -------------------------------


async def test_a_slot_only_in_kubelets_checkpoint_is_never_freed(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """An init container's device is not in pod-resources ``List`` (kubelet skips
    non-restartable init containers) but kubelet keeps it assigned: its checkpoint has it.
    Before, the slot was reclaimed while the init container ran."""
    await store.create(make("cam-aaaaaa", s0=NODE))
    kubelet.checkpoint = lambda now: {"akri.sh/cam-aaaaaa": frozenset({"cam-aaaaaa-0"})}
    nudges: list[float] = []
    reclaimer = reclaimer_for(
        store, fake, tmp_path, kubelet=kubelet, nudge=lambda: nudges.append(fake.now)
    )
    store.reset()
    await run_until(reclaimer, fake, START + 25.5)
    assert store.writes == []
    assert usage(store, "cam-aaaaaa")["cam-aaaaaa-0"] == NODE
    # kubelet was asked to rewrite its checkpoint at once, then only every 10 s
    assert nudges == [100.0, 110.0, 120.0]


async def test_a_gone_pod_left_in_the_checkpoint_is_freed_after_kubelet_rewrites_it(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """kubelet forgets a gone pod when asked for ``List`` but writes its checkpoint only on
    its next write: the nudge (a plugin re-sends its list) makes that write happen."""
    await store.create(make("cam-aaaaaa", s0=NODE))
    rewritten = [False]
    kubelet.checkpoint = lambda now: (
        {} if rewritten[0] else {"akri.sh/cam-aaaaaa": frozenset({"cam-aaaaaa-0"})}
    )
    reclaimer = reclaimer_for(
        store, fake, tmp_path, kubelet=kubelet, nudge=lambda: rewritten.__setitem__(0, True)
    )
    store.reset()
    await run_until(reclaimer, fake, START + 5.5)
    # 100: only in the checkpoint (nudged); looked at again 0.1 s later: unused everywhere,
    # so freed at 100.1 + 3 (not a whole pass later)
    assert [when for when, _ in store.writes] == [pytest.approx(103.1)]


async def test_a_nudge_with_no_plugin_to_send_it_is_asked_again_at_the_next_pass(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """No plugin runs yet to re-send a list (an agent restarted on DRA: the holding plugin of
    the name is still starting): the nudge says so (False), and the next pass asks again
    instead of waiting the 10 s between nudges of the same slot."""
    await store.create(make("cam-aaaaaa", s0=NODE))
    rewritten = [False]
    kubelet.checkpoint = lambda now: (
        {} if rewritten[0] else {"akri.sh/cam-aaaaaa": frozenset({"cam-aaaaaa-0"})}
    )
    asked: list[float] = []

    def nudge() -> bool:
        asked.append(fake.now)
        if fake.now < 102.0:
            return False  # the holding plugin has not started yet
        rewritten[0] = True
        return True

    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet, nudge=nudge)
    store.reset()
    await run_until(reclaimer, fake, START + 6.5)
    assert asked == [100.0, 101.0, 102.0]
    assert [when for when, _ in store.writes] == [pytest.approx(105.1)]
    assert reclaimer.nudges == 1


async def test_a_kubelet_restart_drops_the_evidence_and_pauses(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """A ``List`` answered while kubelet restarts may miss pods it has not re-admitted yet:
    evidence gathered before a restart is dropped, and nothing is decided for ``settle`` s."""
    await store.create(make("cam-aaaaaa", s0=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path, grace=3.0, kubelet=kubelet)
    reclaimer.settle = 5.0

    async def restart_at_102(now: float) -> None:
        if now == 102.0:
            kubelet.identity = (2, 2)  # a new pod-resources socket

    fake.on_wake = restart_at_102
    store.reset()
    await run_until(reclaimer, fake, START + 12.5)
    # seen unused at 100; kubelet restarted at 102: quiet until 107, seen unused again from
    # 107, freed at 110 (not at 103)
    assert [when for when, _ in store.writes] == [110.0]
    assert reclaimer.restarts_seen == 1
    reclaimer.kubelet_restarted()  # the device-plugin manager saw kubelet.sock re-created
    assert reclaimer.restarts_seen == 2


async def test_instances_this_node_does_not_serve_are_left_alone(
    store: CountingStore, fake: FakeTime, kubelet: Kubelet, tmp_path: Path
) -> None:
    """``akri.sh/<name>`` is node-global: a slot of another namespace's same-named Instance
    cannot be judged from kubelet's answer and is never touched."""
    await store.create(make("cam-aaaaaa", s0=NODE))
    other = make("cam-aaaaaa", s0=NODE).evolve(namespace="other")
    await store.create(other)
    ledger = SlotLedger(store, NODE, clock=fake.clock)
    reclaimer = SlotReclaimer(
        ledger,
        store.list_cached,
        kubelet,
        grace=1.0,
        clock=fake.clock,
        sleep=fake.sleep,
        events=store.subscribe_instances,
        served=lambda instance: instance.namespace == "default",
    )
    await reclaimer.reclaim_once()
    fake.now += 2
    freed = await reclaimer.reclaim_once()
    assert [h.instance for h in freed] == [K("cam-aaaaaa")]
    kept = store.get_cached(ObjectKey("other", "cam-aaaaaa"))
    assert kept is not None and kept.device_usage["cam-aaaaaa-0"] == NODE


async def test_an_outage_backs_off_and_rate_limits_the_warnings(
    store: CountingStore,
    fake: FakeTime,
    kubelet: Kubelet,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 30 (7): during a 30 s outage ``releasing stale slots of X failed`` was logged (and
    the write sent) once a second per Instance. Now the attempts back off exponentially and
    a warning is logged at most every 30 s; the slot is freed once the API answers again."""
    from agent.core.store.base import StoreUnavailableError

    await store.create(make("cam-aaaaaa", s0=NODE))
    reclaimer = reclaimer_for(store, fake, tmp_path, kubelet=kubelet)
    real_update = store.update
    attempts: list[float] = []

    async def unavailable(instance: Instance) -> Instance:
        attempts.append(fake.now)
        raise StoreUnavailableError("connection refused")

    store.update = unavailable  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="agent.node.deviceplugin.reclaimer"):
        for _ in range(33):  # a pass a second for 33 s: 30 of them during the outage
            await reclaimer.reclaim_once()
            fake.now += 1.0
        warnings = [r for r in caplog.records if "releasing stale slots" in r.getMessage()]
    # seen unused at 100, due at 103: tried at 103, 104, 106, 110, 118, 134 (not yet): 5
    assert attempts == [103.0, 104.0, 106.0, 110.0, 118.0]
    assert len(warnings) == 1 and "retrying in 1s" in warnings[0].getMessage()
    store.update = real_update  # type: ignore[method-assign]
    fake.now = 134.0
    with caplog.at_level(logging.INFO, logger="agent.node.deviceplugin.reclaimer"):
        assert [h.instance.name for h in await reclaimer.reclaim_once()] == ["cam-aaaaaa"]
    assert any("works again (5 failure(s))" in r.getMessage() for r in caplog.records)
    assert len(reclaimer.release_backoff) == 0


class _UnreachableKubelet(Kubelet):
    """kubelet's pod-resources answering UNAVAILABLE (kubelet down: a node partitioned)."""

    def __init__(self, fake: FakeTime) -> None:
        super().__init__(fake)
        self.down = True

    async def view(self) -> KubeletView:
        if self.down:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata()
            )
        return await super().view()


async def test_an_unreachable_kubelet_keeps_what_is_held_and_says_so_once(
    store: CountingStore,
    fake: FakeTime,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 39.1: an agent whose kubelet cannot be asked keeps every slot it holds (their
    containers may still run), says so once per episode (not per pass), and shows it in
    ``akri_slot_reclaim_paused``."""
    await store.create(make("cam-aaaaaa", s0=NODE, s1=NODE))
    kubelet = _UnreachableKubelet(fake)
    reclaimer = reclaimer_for(store, fake, tmp_path, grace=1.0, kubelet=kubelet)
    caplog.set_level(logging.INFO, "agent.node.deviceplugin.reclaimer")
    for _ in range(5):
        assert await reclaimer.reclaim_once() == []
        fake.now += 10
    assert reclaimer.paused
    assert usage(store, "cam-aaaaaa")["cam-aaaaaa-0"] == NODE
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "the 2 slot(s) this node holds through device plugins are kept" in warnings[0]
    kubelet.down = False  # back: the episode ends (the slots are unused: freed after grace)
    await reclaimer.reclaim_once()
    assert not reclaimer.paused
    kubelet.down = True  # a new episode: said again
    await reclaimer.reclaim_once()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
