"""Reads of the local state directory that see what one writer left (issue 34.1-2).

Every write of the local store happens under an exclusive ``flock`` on ``STATE_DIR/.lock``,
and an Instance is two files that a write may change one after the other: ``<name>.json``
and its slot journal (:mod:`agent.core.store.journal`). A compaction replaces the file and
removes the journal, and the next claim starts a new journal. A reader that read the two
apart could combine an old file with a newer journal: the newest resourceVersion without
the claims in between (an update decided on it would free them: a double grant), or slots
the old file does not have (an intact state dir called corrupt).

So a reader takes the same lock *shared* for as long as it takes to read the two files'
bytes, and parses them after releasing it: a reader holds writers back for two ``read``
calls, not for the parse of 1,000 slots. The lock file is opened read-only (``flock`` needs
no write access), so ``akri status`` run by a user who cannot write the state directory, or
on a read-only mount, still locks; nor does a reader ever create it (a lock file made by
``root`` running ``akri status`` could shut out the agent's user).

Where the lock file cannot be opened (there is none yet: a writer creates it before its
first write), a read is validated instead: the ``.json`` file is read again after the
journal, and the pair is used only when both reads of it are the same bytes. Every write of
the file carries a new resourceVersion, so the same bytes mean that it was not replaced in
between, and the journal's records newer than it were appended to it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from agent.core.store import journal
from agent.core.store.base import CorruptStateError, StoreUnavailableError

UNLOCKED_ATTEMPTS = 50
"""Validated reads of one Instance before giving up, where no lock can be taken (each retry
means the file was replaced during the previous read)."""


class ReadLock:
    """The state directory's lock, taken shared around each read of an Instance's files.
    Opens the lock file once (read-only) and keeps it until :meth:`close`."""

    def __init__(self, lock_path: Path) -> None:
        self.path = lock_path
        self._fd: int | None = None
        self.unusable: str | None = None  # why no lock can be taken (None: it can)

    def _open(self) -> int | None:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as error:
                self.unusable = f"cannot open {self.path}: {error.strerror}"
                return None
            self.unusable = None
        return self._fd

    @contextlib.contextmanager
    def shared(self, *, wait: bool = True) -> Iterator[bool]:
        """Hold the lock shared; yields False when there is no lock file to take (the caller
        validates its read instead). With ``wait=False`` raises :class:`BlockingIOError`
        instead of waiting for a writer."""
        fd = self._open()
        if fd is None:
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | (0 if wait else fcntl.LOCK_NB))
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BlockingIOError(error.errno, "a writer holds the lock") from None
            raise
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ReadLock:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _read(path: Path) -> bytes | None:
    """The bytes of ``path``; None when it does not exist. Raises
    :class:`CorruptStateError` naming it when it cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CorruptStateError(str(path), f"cannot read: {error.strerror}") from error


def _read_pair(instance_file: Path) -> tuple[bytes, bytes] | None:
    data = _read(instance_file)
    if data is None:
        return None
    return data, _read(journal.journal_path(instance_file)) or b""


def read_instance_files(
    lock: ReadLock, instance_file: Path, *, wait: bool = True
) -> tuple[bytes, bytes] | None:
    """The bytes of ``<name>.json`` and of its journal (empty when there is none) as one
    write left them; None when the Instance file does not exist. With ``wait=False`` raises
    :class:`BlockingIOError` when a writer holds the lock (the caller waits elsewhere)."""
    for _ in range(UNLOCKED_ATTEMPTS):
        with lock.shared(wait=wait) as locked:
            if locked:
                return _read_pair(instance_file)
        pair = _read_pair(instance_file)
        if pair is None or _read(instance_file) == pair[0]:
            return pair
        # replaced while we read: read again (a writer now running has made the lock file)
    raise StoreUnavailableError(
        f"{instance_file} changed during each of {UNLOCKED_ATTEMPTS} reads without the "
        f"lock ({lock.unusable})"
    )
