"""Watched caches of raw objects (Nodes, broker Pods, Jobs, Services, ResourceSlices): an
:class:`~agent.core.store.informer.Informer` per collection, optionally narrowed by a label
selector, that wakes the reconciler on every change."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

from agent.core.kube import KubeClient
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
        request_timeout: float = 30.0,
        keep: Callable[[Obj], Obj] = whole,
    ) -> None:
        self.client = client
        self.path = path
        self.label_selector = label_selector
        self.request_timeout = request_timeout
        self._on_event = on_event
        self.informer = Informer(name, self._list, self._watch, on_event, keep=keep)
        self._task: asyncio.Task[None] | None = None

    @property
    def cache(self) -> dict[str, Obj]:
        return self.informer.cache

    async def _list(self) -> tuple[list[Obj], str]:
        params: dict[str, Any] = {}
        if self.label_selector:
            params["labelSelector"] = self.label_selector
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
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wrote(self, obj: Obj, deleted: bool = False) -> None:
        """Our own write, reflected at once (the watch confirms it later)."""
        self.informer.apply_local(RawEvent("DELETED" if deleted else "ADDED", obj))
