"""The local backend's slot journal (issue 27): a claim or release appends one line instead of
rewriting the Instance, and the state stays what the API server's semantics say it is —
compare-and-swap on resourceVersion, versions never reused, several processes on one state
directory under the flock, and crash safety under ``kill -9`` at any byte."""

from __future__ import annotations

import asyncio
import errno
import json
import multiprocessing
import os
import random
import signal
import sys
from pathlib import Path

import pytest

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store import journal
from agent.core.store.base import ConflictError, CorruptStateError, StorageError
from agent.core.store.local import LocalInstanceStore, load_instance_file, read_state_dir
from tests.paths import REPO

NAME = "cfg-abcdef"
KEY = ObjectKey("default", NAME)


def make(capacity: int = 8) -> Instance:
    return Instance(
        name=NAME,
        configuration_name="cfg",
        capacity=capacity,
        nodes=("n1",),
        shared=True,
        device_usage={f"{NAME}-{i}": "" for i in range(capacity)},
    )


def paths(state: Path) -> tuple[Path, Path]:
    base = state / "instances" / f"{NAME}.json"
    return base, journal.journal_path(base)


async def claim(store: LocalInstanceStore, slot: int, value: str = "n1") -> Instance:
    current = await store.get(KEY)
    usage = {**current.device_usage, f"{NAME}-{slot}": value}
    return await store.update(current.evolve(device_usage=usage))


@pytest.fixture
async def store(tmp_path: Path) -> LocalInstanceStore:
    s = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await s.start()
    yield s  # type: ignore[misc]
    await s.close()


async def test_a_claim_appends_a_line_and_leaves_the_file(
    store: LocalInstanceStore, tmp_path: Path
) -> None:
    created = await store.create(make())
    base, log = paths(tmp_path / "state")
    before = base.read_bytes()
    first = await claim(store, 3)
    second = await claim(store, 5, "C:0:n1")
    assert base.read_bytes() == before  # the Instance file was not rewritten
    lines = log.read_bytes().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"rv": first.resource_version, "u": {f"{NAME}-3": "n1"}},
        {"rv": second.resource_version, "u": {f"{NAME}-5": "C:0:n1"}},
    ]
    assert int(created.resource_version or 0) < int(first.resource_version or 0)
    assert int(first.resource_version or 0) < int(second.resource_version or 0)
    # what every reader sees: the file with the journal applied
    for seen in (
        await store.get(KEY),
        load_instance_file(base),
        read_state_dir(store.state_dir)[0],
    ):
        assert seen.resource_version == second.resource_version
        assert seen.device_usage[f"{NAME}-3"] == "n1"
        assert seen.device_usage[f"{NAME}-5"] == "C:0:n1"


async def test_compare_and_swap_holds_across_journal_writes(store: LocalInstanceStore) -> None:
    await store.create(make())
    stale = await store.get(KEY)
    await claim(store, 1)
    usage = {**stale.device_usage, f"{NAME}-2": "n1"}
    with pytest.raises(ConflictError):
        await store.update(stale.evolve(device_usage=usage))
    assert (await store.get(KEY)).device_usage[f"{NAME}-2"] == ""


async def test_any_other_change_rewrites_the_file_and_folds_the_journal(
    store: LocalInstanceStore, tmp_path: Path
) -> None:
    await store.create(make())
    base, log = paths(tmp_path / "state")
    await claim(store, 0)
    assert log.exists()
    current = await store.get(KEY)
    moved = await store.update(current.evolve(nodes=("n1", "n2")))
    assert not log.exists()
    on_disk = json.loads(base.read_text())
    assert on_disk["metadata"]["resourceVersion"] == moved.resource_version
    assert on_disk["spec"]["deviceUsage"][f"{NAME}-0"] == "n1"


async def test_the_journal_is_compacted(
    store: LocalInstanceStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal, "COMPACT_AFTER", 3)
    await store.create(make())
    base, log = paths(tmp_path / "state")
    for slot in range(3):
        await claim(store, slot)
    assert len(log.read_bytes().splitlines()) == 3
    fourth = await claim(store, 3)  # the journal is full: the file is rewritten instead
    assert not log.exists()
    on_disk = load_instance_file(base)
    assert on_disk.resource_version == fourth.resource_version
    assert [on_disk.device_usage[f"{NAME}-{i}"] for i in range(5)] == ["n1"] * 4 + [""]


async def test_records_at_or_below_the_file_s_version_are_skipped(tmp_path: Path) -> None:
    # a compaction killed after it wrote the file and before it removed the journal
    state = tmp_path / "state"
    store = LocalInstanceStore(state)
    await store.start()
    await store.create(make())
    await claim(store, 0)
    _, log = paths(state)
    old_journal = log.read_bytes()
    current = await store.get(KEY)
    folded = await store.update(current.evolve(nodes=("n1", "n2")))
    released = {**folded.device_usage, f"{NAME}-0": ""}
    await store.update(folded.evolve(device_usage=released, nodes=("n1", "n3")))
    await store.close()
    log.write_bytes(old_journal)  # its record says slot 0 is held: older than the file
    again = LocalInstanceStore(state)
    await again.start()
    assert (await again.get(KEY)).device_usage[f"{NAME}-0"] == ""
    await again.close()


