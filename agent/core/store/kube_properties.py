"""Secrets and ConfigMaps named by ``discoveryProperties``: read on demand, watched by name.

Split out of :mod:`agent.core.store.kubernetes`, whose job is the akri.sh objects (informer
caches, compare-and-swap Instance writes). These are core/v1 objects the agent only reads, one
by name, with errors worded for the operator who must grant the read (RBAC) — a different job
with its own failure handling: a missing object is ``None``, an unreadable one a
:class:`PropertyResolutionError`, and a watch that cannot list yet retries every 5 s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from typing import Any

from agent.core.kube import ApiError, KubeClient, resource_path
from agent.core.model.properties import ObjectRef, PropertyResolutionError
from agent.core.store.base import StoreUnavailableError
from agent.core.store.informer import Informer, Obj, RawEvent, watch_events

# the logger of the module these lines came from, so that log filters keep matching them
log = logging.getLogger("agent.core.store.kubernetes")

LIST_RETRY_SECONDS = 5.0


def _plural(kind: str) -> str:
    return "secrets" if kind == "secret" else "configmaps"


class PropertySources:
    """Reads and watches the Secrets/ConfigMaps that ``discoveryProperties`` refer to."""

    def __init__(
        self,
        client: KubeClient,
        request_timeout: float,
        watch_timeout_seconds: int,
        count_request: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self._request_timeout = request_timeout
        self._watch_timeout_seconds = watch_timeout_seconds  # the store's, for every watch
        self._count_request = count_request  # the store's request counter

    async def read(self, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The object, or None if it does not exist."""
        plural = _plural(kind)
        self._count_request()
        try:
            return await self._client.get(
                resource_path("", "v1", plural, namespace, name),
                request_timeout=self._request_timeout,
            )
        except ApiError as error:
            if error.status == 404:
                return None
            if error.status == 403:
                raise PropertyResolutionError(
                    f"cannot read {kind} {namespace}/{name}: forbidden — the agent's "
                    f"ServiceAccount needs get, list and watch on {plural} in namespace "
                    f"{namespace}: kubectl apply -n {namespace} -f "
                    "deploy/properties-reader.yaml"
                ) from error
            what = f"HTTP {error.status}" if error.status else type(error).__name__
            raise PropertyResolutionError(
                f"cannot read {kind} {namespace}/{name}: {what}"
            ) from error

    def watch(self, refs: Iterable[ObjectRef], on_change: Callable[[], None]) -> Callable[[], None]:
        """Call ``on_change`` whenever one of ``refs`` changes; returns the function that stops."""
        tasks = [
            asyncio.get_running_loop().create_task(
                self._watch_named(ref, on_change), name=f"watch-{ref.kind}-{ref.name}"
            )
            for ref in refs
        ]

        def stop() -> None:
            for task in tasks:
                task.cancel()

        return stop

    async def _watch_named(self, ref: ObjectRef, on_change: Callable[[], None]) -> None:
        """Watch one Secret/ConfigMap by name (field selector, so RBAC may use resourceNames)."""
        selector = f"metadata.name={ref.name}"
        path = resource_path("", "v1", _plural(ref.kind), ref.namespace)
        initial = True

        async def list_fn() -> tuple[list[Obj], str]:
            self._count_request()
            try:
                return await self._client.list_all(
                    path,
                    params={"fieldSelector": selector},
                    request_timeout=self._request_timeout,
                )
            except ApiError as error:
                if error.status == 0:
                    raise
                raise StoreUnavailableError(f"list {ref.kind}: HTTP {error.status}") from error

        def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
            stream = self._client.watch(
                path, version, timeout_seconds=self._watch_timeout_seconds, field_selector=selector
            )
            return watch_events(stream, ref.kind)

        def changed(_event: RawEvent) -> None:
            if not initial:
                on_change()

        informer = Informer(f"{ref.kind} {ref.namespace}/{ref.name}", list_fn, watch_fn, changed)
        while True:
            try:
                await informer.initial_list()
                break
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("cannot list %s %s/%s: %s", ref.kind, ref.namespace, ref.name, error)
                await asyncio.sleep(LIST_RETRY_SECONDS)
        initial = False
        await informer.run()
