"""Frees slots this node holds for containers that no longer exist.

kubelet says which device IDs are assigned to containers, per resource: its pod-resources
``List`` plus its device-manager checkpoint (which also has init containers, see
:mod:`agent.node.kubelet.state`). A slot this node holds through a device plugin is
*in use* if its device ID is assigned under its resource:

* IL value ``<node>`` in Instance I, slot S → ``S`` listed under ``akri.sh/I``;
* CL value ``C:<vdev>:<node>`` in an Instance of configuration C → ``vdev`` listed under
  ``akri.sh/C``.

(Both are compared in kubelet's own format, so unlike Akri 0.13 IL slots are really freed.)
DRA slots (``D:…``) belong to the DRA driver (:mod:`agent.node.dra.reclaim`) and are never
touched here. If the pod-resources socket is missing, reclaim is off and the log says so once.
Only Instances served on this node (their Configuration name's owner namespace,
:mod:`agent.node.discovery.ownership`) are considered: ``akri.sh/<name>`` is node-global — plus
another namespace's Instances while a node drains them (their Configuration lost the name
while its containers ran): a slot is freed only when kubelet assigns its device id to no
container at all, which stays safe whichever namespace the container came from.

kubelet restarts. While kubelet restarts, ``List`` can answer before it has re-admitted its
pods. A restart seen by the device-plugin manager (``kubelet_restarted``) or a new
pod-resources socket drops all evidence gathered so far and pauses reclaim for ``settle``
seconds.

Timing. Passes run at a fixed rate, ``interval`` apart measured start to start. A pass takes
a clock reading, then asks kubelet: a slot missing from the answer is *seen unused* from that
reading on (``first_seen``), and gets its own deadline ``first_seen + grace``. The reclaimer
wakes at the earliest deadline (not at the next whole pass) and runs a pass there, which asks
kubelet again: a slot is released only when an answer obtained after its deadline still does
not list it. A slot that shows up in any answer in between starts over. Reclaim latency is
therefore about ``grace`` plus the time to the first pass that sees the pod gone
(≤ ``interval``), not a whole number of passes. A deadline that falls just after a pass time
(within ``TICK_SLACK`` of the interval) is confirmed in that pass, delayed to the deadline, so
the deadlines of slots seen unused in the same pass cost one ``List``, not two.

Release. Due slots are grouped by Instance: each Instance gets one CAS write for all its due
slots (the ledger re-reads and re-decides on conflict, frees a slot only if it still holds
the expected value, and keeps any slot this node granted again since it was first seen
unused). Different Instances are released concurrently, at most ``concurrency`` at a time.

Idle cost. The slots this node holds through plugins are kept in an index
(:class:`~agent.node.deviceplugin.held_slots.HeldIndex`, its own module, shared with the DRA
reclaimer) fed by the store's Instance events when the reclaimer is given ``events`` (the agent does
this), so a pass costs O(events since the last pass + held slots), not a parse of every slot
of every Instance. When the node holds no plugin slot, a pass does not call kubelet at all.
Without ``events`` the index is refreshed from ``list_instances()`` on every pass, re-parsing
only Instances that changed.

The decisions (which slots are stale, due; when to wake) are pure functions below; the I/O is
in :class:`SlotReclaimer`. Which slots are held is :mod:`agent.node.deviceplugin.held_slots`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from agent.core.aio.backoff import FailureBackoff
from agent.core.aio.events import Subscription
from agent.core.aio.fswatch import DirectoryWatch
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import InstanceEvent
from agent.node.deviceplugin.held_slots import HeldIndex, HeldSlot, SlotKey, follow_until_held
from agent.node.kubelet.state import InUse, KubeletStateError, KubeletView

log = logging.getLogger(__name__)

TICK_SLACK = 0.1  # fraction of the interval a pass may move to confirm a deadline with it
DEFAULT_CONCURRENCY = 8  # Instances released at the same time
RESTART_SETTLE = 10.0  # seconds without reclaim after kubelet restarted
RELEASE_BACKOFF_MAX = 30.0  # seconds between attempts at an Instance whose release keeps failing
RELEASE_LOG_EVERY = 30.0  # seconds between two warnings about one such Instance
RENUDGE_INTERVAL = 10.0  # how often to ask kubelet to rewrite its checkpoint for the same slots
NUDGE_RECHECK = 0.1  # seconds between asking kubelet to rewrite its checkpoint and looking
SOCKET_POLL = 5.0  # where inotify cannot tell when the pod-resources socket appears


class KubeletSource(Protocol):
    """Where the reclaimer learns what kubelet assigns (:class:`KubeletState`)."""

    def available(self) -> bool: ...

    def socket_identity(self) -> tuple[int, int] | None: ...

    async def view(self) -> KubeletView: ...


@dataclass(frozen=True)
class ReclaimPlan:
    """One pass's decision: the slots to release now, and when the next one becomes due."""

    due: tuple[HeldSlot, ...]
    next_deadline: float | None  # earliest first_seen + grace still after ``now``


