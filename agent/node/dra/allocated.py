"""Slots the scheduler allocated to ResourceClaims that are not prepared yet: held back from
the device plugins (issue 30, 2).

Between the scheduler allocating a claim one of our devices and kubelet calling
``NodePrepareResources``, the slot is still free in ``deviceUsage``: a device-plugin pod
admitted in that window could take it. The Instance compare-and-swap keeps that safe (one
holder) but not live: the claim's allocation is fixed, so its pod can run nowhere else and its
prepare fails until the device-plugin pod ends, while a device-plugin pod could have had any
other slot. So the slot is reserved for the claim (``agent.core.ledger.reservations``): the
device plugins list it Unhealthy, GetPreferredAllocation and CL placement pass it by, and an
Allocate that asks for it anyway is refused (``Reserved``) — the device-plugin side loses fast
and its pod's controller retries with another slot. The CAS stays the final arbiter.

The agent watches ResourceClaims of every namespace (RBAC ``list``/``watch`` on
``resourceclaims``, read-only) and keeps of each only its ``akri.sh`` allocation results. A
result resolves to a slot when its pool is this node's pool or a shared Instance's pool this
node serves. Once the claim is prepared its slot holds ``D:<uid>:<node>`` and the reservation
has nothing left to do; it ends when the claim is deallocated or deleted.

**Only where the race can happen** (issue 33.5): a node in ``dra`` mode registers device
plugins only for the names it shares with device-plugin nodes (``agent/node/dra/name_paths.py``);
while none runs nothing there could take an allocated slot. The agent follows claims on a
device-plugin node that also runs the DRA driver, and on a ``dra``-mode node only while one of
its device plugins runs (``agent/node/dra/path_follower.py``, ``claims_step``). The API cannot
narrow the stream (a ResourceClaim's selectable fields are ``metadata.name``/``namespace`` only, and
claims carry no label of their driver), so what the agent holds is narrowed instead: a list
page is reduced to the claims with ``akri.sh`` results as it arrives (never the whole
collection at once), and the cache holds only those claims, in :func:`compact` form; a watch
event of any other claim only advances the resourceVersion (or removes a claim that no longer
has ``akri.sh`` results).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any

from agent.core.aio.events import Subscription
from agent.core.kube import KubeClient, resource_path
from agent.core.ledger.reservations import DRA_ALLOCATED, Reservations
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import InstanceEvent, StoreError
from agent.core.store.informer import Informer, Obj, RawEvent, key_of, watch_events
from agent.node.dra.slices import DRIVER, slot_for_device

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "resource.k8s.io", "v1", "resourceclaims"
WATCH_TIMEOUT = 290
PAGE_SIZE = 500


def akri_results(claim: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(pool, device)`` of each ``akri.sh`` allocation result of ``claim``."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [
        (str(r.get("pool")), str(r.get("device")))
        for r in results
        if isinstance(r, Mapping) and r.get("driver") == DRIVER
    ]


def compact(claim: Obj) -> Obj:
    """What the agent keeps of a claim: its identity and its ``akri.sh`` allocation results
    (specs, other drivers' results, statuses are not kept)."""
    meta = claim.get("metadata") or {}
    kept = ("name", "namespace", "uid", "resourceVersion")
    results = [
        {"driver": DRIVER, "pool": pool, "device": device} for pool, device in akri_results(claim)
    ]
    found: Obj = {"metadata": {k: meta[k] for k in kept if k in meta}}
    if results:
        found["status"] = {"allocation": {"devices": {"results": results}}}
    return found


def ours(claim: Obj) -> Obj | None:
    """:func:`compact` for a claim with ``akri.sh`` results; None for any other (a list keeps
    only ours)."""
    found = compact(claim)
    return found if "status" in found else None


def reserved_slots(
    allocated: Sequence[tuple[str, str]], instances: Sequence[Instance], node: str
) -> dict[ObjectKey, set[str]]:
    """The slots of ``instances`` that ``allocated`` ``(pool, device)`` pairs name."""
    by_name = {instance.name: instance for instance in instances}
    reserved: dict[ObjectKey, set[str]] = {}
    for pool, device in allocated:
        resolved = slot_for_device(pool, device, by_name, node)
        if resolved is not None:
            instance, slot = resolved
            reserved.setdefault(instance.key, set()).add(slot)
    return reserved


class AllocatedClaims:
    """Follows ResourceClaims and keeps ``reservations`` (source ``dra-allocated``) equal to
    the slots of this node's Instances that allocated claims name."""

    def __init__(
        self,
        client: KubeClient,
        node: str,
        instances: Callable[[], list[Instance]],
        reservations: Reservations,
    ) -> None:
        self._client = client
        self.node = node
        self._instances = instances
        self.reservations = reservations
        self._informer = Informer(
            PLURAL, self._list, self._watch, self._on_event, keep=compact, probe=self._probe
        )
        self._tasks: list[asyncio.Task[None]] = []
        # namespace/name -> its akri.sh (pool, device) results, for allocated claims only
        self._allocated: dict[str, list[tuple[str, str]]] = {}
        self.available = False  # False: claims cannot be listed (RBAC); nothing is reserved

    async def start(self) -> None:
        """First list, then follow. A cluster (or RBAC) that does not let the agent list
        claims leaves the reservations off, said once: the CAS still keeps slots safe."""
        from agent.core.store.kubernetes import first_list

        try:
            await first_list(self._informer, PLURAL, 0.0, group=GROUP)
        except StoreError as error:
            log.warning(
                "ResourceClaims cannot be followed (%s): slots allocated to claims are not held "
                "back from the device plugins until they are prepared",
                error,
            )
            return
        self.available = True
        self.recompute()
        self._tasks.append(asyncio.create_task(self._informer.run(), name="watch-claims"))

    def follow_instances(self, events: Subscription[InstanceEvent]) -> None:
        """Recompute when Instances change (a slot resolves only once its Instance is
        known here)."""
        self._tasks.append(asyncio.create_task(self._follow(events), name="claims-instances"))

    async def _follow(self, events: Subscription[InstanceEvent]) -> None:
        try:
            async for _ in events:
                if self._allocated:
                    self.recompute()
        finally:
            events.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def recompute(self) -> None:
        allocated = [pair for results in self._allocated.values() for pair in results]
        slots = reserved_slots(allocated, self._instances(), self.node) if allocated else {}
        self.reservations.replace(DRA_ALLOCATED, slots)

    # -- informer plumbing ---------------------------------------------------------------
    async def _list(self) -> tuple[list[Obj], str]:
        return await self._client.list_all(
            resource_path(GROUP, VERSION, PLURAL),
            page_size=PAGE_SIZE,
            request_timeout=30,
            keep=ours,
        )

    async def _watch(self, version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        """The watch, narrowed: events of claims with ``akri.sh`` results pass (compacted); a
        claim that no longer has any leaves the cache (DELETED); any other event only moves
        the resourceVersion on (as a bookmark)."""
        stream = self._client.watch(
            resource_path(GROUP, VERSION, PLURAL), version, timeout_seconds=WATCH_TIMEOUT
        )
        async with contextlib.aclosing(watch_events(stream, PLURAL)) as events:
            async for kind, obj in events:
                if kind == "BOOKMARK":
                    yield kind, obj
                    continue
                found = compact(obj)
                if kind == "DELETED" or "status" in found:
                    yield kind, found
                elif key_of(found) in self._informer.cache:
                    yield "DELETED", found  # deallocated, or allocated elsewhere
                else:
                    meta = found.get("metadata") or {}
                    yield "BOOKMARK", {"metadata": {"resourceVersion": meta.get("resourceVersion")}}

    async def _probe(self) -> None:
        await self._client.get("/version", request_timeout=2.0)

    def _on_event(self, event: RawEvent) -> None:
        key = key_of(event.obj)
        results = [] if event.type == "DELETED" else akri_results(event.obj)
        if results == self._allocated.get(key, []):
            return  # another driver's claim, or no change in what it holds of ours
        if results:
            self._allocated[key] = results
        else:
            self._allocated.pop(key, None)
        self.recompute()
