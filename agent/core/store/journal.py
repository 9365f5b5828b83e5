"""The slot journal of the local backend: a claim or release appends one line, not the Instance.

An Instance of capacity 1,000 is a ~40 KB file; rewriting it (temp file, fsync, rename, fsync
of the directory) on every Allocate cost 1-3 ms at the median and 6-12 ms at the tail here.
A write that changes only ``deviceUsage`` (every claim and release) is instead one line
appended to ``<name>.journal`` beside ``<name>.json`` and made durable with one
``fdatasync``::

    {"rv":"1042","u":{"cam-8120fe-17":"node-a"}}

The Instance is its ``.json`` file with every journal line whose ``rv`` is greater than the
file's resourceVersion applied in order (a line at or below it was already folded in: a
rewrite of the file that was killed before it could remove the journal). A full write of the
``.json`` file (any other change, or a compaction every :data:`COMPACT_AFTER` lines) folds
the journal in and then removes it.

Writers change the two files one after the other under the exclusive lock, so a reader reads
both under the shared lock (:mod:`agent.core.store.consistent_read`): an old ``.json`` read
before a compaction with the journal the next claim started after it would have the newest
resourceVersion without the claims in between.

Crash safety, ``kill -9`` at any byte: a line counts only once its closing ``\\n`` is on
disk, and the newline is its last byte, so a torn last line is ignored when read and cut off
under the lock before the next append; a complete line that is not a record is damage, and
the agent refuses to start naming the file (as for a broken ``.json``). Nothing is granted
before the ``fdatasync`` returned. A write that fails part-way (``ENOSPC``, ``EIO``) is cut
back to the old length and reported as :class:`StorageError`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.core.model.instance import Instance
from agent.core.store.base import CorruptStateError, StorageError
from agent.core.store.files import fsync_dir, write_all

SUFFIX = ".journal"
# a compaction rewrites the whole Instance once per this many claims/releases: the journal of
# a 1000-slot Instance stays under ~16 KB and a read replays at most this many lines
COMPACT_AFTER = 256


def journal_path(instance_file: Path) -> Path:
    """``<name>.journal`` beside ``<name>.json``."""
    return instance_file.with_suffix(SUFFIX)


class Journal:
    """What a journal file holds: its complete records and where the last one ends."""

    __slots__ = ("length", "records")

    def __init__(self, records: list[tuple[int, dict[str, str]]], length: int) -> None:
        self.records = records  # (resourceVersion, the deviceUsage entries it sets)
        self.length = length  # bytes up to the last complete line (a torn tail after it)

    def appended(self, version: int, changes: dict[str, str], line: bytes) -> Journal:
        """This journal after :func:`append` wrote ``line``."""
        return Journal([*self.records, (version, changes)], self.length + len(line))


EMPTY = Journal([], 0)


def parse(data: bytes, where: str) -> Journal:
    """The complete lines of ``data``; raises :class:`CorruptStateError` naming ``where`` for
    a complete line that is not a record. A last line without its newline is a write that was
    cut short: not a record, ignored."""
    end = data.rfind(b"\n") + 1
    records: list[tuple[int, dict[str, str]]] = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        records.append(_record(line, where, number))
    return Journal(records, end)


def _record(line: bytes, where: str, number: int) -> tuple[int, dict[str, str]]:
    try:
        obj: Any = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CorruptStateError(where, f"line {number} is not a journal record ({error})") from None
    version = obj.get("rv") if isinstance(obj, dict) else None
    usage = obj.get("u") if isinstance(obj, dict) else None
    if (
        not isinstance(version, str)
        or not version.isascii()
        or not version.isdigit()
        or len(version) > 19
        or not isinstance(usage, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in usage.items())
    ):
        raise CorruptStateError(where, f"line {number} is not a journal record")
    return int(version), usage


def read(instance_file: Path) -> Journal:
    """The journal beside ``instance_file`` (empty when there is none)."""
    path = journal_path(instance_file)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return EMPTY
    except OSError as error:
        raise CorruptStateError(str(path), f"cannot read: {error.strerror}") from error
    return parse(data, str(path))


def replay(instance: Instance, journal: Journal, where: str) -> Instance:
    """``instance`` (as its file holds it) with the journal's newer records applied. A record
    for a slot the Instance does not have is damage (a capacity change rewrites the file)."""
    base = int(instance.resource_version or 0)
    newer = [(version, usage) for version, usage in journal.records if version > base]
    if not newer:
        return instance
    usage = dict(instance.device_usage)
    last = base
    for version, changes in newer:
        if version <= last:
            raise CorruptStateError(where, f"resourceVersion {version} out of order")
        unknown = changes.keys() - usage.keys()
        if unknown:
            raise CorruptStateError(
                where, f"record {version} names unknown slots {sorted(unknown)}"
            )
        usage.update(changes)
        last = version
    return instance.evolve(device_usage=usage, resource_version=str(last))


def usage_changes(current: Instance, desired: Instance) -> dict[str, str] | None:
    """The ``deviceUsage`` entries ``desired`` sets when that is all that differs from
    ``current`` (the same slots, everything else equal but the resourceVersion), else None
    (the change needs a full write)."""
    old, new = current.device_usage, desired.device_usage
    if old.keys() != new.keys():
        return None
    same = current.evolve(device_usage=new, resource_version=desired.resource_version)
    # extra_metadata is not part of Instance equality: compared on its own
    if same != desired or dict(current.extra_metadata) != dict(desired.extra_metadata):
        return None
    return dict(new.items() - old.items())  # a C-level set difference of the two maps


def record_line(version: str, changes: Mapping[str, str]) -> bytes:
    """One journal line (compact JSON, then the newline that makes it count)."""
    return json.dumps({"rv": version, "u": dict(changes)}, separators=(",", ":")).encode() + b"\n"


def append(instance_file: Path, journal: Journal, line: bytes, *, durable: bool = True) -> None:
    """Append ``line`` to the journal whose complete part is ``journal.length`` bytes (a torn
    tail after it is cut off first), and make it durable. Raises :class:`StorageError` with
    the journal as it was (cut back) when the write cannot complete. Caller holds the lock."""
    path = journal_path(instance_file)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise StorageError(str(path), error) from error
    try:
        try:
            size = os.fstat(fd).st_size
            created = size == 0 and journal.length == 0
            if size != journal.length:
                os.ftruncate(fd, journal.length)  # a torn tail of a killed append
            os.lseek(fd, journal.length, os.SEEK_SET)
            write_all(fd, line)
            if durable:
                os.fdatasync(fd)
        except OSError as error:
            # not cut back: the torn tail is ignored when read and cut before the next append
            with contextlib.suppress(OSError):
                os.ftruncate(fd, journal.length)
            raise StorageError(str(path), error) from error
    finally:
        os.close(fd)
    if durable and created:
        try:
            fsync_dir(path.parent)  # the new journal's directory entry
        except OSError as error:
            raise StorageError(str(path.parent), error) from error


def remove(instance_file: Path, *, durable: bool = True) -> None:
    """Remove the journal once the ``.json`` file holds all of it (a compaction). Not done is
    harmless: its records are at or below the file's resourceVersion and are skipped."""
    path = journal_path(instance_file)
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as error:
        raise StorageError(str(path), error) from error
    if durable:
        try:
            fsync_dir(path.parent)
        except OSError as error:
            raise StorageError(str(path.parent), error) from error


def orphans(directory: Path) -> list[Path]:
    """Journals whose ``.json`` file is gone (a delete killed before it removed them)."""
    return [path for path in directory.glob(f"*{SUFFIX}") if not path.with_suffix(".json").exists()]
