"""Remove the ``akri.sh/slots`` finalizer of terminating Instances that hold nothing.

The write that frees the last held slot of a terminating Instance removes the finalizer itself
(``agent.core.ledger.finalizer``). This task covers the rest: an Instance deleted while no slot
was held, or whose last slot another agent (an Akri agent, the controller's dead-node cleanup)
freed. One write of one node does it: every agent runs this task, but each waits its turn
(:func:`~agent.core.ledger.finalizer.settle_delay`: the first of the Instance's ``nodes`` at
once, the next one :data:`~agent.core.ledger.finalizer.SETTLE_STEP` seconds later if the
Instance is still there, ...). Before, every agent wrote at once and all but one conflicted
(issue 36).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from agent.core.aio.events import Subscription
from agent.core.ledger.finalizer import finalizer_done, settle_delay
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.keys import ObjectKey
from agent.core.store.base import EventType, InstanceEvent, StoreError

log = logging.getLogger(__name__)

RETRY_DELAY = 5.0  # after a failed write (API server unavailable), before the next attempt


async def settle_finalizers(
    events: Subscription[InstanceEvent],
    ledger: SlotLedger,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Follow Instance events; settle each terminating Instance that holds no slot when this
    node's turn comes (at once for its settler). Instances are settled concurrently (one task
    each: a deleted Configuration's Instances go together, not one write after the other). A
    write that fails (API server unavailable) is tried again after :data:`RETRY_DELAY`; the
    Instance meanwhile stays terminating, nothing is lost."""
    due: dict[ObjectKey, float] = {}  # Instance -> when this node settles it
    running: dict[ObjectKey, asyncio.Task[None]] = {}
    try:
        while True:
            now = clock()
            for key in sorted(k for k, when in due.items() if when <= now):
                del due[key]
                if key not in running:
                    running[key] = asyncio.create_task(
                        _settle(ledger, key, running), name=f"settle-{key.name}"
                    )
            wait = max(0.0, min(due.values()) - clock()) if due else None
            try:
                async with asyncio.timeout(wait):
                    event = await anext(events)
            except TimeoutError:
                continue
            except StopAsyncIteration:
                return
            key = event.instance.key
            if event.type is EventType.DELETED or not finalizer_done(event.instance):
                due.pop(key, None)
                continue
            # the turn follows the Instance's nodes as they are now (a gone settler taken
            # out by the controller's dead-node cleanup makes the next one the settler)
            when = clock() + settle_delay(event.instance, ledger.node)
            if when < due.get(key, float("inf")):
                due[key] = when
    finally:
        events.close()
        for task in list(running.values()):
            task.cancel()
        for task in list(running.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _settle(
    ledger: SlotLedger, key: ObjectKey, running: dict[ObjectKey, asyncio.Task[None]]
) -> None:
    """Remove the finalizer of ``key`` while the cache says it may go, retrying failed
    writes; then leave ``running``."""
    logged = False
    try:
        while True:
            cached = ledger.store.get_cached(key)
            if cached is None or not finalizer_done(cached):
                return
            try:
                await ledger.settle_finalizer(key)
                return
            except StoreError as error:
                if not logged:
                    what = "deleting it" if ledger.store.local else "removing its finalizer"
                    log.warning("instance %s: %s failed (retried): %s", key, what, error)
                    logged = True
            await asyncio.sleep(RETRY_DELAY)
    finally:
        running.pop(key, None)
