"""Watched caches of raw objects (Nodes, broker Pods, Jobs, Services, ResourceSlices, the pods
of a node that does not serve): an :class:`~agent.core.store.informer.Informer` per
collection, optionally narrowed by a label or field selector, that wakes the reconciler on
every change."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from agent.core.kube import KubeClient
from agent.core.ledger.node_standing import may_hold_slots
from agent.core.store.informer import Informer, Obj, RawEvent, watch_events, whole

WATCH_TIMEOUT_SECONDS = 290
_BROKER_METADATA = ("name", "namespace", "uid", "resourceVersion", "labels",
                    "creationTimestamp", "deletionTimestamp")  # fmt: skip
_BROKER_STATUS = ("phase", "active", "succeeded")


def broker_summary(obj: Obj) -> Obj:
    """What the decisions read of a broker Pod or Job (``reconcile.observed``): the cache of
    10,000 broker Pods holds this, not their specs."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    return {
        "kind": obj.get("kind"),
        "metadata": {key: meta[key] for key in _BROKER_METADATA if key in meta},
        "status": {key: status[key] for key in _BROKER_STATUS if key in status},
    }


HOLDS_SLOTS = "akri.sh/mayHoldSlots"  # in a pod_summary: may_hold_slots of the whole pod


def pod_summary(obj: Obj) -> Obj:
    """What the node rule reads of a pod bound to a node that does not serve: its identity,
    and whether it may hold a slot (decided on the whole pod as it arrives)."""
    meta = obj.get("metadata") or {}
    return {
        "kind": "Pod",
        "metadata": {key: meta[key] for key in _BROKER_METADATA if key in meta},
        HOLDS_SLOTS: may_hold_slots(obj),
    }


class Watched:
    """One collection kept in ``cache`` (``namespace/name`` → object)."""

    def __init__(
        self,
        client: KubeClient,
        name: str,
        path: str,
        on_event: Callable[[RawEvent], None],
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        request_timeout: float = 30.0,
        keep: Callable[[Obj], Obj] = whole,
    ) -> None:
        self.client = client
        self.path = path
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.request_timeout = request_timeout
        self._on_event = on_event
        self.informer = Informer(name, self._list, self._watch, on_event, keep=keep)
        self._task: asyncio.Task[None] | None = None
        self._was_connected = False

    def lost(self) -> bool:
        """Whether the watch ran and is down now (its cache may miss changes since)."""
        if self.informer.connected.is_set():
            self._was_connected = True
            return False
        return self._was_connected

    @property
    def cache(self) -> dict[str, Obj]:
        return self.informer.cache

    async def _list(self) -> tuple[list[Obj], str]:
        params: dict[str, Any] = {}
        if self.label_selector:
            params["labelSelector"] = self.label_selector
        if self.field_selector:
            params["fieldSelector"] = self.field_selector
        return await self.client.list_all(
            self.path, params=params, request_timeout=self.request_timeout
        )

    def _watch(self, version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        params: dict[str, Any] = {
            "watch": True,
            "resourceVersion": version,
            "timeoutSeconds": WATCH_TIMEOUT_SECONDS,
            "allowWatchBookmarks": True,
            "labelSelector": self.label_selector,
            "fieldSelector": self.field_selector,
        }
        lines = self.client.stream_lines(
            self.path, params=params, request_timeout=WATCH_TIMEOUT_SECONDS + 30, idle_timeout=150
        )
        return watch_events(lines, self.informer.name)

    async def start(self) -> None:
        """First list (raises when the API server cannot answer), then watch in a task."""
        await self.informer.initial_list()
        self._task = asyncio.create_task(self.informer.run(), name=f"watch-{self.informer.name}")

    async def stop(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            # not ``suppress(CancelledError)``: that would also swallow the cancellation of
            # the caller (a reconcile pass stopping a watch as it is cancelled went on)
            await asyncio.gather(task, return_exceptions=True)

    def wrote(self, obj: Obj, deleted: bool = False) -> None:
        """Our own write, reflected at once (the watch confirms it later)."""
        self.informer.apply_local(RawEvent("DELETED" if deleted else "ADDED", obj))
