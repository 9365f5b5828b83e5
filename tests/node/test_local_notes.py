"""``akri status --state-dir`` and the notes files local agents leave (issue 34.3): a notes file
that cannot be used is skipped with a line saying which and why, and the Instances and the
other notes are shown as ever."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agent.cli import main
from agent.core.store.local import LocalInstanceStore
from agent.node.local_notes import MAX_NOTES_BYTES, notes_file
from tests.core.state_racers import fresh

DEEP = 100_000  # far past the JSON parser's recursion limit

HOSTILE = {
    "deeply-nested": "[" * DEEP + "]" * DEEP,
    "deep-in-a-reason": json.dumps({"node": "x", "refused": {"a/b": "r"}}).replace(
        '"r"', "[" * 900 + "]" * 900
    ),
    "deep-in-a-node": '{"node": ' + "[" * 900 + "]" * 900 + "}",
    "not-json": "{not json",
    "not-utf8": b"\xff\xfe{".decode("latin-1"),
    "a-list": "[1, 2, 3]",
    "counts-not-numbers": json.dumps({"node": "x", "left_out": {"a/b": {"left_out": "many"}}}),
    "huge-number": '{"node": "x", "limit": ' + "9" * 5000 + "}",
    "offline-not-times": json.dumps({"node": "x", "offline": {"default/cam-abcdef": "soon"}}),
    "offline-not-names": json.dumps({"node": "x", "offline": {"cam": 1.0}}),
}


@pytest.fixture
def state(tmp_path: Path) -> Path:
    state = tmp_path / "state"

    async def make() -> None:
        store = LocalInstanceStore(state)
        await store.start()
        await store.create(fresh("cam-abcdef", 2))
        await store.close()

    asyncio.run(make())
    good = {"node": "lab", "limit": 1, "left_out": {}, "refused": {"default/cam": "a reason"}}
    notes_file(state, "lab").write_text(json.dumps(good))
    return state


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_status_skips_a_notes_file_it_cannot_use(
    state: Path, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = notes_file(state, "hostile")
    bad.write_bytes(content.encode("latin-1"))
    assert main(["status", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert "cam-abcdef" in out  # the Instances, as ever
    assert "refused on lab: default/cam: a reason" in out  # and the usable notes
    [skipped] = [line for line in out.splitlines() if "skipped" in line]
    assert skipped.startswith(f"notes file {bad} skipped: ")


def test_status_skips_a_notes_file_too_large_or_unreadable(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes_file(state, "huge").write_bytes(b" " * (MAX_NOTES_BYTES + 1))
    notes_file(state, "dir").mkdir()
    assert main(["status", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    assert f"notes file {notes_file(state, 'huge')} skipped: larger than" in out
    assert f"notes file {notes_file(state, 'dir')} skipped: cannot read" in out
    assert "refused on lab: default/cam: a reason" in out


def test_status_shows_the_offline_grace_a_node_notes(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34.9: a node that no longer sees the device notes when its grace ends."""
    import time

    until = time.time() + 100
    notes = {"node": "lab", "offline": {"default/cam-abcdef": until}}
    notes_file(state, "lab").write_text(json.dumps(notes))
    assert main(["status", "--state-dir", str(state)]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "cam-abcdef" in line]
    assert "offline (lab, 100 s left)" in row or "offline (lab, 99 s left)" in row, row
