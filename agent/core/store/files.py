"""Crash-safe JSON files: write to a temp file, fsync, rename, fsync the directory.

A reader never sees a torn file: after ``kill -9`` at any point the path holds either the old
or the new content (plus possibly a stray ``.tmp-*`` file, removed at the next start).

A write that cannot complete — a short write, ``ENOSPC``, ``EDQUOT``, ``EIO``, ``EROFS`` at
open, write, fsync or rename — never replaces the old file: the temp file is removed (it
would hold the very space that ran out) and :class:`StorageError` names the path and the
cause. The old file stays valid, so the same write succeeds once the cause is gone.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

from agent.core.store.base import CorruptStateError, StorageError

TMP_PREFIX = ".tmp-"
# distinct temp names for concurrent writers of one path in one process (worker threads)
_sequence = itertools.count()
_sequence_lock = threading.Lock()


def _temp_path(path: Path) -> Path:
    with _sequence_lock:
        number = next(_sequence)
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{number}")


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd``: ``os.write`` may write less than asked (a
    signal, a nearly full file system); a write that makes no progress is a full disk."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically; raises :class:`StorageError` (and leaves
    ``path`` as it was, with no temp file behind) when that cannot be done."""
    tmp = _temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise StorageError(str(path), error) from error
    try:
        try:
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as error:
        _discard(tmp)
        raise StorageError(str(path), error) from error
    if durable:
        try:
            fsync_dir(path.parent)
        except OSError as error:
            # the new content is in place but may not survive a power loss: the caller must
            # not report it as done (the next write of the same path makes it durable)
            raise StorageError(str(path.parent), error) from error


def _discard(tmp: Path) -> None:
    # read-only now, or gone: a stray temp file is removed at the next start
    with contextlib.suppress(OSError):
        tmp.unlink()


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    """Replace ``path`` with ``obj`` as compact JSON atomically (an Instance of capacity 1000
    is written on every claim: pretty-printing made it 37.5 KB)."""
    data = (json.dumps(obj, separators=(",", ":"), sort_keys=True) + "\n").encode()
    atomic_write_bytes(path, data, durable=durable)


def remove_file(path: Path, *, durable: bool = True) -> bool:
    """Remove ``path`` (and persist the removal); False if it was not there. Raises
    :class:`StorageError` when it cannot be removed (read-only file system, I/O error)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as error:
        raise StorageError(str(path), error) from error
    if durable:
        try:
            fsync_dir(path.parent)
        except OSError as error:
            raise StorageError(str(path.parent), error) from error
    return True


def ensure_directory(path: Path) -> None:
    """Create directory ``path`` and its parents unless it is one. Raises OSError naming the
    path; a file in its place is :class:`NotADirectoryError` ("Not a directory"), not the
    "File exists" that ``mkdir`` says there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from None


def fsync_dir(directory: Path) -> None:
    """Persist a rename/unlink in ``directory``."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    """Read a JSON state file; raises :class:`CorruptStateError` naming the file, whatever
    the content (nesting deep enough to exhaust the parser's recursion included)."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise CorruptStateError(str(path), f"cannot read: {error.strerror}") from error
    return parse_json(raw, path)


def parse_json(raw: bytes, path: Path) -> Any:
    """:func:`read_json` of bytes already read from ``path``."""
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptStateError(str(path), f"not valid JSON ({error})") from error
    except RecursionError as error:
        raise CorruptStateError(str(path), "not valid state: JSON nested too deeply") from error


def remove_stray_temp_files(directory: Path) -> list[Path]:
    """Delete temp files left by a write that was killed; returns what was removed."""
    removed = []
    for candidate in directory.glob(f"{TMP_PREFIX}*"):
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed
