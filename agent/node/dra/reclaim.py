"""Frees ``D:<claim-uid>:<node>`` slots of this node whose claim no longer uses them.

kubelet frees a claim's slots itself by calling ``NodeUnprepareResources``; this covers what
that misses: a prepare interrupted after claiming slots (agent killed, prepare failed half
way and its release failed), an unprepare lost with a restart, a claim deleted while its
prepare was being retried. Each held ``D:`` slot is classified (:func:`classify`) against the
DRA checkpoint and, when needed, the ResourceClaim in the API:

* **prepared** — the claim is prepared on this slot (checkpoint): in use until kubelet
  unprepares it;
* **allocated** — the claim was being prepared (checkpoint "preparing") and the API still has
  it, same uid, allocated with this slot's device: in use (kubelet retries the prepare);
* **stale** — the claim is prepared on other slots, or its ResourceClaim is gone, replaced,
  deallocated or no longer allocated this device;
* **releasing** — the claim was unprepared on the node while the API refused to free its
  slots (an agent being uninstalled, ``state.py``): a *pending release* in the checkpoint.
  Nothing uses the slot; it is freed as soon as the API answers (:meth:`DraReclaimer.
  complete_releases`, every pass, each Instance with its own backoff), by this agent or the
  next one on this node at its start, and the record goes with it (issue 39.2);
* **untraceable** — the checkpoint does not know the claim (lost or unreadable checkpoint,
  or a slot written by another agent): never freed here, reported once with the slot so an
  operator can free it. Whether such a claim is gone from the API cannot be established:
  the slot holds only the claim's uid, a ``GET`` needs its namespace and name (which only
  the lost checkpoint had), and the claims the agent follows (``allocated.py``) are used only
  to reserve slots: a uid missing from them is no proof (a claim created after the list, a
  watch that fell behind). Freeing on a guess could give a device in use to a second claim.
  kubelet still frees most of them: it keeps its own record and calls
  ``NodeUnprepareResources`` when the claim's pod ends, and :meth:`DraState.unprepare` frees
  every ``D:<uid>:<node>`` slot of a claim the checkpoint does not know (docs/dra.md, "Slots
  nobody uses any more").

A stale slot is freed once it has been seen stale for ``grace`` seconds (two looks, like the
device-plugin reclaimer) and was not granted again meanwhile; the claim's *preparing* record
goes with its last slot. Passes run every ``interval`` seconds only while this node holds
``D:`` slots (an index fed by Instance events), and under the DRA state's lock, so they never
see a prepare half done.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from agent.core.aio.backoff import FailureBackoff
from agent.core.aio.events import Subscription
from agent.core.model.device_usage import ClaimUsage, parse_usage
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import InstanceEvent, NotFoundError, StorageError, StoreError
from agent.node.deviceplugin.held_slots import HeldIndex, HeldSlot, follow_until_held, held_in
from agent.node.dra.checkpoint import Checkpoint
from agent.node.dra.slices import DRIVER, device_name
from agent.node.dra.state import ClaimReader, DraState, driver_results

log = logging.getLogger(__name__)


class ClaimSlotState(enum.Enum):
    """What a held ``D:`` slot is, as far as this node can tell."""

    PREPARED = "prepared"
    ALLOCATED = "allocated"
    STALE = "stale"
    RELEASING = "releasing"
    UNTRACEABLE = "untraceable"


def claim_slot(instance: Instance, slot: str, value: str, node: str) -> HeldSlot | None:
    """``slot`` as a ``D:<uid>:<node>`` slot of ``node`` (``device_id`` = the claim uid)."""
    if not value.startswith("D:"):
        return None
    usage = parse_usage(value)
    if isinstance(usage, ClaimUsage) and usage.node == node:
        return HeldSlot(instance.key, slot, value, DRIVER, usage.claim_uid)
    return None


def claim_slots_in(instance: Instance, node: str) -> tuple[HeldSlot, ...]:
    """The ``D:<uid>:<node>`` slots of ``instance``."""
    return held_in(instance, node, claim_slot)


def classify(
    slot: HeldSlot,
    checkpoint: Checkpoint,
    claim: Mapping[str, Any] | None,
    pool_of: Callable[[HeldSlot], str],
) -> ClaimSlotState:
    """Classify one held ``D:`` slot. ``claim`` is the ResourceClaim as read from the API for
    a *preparing* claim (None when it does not exist); ``pool_of`` gives the pool name the
    slot's device is published in."""
    uid = slot.device_id
    prepared = checkpoint.claims.get(uid)
    if prepared is not None:
        on_slot = any(
            ObjectKey(d.namespace, d.instance) == slot.instance and d.slot == slot.slot
            for d in prepared.devices
        )
        return ClaimSlotState.PREPARED if on_slot else ClaimSlotState.STALE
    if uid in checkpoint.releases:
        return ClaimSlotState.RELEASING
    if uid not in checkpoint.pending:
        return ClaimSlotState.UNTRACEABLE
    if claim is None or (claim.get("metadata") or {}).get("uid") != uid:
        return ClaimSlotState.STALE
    wanted = (pool_of(slot), device_name(slot.slot))
    for result in driver_results(claim):
        if (str(result.get("pool")), str(result.get("device"))) == wanted:
            return ClaimSlotState.ALLOCATED
    return ClaimSlotState.STALE