def plan_reclaim(
    held: Iterable[HeldSlot],
    in_use: InUse,
    unused_since: dict[SlotKey, float],
    now: float,
    grace: float,
) -> ReclaimPlan:
    """Decide on one ``List`` answer, obtained after the clock read ``now``.

    ``unused_since`` (slot -> first time seen unused) is updated in place: slots listed in
    ``in_use`` or no longer held are forgotten, newly unused ones start at ``now``. A slot is
    due when ``now`` has reached its deadline ``first_seen + grace``: two answers, one from
    ``first_seen`` and this one from after the deadline, both show it unused (and no answer in
    between showed it in use, or it would have started over)."""
    due = []
    current: set[SlotKey] = set()
    next_deadline: float | None = None
    for slot in held:
        key = slot.key
        current.add(key)
        if slot.device_id in in_use.get(slot.resource, frozenset()):
            unused_since.pop(key, None)
            continue
        deadline = unused_since.setdefault(key, now) + grace
        if now >= deadline:
            due.append(slot)
        elif next_deadline is None or deadline < next_deadline:
            next_deadline = deadline
    for key in [k for k in unused_since if k not in current]:
        del unused_since[key]
    return ReclaimPlan(tuple(sorted(due, key=lambda s: s.key)), next_deadline)


def by_instance(slots: Iterable[HeldSlot]) -> dict[ObjectKey, list[HeldSlot]]:
    """Slots grouped per Instance (one write each), in the order given."""
    groups: defaultdict[ObjectKey, list[HeldSlot]] = defaultdict(list)
    for slot in slots:
        groups[slot.instance].append(slot)
    return dict(groups)


def wake_time(next_tick: float, deadline: float | None, slack: float) -> float:
    """When the next pass should start: the next tick of the fixed-rate schedule, or the
    earliest deadline if that comes first. A deadline at most ``slack`` after the tick moves
    that tick's pass to the deadline, so one ``List`` serves both."""
    if deadline is None or deadline > next_tick + slack:
        return next_tick
    return deadline


def next_tick_after(started: float, tick: float, interval: float, slack: float) -> float:
    """The next tick of the schedule ``tick + k * interval`` once a pass started at
    ``started``. A pass that started at most ``slack`` before a tick counts as that tick's
    pass; ticks missed by a long pass are skipped (no burst of catch-up passes)."""
    if started + slack < tick:
        return tick  # an early pass for a deadline: the schedule stays
    return tick + (math.floor((started + slack - tick) / interval) + 1) * interval


