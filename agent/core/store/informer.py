"""A minimal informer: list, then watch from the list's resourceVersion, forever.

* resumes a dropped watch from the last resourceVersion it saw (events or bookmarks);
* on ``410 Gone`` (history compacted), or any other error event in the stream (e.g. "too
  large resource version"), relists and reports the difference against its cache as
  synthetic events, so consumers see each real change once and nothing twice;
* the agent's own writes (and reads that refresh an object) are applied at once
  (:meth:`Informer.apply_local`); watch events older than such a version are skipped, and a
  relist requested before the write completed does not move the object back. Versions of
  one resource compare as integers (KEP-5504, apimachinery ``CompareResourceVersion``: a
  positive decimal without leading zeros), so "older" is decided by comparing them, whatever
  the order in which the write's answer and its watch event arrive (a real API server gives
  none). A version that is not such an integer is opaque: it is compared for equality only,
  and an own write is then assumed to reach the cache before its watch event (the old rule,
  with its 30 s limit);
* reconnects with capped, jittered exponential backoff while the API server is unreachable,
  keeping the cache (the agent keeps working on what it knew); with a ``probe`` (a cheap
  request), a long backoff is cut short within a second of the API server answering again.

The HTTP calls are injected (``list_fn``/``watch_fn``) so the same loop serves Instances and
Configurations, and the decision logic (:func:`diff_snapshot`) is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.kube.client import MAX_RETRY_AFTER
from agent.core.kube.errors import ApiError

log = logging.getLogger(__name__)

Obj = dict[str, Any]


# an own write the watch has not confirmed after this long is forgotten: the watch had already
# moved past it (a relist answered from a snapshot newer than our write, then someone else
# wrote), and skipping the object's events any longer would freeze it in the cache
LOCAL_CONFIRM_TIMEOUT = 30.0
# reconnect backoff of a failing watch: 0.5 s doubling to this (the watch request itself is
# cheap, and a longer gap leaves the cache stale that much longer after an outage)
MAX_WATCH_BACKOFF = 10.0
PROBE_INTERVAL = 1.0  # seconds between probes of an API server a watch waits for


class WatchExpiredError(Exception):
    """The watch's resourceVersion is too old (HTTP 410 Gone), or the server sent another
    error event that resuming from the same version would only repeat: relist."""


@dataclass(frozen=True)
class RawEvent:
    """``type`` is ADDED, MODIFIED or DELETED; ``obj`` the object (for DELETED: last state)."""

    type: str
    obj: Obj


def key_of(obj: Mapping[str, Any]) -> str:
    """``namespace/name`` of an object."""
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name')}"


def resource_version(obj: Mapping[str, Any]) -> str:
    """``metadata.resourceVersion`` or ``""``."""
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def without_managed_fields(obj: Obj) -> Obj:
    """``obj`` without ``metadata.managedFields`` (server-side-apply bookkeeping the agent
    never reads; on a real API server it is often the largest part of a small object). Like
    client-go's ``TransformStripManagedFields``; a PUT without it leaves the server's as is."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    return obj


def whole(obj: Obj) -> Obj:
    """The cache keeps the whole object (``managedFields`` already dropped)."""
    return obj


def identity_only(obj: Obj) -> Obj:
    """Only what the informer itself needs of a cached object (name, namespace,
    resourceVersion, uid): for callers that keep their own typed copy of every object."""
    meta = obj.get("metadata") or {}
    keep = ("name", "namespace", "resourceVersion", "uid")
    return {"metadata": {key: meta[key] for key in keep if key in meta}}


def compare_versions(a: str, b: str) -> int | None:
    """-1, 0 or 1 as resourceVersion ``a`` is older than, equal to or newer than ``b`` (two
    versions of one resource), or None when either is not a positive decimal integer without
    leading zeros (apimachinery ``resourceversion.CompareResourceVersion``, KEP-5504)."""
    if not (a.isdigit() and b.isdigit()) or a[0] == "0" or b[0] == "0":
        return None
    if len(a) != len(b):
        return -1 if len(a) < len(b) else 1
    return (a > b) - (a < b)


