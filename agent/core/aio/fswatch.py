"""``DirectoryWatch``: wake up when entries of some directories change, without polling.

The kernel tells us (inotify, through ``asyncinotify``: a small ctypes wrapper that reads the
inotify descriptor with the event loop's own ``add_reader`` — no thread, no compiled code,
maintained) when kubelet re-creates ``kubelet.sock``, when our plugin sockets or DRA sockets
are removed, when the pod-resources socket appears, when a Configuration file or the local
state directory changes.

**One inotify instance per process** (per event loop; the agent has one): every watch shares
it, and one reader task hands each event to the watches of its directory. An inotify instance
is a per-user kernel resource (``fs.inotify.max_user_instances``, often 128), and an agent that
took one per watch used three.

Where inotify cannot be used the watch falls back to waking every ``fallback`` seconds, so
callers always re-check the state they care about after :meth:`DirectoryWatch.changed`
returns: a wake-up is a hint, never the fact itself. The cases:

* not Linux, or no ``asyncinotify``: polling, silently;
* ``inotify_init`` refused (``EMFILE``: the user's instances are used up by other software;
  ``ENOMEM``...) or a watch refused (``ENOSPC``: ``max_user_watches`` reached): **one** warning
  per process until inotify works again, counted in :data:`STATS` (``akri_inotify_fallbacks``
  metrics), and inotify is tried again only every :data:`RETRY_INTERVAL` seconds, quietly (a
  debug line): before, every ``changed()`` call tried again and warned again (10,682 lines in
  three minutes across 44 agents);
* a directory that does not exist yet: polled until it does (not a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_inotify_module: Any
try:  # pragma: no cover - depends on the platform
    import asyncinotify as _inotify_module
except (ImportError, OSError):  # pragma: no cover
    _inotify_module = None

if _inotify_module is not None:
    Mask: Any = _inotify_module.Mask
    _MASK: Any = (
        Mask.CREATE
        | Mask.DELETE
        | Mask.MOVED_FROM
        | Mask.MOVED_TO
        | Mask.CLOSE_WRITE
        | Mask.ATTRIB
        | Mask.DELETE_SELF
        | Mask.MOVE_SELF
    )
    # plain ints: enum.Flag arithmetic per event cost ~0.2 ms a plugin when a kubelet restart
    # re-creates hundreds of sockets
    _GONE = int(Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED)
    _REMOVED = int(Mask.DELETE | Mask.MOVED_FROM)

RETRY_INTERVAL = 300.0
"""Seconds between attempts to use inotify again after the kernel refused it."""


@dataclass
class InotifyStats:
    """Process-wide inotify state, for metrics and tests."""

    available: bool = True  # False while the last attempt to use inotify was refused
    fallbacks: dict[str, int] = field(default_factory=dict)  # refusals by kind: instance, watch
    instances_opened: int = 0


STATS = InotifyStats()


class _Refusals:
    """When inotify (the instance, or a watch on one directory) was last refused, so that it is
    tried again only every :data:`RETRY_INTERVAL`, and warned about once per outage."""

    def __init__(self) -> None:
        self.instance_at: float | None = None
        self.watch_at: dict[Path, float] = {}
        self.warned = False

    def may_try(self, at: float | None) -> bool:
        return at is None or _now() - at >= RETRY_INTERVAL

    def refused(self, kind: str, what: str, error: OSError, fallback: float) -> None:
        STATS.available = False
        STATS.fallbacks[kind] = STATS.fallbacks.get(kind, 0) + 1
        if self.warned:
            log.debug("inotify still refused (%s: %s); polling", what, error)
            return
        self.warned = True
        log.warning(
            "inotify unavailable (%s: %s): watched directories are polled instead (every "
            "%.1fs or so) and inotify is tried again every %.0fs; raise "
            "fs.inotify.max_user_instances / max_user_watches to restore it",
            what,
            error,
            fallback,
            RETRY_INTERVAL,
        )

    def recovered(self) -> None:
        if not STATS.available or self.warned:
            log.info("inotify works again: watched directories are no longer polled")
        STATS.available = True
        self.warned = False


_REFUSALS = _Refusals()


def _now() -> float:
    return time.monotonic()


class _Hub:
    """The inotify instance of one event loop, its watches, and the task that reads its events
    and hands them to the :class:`DirectoryWatch` objects of each directory."""

    def __init__(self) -> None:
        self.inotify: Any = None
        self.watches: dict[Path, Any] = {}
        self.subscribers: dict[Path, set[DirectoryWatch]] = {}
        self.reader: asyncio.Task[None] | None = None

    def _open(self, fallback: float) -> bool:
        if self.inotify is not None:
            return True
        if not _REFUSALS.may_try(_REFUSALS.instance_at):
            return False
        try:
            self.inotify = _inotify_module.Inotify()
        except OSError as error:
            _REFUSALS.instance_at = _now()
            _REFUSALS.refused("instance", "inotify_init", error, fallback)
            return False
        _REFUSALS.instance_at = None
        STATS.instances_opened += 1
        self.reader = asyncio.get_running_loop().create_task(self._read(), name="inotify")
        return True

    def add(self, directory: Path, subscriber: DirectoryWatch) -> bool:
        """Watch ``directory`` for ``subscriber``; False when inotify cannot (polling)."""
        if directory in self.watches:
            self.subscribers[directory].add(subscriber)
            return True
        if not _REFUSALS.may_try(_REFUSALS.watch_at.get(directory)):
            return False
        if not self._open(subscriber.fallback):
            return False
        try:
            watch = self.inotify.add_watch(directory, _MASK)
        except OSError as error:
            if not directory.is_dir():
                return False  # gone meanwhile: polled until it exists, not a refusal
            _REFUSALS.watch_at[directory] = _now()
            _REFUSALS.refused("watch", f"watch {directory}", error, subscriber.fallback)
            return False
        _REFUSALS.watch_at.pop(directory, None)
        if not _REFUSALS.watch_at and _REFUSALS.instance_at is None:
            _REFUSALS.recovered()
        self.watches[directory] = watch
        self.subscribers[directory] = {subscriber}
        return True

    def remove(self, directory: Path, subscriber: DirectoryWatch) -> None:
        subscribers = self.subscribers.get(directory)
        if subscribers is None:
            return
        subscribers.discard(subscriber)
        if subscribers:
            return
        del self.subscribers[directory]
        watch = self.watches.pop(directory, None)
        if watch is not None and self.inotify is not None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.inotify.rm_watch(watch)
        if not self.watches:
            self._close()

    def _close(self) -> None:
        """No watch left: give the descriptor back (a test's loop, or an agent stopping)."""
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        if self.inotify is not None:
            with contextlib.suppress(OSError):
                self.inotify.close()
            self.inotify = None

    async def _read(self) -> None:
        inotify = self.inotify
        try:
            while True:
                event = await inotify.get()
                self._dispatch(event)
                while inotify._events:  # read along with it: one wake-up per batch
                    self._dispatch(inotify._events.pop(0))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the descriptor broke: every watch falls back to polling
            log.warning("inotify stopped (%s: %s); polling", type(error).__name__, error)
            for subscribers in list(self.subscribers.values()):
                for subscriber in list(subscribers):
                    subscriber._lost_all()
            self.watches.clear()
            self.subscribers.clear()
            self.reader = None
            with contextlib.suppress(OSError):
                inotify.close()
            self.inotify = None

    def _dispatch(self, event: Any) -> None:
        path = event.watch.path if event.watch is not None else None
        if path is None:
            return
        directory = Path(path)
        gone = bool(int(event.mask) & _GONE)
        for subscriber in list(self.subscribers.get(directory, ())):
            subscriber._deliver(directory, event, gone)
        if gone:
            self.watches.pop(directory, None)
            self.subscribers.pop(directory, None)


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Hub] = weakref.WeakKeyDictionary()