class SlotReclaimer:
    """Frees this node's stale IL/CL slots.

    ``clock`` must be the clock of the ledger's grant times (monotonic); ``sleep`` waits on
    it. ``events`` (the store's ``subscribe_instances``) keeps the held-slot index without
    listing every Instance on every pass; without it ``list_instances`` is read each pass.
    ``served`` tells which Instances this node serves (the others are never touched);
    ``nudge`` asks kubelet to rewrite its checkpoint (a plugin re-sends its device list; it
    returns False when no plugin runs to send it).
    """

    def __init__(
        self,
        ledger: SlotLedger,
        list_instances: Callable[[], list[Instance]],
        kubelet: KubeletSource,
        *,
        interval: float = 1.0,
        grace: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        events: Callable[[], Subscription[InstanceEvent]] | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        served: Callable[[Instance], bool] = lambda _: True,
        nudge: Callable[[], object] = lambda: None,
        settle: float = RESTART_SETTLE,
    ) -> None:
        self.ledger = ledger
        self._list = list_instances
        self.kubelet = kubelet
        self.interval = interval
        self.grace = grace
        self.settle = settle
        self.concurrency = max(1, concurrency)
        self._clock = clock
        self._sleep = sleep
        self._events = events
        self._nudge = nudge
        self._subscription: Subscription[InstanceEvent] | None = None
        self.index = HeldIndex(ledger.node, served)
        self._unused_since: dict[SlotKey, float] = {}
        self._next_deadline: float | None = None
        self._warned = False
        self._socket_identity: tuple[int, int] | None = None
        self._quiet_until: float | None = None
        self._nudged: dict[SlotKey, float] = {}  # slot -> when kubelet was last asked about it
        self._listed_pods: frozenset[tuple[str, str]] = frozenset()
        # an Instance whose release failed (API server unavailable) is tried again after a
        # backoff, not at every pass, and its failures are logged at most every 30 s
        self.release_backoff: FailureBackoff[ObjectKey] = FailureBackoff(
            initial=max(1.0, interval), maximum=RELEASE_BACKOFF_MAX, log_every=RELEASE_LOG_EVERY
        )
        self.freed = 0
        self.passes = 0  # passes that asked kubelet
        self.skipped = 0  # passes that did not need to (nothing held)
        self.nudges = 0
        self.restarts_seen = 0
        self.idle = asyncio.Event()  # set while waiting for this node to hold a slot
        # kubelet's pod-resources could not be read at the last pass: what is held is kept
        self.paused = False

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline of a slot seen unused (None if there is none)."""
        return self._next_deadline

    def kubelet_restarted(self) -> None:
        """kubelet restarted: what it said before may not hold, and what it says for a while
        may be incomplete. Forget the evidence and pause for ``settle`` seconds."""
        self.restarts_seen += 1
        self._unused_since.clear()
        self._nudged.clear()
        self._quiet_until = self._clock() + self.settle
        log.info("kubelet restarted: slot reclaim paused for %.0fs", self.settle)

    def resync(self) -> None:
        """Which Instances are served changed: rebuild the held-slot index."""
        self.index.clear()
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None

    async def run(self) -> None:
        """Reclaim until cancelled: passes at a fixed rate, plus one at each deadline — but
        none while this node holds no slot (it waits for the Instance event that gives it
        one) or kubelet's pod-resources socket is missing (it waits for the socket)."""
        slack = self.interval * TICK_SLACK
        next_tick = self._clock()
        socket = getattr(self.kubelet, "socket", None)
        watch = (
            DirectoryWatch(
                [socket.parent],
                SOCKET_POLL,
                interesting=lambda name, _removed: name == socket.name,
            )
            if isinstance(socket, Path)
            else None
        )
        try:
            while True:
                if self._events is not None:
                    await self._refresh_index()
                    if not self.kubelet.available() and watch is not None:
                        self._warn_off()
                        await watch.changed()
                        next_tick = self._clock()
                        continue
                    if not self.index and self._quiet_until is None:
                        self._unused_since.clear()
                        self._next_deadline = None
                        await self._wait_for_held()
                        next_tick = self._clock()
                        continue
                wake = wake_time(next_tick, self._next_deadline, slack)
                now = self._clock()
                while now < wake:
                    await self._sleep(wake - now)
                    now = self._clock()
                next_tick = next_tick_after(now, next_tick, self.interval, slack)
                try:
                    await self.reclaim_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self._next_deadline = None  # retried at the next tick, not in a tight loop
                    log.exception("slot reclaim pass failed")
        finally:
            if watch is not None:
                watch.close()
            self.close()

    async def _wait_for_held(self) -> None:
        """Until an Instance event gives this node a slot through a plugin."""
        if self._subscription is None:
            self._subscription = self._events() if self._events is not None else None
            self.index.clear()
        if self._subscription is None:
            return
        if not await follow_until_held(self.index, self._subscription, self.idle):
            self._subscription = None

    def _warn_off(self) -> None:
        self.paused = True
        if not self._warned:
            log.warning(
                "kubelet pod-resources socket not found: slot reclaim is off until it appears; "
                "the %d slot(s) this node holds through device plugins are kept",
                len(self.index),
            )
            self._warned = True

    def close(self) -> None:
        """Stop following Instance events."""
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None

    async def _refresh_index(self) -> None:
        if self._events is None:
            self.index.sync(self._list())
            return
        if self._subscription is None:
            self.index.clear()  # the new subscription starts with every Instance as ADDED
            self._subscription = self._events()
        subscription = self._subscription
        while subscription.pending():
            try:
                event = await anext(subscription)  # queued: returns without waiting
            except StopAsyncIteration:  # the store closed it: start over next time
                self._subscription = None
                return
            self.index.apply(event)

    def _check_restart(self) -> None:
        identity = self.kubelet.socket_identity()
        if identity is None:
            return
        if self._socket_identity is not None and identity != self._socket_identity:
            self.kubelet_restarted()
        self._socket_identity = identity

    async def reclaim_once(self) -> list[HeldSlot]:
        """One pass; returns the slots freed."""
        self._next_deadline = None
        await self._refresh_index()  # even while reclaim is off: keeps the event queue short
        if not self.kubelet.available():
            self._warn_off()
            return []
        self._check_restart()
        if self._quiet_until is not None:
            if self._clock() < self._quiet_until:
                self._next_deadline = self._quiet_until
                return []
            self._quiet_until = None
        if not self.index:
            self._unused_since.clear()
            self.skipped += 1
            return []  # nothing held through plugins: nothing to ask kubelet about
        # taken before asking kubelet: anything granted after this is not covered by the answer
        snapshot = self._clock()
        try:
            view = await self.kubelet.view()
        except (grpc.aio.AioRpcError, KubeletStateError) as error:
            what = error.code().name if isinstance(error, grpc.aio.AioRpcError) else str(error)
            self.paused = True
            if not self._warned:
                log.warning(
                    "asking kubelet what is in use failed (%s): slot reclaim paused; the %d "
                    "slot(s) this node holds through device plugins are kept (their containers "
                    "may still run) until kubelet answers again",
                    what,
                    len(self.index),
                )
                self._warned = True
            return []
        self.passes += 1
        self.paused = False
        if self._warned:
            log.info("kubelet pod-resources available: slot reclaim is on")
            self._warned = False
        self._check_restart()  # restarted while we asked: this answer may be incomplete
        if self._quiet_until is not None:
            self._next_deadline = self._quiet_until
            return []
        await self._refresh_index()  # what was granted while kubelet answered
        nudged = self._nudge_if_stale(view, snapshot)
        plan = plan_reclaim(self.index, view.in_use, self._unused_since, snapshot, self.grace)
        self._next_deadline = plan.next_deadline
        if nudged:
            # kubelet rewrites its checkpoint as it receives the list: look again soon, not
            # a whole interval later (a gone pod's slot would wait one pass more)
            soon = self._clock() + NUDGE_RECHECK
            if self._next_deadline is None or soon < self._next_deadline:
                self._next_deadline = soon
        if not plan.due:
            return []
        return await self._release(plan.due)

    def _nudge_if_stale(self, view: KubeletView, now: float) -> bool:
        """Held slots in kubelet's checkpoint but not in ``List``: ask kubelet to rewrite the
        checkpoint, so a pod that is gone drops out of it (a running init container stays).
        Asked when such a slot first appears, when a pod disappeared from ``List`` (this
        ``List`` made kubelet forget it: only the file lags), and every
        ``RENUDGE_INTERVAL`` seconds."""
        gone = bool(self._listed_pods - view.pods)
        self._listed_pods = view.pods
        due = False
        current: set[SlotKey] = set()
        for slot in self.index:
            if not view.only_checkpointed(slot.resource, slot.device_id):
                continue
            current.add(slot.key)
            last = self._nudged.get(slot.key)
            if last is None or gone or now - last >= RENUDGE_INTERVAL:
                self._nudged[slot.key] = now
                due = True
        for key in [k for k in self._nudged if k not in current]:
            del self._nudged[key]
        if due:
            if self._nudge() is False:
                # no plugin to send it through yet (the holding plugin of a name nobody
                # serves is starting): ask again at the next pass, not RENUDGE_INTERVAL later
                for key in current:
                    self._nudged.pop(key, None)
                return False
            self.nudges += 1
        return due

    async def _release(self, due: Sequence[HeldSlot]) -> list[HeldSlot]:
        """Release ``due``: one write per Instance, Instances concurrently (bounded). An
        Instance still backing off from a failed release waits (its slots stay seen unused:
        due again when its backoff is over)."""
        limit = asyncio.Semaphore(self.concurrency)
        now = self._clock()
        groups = {
            name: slots
            for name, slots in by_instance(due).items()
            if self.release_backoff.due(name, now)
        }

        async def release(name: ObjectKey, slots: list[HeldSlot]) -> tuple[str, ...]:
            expected = {slot.slot: slot.value for slot in slots}
            since = {slot.slot: self._unused_since[slot.key] for slot in slots}
            async with limit:
                return await self.ledger.release_slots(name, expected, unless_granted_since=since)

        results = await asyncio.gather(
            *(release(name, slots) for name, slots in groups.items()), return_exceptions=True
        )
        freed = []
        for (name, slots), result in zip(groups.items(), results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                # kept as seen unused: due again once its backoff is over
                failure = self.release_backoff.failed(name, self._clock())
                if failure.log:
                    more = (
                        f" ({failure.unlogged} more failure(s) since the last report)"
                        if failure.unlogged
                        else ""
                    )
                    log.warning(
                        "releasing stale slots of %s failed: %s; retrying in %.0fs%s",
                        name,
                        result,
                        failure.delay,
                        more,
                    )
                continue
            failures = self.release_backoff.succeeded(name)
            if failures:
                log.info("releasing stale slots of %s works again (%d failure(s))", name, failures)
            for slot in slots:
                self._unused_since.pop(slot.key, None)
                if slot.slot in result:
                    log.info(
                        "reclaimed slot %s (%s): no container uses %s any more",
                        slot.slot,
                        slot.value,
                        slot.device_id,
                    )
                    self.freed += 1
                    freed.append(slot)
                # else: granted again (kubelet re-offered it) since we saw it unused, or its
                # value changed: it starts over
        return freed