def diff_snapshot(cache: Mapping[str, Obj], listed: Mapping[str, Obj]) -> list[RawEvent]:
    """Events that turn ``cache`` into ``listed`` (used after a relist)."""
    events: list[RawEvent] = []
    for key in sorted(set(cache) - set(listed)):
        events.append(RawEvent("DELETED", cache[key]))
    for key in sorted(listed):
        if key not in cache:
            events.append(RawEvent("ADDED", listed[key]))
        elif resource_version(cache[key]) != resource_version(listed[key]):
            events.append(RawEvent("MODIFIED", listed[key]))
    return events


ListFn = Callable[[], Awaitable[tuple[list[Obj], str]]]
WatchFn = Callable[[str], AsyncGenerator[tuple[str, Obj], None]]


class Informer:
    """Keeps ``cache`` equal to the server's collection and calls ``on_event`` per change."""

    def __init__(
        self,
        name: str,
        list_fn: ListFn,
        watch_fn: WatchFn,
        on_event: Callable[[RawEvent], None],
        *,
        max_backoff: float = MAX_WATCH_BACKOFF,
        keep: Callable[[Obj], Obj] = whole,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        probe: Callable[[], Awaitable[object]] | None = None,
        admits: Callable[[Obj], bool] | None = None,
    ) -> None:
        self.name = name
        # the selector the list and watch ask the server for, as a predicate: an object our own
        # write or read brings that fails it has left the watched collection (the server's
        # watch says so with a DELETED event), so the cache drops it at once
        self._admits = admits
        self._list = list_fn
        self._watch = watch_fn
        self._on_event = on_event
        self._max_backoff = max_backoff
        self._sleep = sleep
        # a cheap request (GET /version) that answers once the API server is back: a watch
        # backing off after an outage reconnects within PROBE_INTERVAL of that, not at the
        # end of its (grown) backoff
        self._probe = probe
        self.probes = 0
        # what the cache holds of each object; events always carry the whole object, except
        # DELETED events made up after a relist, which carry what the cache held
        self._keep = keep
        self.cache: dict[str, Obj] = {}
        # our own writes not yet seen in the watch: key -> (resourceVersion or None for a
        # delete, monotonic time the write completed)
        self._local: dict[str, tuple[str | None, float]] = {}
        # of a pending delete: the version of the object we deleted (watch events up to it
        # are older than the delete; a later one is its deletion or a new object of the name)
        self._deleted_at: dict[str, str] = {}
        self.resource_version = ""
        self.relists = 0
        self.connected = asyncio.Event()

    async def initial_list(self) -> None:
        """First list; fills the cache (events are emitted for every object)."""
        await self._relist()

    async def _relist(self) -> None:
        requested = time.monotonic()
        items, version = await self._list()
        listed = {key_of(item): without_managed_fields(item) for item in items}
        for key, (local_version, written) in list(self._local.items()):
            mark = self._deleted_at.get(key) if local_version is None else local_version
            listed_version = resource_version(listed[key]) if key in listed else ""
            if key in listed and (
                listed_version == local_version
                or (mark is not None and compare_versions(listed_version, mark) == 1)
            ):
                self._forget_local(key)  # the list holds our write itself, or newer
            elif written > requested:
                # our write completed after the list was asked for: the list may predate it,
                # keep what we wrote (the watch from this list delivers it, or newer)
                if local_version is None:
                    listed.pop(key, None)
                elif key in self.cache:
                    listed[key] = self.cache[key]
            else:
                self._forget_local(key)  # the list is at least as new as our write
        events = diff_snapshot(self.cache, listed)
        self.cache = {key: self._keep(obj) for key, obj in listed.items()}
        self.resource_version = version
        self.relists += 1
        for event in events:
            self._on_event(event)

    def apply_local(self, event: RawEvent) -> None:
        """Reflect our own successful write at once (write-through), ahead of the watch; also
        a read that refreshes an object (e.g. after a conflict). A version the cache already
        holds, or an older one (the watch was faster), changes nothing."""
        key = key_of(event.obj)
        if event.type != "DELETED" and self._admits is not None and not self._admits(event.obj):
            if key not in self.cache:
                return  # outside the watched collection, and never in it: nothing to keep
            event = RawEvent("DELETED", event.obj)
        seen = resource_version(event.obj)
        known = self.cache.get(key)
        order = None if known is None else compare_versions(resource_version(known), seen)
        if event.type == "DELETED":
            if order == 1:
                return  # the watch already brought a newer object of this name
            self._deleted_at.pop(key, None)
            if compare_versions(seen, seen) is not None:  # an integer version
                self._deleted_at[key] = seen
            self._local[key] = (None, time.monotonic())
        else:
            if order is not None and order >= 0:
                return  # the watch already brought this version, or a newer one
            self._deleted_at.pop(key, None)
            self._local[key] = (seen, time.monotonic())
        self._apply(event, emit=True)

    def _apply(self, event: RawEvent, *, emit: bool) -> None:
        event = RawEvent(event.type, without_managed_fields(event.obj))
        key = key_of(event.obj)
        known = self.cache.get(key)
        if event.type == "DELETED":
            if known is None:
                return
            del self.cache[key]
        else:
            if known is not None and resource_version(event.obj) == resource_version(known):
                return  # already have this version (e.g. our own write echoed by the watch)
            if (
                known is not None
                and compare_versions(resource_version(event.obj), resource_version(known)) == -1
            ):
                return  # older than what the cache holds
            self.cache[key] = self._keep(event.obj)
            if known is None and event.type == "MODIFIED":
                event = RawEvent("ADDED", event.obj)
        if emit:
            self._on_event(event)

    def _from_watch(self, event: RawEvent) -> None:
        """A watch event: skipped while it is older than our own write of the object."""
        key = key_of(event.obj)
        pending = self._local.get(key)
        if pending is not None:
            local_version = pending[0]
            mark = self._deleted_at.get(key) if local_version is None else local_version
            order = None if mark is None else compare_versions(resource_version(event.obj), mark)
            if order is not None:
                if order <= 0:
                    if order == 0 and local_version is not None:
                        self._forget_local(key)  # our write, seen by the watch (applied)
                    return  # older than our write or delete
                self._forget_local(key)  # news: the watch has passed our write
                self._apply(event, emit=True)
                return
        if pending is not None and time.monotonic() - pending[1] > LOCAL_CONFIRM_TIMEOUT:
            self._forget_local(key)
            pending = None
        if pending is not None:
            local_version = pending[0]
            if local_version is None:
                if event.type == "DELETED":
                    self._forget_local(key)  # our delete, seen by the watch
                return  # older than our delete
            if resource_version(event.obj) == local_version:
                self._forget_local(key)  # our write, seen by the watch (already applied)
            return  # either ours, or older than ours (watch events come in order)
        self._apply(event, emit=True)

    def _forget_local(self, key: str) -> None:
        self._local.pop(key, None)
        self._deleted_at.pop(key, None)

    async def run(self) -> None:
        """Watch forever (call :meth:`initial_list` first)."""
        backoff = 0.5
        # error events (or 410 answers) in a row with no watch event between them: a 410
        # after a healthy watch relists at once, but a server that errors every watch right
        # away must not be listed in a tight loop
        expired_in_a_row = 0
        while True:
            try:
                if not self.resource_version:
                    await self._relist()
                self.connected.set()
                async with contextlib.aclosing(self._watch(self.resource_version)) as events:
                    async for kind, obj in events:
                        backoff = 0.5
                        expired_in_a_row = 0
                        version = resource_version(obj)
                        if kind == "BOOKMARK":
                            self.resource_version = version or self.resource_version
                            continue
                        self._from_watch(RawEvent(kind, obj))
                        if version:
                            self.resource_version = version
            except asyncio.CancelledError:
                raise
            except WatchExpiredError as error:
                self.resource_version = ""
                delay = expired_delay(expired_in_a_row, self._max_backoff)
                expired_in_a_row += 1
                if not delay:
                    log.info("%s watch: %s; relisting", self.name, error)
                    continue
                log.warning(
                    "%s watch: %s (%d in a row without an event); relisting in %.1fs",
                    self.name,
                    error,
                    expired_in_a_row,
                    delay,
                )
                await self._sleep(delay)
                continue
            except Exception as error:
                self.connected.clear()
                delay = retry_delay(backoff, error)
                log.warning(
                    "%s watch failed (%s: %s); retrying in %.1fs",
                    self.name,
                    type(error).__name__,
                    error,
                    delay,
                )
                await self._wait_before_retry(delay)
                backoff = min(backoff * 2, self._max_backoff)

    async def _wait_before_retry(self, delay: float) -> None:
        """Sleep ``delay`` seconds — but with a probe, ask it every :data:`PROBE_INTERVAL`
        and return as soon as the API server answers."""
        if self._probe is None or delay <= PROBE_INTERVAL:
            await self._sleep(delay)
            return
        waited = 0.0
        while waited < delay:
            step = min(PROBE_INTERVAL, delay - waited)
            await self._sleep(step)
            waited += step
            if waited >= delay:
                return
            self.probes += 1
            try:
                await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception:  # still down (or answering errors): keep waiting
                continue
            log.info("%s watch: the API server answers again; reconnecting now", self.name)
            return


