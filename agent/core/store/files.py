"""Crash-safe JSON files: write to a temp file, fsync, rename, fsync the directory.

A reader never sees a torn file: after ``kill -9`` at any point the path holds either the old
or the new content (plus possibly a stray ``.tmp-*`` file, removed at the next start).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agent.core.store.base import CorruptStateError

TMP_PREFIX = ".tmp-"


def atomic_write_bytes(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    """Replace ``path`` with ``obj`` as compact JSON atomically (an Instance of capacity 1000
    is written on every claim: pretty-printing made it 37.5 KB)."""
    data = (json.dumps(obj, separators=(",", ":"), sort_keys=True) + "\n").encode()
    atomic_write_bytes(path, data, durable=durable)


def fsync_dir(directory: Path) -> None:
    """Persist a rename/unlink in ``directory``."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    """Read a JSON state file; raises :class:`CorruptStateError` naming the file."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise CorruptStateError(str(path), f"cannot read: {error.strerror}") from error
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptStateError(str(path), f"not valid JSON ({error})") from error


def remove_stray_temp_files(directory: Path) -> list[Path]:
    """Delete temp files left by a write that was killed; returns what was removed."""
    removed = []
    for candidate in directory.glob(f"{TMP_PREFIX}*"):
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed
