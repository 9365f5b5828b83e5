"""Remove the ``akri.sh/slots`` finalizer of terminating Instances that hold nothing.

The write that frees the last held slot of a terminating Instance removes the finalizer itself
(``agent.core.ledger.finalizer``). This task covers the rest: an Instance deleted while no slot
was held, or whose last slot another agent (an Akri agent, the controller's dead-node cleanup)
freed. Every agent runs it; the compare-and-swap lets one of them win, the others find the
Instance gone.
"""

from __future__ import annotations

import asyncio
import logging

from agent.core.aio.events import Subscription
from agent.core.ledger.finalizer import finalizer_done
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.keys import ObjectKey
from agent.core.store.base import EventType, InstanceEvent, StoreError

log = logging.getLogger(__name__)

RETRY_DELAY = 5.0  # after a failed write (API server unavailable), before the next attempt


async def settle_finalizers(events: Subscription[InstanceEvent], ledger: SlotLedger) -> None:
    """Follow Instance events; settle each terminating Instance that holds no slot. A write
    that fails (API server unavailable) is tried again after :data:`RETRY_DELAY` (or at the
    next event of that Instance); the Instance meanwhile stays terminating, nothing is lost."""
    pending: set[ObjectKey] = set()
    try:
        while True:
            try:
                async with asyncio.timeout(RETRY_DELAY if pending else None):
                    event = await anext(events)
            except TimeoutError:
                keys, pending = pending, set()
                for key in sorted(keys):
                    cached = ledger.store.get_cached(key)
                    if cached is not None and finalizer_done(cached):
                        await _settle(ledger, key, pending)
                continue
            except StopAsyncIteration:
                return
            if event.type is EventType.DELETED or not finalizer_done(event.instance):
                pending.discard(event.instance.key)
                continue
            await _settle(ledger, event.instance.key, pending)
    finally:
        events.close()


async def _settle(ledger: SlotLedger, key: ObjectKey, pending: set[ObjectKey]) -> None:
    try:
        await ledger.settle_finalizer(key)
    except StoreError as error:
        if key not in pending:
            log.warning("instance %s: removing its finalizer failed (retried): %s", key, error)
        pending.add(key)