class DraReclaimer:
    """Runs the passes described in the module docstring."""

    def __init__(
        self,
        state: DraState,
        events: Callable[[], Subscription[InstanceEvent]],
        read_claim: ClaimReader,
        lookup: Callable[[ObjectKey], Instance | None],
        *,
        served: Callable[[Instance], bool] = lambda _: True,
        interval: float = 1.0,
        grace: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.state = state
        self.ledger = state.ledger
        self.node = state.node
        self._events = events
        self._read_claim = read_claim
        self._lookup = lookup
        self.interval = interval
        self.grace = grace
        self._clock = clock
        self._sleep = sleep
        self.index = HeldIndex(state.node, served, claim_slot)
        self._subscription: Subscription[InstanceEvent] | None = None
        self._stale_since: dict[tuple[ObjectKey, str], float] = {}
        self._reported: set[tuple[ObjectKey, str, str]] = set()
        # an Instance whose release failed (API server unavailable) waits before the next
        # attempt, and its failures are logged at most every 30 s
        self.release_backoff: FailureBackoff[ObjectKey] = FailureBackoff(
            initial=max(1.0, interval), maximum=30.0, log_every=30.0
        )
        self.freed = 0
        self.passes = 0
        self.idle = asyncio.Event()  # set while waiting for this node to hold a D: slot

    def resync(self) -> None:
        """Which Instances are served changed: rebuild the index."""
        self.index.clear()
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None

    async def run(self) -> None:
        """A pass every ``interval`` seconds while this node holds a ``D:`` slot; none at all
        while it holds none (it waits for the Instance event that gives it one)."""
        try:
            while True:
                try:
                    await self.reclaim_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("DRA slot reclaim pass failed")
                if not self.index and not self.state.checkpoint.releases:
                    await self._wait_for_held()
                    continue
                await self._sleep(self.interval)
        finally:
            if self._subscription is not None:
                self._subscription.close()
                self._subscription = None

    async def _wait_for_held(self) -> None:
        """Until an Instance event gives this node a ``D:`` slot (or the index is rebuilt)."""
        if self._subscription is None:
            self.index.clear()
            self._subscription = self._events()
        subscription = self._subscription
        # resync() replaces the subscription: stop following the old one
        if not await follow_until_held(
            self.index, subscription, self.idle, lambda: subscription is self._subscription
        ):
            self._subscription = None

    async def _refresh_index(self) -> None:
        if self._subscription is None:
            self.index.clear()
            self._subscription = self._events()
        subscription = self._subscription
        while subscription.pending():
            try:
                event = await anext(subscription)
            except StopAsyncIteration:
                self._subscription = None
                return
            self.index.apply(event)

    def _pool_of(self, slot: HeldSlot) -> str:
        instance = self._lookup(slot.instance)
        if instance is not None and instance.shared:
            return instance.name
        return self.node

    async def reclaim_once(self) -> list[HeldSlot]:
        """One pass; returns the slots freed (pending releases apart)."""
        await self._refresh_index()
        if self.state.checkpoint.releases:
            await self.complete_releases()
        if not self.index:
            self._stale_since.clear()
            return []
        self.passes += 1
        freed: list[HeldSlot] = []
        async with self.state.lock():
            # again under the lock: an unprepare that held it meanwhile freed slots whose
            # events are only queued now (a stale index took them for unknown claims)
            await self._refresh_index()
            checkpoint = self.state.checkpoint
            claims: dict[str, Mapping[str, Any] | None] = {}
            now = self._clock()
            current: set[tuple[ObjectKey, str]] = set()
            due: list[HeldSlot] = []
            for slot in list(self.index):
                uid = slot.device_id
                pending = checkpoint.pending.get(uid)
                if pending is not None and uid not in claims:
                    try:
                        claims[uid] = await self._read_claim(pending.namespace, pending.name)
                    except Exception as error:  # unknown: keep it, ask again next pass
                        log.warning(
                            "cannot read ResourceClaim %s/%s: %s",
                            pending.namespace,
                            pending.name,
                            error,
                        )
                        continue
                state = classify(slot, checkpoint, claims.get(uid), self._pool_of)
                if state is ClaimSlotState.UNTRACEABLE:
                    if await self._still_held(slot):
                        self._report_untraceable(slot)
                    continue
                if state is not ClaimSlotState.STALE:
                    continue
                current.add(slot.key)
                since = self._stale_since.setdefault(slot.key, now)
                if now - since >= self.grace:
                    due.append(slot)
            for key in [k for k in self._stale_since if k not in current]:
                del self._stale_since[key]
            for slot in due:
                if not self.release_backoff.due(slot.instance, now):
                    continue  # still stale since then: freed once its backoff is over
                since = self._stale_since.pop(slot.key)
                try:
                    released = await self.ledger.release_slots(
                        slot.instance,
                        {slot.slot: slot.value},
                        unless_granted_since={slot.slot: since},
                    )
                except StoreError as error:
                    # the API or the disk refused (StorageError names the cause): still stale
                    # since then, so a later pass frees it without a new grace
                    self._stale_since[slot.key] = since
                    failure = self.release_backoff.failed(slot.instance, self._clock())
                    if failure.log:
                        log.warning(
                            "cannot free DRA slot %s (%s) now: %s; retrying in %.0fs",
                            slot.slot,
                            slot.value,
                            error,
                            failure.delay,
                        )
                    continue
                self.release_backoff.succeeded(slot.instance)
                if slot.slot in released:
                    self.freed += 1
                    freed.append(slot)
                    log.info(
                        "reclaimed DRA slot %s (%s): its claim no longer uses it",
                        slot.slot,
                        slot.value,
                    )
            if freed:
                await self._refresh_index()
                self._forget_finished_pending(freed)
        return freed

    async def complete_releases(self) -> int:
        """Free the values of the checkpoint's pending releases where the API lets it now
        (an Instance that failed waits for its backoff); each Instance done — freed, or the
        value no longer there, or the Instance gone — leaves the record. Returns how many
        were done."""
        completed = 0
        async with self.state.lock():
            checkpoint = self.state.checkpoint
            now = self._clock()
            for release in list(checkpoint.releases.values()):
                done: list[ObjectKey] = []
                for key in release.instances:
                    if not self.release_backoff.due(key, now):
                        continue
                    try:
                        freed = await self.ledger.release_values(key, {release.value})
                    except StoreError as error:
                        failure = self.release_backoff.failed(key, self._clock())
                        if failure.log:
                            log.warning(
                                "cannot free %s in Instance %s yet (claim %s/%s was unprepared "
                                "on this node, its slot release is pending): %s; retrying in "
                                "%.0fs",
                                release.value,
                                key,
                                release.namespace,
                                release.name,
                                error,
                                failure.delay,
                            )
                        continue
                    self.release_backoff.succeeded(key)
                    done.append(key)
                    self.freed += len(freed)
                    log.info(
                        "pending release done: %s freed in Instance %s (%s) for claim %s/%s, "
                        "unprepared on this node earlier",
                        release.value,
                        key,
                        ", ".join(freed) or "no slot held it any more",
                        release.namespace,
                        release.name,
                    )
                if not done:
                    continue
                try:
                    checkpoint.released(release.uid, done)
                except StorageError as error:
                    # kept: the next pass finds the value gone and drops the record then
                    log.warning("could not update the DRA checkpoint's pending releases: %s",
                                error)  # fmt: skip
                    continue
                completed += len(done)
        return completed

    def _forget_finished_pending(self, freed: list[HeldSlot]) -> None:
        uids = {slot.device_id for slot in freed}
        still = {slot.device_id for slot in self.index}
        gone = [uid for uid in uids if uid in self.state.checkpoint.pending and uid not in still]
        if not gone:
            return
        try:
            self.state.checkpoint.forget(gone)
        except StorageError as error:
            # harmless: a "preparing" entry whose claim is gone frees nothing more later
            log.warning("could not drop finished claims from the DRA checkpoint: %s", error)

    async def _still_held(self, slot: HeldSlot) -> bool:
        """Whether ``slot`` still holds its value on the freshest version there is — the
        cache (this node's own writes are in it at once), then the store itself — before an
        error says nobody knows its claim: a slot already free is no news."""
        cached = self._lookup(slot.instance)
        if cached is None or cached.device_usage.get(slot.slot) != slot.value:
            return False
        try:
            fresh = await self.ledger.store.get(slot.instance)
        except NotFoundError:
            return False
        except StoreError:
            return True  # cannot tell: the cache says held
        return fresh.device_usage.get(slot.slot) == slot.value

    def _report_untraceable(self, slot: HeldSlot) -> None:
        key = (slot.instance, slot.slot, slot.value)
        if key in self._reported:
            return
        self._reported.add(key)
        log.error(
            "instance %s slot %s is held by %s, a claim this node's DRA checkpoint does not "
            "know (checkpoint lost?): it is kept; once no pod uses it, free it by setting "
            "spec.deviceUsage[%s] to an empty string",
            slot.instance,
            slot.slot,
            slot.value,
            slot.slot,
        )
