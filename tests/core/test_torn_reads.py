"""Every read of the local store is a state some writer wrote (issue 34.1-2, invariant 8).

An Instance of the local store is two files, ``<name>.json`` and its slot journal, and a
compaction rewrites the one and removes the other. A reader that reads them apart, while
another process compacts and appends, combines an old file with a newer journal: a view with
the newest resourceVersion that lacks every claim in between (a CAS update based on it frees
them: a double grant), or that names slots the old file does not have ("corrupt"). These
tests race real processes on one state directory for a bounded time (``AKRI_TORN_SECONDS``,
default 8 s) and count such views; before readers took the shared lock they found them in
every run.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from agent.core.store.local import LocalInstanceStore
from tests.core.state_racers import fresh
from tests.paths import REPO

SECONDS = float(os.environ.get("AKRI_TORN_SECONDS", "8"))
NAME = "cam-abcdef"
ENV = {
    **os.environ,
    "PYTHONPATH": str(REPO),
    # a compaction every third write (the shipped value is 257th), claims in bursts of four
    # with 10 ms between them: many compactions, and quiet moments in which an update
    # decided on a torn view could go through
    "AKRI_TEST_COMPACT_AFTER": "2",
    "AKRI_TEST_BURST": "4",
    "AKRI_TEST_PAUSE": "0.01",
    "AKRI_TEST_CYCLE": "100",  # a capacity change every 100 claims
}


async def race(state: Path, *roles: str) -> list[dict[str, Any]]:
    """Run one racer process per role on Instance NAME for SECONDS; their reports, in order."""
    command = [sys.executable, "-m", "tests.core.state_racers"]
    procs = [
        await asyncio.create_subprocess_exec(
            *command,
            role,
            str(state),
            str(SECONDS),
            NAME,
            stdout=asyncio.subprocess.PIPE,
            env=ENV,
            cwd=REPO,
        )
        for role in roles
    ]
    async with asyncio.timeout(SECONDS + 90):
        outputs = [await proc.communicate() for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * len(procs)
    return [json.loads(out.splitlines()[-1]) for out, _ in outputs]


async def create(state: Path) -> None:
    store = LocalInstanceStore(state)
    await store.start()
    await store.create(fresh(NAME, 1000))
    await store.close()


async def test_readers_never_see_a_torn_instance(tmp_path: Path) -> None:
    """A writer claims slots of a capacity-1000 Instance (compacting every third write,
    changing the capacity every 100 claims), while two processes read it with ``get()`` and one with
    ``read_state_dir`` (``akri status``): no view is a mix of two writes, none is refused as
    corrupt."""
    state = tmp_path / "state"
    await create(state)
    writer, *readers = await race(state, "writer", "get", "get", "status")
    assert len(writer["writes"]) > 16, writer  # compactions happened
    for report in readers:
        assert report["views"] > 0, report
        assert (report["torn"], report["corrupt"]) == (0, 0), report


def granted_twice(writes: list[list[int | None]], accepted: list[list[int]]) -> list[int]:
    """The slots an accepted write took while the writer held them: granted since its last
    reset before that write."""
    twice = []
    for rv, *slots in accepted:
        held: set[int] = set()
        for version, slot in writes:
            assert version is not None
            if version > rv:
                break
            if slot is None:
                held.clear()
            else:
                held.add(slot)
        twice.extend(sorted(held.intersection(slots)))
    return twice


async def test_no_update_decided_on_a_torn_view_is_accepted(tmp_path: Path) -> None:
    """The double grant: beside the writer, a process re-reads the Instance with ``get()`` (as
    ``cas_update`` does after a conflict) and claims any free slot that lies among held ones,
    which only a torn view shows (the writer's states hold the top k slots). Every write it
    makes is resourceVersion-checked: none may be accepted, and no slot is granted twice."""
    state = tmp_path / "state"
    await create(state)
    writer, claimer = await race(state, "writer", "gap-claimer")
    assert len(writer["writes"]) > 16 and claimer["reads"] > 0, (writer, claimer)
    twice = granted_twice(writer["writes"], claimer["accepted"])
    assert claimer["accepted"] == [], (
        f"{len(claimer['accepted'])} of {claimer['attempts']} writes from torn views accepted "
        f"(of {claimer['reads']} reads), {len(twice)} slots granted twice"
    )
