"""What a local agent records for ``akri status --state-dir``.

In a cluster the agent's notices are Events (``OverBudget``, ``NameConflict``) and ``akri
status`` reads them. Local mode has no Events, so a local agent keeps the standing ones in
its state directory, one small file per node (several simulated nodes may share a state
directory): ``STATE_DIR/notes-<node>.json`` with the devices its Instance budget leaves out
(:mod:`agent.node.discovery.budget`), the Configurations it refuses because another has
their kubelet names (:mod:`agent.node.discovery.ownership`), and the Instances whose device it
no longer sees, in their offline grace (their slots Unhealthy), with when the grace ends: a
cluster's ``akri status`` reads that from kubelet and the ResourceSlices, a state directory has
nothing else to show it. The file is rewritten when one of them changes, removed when there is
nothing to say, and cleared at start.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

from agent.core.model.keys import ObjectKey
from agent.core.store.files import atomic_write_json
from agent.node.discovery.budget import InstanceBudget

log = logging.getLogger(__name__)
NOTES_PREFIX = "notes-"


def notes_file(state_dir: Path, node: str) -> Path:
    """Where a local agent on ``node`` keeps its notes."""
    return state_dir / f"{NOTES_PREFIX}{quote(node, safe='')}.json"


def notes_record(
    node: str,
    budget: InstanceBudget,
    refused: Mapping[ObjectKey, str],
    offline: Mapping[ObjectKey, float] | None = None,
) -> dict[str, object]:
    """The JSON of one node's notes (pure). ``offline``: Instance -> when its offline grace
    ends here (seconds since the epoch)."""
    return {
        "node": node,
        "limit": budget.limit,
        "left_out": {
            str(key): {"left_out": left, "reported": len(budget.reported(key))}
            for key, left in sorted(budget.left_out.items())
        },
        "refused": {str(key): reason for key, reason in sorted(refused.items())},
        "offline": {str(key): round(until, 1) for key, until in sorted((offline or {}).items())},
    }


def record_notes(
    state_dir: Path,
    node: str,
    budget: InstanceBudget,
    refused: Mapping[ObjectKey, str],
    offline: Mapping[ObjectKey, float] | None = None,
) -> None:
    """Write (or, with nothing to say, remove) this node's notes. A failure is logged, never
    raised: the file only feeds ``akri status``."""
    path = notes_file(state_dir, node)
    try:
        if budget.left_out or refused or offline:
            record = notes_record(node, budget, refused, offline)
            atomic_write_json(path, record, durable=False)
        else:
            path.unlink(missing_ok=True)
    except OSError as error:
        log.warning("could not record this node's notes in %s: %s", path, error)


MAX_NOTES_BYTES = 1 << 20
"""A notes file above this is not one an agent wrote (a few lines per Configuration)."""


def read_notes(state_dir: Path) -> list[dict[str, object]]:
    """The notes files of a local state directory. One that cannot be used — unreadable, too
    large, not JSON, nested too deeply for the parser, or of another shape — is skipped (it
    only feeds ``akri status``, which must show the Instances whatever it holds): in its
    place a record ``{"skipped": <path>, "reason": ...}`` that :func:`note_lines` prints."""
    records: list[dict[str, object]] = []
    for path in sorted(state_dir.glob(f"{NOTES_PREFIX}*.json")):
        try:
            record = _load(path)
        except NotesError as error:
            records.append({"skipped": str(path), "reason": str(error)})
        else:
            records.append(record)
    return records


class NotesError(Exception):
    """Why a notes file is skipped."""


def _load(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_NOTES_BYTES + 1)
    except OSError as error:
        raise NotesError(f"cannot read: {error.strerror}") from None
    if len(raw) > MAX_NOTES_BYTES:
        raise NotesError(f"larger than {MAX_NOTES_BYTES} bytes")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise NotesError("not valid JSON (nested too deeply)") from None
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError too
        raise NotesError(f"not valid JSON ({error})") from None
    problem = _shape_problem(data)
    if problem is not None:
        raise NotesError(f"not a notes record ({problem})")
    return cast(dict[str, object], data)


def _shape_problem(data: Any) -> str | None:
    """What makes ``data`` something :func:`notes_record` does not write (None if nothing):
    only the values it writes are printed, so no hostile value reaches an f-string."""
    if not isinstance(data, dict):
        return "not an object"
    if not isinstance(data.get("node"), str):
        return "node is not a string"
    if not isinstance(data.get("limit", 0), int):
        return "limit is not a number"
    refused = data.get("refused", {})
    if not isinstance(refused, dict) or not all(isinstance(v, str) for v in refused.values()):
        return "refused does not map names to reasons"
    left_out = data.get("left_out", {})
    if not isinstance(left_out, dict) or not all(
        isinstance(counts, dict)
        and isinstance(counts.get("left_out"), int)
        and isinstance(counts.get("reported"), int)
        for counts in left_out.values()
    ):
        return "left_out does not map names to counts"
    offline = data.get("offline", {})
    if not isinstance(offline, dict) or not all(
        isinstance(until, int | float) and not isinstance(until, bool) and "/" in str(key)
        for key, until in offline.items()
    ):
        return "offline does not map namespace/name to times"
    return None


def offline_until(records: Sequence[Mapping[str, object]]) -> dict[ObjectKey, dict[str, float]]:
    """From the notes of a state directory: per Instance, the nodes that keep it in their
    offline grace and when it ends there (seconds since the epoch)."""
    result: dict[ObjectKey, dict[str, float]] = {}
    for record in records:
        offline = record.get("offline")
        if "skipped" in record or not isinstance(offline, Mapping):
            continue
        for name, until in offline.items():
            namespace, _, instance = str(name).partition("/")
            result.setdefault(ObjectKey(namespace, instance), {})[str(record["node"])] = until
    return result


def note_lines(records: Sequence[Mapping[str, object]]) -> list[str]:
    """``akri status`` lines for the notes of a state directory (pure)."""
    lines = []
    for record in records:
        if "skipped" in record:
            lines.append(f"notes file {record['skipped']} skipped: {record.get('reason')}")
            continue
        node = record.get("node")
        refused = record.get("refused")
        if isinstance(refused, Mapping):
            for configuration, reason in sorted(refused.items()):
                lines.append(f"refused on {node}: {configuration}: {reason}")
        left_out = record.get("left_out")
        if isinstance(left_out, Mapping):
            for configuration, counts in sorted(left_out.items()):
                if not isinstance(counts, Mapping):
                    continue
                lines.append(
                    f"over budget on {node}: {counts.get('left_out')} of the "
                    f"{counts.get('reported')} devices of {configuration} are not served (at "
                    f"most {record.get('limit')} instances, --max-instances)"
                )
    return lines