def test_a_journal_cut_at_any_byte_reads_as_its_complete_lines(tmp_path: Path) -> None:
    """``kill -9`` during an append, at every byte: the records whose newline is on disk
    count, the rest does not, and the next append cuts the torn tail off."""
    base = tmp_path / f"{NAME}.json"
    records = [journal.record_line(str(10 + i), {f"{NAME}-{i}": "n1"}) for i in range(3)]
    whole = b"".join(records)
    ends = [sum(len(r) for r in records[: i + 1]) for i in range(len(records))]
    for cut in range(len(whole) + 1):
        data = whole[:cut]
        parsed = journal.parse(data, "j")
        complete = sum(1 for end in ends if end <= cut)
        assert [v for v, _ in parsed.records] == [10 + i for i in range(complete)], cut
        assert parsed.length == (ends[complete - 1] if complete else 0)
        log = journal.journal_path(base)
        log.write_bytes(data)
        journal.append(base, journal.read(base), journal.record_line("99", {"x": "y"}))
        after = journal.read(base)
        assert [v for v, _ in after.records] == [*(10 + i for i in range(complete)), 99], cut
        assert log.read_bytes().endswith(b'{"rv":"99","u":{"x":"y"}}\n')


async def test_a_damaged_line_stops_the_start_naming_the_journal(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = LocalInstanceStore(state)
    await store.start()
    await store.create(make())
    await claim(store, 0)
    await claim(store, 1)
    await store.close()
    _, log = paths(state)
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(lines[0] + b'{"rv": "x"}\n' + lines[1])
    with pytest.raises(CorruptStateError, match=r"\.journal"):
        await LocalInstanceStore(state).start()


async def test_an_orphan_journal_is_removed_at_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = LocalInstanceStore(state)
    await store.start()
    await store.create(make())
    await claim(store, 0)
    base, log = paths(state)
    await store.close()
    base.unlink()  # a delete killed between the file and its journal
    again = LocalInstanceStore(state)
    await again.start()
    assert not log.exists()
    assert again.list_cached() == []
    await again.close()


async def test_a_failed_append_grants_nothing_and_leaves_the_journal(
    store: LocalInstanceStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.create(make())
    held = await claim(store, 0)
    _, log = paths(tmp_path / "state")
    before = log.read_bytes()
    real_write = os.write

    def half_then_full(fd: int, data: bytes | memoryview) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(journal.SUFFIX):
            if len(data) > 4:
                return real_write(fd, bytes(data)[:4])  # a short write ...
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # ... then a full disk
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(StorageError):
        await claim(store, 1)
    monkeypatch.undo()
    assert log.read_bytes() == before  # cut back: no torn line left behind
    current = await store.get(KEY)
    assert current.resource_version == held.resource_version
    assert current.device_usage[f"{NAME}-1"] == ""
    assert (await claim(store, 1)).device_usage[f"{NAME}-1"] == "n1"  # works once space is back


async def test_another_store_on_the_directory_sees_journal_writes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    a, b = (
        LocalInstanceStore(state, poll_interval=0.05),
        LocalInstanceStore(state, poll_interval=0.05),
    )
    await a.start()
    await b.start()
    try:
        await a.create(make())
        events = b.subscribe_instances()
        written = await claim(a, 4)
        async with asyncio.timeout(30):  # inotify wakes it within milliseconds
            async for event in events:
                seen = event.instance
                if seen.resource_version == written.resource_version:
                    break
        events.close()
        assert seen.device_usage[f"{NAME}-4"] == "n1"
    finally:
        await a.close()
        await b.close()


def _claim_distinct(state: str, worker: int, slots: list[int]) -> None:
    """Child process: claim its own slots of one Instance, each a CAS write with retries."""

    async def run() -> None:
        store = LocalInstanceStore(Path(state), poll_interval=10)
        await store.start()
        for slot in slots:
            while True:
                current = await store.get(KEY)
                assert current.device_usage[f"{NAME}-{slot}"] == ""
                usage = {**current.device_usage, f"{NAME}-{slot}": f"w{worker}"}
                try:
                    await store.update(current.evolve(device_usage=usage))
                    break
                except ConflictError:
                    continue
        await store.close()

    asyncio.run(run())


async def test_processes_sharing_the_directory_never_lose_a_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    store = LocalInstanceStore(state)
    await store.start()
    await store.create(make(capacity=60))
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=_claim_distinct, args=(str(state), w, list(range(w, 60, 4))))
        for w in range(4)
    ]
    for process in workers:
        process.start()
    await asyncio.to_thread(lambda: [p.join(120) for p in workers])
    assert all(p.exitcode == 0 for p in workers)
    final = await store.get(KEY)
    assert final.device_usage == {f"{NAME}-{i}": f"w{i % 4}" for i in range(60)}
    await store.close()


