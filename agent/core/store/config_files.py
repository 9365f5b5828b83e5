"""Configurations read from YAML files (local mode), re-read when a file changes.

Each path is a YAML file (one or more ``---`` documents) or a directory of ``*.yaml``/``*.yml``
files. Files are re-checked by ``scan()`` (the local store calls it every poll interval);
only files whose size, mtime or inode changed are re-parsed, and only once the change has been
stable for one poll interval: a file caught half-written (truncated by an editor, ``cp`` or a
shell redirection) would otherwise look like deleted Configurations. Files present at start
are read at once.

Bad input never stops the others:

* a document that is not a valid Configuration produces one error event naming the file and
  the field; the last good version of that Configuration keeps running. If it never had one,
  it is still *known* (:meth:`ConfigurationFiles.invalid`): its Instances are left as they are;
* a file that cannot be read or is not YAML is *unreadable* (:meth:`unreadable`): the
  Configurations it held keep their last good versions, and while any file is unreadable no
  Instance is taken for an orphan (its Configuration may be in that file);
* a Configuration defined twice (same namespace and name): the definition that was there
  first keeps running; the other file gets an error naming it. Which file that is survives
  restarts (see below); only a Configuration never seen before goes to the first file in
  path order.

Each Configuration gets a ``creationTimestamp`` when first seen (unless its file sets one):
like the API server's, it decides which of two namespaces may use a node-global name.

Both facts live in memory only on the API server's side of the analogy, so here they are
recorded (``record``: ``STATE_DIR/configurations.json``, written atomically whenever they
change): after a restart each Configuration keeps its owning file and its creationTimestamp,
so neither the running definition nor a contested name's owner moves under running pods.
A record that cannot be written is retried at the next scan (the running agent keeps them in
memory); one that cannot be read stops the agent at start, like any broken state file.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.core.bounded_yaml import YamlLimitError, safe_load_all_limited, yaml_problem
from agent.core.model.configuration import (
    Configuration,
    ConfigurationError,
    object_key,
    parse_configuration,
)
from agent.core.model.keys import ObjectKey
from agent.core.store.base import (
    ConfigurationEvent,
    CorruptStateError,
    EventType,
    InvalidConfiguration,
    StorageError,
)
from agent.core.store.files import atomic_write_json, read_json

log = logging.getLogger(__name__)
FileKey = tuple[int, int, int]
# like the API server, whose objects are limited to 1.5 MiB (etcd's request limit)
MAX_FILE_BYTES = 3 * 1024 * 1024 // 2


@dataclass
class _FileState:
    key: FileKey | None = None
    configurations: dict[ObjectKey, Configuration] = field(default_factory=dict)
    invalid: dict[ObjectKey, str] = field(default_factory=dict)  # no good version here
    unreadable: str | None = None  # why, while the file cannot be read or parsed
    seen: bool = False
    pending: FileKey | None = None


def _file_key(path: Path) -> FileKey | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


RECORD_VERSION = 1
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")


@dataclass(frozen=True)
class Recorded:
    """What survives a restart about one Configuration: the file that owns its definition
    (resolved path) and its creationTimestamp."""

    file: str
    created: str


def _record_key(key: ObjectKey) -> str:
    return f"{key.namespace}/{key.name}"


def parse_record(data: Any) -> dict[ObjectKey, Recorded]:
    """The Configurations of a record document; raises ValueError naming the problem."""
    if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
        raise ValueError(f"expected an object with version {RECORD_VERSION}")
    entries = data.get("configurations")
    if not isinstance(entries, dict):
        raise ValueError("configurations must be an object")
    recorded: dict[ObjectKey, Recorded] = {}
    for name, entry in entries.items():
        namespace, _, bare = name.partition("/")
        if not namespace or not bare:
            raise ValueError(f"configurations: {name!r} is not namespace/name")
        if not isinstance(entry, dict):
            raise ValueError(f"configurations[{name!r}] must be an object")
        file, created = entry.get("file"), entry.get("creationTimestamp")
        if not isinstance(file, str) or not file:
            raise ValueError(f"configurations[{name!r}].file must be a path")
        if not isinstance(created, str) or not _TIMESTAMP.fullmatch(created):
            raise ValueError(f"configurations[{name!r}].creationTimestamp must be RFC 3339")
        recorded[ObjectKey(namespace, bare)] = Recorded(file, created)
    return recorded


class ConfigurationFiles:
    """Tracks the Configurations defined by a set of files and reports changes."""

    def __init__(
        self,
        paths: list[Path],
        emit: Callable[[ConfigurationEvent], None],
        on_catalog_change: Callable[[], None] = lambda: None,
        *,
        record: Path | None = None,
        durable: bool = True,
    ) -> None:
        self._paths = paths
        self._record_path = record
        self._durable = durable
        self._recorded: dict[ObjectKey, Recorded] = {}  # as on disk
        self._to_record: dict[ObjectKey, Recorded] | None = None  # not written yet
        self._emit = emit
        self._on_catalog_change = on_catalog_change
        self._files: dict[Path, _FileState] = {}
        self._current: dict[ObjectKey, Configuration] = {}
        self._invalid: dict[ObjectKey, InvalidConfiguration] = {}
        self._provider: dict[ObjectKey, Path] = {}  # which file a Configuration comes from
        self._first_seen: dict[ObjectKey, str] = {}
        self._reported_errors: set[tuple[str, str]] = set()
        self._unreadable_before: list[str] = []
        self._broken: set[ObjectKey] = set()  # reported invalid, not valid again yet

    def load_record(self) -> None:
        """Read the owners and creation times recorded before a restart (call before the
        first :meth:`scan`). Raises :class:`CorruptStateError` naming the file."""
        if self._record_path is None or not self._record_path.exists():
            return
        data = read_json(self._record_path)
        try:
            self._recorded = parse_record(data)
        except ValueError as error:
            raise CorruptStateError(str(self._record_path), str(error)) from error

    def _save_record(self) -> None:
        wanted = self._to_record
        if wanted is None or self._record_path is None:
            return
        if wanted == self._recorded:
            self._to_record = None
            return
        document = {
            "version": RECORD_VERSION,
            "configurations": {
                _record_key(key): {"file": entry.file, "creationTimestamp": entry.created}
                for key, entry in sorted(wanted.items())
            },
        }
        try:
            atomic_write_json(self._record_path, document, durable=self._durable)
        except StorageError as error:
            log.warning("cannot record Configuration owners (retried at the next scan): %s", error)
            return
        self._recorded = wanted
        self._to_record = None

    def current(self) -> list[Configuration]:
        """The Configurations in force, sorted by key."""
        return [self._current[key] for key in sorted(self._current)]

    def invalid(self) -> list[InvalidConfiguration]:
        """Configurations defined in a file but never valid, sorted by key."""
        return [self._invalid[key] for key in sorted(self._invalid)]

    def unreadable(self) -> list[str]:
        """Files that cannot be read or parsed right now (their Configurations are unknown)."""
        return sorted(
            f"{path}: {state.unreadable}"
            for path, state in self._files.items()
            if state.unreadable is not None
        )

    def settling(self) -> bool:
        """Whether a changed file waits for a second look (call :meth:`scan` again soon)."""
        return any(state.pending is not None for state in self._files.values())

    def watched_directories(self) -> list[Path]:
        """Directories whose entries can change what :meth:`scan` reads."""
        return sorted({p if p.is_dir() else p.parent for p in self._paths})

    def concerns(self, name: str) -> bool:
        """Whether a directory entry called ``name`` can change what :meth:`scan` reads."""
        if not name.endswith((".yaml", ".yml")) and all(p.name != name for p in self._paths):
            # neither a configured file's name nor YAML: no stat needed to say no (the local
            # store's own writes, a journal line and the counter's rename, ask this per write)
            return False
        files = {p.name for p in self._paths if not p.is_dir()}
        return name in files or (
            any(p.is_dir() for p in self._paths) and name.endswith((".yaml", ".yml"))
        )

    def _expand(self) -> list[Path]:
        files: list[Path] = []
        for path in self._paths:
            if path.is_dir():
                files.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")))
            else:
                files.append(path)
        return files

    def _error(self, source: str, key: ObjectKey | None, message: str) -> None:
        text = f"{source}: {message}"
        file_name = source.split(" (document ")[0]
        if (file_name, text) in self._reported_errors:
            return  # report each distinct problem once, not every poll
        self._reported_errors.add((file_name, text))
        log.error("invalid Configuration in %s", text)
        self._emit(ConfigurationEvent(EventType.MODIFIED, key, None, text, source))

    def _parse_file(self, path: Path, state: _FileState) -> None:
        """Re-read ``path`` into ``state``; on errors keep the previous good versions."""
        source = str(path)
        try:
            with path.open("rb") as handle:
                raw = handle.read(MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                raise YamlLimitError(f"the file is larger than {MAX_FILE_BYTES} bytes")
            documents = [
                doc
                for doc in safe_load_all_limited(raw.decode(), max_bytes=MAX_FILE_BYTES)
                if doc is not None
            ]
        except (OSError, UnicodeDecodeError) as error:
            state.unreadable = f"cannot read file: {error}"
            self._error(source, None, state.unreadable)
            return
        except YamlLimitError as error:
            state.unreadable = f"too large: {error}"
            self._error(source, None, state.unreadable)
            return
        except yaml.YAMLError as error:
            state.unreadable = f"not valid YAML: {yaml_problem(error)}"
            self._error(source, None, state.unreadable)
            return
        state.unreadable = None
        configurations: dict[ObjectKey, Configuration] = {}
        invalid: dict[ObjectKey, str] = {}
        for index, document in enumerate(documents):
            where = f"{source} (document {index + 1})" if len(documents) > 1 else source
            key = object_key(document)
            try:
                # strict: fields no API server would accept are errors, not ignored
                configuration = parse_configuration(document, strict=True)
            except ConfigurationError as error:
                message = "; ".join(error.problems)
                self._error(where, key, message)
                if key is not None:
                    self._broken.add(key)
                if key is None:
                    state.unreadable = f"document {index + 1} has no readable name"
                elif key in state.configurations:
                    configurations[key] = state.configurations[key]  # last good version
                else:
                    invalid[key] = message
                continue
            if configuration.key in configurations or configuration.key in invalid:
                self._error(
                    where, configuration.key, f"duplicate Configuration {configuration.key}"
                )
                continue
            configurations[configuration.key] = configuration
            if configuration.key in self._broken:
                self._broken.discard(configuration.key)
                log.info(
                    "configuration %s in %s is valid again: accepted", configuration.key, where
                )
        state.configurations = configurations
        state.invalid = invalid

    def scan(self) -> None:
        """Re-read changed files and emit ADDED/MODIFIED/DELETED for what changed."""
        self._save_record()  # one that failed before (disk full, read-only)
        files = self._expand()
        changed = False
        for path in files:
            state = self._files.setdefault(path, _FileState())
            key = _file_key(path)
            if key == state.key and state.seen:
                state.pending = None
                continue
            if state.seen and key != state.pending:
                # changed since the last look: apply it only once two polls agree, so a file
                # caught half-written (editors, cp, shell redirection) is never acted on
                state.pending = key
                continue
            state.seen = True
            state.pending = None
            changed = True
            self._reported_errors = {e for e in self._reported_errors if e[0] != str(path)}
            if key is None:
                self._error(str(path), None, "file not found")
                state.configurations = {}
                state.invalid = {}
                state.unreadable = None
            else:
                self._parse_file(path, state)
            state.key = key
        for gone in set(self._files) - set(files):
            del self._files[gone]
            changed = True
        if changed:
            unreadable = self.unreadable()
            self._merge(files)
            if unreadable != self._unreadable_before:
                self._unreadable_before = unreadable
                self._on_catalog_change()

    def _merge(self, files: list[Path]) -> None:
        definers: dict[ObjectKey, list[Path]] = {}
        for path in files:
            state = self._files.get(path)
            if state is None:
                continue
            for key in [*state.configurations, *state.invalid]:
                definers.setdefault(key, []).append(path)
        merged: dict[ObjectKey, Configuration] = {}
        invalid: dict[ObjectKey, InvalidConfiguration] = {}
        providers: dict[ObjectKey, Path] = {}
        for key, paths in definers.items():
            provider = self._provider.get(key)
            recorded = self._recorded.get(key)
            if provider not in paths and recorded is not None:
                # after a restart: the file that owned it before keeps it
                provider = next((p for p in paths if str(p.resolve()) == recorded.file), None)
            if provider not in paths:
                provider = paths[0]  # new, or its file dropped it: the first one in order
            providers[key] = provider
            for other in paths:
                if other != provider:
                    self._error(
                        str(other),
                        key,
                        f"duplicate Configuration {key}: already defined in {provider}; "
                        "this definition is ignored",
                    )
            first_seen = self._first_seen.setdefault(
                key, recorded.created if recorded is not None else _now()
            )
            state = self._files[provider]
            configuration = state.configurations.get(key)
            if configuration is not None:
                if configuration.creation_timestamp is None:
                    configuration = dataclasses.replace(
                        configuration, creation_timestamp=first_seen
                    )
                merged[key] = configuration
            else:
                invalid[key] = InvalidConfiguration(key, state.invalid[key], first_seen)
        self._provider = providers
        for key in set(self._first_seen) - set(definers):
            del self._first_seen[key]
        self._to_record = {
            key: Recorded(str(path.resolve()), self._first_seen[key])
            for key, path in providers.items()
        }
        self._save_record()
        catalog_before = (set(self._current), set(self._invalid))
        self._invalid = invalid
        for key in sorted(set(self._current) - set(merged)):
            old = self._current.pop(key)
            self._emit(ConfigurationEvent(EventType.DELETED, key, old))
        for key in sorted(merged):
            configuration = merged[key]
            old_cfg = self._current.get(key)
            if old_cfg is None:
                self._current[key] = configuration
                self._emit(ConfigurationEvent(EventType.ADDED, key, configuration))
            elif old_cfg.raw != configuration.raw:
                self._current[key] = configuration
                self._emit(ConfigurationEvent(EventType.MODIFIED, key, configuration))
        for key in sorted(set(catalog_before[1]) - set(invalid) - set(merged)):
            # an invalid Configuration removed from its file: gone (its Instances retire)
            self._emit(ConfigurationEvent(EventType.DELETED, key, None))
        if catalog_before != (set(self._current), set(self._invalid)):
            self._on_catalog_change()
