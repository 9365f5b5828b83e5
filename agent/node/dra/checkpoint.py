"""Prepared claims on disk, so a restarted agent answers repeated calls the same way.

``<data-dir>/checkpoint.json`` = ``{"version": 2, "preparedClaims": {uid: PreparedClaim},
"preparingClaims": {uid: PendingClaim}}``, written atomically (temp file, fsync, rename).

A claim is recorded as *preparing* (with its namespace and name) before any of its slots is
claimed, and as *prepared* once its CDI spec is written. So every ``D:<uid>:<node>`` slot
this node writes can be traced back to its ResourceClaim: the DRA reclaimer
(:mod:`agent.node.dra.reclaim`) asks the API about preparing ones, and keeps prepared ones until
kubelet unprepares them. Version 1 files (no ``preparingClaims``) are read as well.

Every change is written before it takes effect in memory (:meth:`Checkpoint.record_preparing`,
:meth:`~Checkpoint.record_prepared`, :meth:`~Checkpoint.forget`): a write that fails (disk
full, read-only, I/O error: :class:`StorageError`) leaves both the file and the in-memory
state as they were, so nothing is answered that is not recorded.

A checkpoint that cannot be read, whatever its content, stops the agent at start
(:class:`CorruptStateError` naming the file: exit code 3) rather than starting empty: an
empty start would leave every ``D:`` slot it traced untraceable for good (see docs/dra.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.core.store.base import CorruptStateError, StorageError
from agent.core.store.files import atomic_write_json, read_json

log = logging.getLogger(__name__)
VERSION = 2
KNOWN_VERSIONS = (1, 2)
RECOVERY_HINT = (
    "move it aside to start without it (slots of the claims it records are then kept until "
    "freed by hand, see docs/dra.md)"
)


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device of a prepared claim."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    instance: str
    slot: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    namespace: str = "default"  # the Instance's


@dataclass(frozen=True)
class PendingClaim:
    """A claim whose prepare started (slots may be claimed) but did not finish."""

    uid: str
    namespace: str
    name: str


@dataclass(frozen=True)
class PreparedClaim:
    """A claim this node prepared."""

    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]


class _Malformed(Exception):
    """Where in the document, and what is wrong there."""


def _field(obj: Mapping[str, Any], name: str, where: str, default: Any = ...) -> str:
    value = obj.get(name, default)
    if value is ...:
        raise _Malformed(f"{where}.{name} is missing")
    if not isinstance(value, str):
        raise _Malformed(f"{where}.{name} must be a string")
    return value


def _strings(obj: Mapping[str, Any], name: str, where: str) -> tuple[str, ...]:
    value = obj.get(name)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _Malformed(f"{where}.{name} must be a list of strings")
    return tuple(value)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _Malformed(f"{where} must be an object")
    return value


def _device(obj: Any, where: str) -> PreparedDevice:
    d = _mapping(obj, where)
    share = d.get("share_id")
    if share is not None and not isinstance(share, str):
        raise _Malformed(f"{where}.share_id must be a string or null")
    return PreparedDevice(
        request_names=_strings(d, "request_names", where),
        pool=_field(d, "pool", where),
        device=_field(d, "device", where),
        instance=_field(d, "instance", where),
        slot=_field(d, "slot", where),
        cdi_device_ids=_strings(d, "cdi_device_ids", where),
        share_id=share,
        namespace=_field(d, "namespace", where, "default"),
    )


def parse_checkpoint(data: Any) -> tuple[dict[str, PreparedClaim], dict[str, PendingClaim]]:
    """(prepared, preparing) claims of a checkpoint document; raises :class:`_Malformed`
    naming the first problem (any content: the file may be damaged or hand-edited)."""
    doc = _mapping(data, "the checkpoint")
    version = doc.get("version", 1)
    if isinstance(version, bool) or version not in KNOWN_VERSIONS:
        raise _Malformed(f"version {version!r} is not one this agent reads {KNOWN_VERSIONS}")
    claims: dict[str, PreparedClaim] = {}
    for uid, raw in _mapping(doc.get("preparedClaims"), "preparedClaims").items():
        where = f"preparedClaims[{uid!r}]"
        claim = _mapping(raw, where)
        devices = claim.get("devices")
        if not isinstance(devices, list):
            raise _Malformed(f"{where}.devices must be a list")
        claims[uid] = PreparedClaim(
            uid=uid,
            namespace=_field(claim, "namespace", where),
            name=_field(claim, "name", where),
            devices=tuple(
                _device(device, f"{where}.devices[{index}]") for index, device in enumerate(devices)
            ),
        )
    pending: dict[str, PendingClaim] = {}
    preparing = doc.get("preparingClaims")
    for uid, raw in (_mapping(preparing, "preparingClaims") if preparing else {}).items():
        where = f"preparingClaims[{uid!r}]"
        entry = _mapping(raw, where)
        pending[uid] = PendingClaim(
            uid, _field(entry, "namespace", where), _field(entry, "name", where)
        )
    return claims, pending


class Checkpoint:
    """Load/save prepared and preparing claims. ``claims`` and ``pending`` are read-only to
    everyone else: changes go through the ``record_*``/``forget`` methods, which write first."""

    def __init__(self, path: Path, *, durable: bool = True) -> None:
        self.path = path
        self.claims: dict[str, PreparedClaim] = {}
        self.pending: dict[str, PendingClaim] = {}
        self._durable = durable

    def load(self) -> None:
        """Read the file (none: nothing prepared). Raises :class:`CorruptStateError` naming it
        for any content that is not a checkpoint."""
        if not self.path.exists():
            return
        data: Any = read_json(self.path)
        try:
            self.claims, self.pending = parse_checkpoint(data)
        except (_Malformed, RecursionError) as error:
            raise CorruptStateError(str(self.path), f"{error}; {RECOVERY_HINT}") from error

    def save(self) -> None:
        """Write the current state (raises :class:`StorageError`)."""
        self._write(self.claims, self.pending)

    def record_preparing(self, claim: PendingClaim) -> None:
        """Record ``claim`` as preparing (before any of its slots is claimed)."""
        self._commit(self.claims, {**self.pending, claim.uid: claim})

    def record_prepared(self, claim: PreparedClaim) -> None:
        """Record ``claim`` as prepared (no longer preparing)."""
        pending = {uid: p for uid, p in self.pending.items() if uid != claim.uid}
        self._commit({**self.claims, claim.uid: claim}, pending)

    def forget(self, uids: Iterable[str]) -> bool:
        """Drop ``uids`` from both lists; writes (and returns True) only if one was there."""
        gone = set(uids)
        if not gone & (set(self.claims) | set(self.pending)):
            return False
        self._commit(
            {uid: c for uid, c in self.claims.items() if uid not in gone},
            {uid: p for uid, p in self.pending.items() if uid not in gone},
        )
        return True

    def remove_if_empty(self) -> bool:
        """Delete the file, then its directory if nothing else is left there, when no claim is
        prepared or preparing, in memory or on disk (re-read: what is written decides). For an
        agent leaving for good (an uninstall, agent/node/leaving.py), never on a restart: the
        next agent reads the file. Returns whether the file is gone."""
        if self.claims or self.pending:
            return False
        on_disk = Checkpoint(self.path, durable=self._durable)
        try:
            on_disk.load()
        except (CorruptStateError, StorageError, OSError) as error:
            log.warning("DRA checkpoint %s kept: it cannot be read (%s)", self.path, error)
            return False
        if on_disk.claims or on_disk.pending:
            return False
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:
            log.warning("could not remove the empty DRA checkpoint %s: %s", self.path, error)
            return False
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # only when empty (a stranger's file stays, and its dir)
        return True

    def _commit(self, claims: dict[str, PreparedClaim], pending: dict[str, PendingClaim]) -> None:
        self._write(claims, pending)  # raises before anything changes in memory
        self.claims, self.pending = claims, pending

    def _write(self, claims: dict[str, PreparedClaim], pending: dict[str, PendingClaim]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageError(str(self.path.parent), error) from error
        atomic_write_json(
            self.path,
            {
                "version": VERSION,
                "preparedClaims": {uid: asdict(claim) for uid, claim in claims.items()},
                "preparingClaims": {
                    uid: {"namespace": p.namespace, "name": p.name} for uid, p in pending.items()
                },
            },
            durable=self._durable,
        )
