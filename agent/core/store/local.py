"""Local backend: Instances as JSON files in a state directory, Configurations from YAML files.

Layout::

    STATE_DIR/instances/<instance>.json   one Instance of namespace ``default`` each
                                          (Kubernetes JSON form)
    STATE_DIR/instances/<ns>/<instance>.json  Instances of any other namespace
    STATE_DIR/resource-version            last resourceVersion handed out (an integer)
    STATE_DIR/configurations.json         each Configuration's owning file and
                                          creationTimestamp (kept across restarts)
    STATE_DIR/.lock                       flock taken around every write (exclusive) and
                                          every read of an Instance (shared)

CAS semantics match the API server: every write happens under an exclusive ``flock`` (so
several agents may share one state dir, e.g. to simulate nodes), re-reads the file, and
refuses the write if the stored resourceVersion differs from the one the caller decided on.
Every read (``get``, the rescan, ``akri status``) holds the lock shared while it reads an
Instance's file and journal, so it sees what one write left, never an old file with a newer
journal (:mod:`agent.core.store.consistent_read`).
ResourceVersions come from one counter that is persisted *before* the object that uses it,
so a version is never reused, even after ``kill -9``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent.core.aio.fswatch import DirectoryWatch
from agent.core.model.configuration import Configuration
from agent.core.model.instance import Instance, InstanceFormatError
from agent.core.model.keys import DEFAULT_NAMESPACE, ObjectKey
from agent.core.model.naming import (
    DEVICE_DIGEST_ANNOTATION,
    MAX_CAPACITY,
    is_dns_label,
    is_dns_subdomain,
    offline_annotation,
)
from agent.core.store import journal
from agent.core.store.base import (
    AlreadyExistsError,
    ConfigurationEvent,
    ConflictError,
    CorruptStateError,
    EventType,
    InstanceEvent,
    InstanceStore,
    InvalidConfiguration,
    NotFoundError,
    StorageError,
    StoreError,
)
from agent.core.store.cache import InstanceCache
from agent.core.store.config_files import ConfigurationFiles
from agent.core.store.consistent_read import ReadLock, read_instance_files
from agent.core.store.files import (
    atomic_write_bytes,
    atomic_write_json,
    ensure_directory,
    parse_json,
    read_json,
    remove_file,
    remove_stray_temp_files,
)

log = logging.getLogger(__name__)

INSTANCES_DIR = "instances"
COUNTER_FILE = "resource-version"
CONFIGURATIONS_FILE = "configurations.json"  # which file owns each Configuration, since when
LOCK_FILE = ".lock"


def instance_path(instances_dir: Path, key: ObjectKey) -> Path:
    """Where Instance ``key`` is kept: namespace ``default`` flat (the layout before
    namespaces were kept apart), any other namespace in a subdirectory of its name."""
    if key.namespace == DEFAULT_NAMESPACE:
        return instances_dir / f"{key.name}.json"
    return instances_dir / key.namespace / f"{key.name}.json"


# ASCII digits only: str.isdigit() accepts "²" and "٣", which int() then rejects or reads
_VERSION = re.compile(r"[0-9]{1,19}")


def rfc3339_now() -> str:
    """A ``deletionTimestamp`` as the API server writes it (UTC, whole seconds)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_finalizers(current: Instance, desired: Instance) -> None:
    """The API server's rule for a terminating object: no new finalizer may be added."""
    if current.deletion_timestamp is None:
        return
    added = sorted(set(desired.finalizers) - set(current.finalizers))
    if added:
        raise StoreError(
            f"instance {current.key} is being deleted: no new finalizers can be added "
            f"(found {added})"
        )


def is_version(text: str) -> bool:
    """Whether ``text`` is a resourceVersion this backend writes (a decimal integer)."""
    return _VERSION.fullmatch(text) is not None