def _hub() -> _Hub | None:
    if _inotify_module is None:
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # armed outside the loop: watched from the first changed() on
        return None
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = _Hub()
    return hub


class DirectoryWatch:
    """Changes in ``directories`` (their entries, not their subdirectories) that
    ``interesting(name, removed)`` accepts (all by default; ``removed``: the entry was deleted
    or moved away)."""

    def __init__(
        self,
        directories: Iterable[Path],
        fallback: float,
        interesting: Callable[[str, bool], bool] = lambda _name, _removed: True,
    ) -> None:
        self.directories = sorted({Path(d) for d in directories})
        self.fallback = fallback
        self.interesting = interesting
        self._hub: _Hub | None = None
        self._watched: set[Path] = set()
        self._pending: list[tuple[Any, bool]] = []
        self._wake: asyncio.Event | None = None
        self.events = 0  # inotify events seen (tests, debugging)
        self.using_inotify = False

    def arm(self) -> None:
        """Start watching now (``changed`` arms too): arm, then read the state you care
        about, then wait — a change between reading and arming would otherwise be missed."""
        self._arm()

    def _arm(self) -> None:
        """(Re-)add watches for directories that exist now."""
        if self._hub is None:
            self._hub = _hub()
            if self._hub is None:
                return
        for directory in self.directories:
            if directory in self._watched or not directory.is_dir():
                continue
            if self._hub.add(directory, self):
                self._watched.add(directory)
        self.using_inotify = bool(self._watched) and self._watched == set(self.directories)

    def _deliver(self, directory: Path, event: Any, gone: bool) -> None:
        self._pending.append((event, gone))
        if gone:
            self._watched.discard(directory)
            self.using_inotify = False
        if self._wake is not None:
            self._wake.set()

    def _lost_all(self) -> None:
        self._watched.clear()
        self.using_inotify = False
        if self._wake is not None:
            self._wake.set()

    async def changed(self, within: float | None = None) -> bool:
        """Wait for a change (True), or until ``within`` seconds / the fallback period have
        passed (False). Events that arrived together are coalesced into one wake-up."""
        self._arm()
        limit = within if self.using_inotify else self._fallback_limit(within)
        if not self._watched and not self._pending:
            await asyncio.sleep(limit if limit is not None else self.fallback)
            return False
        if self._wake is None:
            self._wake = asyncio.Event()
        try:
            async with asyncio.timeout(limit):
                while True:
                    if not self._pending:
                        self._wake.clear()
                        await self._wake.wait()
                    pending, self._pending = self._pending, []
                    relevant = False
                    for event, gone in pending:
                        relevant = self._note(event, gone) or relevant
                    if relevant:
                        return True
                    if not self.using_inotify:
                        return False  # a watched directory went away: re-arm and re-check
        except TimeoutError:
            return False

    def _note(self, event: Any, gone: bool) -> bool:
        """Record ``event``; whether it is one the caller cares about."""
        self.events += 1
        if gone:
            return True
        name = event.name
        removed = bool(int(event.mask) & _REMOVED)
        return name is None or self.interesting(str(name), removed)

    def _fallback_limit(self, within: float | None) -> float:
        return self.fallback if within is None else min(within, self.fallback)

    def close(self) -> None:
        """Stop watching (the process's inotify instance is closed with its last watch)."""
        if self._hub is not None:
            for directory in list(self._watched):
                self._hub.remove(directory, self)
        self._watched.clear()
        self.using_inotify = False
