"""This node's offline marks: which Instances it publishes as offline, and its own mark on
each shared one, so that a shared device's DRA pool follows the nodes that see it.

A node that stops seeing a device keeps its Instance for the offline grace (300 s for shared
devices by default) and lists its slots Unhealthy to kubelet at once (device plugins, DRA
health: the discovery runners' own offline sets, not this module). What the *other* nodes
need to know — the publisher of a shared pool above all, which must leave this node out of
the pool's ``nodeSelector`` while another node still sees the device, and taint the pool only
when none does (``agent/core/model/resource_slices.py``) — is written into the Instance:
the annotation ``akri.sh/offline.<node>`` (value: when it stopped seeing the device), one key
per node, applied with the node's own server-side-apply field manager in the same applied
configuration as its ``spec.nodes`` entry (:meth:`SlotLedger.mark_offline`). Map keys are
owned per manager, so nodes going offline together never conflict: one write per node per
transition, and a leave at the end of the grace takes the entry and the mark away in one
apply.

**Flapping is damped** (:class:`OfflineDamper`): a device that goes offline is published
offline at once (the safe direction: nothing is offered where it may be gone), but it is
published online again only once a *hold* has passed since it went offline. The hold is
:data:`FIRST_HOLD` and doubles, up to :data:`LONGEST_HOLD`, each time the device goes offline
again within :data:`QUIET` of the last time; blinks within a hold change nothing. So a device
blinking every second costs a few writes a minute, not two a second, and both the marks and
this node's ResourceSlices (the publisher takes the damped set) follow the damped view.

A mark is cleared only for an Instance the node's discovery reports (its handler has listed
the device since the agent started): an agent that restarts does not clear a mark it would
set again a moment later, before its handler has reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime

from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.naming import offline_annotation
from agent.core.store.base import InstanceStore, StoreError

log = logging.getLogger("agent.discovery")

FIRST_HOLD = 1.0  # seconds a device stays published offline at least
LONGEST_HOLD = 60.0
QUIET = 120.0  # going offline again later than this after the last time starts afresh
DEBOUNCE = 0.02  # coalesce the wake-ups of one burst of changes into one pass
RECHECK = 30.0  # a full pass at least this often (marks a failed write or a restart left)
RETRY = (1.0, 30.0)  # first and longest wait before writing a failed mark again


def rfc3339(wall: float) -> str:
    """``wall`` (seconds since the epoch) as the API's RFC 3339 time, whole seconds, UTC."""
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Offline:
    since: float  # monotonic time it was last published offline
    wall: str  # the same as RFC 3339: the mark's value
    hold: float  # published offline at least this long from ``since``


class OfflineDamper:
    """The damped offline set (pure; the caller gives the time): a name goes in when the raw
    set has it, and out when the raw set no longer has it and its hold is over."""

    def __init__(
        self, first: float = FIRST_HOLD, longest: float = LONGEST_HOLD, quiet: float = QUIET
    ) -> None:
        self.first, self.longest, self.quiet = first, longest, quiet
        self.published: frozenset[str] = frozenset()
        self._state: dict[str, _Offline] = {}

    def update(self, raw: Collection[str], now: float, wall: float) -> float | None:
        """Follow ``raw`` at ``now`` (monotonic; ``wall``: the same moment since the epoch);
        returns when a name held offline may be released, if one waits."""
        published = set(self.published)
        for name in raw:
            if name in published:
                continue
            last = self._state.get(name)
            hold = self.first
            if last is not None and now - last.since < self.quiet:
                hold = min(max(last.hold, self.first) * 2, self.longest)
            self._state[name] = _Offline(now, rfc3339(wall), hold)
            published.add(name)
        deadline: float | None = None
        for name in [n for n in published if n not in raw]:
            state = self._state[name]
            until = state.since + state.hold
            if now >= until:
                published.discard(name)
            else:
                deadline = until if deadline is None else min(deadline, until)
        for name in [n for n, s in self._state.items() if n not in published]:
            if now - self._state[name].since >= self.quiet:
                del self._state[name]
        self.published = frozenset(published)
        return deadline

    def since(self, name: str) -> str | None:
        """When ``name`` was published offline (RFC 3339), while it is."""
        state = self._state.get(name)
        return state.wall if state is not None and name in self.published else None


