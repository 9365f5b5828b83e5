"""``DirectoryWatch``: wake up when entries of some directories change, without polling.

The kernel tells us (inotify, through ``asyncinotify``: a small ctypes wrapper that reads the
inotify descriptor with the event loop's own ``add_reader`` — no thread, no compiled code,
maintained) when kubelet re-creates ``kubelet.sock``, when our plugin sockets or DRA sockets
are removed, when the pod-resources socket appears, when a Configuration file or the local
state directory changes. Where inotify cannot be used (not Linux, the per-user watch limit
reached, a directory that does not exist yet) the watch falls back to waking every
``fallback`` seconds, so callers always re-check the state they care about after
:meth:`DirectoryWatch.changed` returns: a wake-up is a hint, never the fact itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
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
        self._inotify: Any = None
        self._watched: set[Path] = set()
        self.events = 0  # inotify events seen (tests, debugging)
        self.using_inotify = False

    def arm(self) -> None:
        """Start watching now (``changed`` arms too): arm, then read the state you care
        about, then wait — a change between reading and arming would otherwise be missed."""
        self._arm()

    def _arm(self) -> None:
        """(Re-)add watches for directories that exist now."""
        if _inotify_module is None:
            return
        if self._inotify is None:
            try:
                self._inotify = _inotify_module.Inotify()
            except OSError as error:
                log.warning("inotify unavailable (%s): polling every %.1fs", error, self.fallback)
                return
        for directory in self.directories:
            if directory in self._watched or not directory.is_dir():
                continue
            try:
                self._inotify.add_watch(directory, _MASK)
            except OSError as error:
                log.warning(
                    "cannot watch %s (%s): polling every %.1fs", directory, error, self.fallback
                )
                continue
            self._watched.add(directory)
        self.using_inotify = bool(self._watched) and self._watched == set(self.directories)

    async def changed(self, within: float | None = None) -> bool:
        """Wait for a change (True), or until ``within`` seconds / the fallback period have
        passed (False). Events that arrived together are coalesced into one wake-up."""
        self._arm()
        limit = within if self.using_inotify else self._fallback_limit(within)
        if self._inotify is None or not self._watched:
            await asyncio.sleep(limit if limit is not None else self.fallback)
            return False
        try:
            async with asyncio.timeout(limit):
                while True:
                    event = await self._inotify.get()
                    relevant = self._note(event)
                    while self._inotify._events:  # read along with it: coalesce
                        relevant = self._note(self._inotify._events.pop(0)) or relevant
                    if relevant:
                        return True
                    if not self.using_inotify:
                        return False  # a watched directory went away: re-arm and re-check
        except TimeoutError:
            return False

    def _note(self, event: Any) -> bool:
        """Record ``event``; whether it is one the caller cares about."""
        self.events += 1
        mask = int(event.mask)
        if mask & _GONE:
            self._forget_gone(event)
            return True
        name = event.name
        removed = bool(mask & _REMOVED)
        return name is None or self.interesting(str(name), removed)

    def _fallback_limit(self, within: float | None) -> float:
        return self.fallback if within is None else min(within, self.fallback)

    def _forget_gone(self, event: Any) -> None:
        path = event.watch.path if event.watch is not None else None
        if path is not None:
            self._watched.discard(Path(path))
        self.using_inotify = False

    def close(self) -> None:
        """Release the inotify descriptor."""
        if self._inotify is not None:
            with contextlib.suppress(OSError):
                self._inotify.close()
            self._inotify = None
            self._watched.clear()
