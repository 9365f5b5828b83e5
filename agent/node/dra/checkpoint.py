"""Prepared claims on disk, so a restarted agent answers repeated calls the same way.

``<data-dir>/checkpoint.json`` = ``{"version": 2, "preparedClaims": {uid: PreparedClaim},
"preparingClaims": {uid: PendingClaim}}``, written atomically (temp file, fsync, rename).

A claim is recorded as *preparing* (with its namespace and name) before any of its slots is
claimed, and as *prepared* once its CDI spec is written. So every ``D:<uid>:<node>`` slot
this node writes can be traced back to its ResourceClaim: the DRA reclaimer
(:mod:`agent.node.dra.reclaim`) asks the API about preparing ones, and keeps prepared ones until
kubelet unprepares them. Version 1 files (no ``preparingClaims``) are read as well.

An unreadable checkpoint is reported and replaced by an empty one only on the next write; the
slots it covered stay held (``D:<uid>:<node>`` values nobody can trace are never freed by
the agent, see docs/dra.md).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.core.store.base import CorruptStateError
from agent.core.store.files import atomic_write_json, read_json

log = logging.getLogger(__name__)
VERSION = 2


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


class Checkpoint:
    """Load/save prepared and preparing claims."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, PreparedClaim] = {}
        self.pending: dict[str, PendingClaim] = {}

    def load(self) -> None:
        if not self.path.exists():
            return
        try:
            data: Any = read_json(self.path)
            claims = data["preparedClaims"]
            self.claims = {
                uid: PreparedClaim(
                    uid=uid,
                    namespace=c["namespace"],
                    name=c["name"],
                    devices=tuple(
                        PreparedDevice(
                            request_names=tuple(d["request_names"]),
                            pool=d["pool"],
                            device=d["device"],
                            instance=d["instance"],
                            slot=d["slot"],
                            cdi_device_ids=tuple(d["cdi_device_ids"]),
                            share_id=d.get("share_id"),
                            namespace=d.get("namespace", "default"),
                        )
                        for d in c["devices"]
                    ),
                )
                for uid, c in claims.items()
            }
            self.pending = {
                uid: PendingClaim(uid, p["namespace"], p["name"])
                for uid, p in (data.get("preparingClaims") or {}).items()
            }
        except (CorruptStateError, KeyError, TypeError, AttributeError) as error:
            log.error(
                "DRA checkpoint %s unreadable (%s); starting empty: prepared slots are "
                "still recorded in the Instances",
                self.path,
                error,
            )
            self.claims = {}
            self.pending = {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            self.path,
            {
                "version": VERSION,
                "preparedClaims": {uid: asdict(claim) for uid, claim in self.claims.items()},
                "preparingClaims": {
                    uid: {"namespace": p.namespace, "name": p.name}
                    for uid, p in self.pending.items()
                },
            },
        )
