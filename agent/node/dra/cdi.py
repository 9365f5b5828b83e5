"""CDI spec files for prepared claims: one transient spec per claim, written atomically.

Kind ``k8s.akri.sh/device`` (vendor ``k8s.<driver>`` like the DRA example driver); one CDI
device per allocated slot named ``<claim-uid>-<device>``, so a name is never reused for
different content. The file is ``<cdi-dir>/k8s.akri.sh-device_<claim-uid>.json``; a claim uid
that is not a plain UUID-like token is replaced by its hash, and the final path is checked to
stay inside the CDI directory (hostile ids never escape it).

``cdiVersion`` is 0.5.0: the lowest version that allows ``hostPath`` in device nodes and
device names starting with a digit (claim uids do).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.core.store.base import StorageError
from agent.core.store.files import TMP_PREFIX, atomic_write_json, remove_file
from agent.node.deviceplugin.container_env import ContainerEdits

CDI_VERSION = "0.5.0"
VENDOR = "k8s.akri.sh"
CLASS = "device"
KIND = f"{VENDOR}/{CLASS}"
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# the temp files of our atomic writes: ``.tmp-k8s.akri.sh-device_<uid>.json.<pid>.<n>``
_OWN_TEMP = f"{TMP_PREFIX}{VENDOR}-{CLASS}_"

log = logging.getLogger(__name__)


def safe_token(text: str) -> str:
    """``text`` if it is a safe file/CDI name token, else a hash of it."""
    if _SAFE.match(text) and ".." not in text:
        return text
    return "h" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def cdi_device_name(claim_uid: str, device: str) -> str:
    """CDI device name of one allocated device of a claim."""
    return f"{safe_token(claim_uid)}-{device}"


def qualified(name: str) -> str:
    """Fully qualified CDI device id ``vendor/class=name``."""
    return f"{KIND}={name}"


@dataclass(frozen=True)
class CdiDevice:
    """One device of a claim's spec."""

    name: str
    edits: ContainerEdits


def spec_for(devices: Sequence[CdiDevice]) -> dict[str, Any]:
    """The CDI spec document."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [
            {
                "name": device.name,
                "containerEdits": {
                    "env": [f"{k}={v}" for k, v in sorted(device.edits.envs.items())],
                    "deviceNodes": [
                        {
                            "path": spec.container_path,
                            "hostPath": spec.host_path,
                            "permissions": spec.permissions or "rwm",
                        }
                        for spec in device.edits.device_specs
                    ],
                    "mounts": [
                        {
                            "hostPath": mount.host_path,
                            "containerPath": mount.container_path,
                            "options": ["ro", "bind"] if mount.read_only else ["rw", "bind"],
                        }
                        for mount in device.edits.mounts
                    ],
                },
            }
            for device in devices
        ],
    }


class CdiWriter:
    """Writes and removes per-claim spec files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path_for(self, claim_uid: str) -> Path:
        path = (self.directory / f"{VENDOR}-{CLASS}_{safe_token(claim_uid)}.json").resolve()
        if path.parent != self.directory.resolve():
            raise ValueError(f"CDI path for claim {claim_uid!r} escapes {self.directory}")
        return path

    def write(self, claim_uid: str, devices: Sequence[CdiDevice]) -> Path:
        """Write the claim's spec atomically; raises :class:`StorageError` (no spec, no
        partial spec) when the directory cannot take it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageError(str(self.directory), error) from error
        path = self.path_for(claim_uid)
        atomic_write_json(path, spec_for(devices))
        return path

    def remove_strays(self, started: float | None = None) -> list[str]:
        """Remove the temp files a killed write of ours left (``.tmp-k8s.akri.sh-device_*``)
        and that are older than ``started`` (wall clock, default: now): the CDI directory is
        shared with other vendors' files, never touched, and a write still in flight (another
        agent process) is younger. Returns the names removed; an unreadable directory is left
        for the writes to report."""
        cutoff = time.time() if started is None else started
        removed: list[str] = []
        try:
            candidates = sorted(self.directory.glob(f"{_OWN_TEMP}*"))
        except OSError:
            return removed
        for path in candidates:
            try:
                if path.lstat().st_mtime >= cutoff:
                    continue
                path.unlink()
            except OSError:
                continue
            removed.append(path.name)
        if removed:
            log.info(
                "removed %d temp file(s) a killed write left in %s: %s",
                len(removed),
                self.directory,
                ", ".join(removed),
            )
        return removed

    def remove(self, claim_uid: str) -> None:
        """Remove the claim's spec (none is fine); raises :class:`StorageError` when it
        stays (the unprepare is then refused, and kubelet retries it)."""
        remove_file(self.path_for(claim_uid))