def mark_changes(
    instances: Collection[Instance],
    node: str,
    damper: OfflineDamper,
    seen: Collection[str],
    draining: Collection[str],
) -> list[tuple[Instance, str | None]]:
    """The shared Instances whose mark of ``node`` must change (pure): to the time it went
    offline (published offline, a member, not in ``draining``: drained or retired here) or
    to nothing (not published offline and reported by this node's discovery, or no longer a
    member)."""
    changes: list[tuple[Instance, str | None]] = []
    key = offline_annotation(node)
    for instance in instances:
        if not instance.shared:
            continue
        marked = key in instance.annotations
        since = damper.since(instance.name)
        member = node in instance.nodes
        if since is not None and member and instance.name not in draining:
            if (
                not marked
                and node not in instance.draining_nodes
                and instance.deletion_timestamp is None
            ):
                changes.append((instance, since))
        elif marked and (instance.name in seen or not member):
            changes.append((instance, None))
    return changes


class OfflineMarks:
    """Keeps this node's offline marks on its shared Instances equal to the damped offline
    set, and gives that set to the ResourceSlice publisher (:meth:`offline`)."""

    def __init__(
        self,
        store: InstanceStore,
        ledger: SlotLedger,
        node: str,
        instances: Callable[[], list[Instance]],
        raw: Callable[[], Collection[str]],
        seen: Callable[[], Collection[str]],
        draining: Callable[[], Collection[str]],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        damper: OfflineDamper | None = None,
    ) -> None:
        self._store = store
        self._ledger = ledger
        self.node = node
        self._instances = instances
        self._raw = raw
        self._seen = seen
        self._draining = draining
        self._clock = clock
        self._wall = wall
        self.damper = damper or OfflineDamper()
        self._listeners: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Instance name -> (failures in a row, monotonic time it may be written again)
        self._retry: dict[str, tuple[int, float]] = {}
        self.writes = 0  # marks set or cleared
        self.passes = 0

    def offline(self) -> frozenset[str]:
        """The Instances this node publishes as offline (damped)."""
        return self.damper.published

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever :meth:`offline` changes."""
        self._listeners.append(listener)

    def changed(self) -> None:
        """The raw offline set, or an Instance, changed: look again soon."""
        self._wake.set()

    def start(self) -> None:
        """Follow the raw offline set (:meth:`changed`) and the Instances."""
        self._tasks = [
            asyncio.create_task(self._loop(), name="offline-marks"),
            asyncio.create_task(self._follow_instances(), name="offline-marks-instances"),
        ]
        self.changed()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _follow_instances(self) -> None:
        # another writer's change (a leave, a drain, a re-creation) may make a mark due
        async with self._store.subscribe_instances() as events:
            async for _ in events:
                self._wake.set()

    async def _loop(self) -> None:
        deadline: float | None = None
        while True:
            timeout = RECHECK if deadline is None else max(0.0, deadline - self._clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(timeout, RECHECK)):
                    await self._wake.wait()
            await asyncio.sleep(DEBOUNCE)
            self._wake.clear()
            try:
                deadline = await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # never die: the next pass tries again
                log.error(
                    "offline marks: pass failed (%s: %s); retrying", type(error).__name__, error
                )
                deadline = self._clock() + RETRY[0]

    async def sync(self) -> float | None:
        """One pass: follow the raw offline set, write the marks that differ. Returns when
        to look again (a hold ending, a failed write's retry), if before :data:`RECHECK`."""
        self.passes += 1
        now = self._clock()
        before = self.damper.published
        deadline = self.damper.update(frozenset(self._raw()), now, self._wall())
        if self.damper.published != before:
            for listener in list(self._listeners):
                listener()
        changes = mark_changes(
            self._instances(),
            self.node,
            self.damper,
            frozenset(self._seen()),
            frozenset(self._draining()),
        )
        due = {instance.name for instance, _ in changes}
        for name in [n for n in self._retry if n not in due]:
            del self._retry[name]
        for instance, since in changes:
            failures, not_before = self._retry.get(instance.name, (0, 0.0))
            if now < not_before:
                deadline = not_before if deadline is None else min(deadline, not_before)
                continue
            try:
                if await self._ledger.mark_offline(instance.key, since):
                    self.writes += 1
                    log.info(
                        "instance %s: %s",
                        instance.key,
                        f"{self.node} does not see the device since {since} (recorded; its "
                        "shared pool leaves the node out while another node sees it)"
                        if since
                        else f"{self.node} sees the device again (recorded)",
                    )
                self._retry.pop(instance.name, None)
            except StoreError as error:
                wait = min(RETRY[0] * 2**failures, RETRY[1])
                self._retry[instance.name] = (failures + 1, now + wait)
                deadline = now + wait if deadline is None else min(deadline, now + wait)
                if failures == 0:
                    log.warning(
                        "instance %s: recording that %s %s failed (%s); retrying in %.0fs",
                        instance.key,
                        self.node,
                        "does not see the device" if since else "sees the device again",
                        error,
                        wait,
                    )
                # the API server is unwell: the others wait for the next pass rather than
                # each waiting out its own timeout now
                break
            await asyncio.sleep(0)
        return deadline