def retry_delay(backoff: float, error: BaseException) -> float:
    """Seconds before reconnecting a failed watch: jittered ``backoff``, but never less than
    what the server asked for (``retryAfterSeconds`` of a 429/5xx the client gave up on),
    itself capped at :data:`~agent.core.kube.client.MAX_RETRY_AFTER` like the client's own waits
    (a bogus figure of hours must not leave the cache unwatched that long)."""
    delay = random.uniform(backoff / 2, backoff)
    asked = error.retry_after if isinstance(error, ApiError) else None
    return max(delay, min(asked, MAX_RETRY_AFTER)) if asked else delay


def expired_delay(in_a_row: int, max_backoff: float) -> float:
    """Seconds before relisting after an expired watch that is the ``in_a_row``-th (from 0)
    with no watch event since the previous one: none for the first (a 410 after a healthy
    watch is normal), then jittered exponential backoff from 0.5 s, capped."""
    if in_a_row == 0:
        return 0.0
    backoff = min(0.5 * 2 ** min(in_a_row - 1, 16), max_backoff)
    return random.uniform(backoff / 2, backoff)


def parse_watch_line(raw: bytes) -> tuple[str, Obj] | None:
    """One line of a watch response (a JSON event), None for a blank line.
    An ``ERROR`` event with code 410 raises :class:`WatchExpiredError`."""
    line = raw.strip()
    if not line:
        return None
    event = json.loads(line)
    kind = str(event.get("type", ""))
    obj = event.get("object") or {}
    if kind == "ERROR":
        # 410 Gone (history compacted) or anything else ("too large resource version", a
        # timeout): resuming from the same version would fail the same way, so relist
        code = obj.get("code")
        raise WatchExpiredError(f"error event {code}: {str(obj.get('message'))[:200]}")
    return kind, obj


async def watch_events(
    lines: AsyncGenerator[bytes, None], what: str
) -> AsyncGenerator[tuple[str, Obj], None]:
    """Events of a watch stream (:meth:`agent.core.kube.KubeClient.stream_lines`); a 410 Gone
    answer or event raises :class:`WatchExpiredError` (relist). Closes ``lines`` when done."""
    async with contextlib.aclosing(lines):
        try:
            async for raw in lines:
                item = parse_watch_line(raw)
                if item is not None:
                    yield item
        except ApiError as error:
            if error.status == 410:
                raise WatchExpiredError(f"watch {what}: 410 Gone") from error
            raise
