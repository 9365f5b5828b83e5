"""``Retirement``: this node leaves the Instances of a Configuration that is gone.

Used when a Configuration is deleted, and at start for Instances that list this node but
whose Configuration no longer exists (and cannot be hiding in an unreadable source). Each
Instance is left through the slot ledger: at once if this node holds none of its slots,
otherwise it stays draining (Unhealthy in the device plugins, out of the ResourceSlices)
and is left as soon as the reclaimers or the DRA driver have released the last slot — the
retirement is woken by every change of those Instances. It ends when this node is in none of
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from agent.core.ledger.ledger import SlotLedger
from agent.core.model.keys import ObjectKey
from agent.core.store.base import InstanceStore
from agent.node.discovery.runner import report_draining

log = logging.getLogger("agent.discovery")
MAX_BACKOFF = 30.0


class Retirement:
    """Takes this node out of every Instance of ``configuration``."""

    def __init__(
        self,
        configuration: ObjectKey,
        store: InstanceStore,
        ledger: SlotLedger,
        why: str,
        on_offline_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.configuration = configuration
        self.store = store
        self.ledger = ledger
        self.node = ledger.node
        self.why = why
        self.draining: dict[str, tuple[str, ...]] = {}  # name -> slots this node still holds
        self._on_offline_change = on_offline_change
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.done = asyncio.Event()

    @property
    def offline(self) -> frozenset[str]:
        """Names of the Instances still draining (their slots are reported Unhealthy)."""
        return frozenset(self.draining)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"retire-{self.configuration}")

    async def stop(self) -> None:
        """Stop (the Configuration came back: its new runner takes the Instances over)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.draining:
            self.draining = {}
            self._on_offline_change()

    def wake(self) -> None:
        """An Instance of the Configuration changed: try again."""
        self._wake.set()

    async def _run(self) -> None:
        backoff = 0.5
        while True:
            self._wake.clear()
            try:
                remaining = await self.retire_once()
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.error(
                    "configuration %s: leaving its instances failed (%s: %s); retrying in %.1fs",
                    self.configuration,
                    type(error).__name__,
                    error,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
                continue
            if not remaining:
                log.info(
                    "configuration %s: %s is in none of its instances any more",
                    self.configuration,
                    self.node,
                )
                self.done.set()
                return
            await self._wake.wait()

    async def retire_once(self) -> int:
        """One pass; returns how many Instances still list this node (draining)."""
        draining: dict[str, tuple[str, ...]] = {}
        for instance in self.store.list_cached(self.configuration):
            if self.node not in instance.nodes:
                continue
            result = await self.ledger.leave(instance.key)
            if result.left:
                continue
            draining[instance.name] = result.slots
            if self.draining.get(instance.name) != result.slots:
                await report_draining(self.store, instance.key, self.node, result.slots, self.why)
        changed = set(draining) != set(self.draining)
        self.draining = draining
        if changed:
            self._on_offline_change()
        return len(draining)