CLAIMER = """
import asyncio, sys
from pathlib import Path
from agent.core.model.keys import ObjectKey
from agent.core.store.local import LocalInstanceStore

async def main() -> None:
    store = LocalInstanceStore(Path(sys.argv[1]), poll_interval=10)
    await store.start()
    key = ObjectKey("default", sys.argv[2])
    for slot in range(int(sys.argv[3]), int(sys.argv[4])):
        current = await store.get(key)
        usage = {**current.device_usage, f"{key.name}-{slot}": "n1"}
        stored = await store.update(current.evolve(device_usage=usage))
        print(slot, stored.resource_version, flush=True)  # reported only once durable

asyncio.run(main())
"""


async def test_kill_9_at_random_points_loses_no_reported_claim(tmp_path: Path) -> None:
    """A claimer process killed with SIGKILL at random moments, again and again: after each
    kill the state loads, every claim it reported is there, versions only grow, and a slot is
    held only if a claim of it was at least started."""
    state = tmp_path / "state"
    store = LocalInstanceStore(state)
    await store.start()
    await store.create(make(capacity=400))
    await store.close()
    rng = random.Random(27)
    next_slot, last_version = 0, 0
    script = tmp_path / "claimer.py"
    script.write_text(CLAIMER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(8):
        if next_slot >= 390:
            break
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), str(state), NAME, str(next_slot), "400",
            stdout=asyncio.subprocess.PIPE, env=env, cwd=tmp_path,
        )  # fmt: skip
        assert proc.stdout is not None
        reported: list[tuple[int, int]] = []
        wanted = rng.randint(1, 40)  # kill after this many reports, mid-way into the next
        async with asyncio.timeout(120):
            while len(reported) < wanted:
                line = await proc.stdout.readline()
                if not line.endswith(b"\n"):  # the end, or a line cut by a kill: no report
                    break
                slot, version = line.split()
                reported.append((int(slot), int(version)))
        await asyncio.sleep(rng.random() * 0.004)
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        # what it printed before the kill and we had not read yet was reported too
        # (a last line the kill cut short was never a report: print writes its pieces apart)
        rest = await proc.stdout.read()
        for line in rest.split(b"\n")[:-1]:
            slot, version = line.split()
            reported.append((int(slot), int(version)))
        loaded = {i.name: i for i in read_state_dir(state)}[NAME]  # never torn, never refused
        held = {int(s.rsplit("-", 1)[1]) for s, v in loaded.device_usage.items() if v}
        for slot, version in reported:
            assert slot in held, (slot, sorted(held))
            assert version > last_version
            last_version = version
        assert int(loaded.resource_version or 0) >= last_version
        # at most the one claim in flight at the kill is there without a report
        assert held <= set(range(next_slot + len(reported) + 1)) | set(range(next_slot))
        next_slot = max(held, default=-1) + 1
        last_version = int(loaded.resource_version or 0)
    assert next_slot > 0
    restarted = LocalInstanceStore(state)
    await restarted.start()  # the store itself starts on what the kills left
    created = await restarted.create(make().evolve(name="cfg-fedcba", device_usage={}))
    assert int(created.resource_version or 0) > last_version  # no version reused
    await restarted.close()


async def test_a_stale_claim_after_another_process_wrote_is_a_conflict(tmp_path: Path) -> None:
    """The writer reuses what its own last write left (no re-read of 1,000 slots) only while
    nobody else wrote: two stores claim the same slot from the same version, the second gets a
    conflict, not a double allocation."""
    state = tmp_path / "state"
    a, b = LocalInstanceStore(state, poll_interval=10), LocalInstanceStore(state, poll_interval=10)
    await a.start()
    await b.start()
    try:
        await a.create(make())
        mine = await claim(a, 0)  # a remembers what it wrote
        theirs = await b.get(KEY)
        await b.update(theirs.evolve(device_usage={**theirs.device_usage, f"{NAME}-1": "n2"}))
        with pytest.raises(ConflictError):  # a's view (its own last write) is stale now
            await a.update(mine.evolve(device_usage={**mine.device_usage, f"{NAME}-1": "n1"}))
        final = await a.get(KEY)
        assert final.device_usage[f"{NAME}-1"] == "n2" and final.device_usage[f"{NAME}-0"] == "n1"
        again = await claim(a, 2)  # and a claim on the fresh version goes through
        assert again.device_usage[f"{NAME}-1"] == "n2"
    finally:
        await a.close()
        await b.close()
