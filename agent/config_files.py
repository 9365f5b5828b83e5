"""Configurations read from YAML files (local mode), re-read when a file changes.

Each path is a YAML file (one or more ``---`` documents) or a directory of ``*.yaml``/``*.yml``
files. Files are re-checked by ``scan()`` (the local store calls it every poll interval);
only files whose size, mtime or inode changed are re-parsed, and only once the change has been
stable for one poll interval: a file caught half-written (truncated by an editor, ``cp`` or a
shell redirection) would otherwise look like deleted Configurations. Files present at start
are read at once.

Bad input never stops the others: a file that is not YAML, a document that is not a valid
Configuration, or a duplicate name produces one error event naming the file and the field;
the last good version of an affected Configuration keeps running (like ``kubectl apply``
rejecting a bad edit), and every other Configuration is untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.model.configuration import Configuration, ConfigurationError, parse_configuration
from agent.store.base import ConfigurationEvent, EventType
from discovery_handlers.details import yaml_problem

log = logging.getLogger(__name__)
FileKey = tuple[int, int, int]


@dataclass
class _FileState:
    key: FileKey | None = None
    configurations: dict[str, Configuration] = field(default_factory=dict)
    seen: bool = False
    pending: FileKey | None = None


def _file_key(path: Path) -> FileKey | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _name_of(document: Any) -> str | None:
    if isinstance(document, dict):
        metadata = document.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("name"), str):
            return str(metadata["name"])
    return None


class ConfigurationFiles:
    """Tracks the Configurations defined by a set of files and reports changes."""

    def __init__(self, paths: list[Path], emit: Callable[[ConfigurationEvent], None]) -> None:
        self._paths = paths
        self._emit = emit
        self._files: dict[Path, _FileState] = {}
        self._current: dict[str, Configuration] = {}
        self._reported_errors: set[tuple[str, str]] = set()

    def current(self) -> list[Configuration]:
        """The Configurations in force, sorted by name."""
        return [self._current[name] for name in sorted(self._current)]

    def _expand(self) -> list[Path]:
        files: list[Path] = []
        for path in self._paths:
            if path.is_dir():
                files.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")))
            else:
                files.append(path)
        return files

    def _error(self, source: str, name: str, message: str) -> None:
        text = f"{source}: {message}"
        file_name = source.split(" (document ")[0]
        if (file_name, text) in self._reported_errors:
            return  # report each distinct problem once, not every poll
        self._reported_errors.add((file_name, text))
        log.error("invalid Configuration in %s", text)
        self._emit(ConfigurationEvent(EventType.MODIFIED, name, None, text, source))

    def _parse_file(self, path: Path, previous: _FileState) -> dict[str, Configuration]:
        """Configurations in ``path``; on errors keep the previous good version."""
        source = str(path)
        try:
            documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        except (OSError, UnicodeDecodeError) as error:
            self._error(source, "", f"cannot read file: {error}")
            return dict(previous.configurations)
        except yaml.YAMLError as error:
            self._error(source, "", f"not valid YAML: {yaml_problem(error)}")
            return dict(previous.configurations)
        result: dict[str, Configuration] = {}
        for index, document in enumerate(documents):
            where = f"{source} (document {index + 1})" if len(documents) > 1 else source
            try:
                configuration = parse_configuration(document)
            except ConfigurationError as error:
                name = _name_of(document) or ""
                self._error(where, name, "; ".join(error.problems))
                if name in previous.configurations:
                    result[name] = previous.configurations[name]
                continue
            if configuration.name in result:
                self._error(where, configuration.name, f"duplicate name {configuration.name!r}")
                continue
            result[configuration.name] = configuration
        return result

    def scan(self) -> None:
        """Re-read changed files and emit ADDED/MODIFIED/DELETED for what changed."""
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
            if key is None:
                self._error(str(path), "", "file not found")
                state.configurations = {}
            else:
                self._reported_errors = {e for e in self._reported_errors if e[0] != str(path)}
                state.configurations = self._parse_file(path, state)
            state.key = key
        for gone in set(self._files) - set(files):
            del self._files[gone]
            changed = True
        if changed:
            self._merge()

    def _merge(self) -> None:
        merged: dict[str, Configuration] = {}
        for path in self._expand():
            state = self._files.get(path)
            if state is None:
                continue
            for name, configuration in state.configurations.items():
                if name in merged:
                    self._error(str(path), name, f"duplicate name {name!r} (first definition wins)")
                    continue
                merged[name] = configuration
        for name in sorted(set(self._current) - set(merged)):
            old = self._current.pop(name)
            self._emit(ConfigurationEvent(EventType.DELETED, name, old))
        for name in sorted(merged):
            configuration = merged[name]
            old_cfg = self._current.get(name)
            if old_cfg is None:
                self._current[name] = configuration
                self._emit(ConfigurationEvent(EventType.ADDED, name, configuration))
            elif old_cfg.raw != configuration.raw:
                self._current[name] = configuration
                self._emit(ConfigurationEvent(EventType.MODIFIED, name, configuration))
