"""Local backend: Instances as JSON files in a state directory, Configurations from YAML files.

Layout::

    STATE_DIR/instances/<instance>.json   one Instance each (Kubernetes JSON form)
    STATE_DIR/resource-version            last resourceVersion handed out (an integer)
    STATE_DIR/.lock                       flock taken around every write

CAS semantics match the API server: every write happens under an exclusive ``flock`` (so
several agents may share one state dir, e.g. to simulate nodes), re-reads the file, and
refuses the write if the stored resourceVersion differs from the one the caller decided on.
ResourceVersions come from one counter that is persisted *before* the object that uses it,
so a version is never reused, even after ``kill -9``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from agent.config_files import ConfigurationFiles
from agent.model.configuration import Configuration
from agent.model.instance import Instance, InstanceFormatError
from agent.model.naming import is_dns_subdomain
from agent.store.base import (
    AlreadyExistsError,
    ConfigurationEvent,
    ConflictError,
    CorruptStateError,
    EventType,
    InstanceEvent,
    InstanceStore,
    NotFoundError,
    StoreError,
)
from agent.store.files import (
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    remove_stray_temp_files,
)

log = logging.getLogger(__name__)

INSTANCES_DIR = "instances"
COUNTER_FILE = "resource-version"
LOCK_FILE = ".lock"


def load_instance_file(path: Path) -> Instance:
    """Read one Instance file; raises :class:`CorruptStateError` naming it."""
    obj = read_json(path)
    try:
        instance = Instance.from_dict(obj)
    except InstanceFormatError as error:
        raise CorruptStateError(str(path), str(error)) from error
    if instance.resource_version is None or not instance.resource_version.isdigit():
        raise CorruptStateError(str(path), "metadata.resourceVersion must be an integer string")
    if path.name != f"{instance.name}.json":
        raise CorruptStateError(str(path), f"holds Instance {instance.name!r}, not {path.stem!r}")
    return instance


def read_state_dir(state_dir: Path) -> list[Instance]:
    """All Instances in ``state_dir`` (for ``akri status``); raises on a corrupt file."""
    counter = state_dir / COUNTER_FILE
    if counter.exists() and not counter.read_text().strip().isdigit():
        raise CorruptStateError(str(counter), "expected an integer")
    directory = state_dir / INSTANCES_DIR
    if not directory.is_dir():
        return []
    return sorted(
        (load_instance_file(p) for p in directory.glob("*.json") if not p.name.startswith(".")),
        key=lambda inst: inst.name,
    )


class LocalInstanceStore(InstanceStore):
    """The file-backed store used by ``akri agent --local``."""

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
        self._cache: dict[str, Instance] = {}
        self._durable = durable
        self._poll_interval = poll_interval
        self._write_lock = asyncio.Lock()
        self._last_counter_stat: tuple[int, int] | None = None
        self._rescan_pending = False
        self._config_files = ConfigurationFiles(list(config_paths), self._on_configuration)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._instances_dir.mkdir(parents=True, exist_ok=True)
        # Temp files only exist while a writer holds the flock, so any found under it were
        # left by a killed writer (never another live process's write in progress).
        with self._flock():
            strays = remove_stray_temp_files(self._instances_dir)
            strays += remove_stray_temp_files(self.state_dir)
        for stray in strays:
            log.info("removed %s left by an interrupted write", stray)
        self._check_counter()
        self._rescan(publish=False)
        self._config_files.scan()
        self._tasks = [
            asyncio.create_task(self._poll_loop(), name="local-store-poll"),
        ]

    async def close(self) -> None:
        await self._stop_watching()

    def _check_counter(self) -> None:
        if not self._counter_path.exists():
            return
        text = self._counter_path.read_text().strip()
        if not text.isdigit():
            raise CorruptStateError(str(self._counter_path), f"expected an integer, got {text!r}")

    async def _poll_loop(self) -> None:
        """Pick up changes made by other processes and edits of Configuration files."""
        while True:
            await asyncio.sleep(self._poll_interval)
            try:
                self._config_files.scan()
                if self._counter_changed():
                    self._rescan(publish=True)
            except CorruptStateError as error:
                log.error("ignoring unreadable state written by another process: %s", error)
            except Exception:  # a poll failure must not end the loop
                log.exception("local store poll failed")

    # -- reads -------------------------------------------------------------------------------
    def get_cached(self, name: str) -> Instance | None:
        return self._cache.get(name)

    def list_cached(self, configuration: str | None = None) -> list[Instance]:
        return [
            inst
            for _, inst in sorted(self._cache.items())
            if configuration is None or inst.configuration_name == configuration
        ]

    async def get(self, name: str) -> Instance:
        path = self._path(name)
        if not path.exists():
            self._apply_to_cache(name, None)
            raise NotFoundError(name)
        instance = load_instance_file(path)
        self._apply_to_cache(name, instance)
        return instance

    def configurations(self) -> list[Configuration]:
        return self._config_files.current()

    # -- writes ------------------------------------------------------------------------------
    async def create(self, instance: Instance) -> Instance:
        self._validate_name(instance.name)
        async with self._write_lock:
            with self._flock():
                path = self._path(instance.name)
                if path.exists():
                    raise AlreadyExistsError(instance.name)
                stored = instance.evolve(
                    resource_version=self._next_version(), uid=instance.uid or str(uuid.uuid4())
                )
                atomic_write_json(path, stored.to_dict(), durable=self._durable)
        self._apply_to_cache(stored.name, stored)
        return stored

    async def update(self, instance: Instance) -> Instance:
        self._validate_name(instance.name)
        if instance.resource_version is None:
            raise ConflictError(f"{instance.name}: update needs the resourceVersion it is based on")
        async with self._write_lock:
            with self._flock():
                path = self._path(instance.name)
                if not path.exists():
                    raise NotFoundError(instance.name)
                current = load_instance_file(path)
                if current.resource_version != instance.resource_version:
                    self._apply_to_cache(current.name, current)
                    raise ConflictError(
                        f"{instance.name}: resourceVersion {instance.resource_version} is stale "
                        f"(stored {current.resource_version})"
                    )
                stored = instance.evolve(resource_version=self._next_version(), uid=current.uid)
                atomic_write_json(path, stored.to_dict(), durable=self._durable)
        self._apply_to_cache(stored.name, stored)
        return stored

    async def delete(self, name: str, *, resource_version: str | None = None) -> None:
        self._validate_name(name)
        async with self._write_lock:
            with self._flock():
                path = self._path(name)
                if not path.exists():
                    self._apply_to_cache(name, None)
                    raise NotFoundError(name)
                if resource_version is not None:
                    current = load_instance_file(path)
                    if current.resource_version != resource_version:
                        self._apply_to_cache(name, current)
                        raise ConflictError(f"{name}: resourceVersion {resource_version} is stale")
                self._next_version()  # a delete is a change other processes must notice
                path.unlink()
        self._apply_to_cache(name, None)

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _validate_name(name: str) -> None:
        if not is_dns_subdomain(name):
            raise StoreError(f"invalid Instance name {name!r}")

    def _path(self, name: str) -> Path:
        return self._instances_dir / f"{name}.json"

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _next_version(self) -> str:
        """Allocate and persist the next resourceVersion (caller holds the flock)."""
        current = 0
        if self._counter_path.exists():
            text = self._counter_path.read_text().strip()
            current = int(text) if text.isdigit() else 0
        current = max(current, self._max_file_version()) + 1
        if self._counter_stat() != self._last_counter_stat:
            # another process wrote since we last looked: our own write below would hide
            # that from the poll, so remember to rescan
            self._rescan_pending = True
        atomic_write_bytes(self._counter_path, f"{current}\n".encode(), durable=self._durable)
        self._last_counter_stat = self._counter_stat()
        return str(current)

    def _max_file_version(self) -> int:
        versions = [int(i.resource_version or 0) for i in self._cache.values()]
        return max(versions, default=0)

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
        self._last_counter_stat = stat
        return True

    def _rescan(self, *, publish: bool) -> None:
        self._last_counter_stat = self._counter_stat()
        on_disk = {inst.name: inst for inst in read_state_dir(self.state_dir)}
        if not publish:
            self._cache = on_disk
            return
        for name in sorted(set(self._cache) | set(on_disk)):
            self._apply_to_cache(name, on_disk.get(name))

    def _apply_to_cache(self, name: str, instance: Instance | None) -> None:
        previous = self._cache.get(name)
        if instance is None:
            if previous is not None:
                del self._cache[name]
                self._publish_instance(InstanceEvent(EventType.DELETED, previous, previous))
            return
        if previous is not None and previous.resource_version == instance.resource_version:
            return
        if previous is not None and int(previous.resource_version or 0) > int(
            instance.resource_version or 0
        ):
            return  # an older read racing a newer write
        self._cache[name] = instance
        kind = EventType.ADDED if previous is None else EventType.MODIFIED
        self._publish_instance(InstanceEvent(kind, instance, previous))

    def _on_configuration(self, event: ConfigurationEvent) -> None:
        self._publish_configuration(event)
