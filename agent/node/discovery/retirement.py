"""``Retirement``: this node leaves the Instances of a Configuration that is gone.

Used when a Configuration is deleted, and at start for Instances that list this node but
whose Configuration no longer exists (and cannot be hiding in an unreadable source). Each
Instance is left through the slot ledger: at once if this node holds none of its slots,
otherwise it stays draining (Unhealthy in the device plugins, out of the ResourceSlices)
and is left as soon as the reclaimers or the DRA driver have released the last slot — the
retirement is woken by every change of those Instances. It ends when this node is in none of
them.

In a cluster, a deleted Configuration's Instances are deleted by Kubernetes' garbage collector
(their ownerReference names it): they are not left one node at a time. While they wait for it
this node writes nothing to them (it offers none of their slots); once deleted they go as a
whole with the ``akri.sh/slots`` finalizer (``agent.core.ledger.finalizer``: nodes do not
leave a terminating Instance). Before (issue 36), every node left every Instance at the same
moment the collector deleted it. If the collector has not deleted one within
:data:`COLLECTION_WAIT` seconds (kube-controller-manager down, the Configuration deleted
with ``propagationPolicy: Orphan``), this node leaves it as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from agent.core.ledger.decisions import node_slots
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import InstanceStore
from agent.node.discovery.runner import report_draining

log = logging.getLogger("agent.discovery")
MAX_BACKOFF = 30.0
# seconds the Instances of a deleted Configuration are left to the garbage collector before
# this node leaves them itself (kube-controller-manager deletes dependents within a second
# or so; this only bounds the wait when it does not)
COLLECTION_WAIT = 30.0


def collected_with_configuration(instance: Instance) -> bool:
    """Whether ``instance`` names its Configuration as owner (Akri's ownerReference), so
    that Kubernetes' garbage collector deletes it once that Configuration is gone."""
    return any(
        ref.get("kind") == "Configuration"
        and str(ref.get("apiVersion") or "").startswith("akri.sh/")
        and ref.get("name") == instance.configuration_name
        for ref in instance.owner_references
    )


class Retirement:
    """Takes this node out of every Instance of ``configuration``."""

    def __init__(
        self,
        configuration: ObjectKey,
        store: InstanceStore,
        ledger: SlotLedger,
        why: str,
        on_offline_change: Callable[[], None] = lambda: None,
        asked: bool = True,
    ) -> None:
        self.configuration = configuration
        self.store = store
        self.ledger = ledger
        self.node = ledger.node
        self.why = why
        # the operator deleted the Configuration (the draining lines are INFO: an expected
        # step of every uninstall), not a refusal of it (already an error of its own)
        self.asked = asked
        self.draining: dict[str, tuple[str, ...]] = {}  # name -> slots this node still holds
        # names of the Instances left to the garbage collector (their Configuration is gone)
        self.collecting: frozenset[str] = frozenset()
        self._on_offline_change = on_offline_change
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._collection_deadline = time.monotonic() + COLLECTION_WAIT
        self._collection_reported = False
        self.done = asyncio.Event()

    @property
    def offline(self) -> frozenset[str]:
        """Names of the Instances still draining or waiting for the garbage collector (their
        slots are reported Unhealthy)."""
        return frozenset(self.draining) | self.collecting

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"retire-{self.configuration}")

    async def stop(self) -> None:
        """Stop (the Configuration came back: its new runner takes the Instances over)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.draining or self.collecting:
            self.draining = {}
            self.collecting = frozenset()
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
            if self.collecting:  # until the collector acts, or the wait for it is over
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(self._deadline_on_loop()):
                        await self._wake.wait()
            else:
                await self._wake.wait()

    def _deadline_on_loop(self) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + max(0.0, self._collection_deadline - time.monotonic())

    def _left_to_collector(self) -> bool:
        """Whether this retirement leaves the Configuration's Instances to the garbage
        collector: the store has one, the Configuration is gone (not only refused or moved to
        another namespace) and the wait for the collector is not over."""
        if not self.store.garbage_collected or time.monotonic() >= self._collection_deadline:
            return False
        key = self.configuration
        return all(c.key != key for c in self.store.configurations()) and all(
            i.key != key for i in self.store.invalid_configurations()
        )

    async def retire_once(self) -> int:
        """One pass; returns how many Instances still list this node (draining)."""
        draining: dict[str, tuple[str, ...]] = {}
        collecting: set[str] = set()
        to_collector = self._left_to_collector()
        for instance in self.store.list_cached(self.configuration):
            if self.node not in instance.nodes:
                continue
            if (
                to_collector
                and instance.deletion_timestamp is None
                and collected_with_configuration(instance)
            ):
                collecting.add(instance.name)
                continue
            if (
                not to_collector
                and instance.name in self.collecting
                and instance.deletion_timestamp is None
            ):
                log.warning(
                    "instance %s: not deleted by the garbage collector within %.0fs of its "
                    "configuration; %s leaves it",
                    instance.key,
                    COLLECTION_WAIT,
                    self.node,
                )
            result = await self.ledger.leave(instance.key)
            if result.left:
                continue
            draining[instance.name] = result.slots
            if self.draining.get(instance.name) != result.slots:
                await report_draining(
                    self.store, instance.key, self.node, result.slots, self.why, self.asked
                )
        if collecting and not self._collection_reported:
            self._collection_reported = True
            held = sum(
                len(node_slots(i, self.node))
                for i in self.store.list_cached(self.configuration)
                if i.name in collecting
            )
            log.info(
                "configuration %s: %d instance(s) on %s are deleted with it by the garbage "
                "collector (%d slot(s) held here stay with their pods until freed)",
                self.configuration,
                len(collecting),
                self.node,
                held,
            )
        changed = set(draining) != set(self.draining) or collecting != self.collecting
        self.draining = draining
        self.collecting = frozenset(collecting)
        if changed:
            self._on_offline_change()
        return len(draining) + len(collecting)