def _string_map(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _metadata_problem(obj: Any) -> str | None:
    """What :meth:`Instance.from_dict` accepts but the agent cannot use later (the API server
    validates these; a hand-edited or damaged file is not validated by anyone else)."""
    metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(metadata, Mapping):
        return None  # from_dict reports it
    for field in ("labels", "annotations"):
        if metadata.get(field) is not None and not _string_map(metadata[field]):
            return f"metadata.{field} must map strings to strings"
    refs = metadata.get("ownerReferences")
    if refs is not None and not (
        isinstance(refs, list) and all(isinstance(ref, Mapping) for ref in refs)
    ):
        return "metadata.ownerReferences must be a list of objects"
    for field in ("namespace", "resourceVersion", "uid", "deletionTimestamp"):
        if metadata.get(field) is not None and not isinstance(metadata[field], str):
            return f"metadata.{field} must be a string"
    return None


def load_instance_file(path: Path, namespace: str = DEFAULT_NAMESPACE) -> Instance:
    """Read one Instance (its file and its slot journal); raises :class:`CorruptStateError`
    naming the file, whatever the content."""
    return load_with_journal(path, namespace)[0]


def load_with_journal(
    path: Path, namespace: str = DEFAULT_NAMESPACE
) -> tuple[Instance, journal.Journal]:
    """The Instance (its file with the journal's newer records applied) and the journal. The
    two files are read apart: the caller holds the state directory's lock (a writer), or
    nobody else writes (tests); readers use :func:`read_instance`."""
    instance = _load_file(path, namespace)
    slot_journal = journal.read(path)
    where = str(journal.journal_path(path))
    return journal.replay(instance, slot_journal, where), slot_journal


def read_instance(lock: ReadLock, path: Path, namespace: str) -> Instance | None:
    """Instance file ``path`` and its journal as one write left them (read under the shared
    lock, :mod:`agent.core.store.consistent_read`); None when there is no such file."""
    pair = read_instance_files(lock, path)
    return None if pair is None else parse_instance(pair, path, namespace)


def parse_instance(pair: tuple[bytes, bytes], path: Path, namespace: str) -> Instance:
    """The Instance of the bytes of its file and journal (pure but for the names in errors)."""
    data, journal_data = pair
    where = str(journal.journal_path(path))
    instance = _parse_file(parse_json(data, path), path, namespace)
    return journal.replay(instance, journal.parse(journal_data, where), where)


def _load_file(path: Path, namespace: str) -> Instance:
    return _parse_file(read_json(path), path, namespace)


def _parse_file(obj: Any, path: Path, namespace: str) -> Instance:
    problem = _metadata_problem(obj)
    if problem is not None:
        raise CorruptStateError(str(path), problem)
    try:
        instance = Instance.from_dict(obj)
    except InstanceFormatError as error:
        raise CorruptStateError(str(path), str(error)) from error
    except (TypeError, ValueError, AttributeError, RecursionError) as error:
        # a shape the parser did not foresee: still a broken file, named, never a traceback
        raise CorruptStateError(str(path), f"{type(error).__name__}: {error}") from error
    if instance.resource_version is None or not is_version(instance.resource_version):
        raise CorruptStateError(str(path), "metadata.resourceVersion must be an integer string")
    if instance.capacity > MAX_CAPACITY:
        # never written by an agent; its slots would not even fit kubelet's device ids
        raise CorruptStateError(str(path), f"spec.capacity is above {MAX_CAPACITY}")
    if path.name != f"{instance.name}.json":
        raise CorruptStateError(str(path), f"holds Instance {instance.name!r}, not {path.stem!r}")
    if instance.namespace != namespace:
        raise CorruptStateError(
            str(path), f"holds namespace {instance.namespace!r}, not {namespace!r}"
        )
    return instance


def _instance_files(directory: Path) -> list[tuple[Path, str]]:
    """(path, namespace) of every Instance file under ``directory``."""
    found = [
        (path, DEFAULT_NAMESPACE)
        for path in directory.glob("*.json")
        if not path.name.startswith(".")
    ]
    for sub in directory.iterdir():
        if sub.is_dir() and is_dns_label(sub.name):
            found.extend(
                (path, sub.name) for path in sub.glob("*.json") if not path.name.startswith(".")
            )
    return found


def read_counter_file(path: Path) -> int | None:
    """The resource-version counter (None if there is none); raises
    :class:`CorruptStateError` naming it for any content but an integer (and OSError when it
    cannot be read at all)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    text = raw.decode("ascii", errors="replace").strip()
    if not is_version(text):
        raise CorruptStateError(str(path), f"expected an integer, got {text[:40]!r}")
    return int(text)


def check_counter_file(path: Path) -> None:
    """:func:`read_counter_file`, except that an empty file passes: the counter is written
    without fsync (agent/core/store/journal.py), and a power loss right after its rename can
    leave it empty on some file systems. Versions then continue above every stored one."""
    with contextlib.suppress(OSError):
        if path.stat().st_size == 0:
            return
    read_counter_file(path)


def read_state_dir(state_dir: Path) -> list[Instance]:
    """All Instances in ``state_dir`` (for ``akri status`` and the store's rescan), each as
    one write left it; raises on a corrupt file. Each Instance is read under the shared lock
    on its own, so a reader of many Instances holds writers back for two reads at a time."""
    check_counter_file(state_dir / COUNTER_FILE)
    directory = state_dir / INSTANCES_DIR
    if not directory.is_dir():
        return []
    instances = []
    with ReadLock(state_dir / LOCK_FILE) as lock:
        for path, namespace in _instance_files(directory):
            instance = read_instance(lock, path, namespace)
            if instance is not None:  # else deleted since the listing: it is gone
                instances.append(instance)
    return sorted(instances, key=lambda inst: inst.key)


class LocalInstanceStore(InstanceStore):
    """The file-backed store used by ``akri agent --local``."""

    local = True

    def __init__(
        self,
        state_dir: Path,
        config_paths: Sequence[Path] = (),
        *,
        poll_interval: float = 1.0,
        durable: bool = True,
    ) -> None:
        super().__init__()
        self.state_dir = state_dir
        self._instances_dir = state_dir / INSTANCES_DIR
        self._counter_path = state_dir / COUNTER_FILE
        self._lock_path = state_dir / LOCK_FILE
        self._cache = InstanceCache()
        # highest resourceVersion seen in a file: a floor for the counter (kept up to date
        # instead of scanning the cache on every write)
        self._max_version = 0
        self._durable = durable
        self._poll_interval = poll_interval
        self._write_lock = asyncio.Lock()
        self._last_counter_stat: tuple[int, int] | None = None
        self._rescan_pending = False
        # the last resourceVersion this process wrote to the counter: the poll tells its own
        # writes (done in a worker thread) from other processes' by the counter's value
        self._last_issued: str | None = None
        # What this process's last update left on disk, per Instance file (the Instance and
        # its journal), valid while the counter still holds that update's version: every
        # write of any process bumps the counter under the flock, so an unchanged counter
        # means nobody wrote since, and the next claim need not read and parse 1,000 slots
        self._parsed: dict[Path, tuple[Instance, journal.Journal]] = {}
        self._parsed_version: str | None = None
        self._config_files = ConfigurationFiles(
            list(config_paths),
            self._on_configuration,
            self._catalog_changed,
            record=state_dir / CONFIGURATIONS_FILE,
            durable=durable,
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        ensure_directory(self._instances_dir)
        # Temp files only exist while a writer holds the flock, so any found under it were
        # left by a killed writer (never another live process's write in progress).
        with self._flock():
            strays = remove_stray_temp_files(self._instances_dir)
            strays += remove_stray_temp_files(self.state_dir)
            for sub in self._instances_dir.iterdir():
                if sub.is_dir():
                    strays += remove_stray_temp_files(sub)
            # a delete killed between removing an Instance file and its journal
            for directory in [self._instances_dir, *self._instances_dir.iterdir()]:
                if directory.is_dir():
                    for orphan in journal.orphans(directory):
                        orphan.unlink(missing_ok=True)
                        strays.append(orphan)
        for stray in strays:
            log.info("removed %s left by an interrupted write", stray)
        self._check_counter()
        self._rescan(publish=False)
        self._config_files.load_record()
        self._config_files.scan()
        self._catalog_changed()
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="local-store-poll"),
        ]

    async def close(self) -> None:
        await self._stop_watching()

    def _check_counter(self) -> None:
        check_counter_file(self._counter_path)

    async def _poll_loop(self) -> None:
        """Pick up changes made by other processes and edits of Configuration files: woken by
        inotify (or every ``poll_interval`` where it cannot be used). A changed file is read
        again one ``poll_interval`` later, and applied once both reads agree."""
        watch = DirectoryWatch(
            [*self._config_files.watched_directories(), self.state_dir],
            self._poll_interval,
            interesting=lambda name, _removed: (
                name == COUNTER_FILE or self._config_files.concerns(name)
            ),
        )
        try:
            watch.arm()
            self._poll_once()  # what changed before the watch was armed
            while True:
                settling = self._config_files.settling() or self._rescan_pending
                await watch.changed(within=self._poll_interval if settling else None)
                self._poll_once()
        finally:
            watch.close()

    def _poll_once(self) -> None:
        try:
            self._config_files.scan()
            if self._counter_changed():
                self._rescan(publish=True)
        except CorruptStateError as error:
            log.error("ignoring unreadable state written by another process: %s", error)
        except Exception:  # a poll failure must not end the loop
            log.exception("local store poll failed")

    # -- reads -------------------------------------------------------------------------------
    def get_cached(self, key: ObjectKey) -> Instance | None:
        return self._cache.get(key)

    def list_cached(self, configuration: ObjectKey | None = None) -> list[Instance]:
        return self._cache.all(configuration)

    def instances_named(self, name: str) -> list[Instance]:
        return self._cache.named(name)

    def instance_configurations(self) -> set[ObjectKey]:
        return self._cache.configuration_keys()

    async def get(self, key: ObjectKey) -> Instance:
        path = self._path(key)
        with ReadLock(self._lock_path) as lock:
            try:  # on the loop when no writer holds the lock: two reads, no thread hop
                pair = read_instance_files(lock, path, wait=False)
            except BlockingIOError:  # a write in progress (any process): wait off the loop
                pair = await asyncio.to_thread(read_instance_files, lock, path)
        if pair is None:
            self._apply_to_cache(key, None)
            raise NotFoundError(str(key))
        instance = parse_instance(pair, path, key.namespace)
        self._apply_to_cache(key, instance)
        return instance

    def configurations(self) -> list[Configuration]:
        return self._config_files.current()

    def invalid_configurations(self) -> list[InvalidConfiguration]:
        return self._config_files.invalid()

    def unreadable_sources(self) -> list[str]:
        return self._config_files.unreadable()

    # -- writes ------------------------------------------------------------------------------
    # The file work (flock, read, write, fsync: ~2 ms, far more on a busy disk) runs in a
    # worker thread so it never holds the event loop; ``_write_lock`` keeps this process's
    # writes in order, and the cache is updated back on the loop.

    async def create(self, instance: Instance) -> Instance:
        self._validate_key(instance.key)
        async with self._write_lock, self._storage_errors():
            stored = await asyncio.to_thread(self._create_file, instance)
        self._apply_to_cache(stored.key, stored)
        return stored

    def _create_file(self, instance: Instance) -> Instance:
        with self._flock():
            path = self._path(instance.key)
            if path.exists():
                raise AlreadyExistsError(str(instance.key))
            ensure_directory(path.parent)  # a namespace's directory
            stored = instance.evolve(
                resource_version=self._next_version(),
                uid=instance.uid or str(uuid.uuid4()),
                deletion_timestamp=None,  # set by the server only, as on the API server
            )
            atomic_write_json(path, stored.to_dict(), durable=self._durable)
        return stored

    async def update(self, instance: Instance) -> Instance:
        key = instance.key
        self._validate_key(key)
        if instance.resource_version is None:
            raise ConflictError(f"{key}: update needs the resourceVersion it is based on")
        async with self._write_lock, self._storage_errors():
            stored, current = await asyncio.to_thread(self._update_file, instance)
        if stored is None:
            assert current is not None
            self._apply_to_cache(key, current)
            raise ConflictError(
                f"{key}: resourceVersion {instance.resource_version} is stale "
                f"(stored {current.resource_version})"
            )
        # a terminating Instance whose last finalizer went is gone (the file was removed)
        gone = stored.deletion_timestamp is not None and not stored.finalizers
        self._apply_to_cache(key, None if gone else stored)
        return stored

    def _update_file(self, instance: Instance) -> tuple[Instance | None, Instance | None]:
        """(stored, None) when written; (None, the current object) on a stale version."""
        key = instance.key
        with self._flock():
            path = self._path(key)
            if not path.exists():
                raise NotFoundError(str(key))
            if self._parsed_version is None or self._read_counter() != self._parsed_version:
                self._parsed.clear()  # another write came in between (any process)
            cached = self._parsed.pop(path, None)
            if cached is None:
                cached = load_with_journal(path, key.namespace)
            current, slot_journal = cached
            if current.resource_version != instance.resource_version:
                self._parsed[path] = cached
                return None, current
            check_finalizers(current, instance)
            stored = instance.evolve(
                resource_version=self._next_version(),
                uid=current.uid,
                deletion_timestamp=current.deletion_timestamp,  # the server's field
            )
            if stored.deletion_timestamp is not None and not stored.finalizers:
                remove_file(path, durable=self._durable)  # as the API server: now it goes
                self._drop_journal(path)
                return stored, None
            changes = journal.usage_changes(current, stored)
            if changes is not None and len(slot_journal.records) < journal.COMPACT_AFTER:
                # a claim or release: one line appended, not the whole Instance rewritten
                line = journal.record_line(str(stored.resource_version), changes)
                journal.append(path, slot_journal, line, durable=self._durable)
                slot_journal = slot_journal.appended(
                    int(stored.resource_version or 0), changes, line
                )
            else:
                atomic_write_json(path, stored.to_dict(), durable=self._durable)
                if slot_journal.length:
                    self._drop_journal(path)  # folded into the file just written
                slot_journal = journal.EMPTY  # (a journal left behind is cut at the next append)
            self._parsed[path] = (stored, slot_journal)
            self._parsed_version = stored.resource_version
        return stored, None

    def _drop_journal(self, path: Path) -> None:
        """Remove the slot journal of an Instance file that holds (or lost) all of it. Not
        done is harmless (its records are at or below the file's resourceVersion, skipped),
        so a failure is a log line, not a failed write."""
        try:
            journal.remove(path, durable=self._durable)
        except StorageError as error:
            log.warning("could not remove a folded slot journal: %s", error)

    async def delete(self, key: ObjectKey, *, resource_version: str | None = None) -> None:
        self._validate_key(key)
        async with self._write_lock, self._storage_errors():
            outcome, current = await asyncio.to_thread(self._delete_file, key, resource_version)
        if outcome == "missing":
            self._apply_to_cache(key, None)
            raise NotFoundError(str(key))
        if outcome == "stale":
            self._apply_to_cache(key, current)
            raise ConflictError(f"{key}: resourceVersion {resource_version} is stale")
        # "terminating": finalizers keep it, marked with a deletionTimestamp
        self._apply_to_cache(key, current if outcome == "terminating" else None)

    def _delete_file(
        self, key: ObjectKey, resource_version: str | None
    ) -> tuple[str, Instance | None]:
        with self._flock():
            path = self._path(key)
            if not path.exists():
                return "missing", None
            current = load_instance_file(path, key.namespace)
            if resource_version is not None and current.resource_version != resource_version:
                return "stale", current
            if current.finalizers:
                # like the API server: an object with finalizers is only marked for deletion
                # and stays until an update removes the last one
                if current.deletion_timestamp is None:
                    current = current.evolve(
                        deletion_timestamp=rfc3339_now(), resource_version=self._next_version()
                    )
                    atomic_write_json(path, current.to_dict(), durable=self._durable)
                return "terminating", current
            self._next_version()  # a delete is a change other processes must notice
            remove_file(path, durable=self._durable)
            self._drop_journal(path)
        return "deleted", None

    async def apply_membership(
        self,
        key: ObjectKey,
        node: str,
        member: bool,
        *,
        uid: str | None,
        offline: str | None = None,
        fingerprint: str | None = None,
    ) -> Instance | None:
        """``spec.nodes`` as a set, and the node's own offline annotation, under the state
        directory's lock: the entry is added or removed, the annotation set (``offline``, a
        member only) or removed, on the stored version, whatever it is (no resourceVersion
        precondition, as server-side apply), and nothing is written when it is already so."""
        self._validate_key(key)
        async with self._write_lock, self._storage_errors():
            stored, written = await asyncio.to_thread(
                self._membership_file, key, node, member, uid, offline, fingerprint
            )
        if written or self.get_cached(key) is None:
            self._apply_to_cache(key, stored)
        return stored

    def _membership_file(
        self,
        key: ObjectKey,
        node: str,
        member: bool,
        uid: str | None,
        offline: str | None,
        fingerprint: str | None = None,
    ) -> tuple[Instance, bool]:
        """(the stored Instance, whether it was written)."""
        with self._flock():
            path = self._path(key)
            if not path.exists():
                raise NotFoundError(str(key))
            current = load_instance_file(path, key.namespace)
            if uid and current.uid != uid:
                raise ConflictError(f"{key}: re-created (uid {current.uid}, expected {uid})")
            if fingerprint and current.device_fingerprint not in (None, fingerprint):
                raise ConflictError(f"{key}: another device's (fingerprint)")
            mark = offline_annotation(node)
            annotations = {k: v for k, v in current.annotations.items() if k != mark}
            if member and offline is not None:
                annotations[mark] = offline
            if fingerprint:
                annotations[DEVICE_DIGEST_ANNOTATION] = fingerprint
            if (node in current.nodes) == member and annotations == dict(current.annotations):
                return current, False
            nodes = current.nodes
            if (node in current.nodes) != member:
                nodes = (*nodes, node) if member else tuple(n for n in nodes if n != node)
            stored = current.evolve(
                nodes=nodes, annotations=annotations, resource_version=self._next_version()
            )
            atomic_write_json(path, stored.to_dict(), durable=self._durable)
        return stored, True

    # -- internals ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _storage_errors(self) -> AsyncIterator[None]:
        """Any other OSError of a write (the flock file on a read-only file system, a
        directory that cannot be made) is a :class:`StorageError` too: the caller (Allocate,
        Prepare) refuses with a status naming it, and the old state stays as it was."""
        try:
            yield
        except OSError as error:
            raise StorageError(str(error.filename or self.state_dir), error) from error

    @staticmethod
    def _validate_key(key: ObjectKey) -> None:
        if not is_dns_subdomain(key.name):
            raise StoreError(f"invalid Instance name {key.name!r}")
        if not is_dns_label(key.namespace):
            raise StoreError(f"invalid namespace {key.namespace!r}")

    def _path(self, key: ObjectKey) -> Path:
        return instance_path(self._instances_dir, key)

    @contextlib.contextmanager
    def _flock(self, *, shared: bool = False) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _next_version(self) -> str:
        """Allocate and persist the next resourceVersion (caller holds the flock)."""
        try:
            current = read_counter_file(self._counter_path) or 0
        except CorruptStateError:
            current = 0  # rewritten below, above every version seen in a file
        current = max(current, self._max_version) + 1
        if self._counter_stat() != self._last_counter_stat:
            # another process wrote since we last looked: our own write below would hide
            # that from the poll, so remember to rescan
            self._rescan_pending = True
        # set before the file becomes visible: a poll on the loop that sees the new counter
        # while this thread has not yet recorded its stat must know it as ours
        self._last_issued = str(current)
        # Not fsynced: what must survive a power loss is each object, whose version is on
        # disk with it (the file, or its journal line, made durable before the write
        # returns), and the start continues above every stored version (_max_version). The
        # counter hands versions out and tells other processes about a write; its two fsyncs
        # were half the cost of a claim (docs/performance.md).
        atomic_write_bytes(self._counter_path, f"{current}\n".encode(), durable=False)
        self._last_counter_stat = self._counter_stat()
        return str(current)

    def _counter_stat(self) -> tuple[int, int] | None:
        try:
            stat = self._counter_path.stat()
        except FileNotFoundError:
            return None
        return (stat.st_ino, stat.st_mtime_ns)

    def _counter_changed(self) -> bool:
        if self._rescan_pending:
            self._rescan_pending = False
            return True
        stat = self._counter_stat()
        if stat == self._last_counter_stat:
            return False
        if self._last_issued is not None and self._read_counter() == self._last_issued:
            # this process's own write, its stat not recorded yet (the writer thread holds
            # the flock, so no other process wrote since): nothing to read back. Without
            # this, a burst of writes rescanned the whole directory per write — O(n²)
            return False
        self._last_counter_stat = stat
        return True

    def _read_counter(self) -> str | None:
        try:
            return self._counter_path.read_text().strip()
        except FileNotFoundError:
            return None

    def _rescan(self, *, publish: bool) -> None:
        # The counter's stat under the lock (shared): a writer persists the counter before
        # the object that uses it, so a rescan woken by the counter waits until that object
        # is written too. Each Instance is then read under the lock on its own: a write that
        # comes in between changes the counter again, and the next poll reads it.
        with self._flock(shared=True):
            self._last_counter_stat = self._counter_stat()
        on_disk = {inst.key: inst for inst in read_state_dir(self.state_dir)}
        self._max_version = max(
            [self._max_version, *(int(i.resource_version or 0) for i in on_disk.values())]
        )
        if not publish:
            self._cache.replace_all(list(on_disk.values()))
            return
        for key in sorted(set(self._cache) | set(on_disk)):
            self._apply_to_cache(key, on_disk.get(key))

    def _apply_to_cache(self, key: ObjectKey, instance: Instance | None) -> None:
        previous = self._cache.get(key)
        if instance is None:
            if previous is not None:
                _, catalog = self._cache.remove(key)
                self._publish_instance(InstanceEvent(EventType.DELETED, previous, previous))
                if catalog:
                    self._catalog_changed()
            return
        if previous is not None and previous.resource_version == instance.resource_version:
            return
        if previous is not None and int(previous.resource_version or 0) > int(
            instance.resource_version or 0
        ):
            return  # an older read racing a newer write
        _, catalog = self._cache.put(instance)
        self._max_version = max(self._max_version, int(instance.resource_version or 0))
        kind = EventType.ADDED if previous is None else EventType.MODIFIED
        self._publish_instance(InstanceEvent(kind, instance, previous))
        if catalog:
            self._catalog_changed()

    def _on_configuration(self, event: ConfigurationEvent) -> None:
        self._publish_configuration(event)
