"""Prepared claims on disk, so a restarted agent answers repeated calls the same way.

``<data-dir>/checkpoint.json`` = ``{"version": 2, "preparedClaims": {uid: PreparedClaim},
"preparingClaims": {uid: PendingClaim}, "pendingReleases": {uid: PendingRelease}}``, written
atomically (temp file, fsync, rename).

A claim is recorded as *preparing* (with its namespace and name) before any of its slots is
claimed, and as *prepared* once its CDI spec is written. So every ``D:<uid>:<node>`` slot
this node writes can be traced back to its ResourceClaim: the DRA reclaimer
(:mod:`agent.node.dra.reclaim`) asks the API about preparing ones, and keeps prepared ones until
kubelet unprepares them. Version 1 files (no ``preparingClaims``) are read as well.

A claim unprepared on the node while the API refused to free its slots (an agent being
uninstalled: the CDI spec goes, kubelet is told it is done, issue 39.2) becomes a *pending
release*: the Instances whose ``D:<uid>:<node>`` value is still to be freed. The DRA reclaimer
frees them once the API answers — this agent while it runs, or the next one on this node at
its start — and drops the record; the file stays on the node while one is left
(:meth:`Checkpoint.remove_if_empty`). ``pendingReleases`` is an addition to version 2, optional
when read: a checkpoint written before it loads as one without pending releases. An agent
older than it (a downgrade) reads the file too, ignores ``pendingReleases`` and drops them at
its first write of the checkpoint (or with the file, when it is uninstalled): their slots are
then kept as untraceable, as before this record existed (docs/dra.md).

Every change is written before it takes effect in memory (:meth:`Checkpoint.record_preparing`,
:meth:`~Checkpoint.record_prepared`, :meth:`~Checkpoint.forget`,
:meth:`~Checkpoint.record_release_pending`, :meth:`~Checkpoint.released`): a write that fails
(disk full, read-only, I/O error: :class:`StorageError`) leaves both the file and the
in-memory state as they were, so nothing is answered that is not recorded.

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

from agent.core.model.keys import ObjectKey
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
class PendingRelease:
    """A claim unprepared on the node whose slots the API did not free: ``value``
    (``D:<uid>:<node>``) is still to be released in each of ``instances``."""

    uid: str
    namespace: str
    name: str
    value: str
    instances: tuple[ObjectKey, ...]


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


def parse_checkpoint(
    data: Any,
) -> tuple[dict[str, PreparedClaim], dict[str, PendingClaim], dict[str, PendingRelease]]:
    """(prepared, preparing, pending releases) of a checkpoint document; raises
    :class:`_Malformed` naming the first problem (any content: the file may be damaged or
    hand-edited)."""
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
    releases: dict[str, PendingRelease] = {}
    listed = doc.get("pendingReleases")
    for uid, raw in (_mapping(listed, "pendingReleases") if listed else {}).items():
        where = f"pendingReleases[{uid!r}]"
        entry = _mapping(raw, where)
        instances = entry.get("instances")
        if not isinstance(instances, list):
            raise _Malformed(f"{where}.instances must be a list")
        keys = []
        for index, item in enumerate(instances):
            at = f"{where}.instances[{index}]"
            instance = _mapping(item, at)
            keys.append(ObjectKey(_field(instance, "namespace", at), _field(instance, "name", at)))
        releases[uid] = PendingRelease(
            uid,
            _field(entry, "namespace", where),
            _field(entry, "name", where),
            _field(entry, "value", where),
            tuple(keys),
        )
    return claims, pending, releases


class Checkpoint:
    """Load/save prepared and preparing claims and pending releases. ``claims``, ``pending``
    and ``releases`` are read-only to everyone else: changes go through the
    ``record_*``/``forget``/``released`` methods, which write first."""

    def __init__(self, path: Path, *, durable: bool = True) -> None:
        self.path = path
        self.claims: dict[str, PreparedClaim] = {}
        self.pending: dict[str, PendingClaim] = {}
        self.releases: dict[str, PendingRelease] = {}
        self._durable = durable

    def load(self) -> None:
        """Read the file (none: nothing prepared). Raises :class:`CorruptStateError` naming it
        for any content that is not a checkpoint."""
        if not self.path.exists():
            return
        data: Any = read_json(self.path)
        try:
            self.claims, self.pending, self.releases = parse_checkpoint(data)
        except (_Malformed, RecursionError) as error:
            raise CorruptStateError(str(self.path), f"{error}; {RECOVERY_HINT}") from error

    def save(self) -> None:
        """Write the current state (raises :class:`StorageError`)."""
        self._write(self.claims, self.pending, self.releases)

    def record_preparing(self, claim: PendingClaim) -> None:
        """Record ``claim`` as preparing (before any of its slots is claimed). A release
        still pending for its uid (the claim unprepared, now prepared again) is dropped: the
        slots it names that the new preparation does not use are then stale, and the
        reclaimer frees them as such."""
        releases = {uid: r for uid, r in self.releases.items() if uid != claim.uid}
        self._commit(self.claims, {**self.pending, claim.uid: claim}, releases)

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

    def record_release_pending(self, release: PendingRelease) -> None:
        """The claim ``release.uid`` is unprepared on the node, but its value is still to be
        freed in ``release.instances``: one write drops the claim from both lists and keeps
        the release (merged with one already pending for it)."""
        earlier = self.releases.get(release.uid)
        if earlier is not None:
            merged = tuple(dict.fromkeys((*earlier.instances, *release.instances)))
            release = PendingRelease(
                release.uid, release.namespace, release.name, release.value, merged
            )
        self._commit(
            {uid: c for uid, c in self.claims.items() if uid != release.uid},
            {uid: p for uid, p in self.pending.items() if uid != release.uid},
            {**self.releases, release.uid: release},
        )

    def released(self, uid: str, done: Iterable[ObjectKey]) -> None:
        """The value of the pending release ``uid`` is freed (or gone) in ``done``: those
        Instances leave the record, and the record goes with the last one."""
        release = self.releases.get(uid)
        if release is None:
            return
        freed = set(done)
        left = tuple(key for key in release.instances if key not in freed)
        releases = {u: r for u, r in self.releases.items() if u != uid}
        if left:
            releases[uid] = PendingRelease(
                release.uid, release.namespace, release.name, release.value, left
            )
        if releases != self.releases:
            self._commit(self.claims, self.pending, releases)

    def remove_if_empty(self) -> bool:
        """Delete the file, then its directory if nothing else is left there, when no claim is
        prepared or preparing and no release pending, in memory or on disk (re-read: what is
        written decides). For an agent leaving for good (an uninstall,
        agent/node/leaving.py), never on a restart: the next agent reads the file. A pending
        release keeps it (and its directory) on the node for the next agent here, which
        completes it. Returns whether the file is gone."""
        if self.claims or self.pending or self.releases:
            return False
        on_disk = Checkpoint(self.path, durable=self._durable)
        try:
            on_disk.load()
        except (CorruptStateError, StorageError, OSError) as error:
            log.warning("DRA checkpoint %s kept: it cannot be read (%s)", self.path, error)
            return False
        if on_disk.claims or on_disk.pending or on_disk.releases:
            return False
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:
            log.warning("could not remove the empty DRA checkpoint %s: %s", self.path, error)
            return False
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # only when empty (a stranger's file stays, and its dir)
        return True

    def _commit(
        self,
        claims: dict[str, PreparedClaim],
        pending: dict[str, PendingClaim],
        releases: dict[str, PendingRelease] | None = None,
    ) -> None:
        releases = self.releases if releases is None else releases
        self._write(claims, pending, releases)  # raises before anything changes in memory
        self.claims, self.pending, self.releases = claims, pending, releases

    def _write(
        self,
        claims: dict[str, PreparedClaim],
        pending: dict[str, PendingClaim],
        releases: dict[str, PendingRelease],
    ) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageError(str(self.path.parent), error) from error
        document: dict[str, Any] = {
            "version": VERSION,
            "preparedClaims": {uid: asdict(claim) for uid, claim in claims.items()},
            "preparingClaims": {
                uid: {"namespace": p.namespace, "name": p.name} for uid, p in pending.items()
            },
        }
        if releases:  # absent when none: the file is byte for byte what older agents wrote
            document["pendingReleases"] = {
                uid: {
                    "namespace": r.namespace,
                    "name": r.name,
                    "value": r.value,
                    "instances": [{"namespace": k.namespace, "name": k.name} for k in r.instances],
                }
                for uid, r in releases.items()
            }
        atomic_write_json(self.path, document, durable=self._durable)
