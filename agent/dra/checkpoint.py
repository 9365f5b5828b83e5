"""Prepared claims on disk, so a restarted agent answers repeated calls the same way.

``<data-dir>/checkpoint.json`` = ``{"version": 1, "preparedClaims": {uid: PreparedClaim}}``,
written atomically (temp file, fsync, rename). An unreadable checkpoint is reported and
replaced by an empty one only on the next write: prepared slots are still recorded in the
Instances (``D:<uid>:<node>``), so nothing is leaked by losing it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.store.base import CorruptStateError
from agent.store.files import atomic_write_json, read_json

log = logging.getLogger(__name__)
VERSION = 1


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


@dataclass(frozen=True)
class PreparedClaim:
    """A claim this node prepared."""

    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]


class Checkpoint:
    """Load/save prepared claims."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, PreparedClaim] = {}

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
                        )
                        for d in c["devices"]
                    ),
                )
                for uid, c in claims.items()
            }
        except (CorruptStateError, KeyError, TypeError, AttributeError) as error:
            log.error(
                "DRA checkpoint %s unreadable (%s); starting empty: prepared slots are "
                "still recorded in the Instances",
                self.path,
                error,
            )
            self.claims = {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            self.path,
            {
                "version": VERSION,
                "preparedClaims": {uid: asdict(claim) for uid, claim in self.claims.items()},
            },
        )
