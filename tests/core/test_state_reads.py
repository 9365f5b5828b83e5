"""How readers of the local store take the state directory's lock (issue 34.1-2): shared, from
a read-only descriptor (a user who cannot write the state dir, a read-only mount), never
creating the lock file, waiting for a write in progress off the event loop, and validating
the read where no lock file can be opened. tests/core/test_torn_reads.py races real
processes; these pin down each case."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent import cli
from agent.core.model.keys import ObjectKey
from agent.core.store import consistent_read, journal
from agent.core.store.files import atomic_write_json
from agent.core.store.local import LOCK_FILE, LocalInstanceStore, read_state_dir
from tests.core.state_racers import fresh
from tests.paths import REPO

NAME = "cam-abcdef"
KEY = ObjectKey("default", NAME)
AKRI = [sys.executable, "-c", "import sys; from agent.cli import main; sys.exit(main())"]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setpriv, mount)")


async def make_state(state: Path, capacity: int = 4) -> LocalInstanceStore:
    store = LocalInstanceStore(state, poll_interval=3600)
    await store.start()
    created = await store.create(fresh(NAME, capacity))
    await store.update(created.evolve(device_usage={**created.device_usage, f"{NAME}-1": "n1"}))
    return store


@contextlib.contextmanager
def world_readable_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path is root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="akri-reads-", dir="/tmp"))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def held_exclusive(lock_file: Path) -> Iterator[int]:
    """The state directory's lock as a writer holds it during a write."""
    fd = os.open(lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def waiting_readers(pid: int) -> int:
    """How many shared flock requests of process ``pid`` are blocked (``/proc/locks`` marks a
    waiting request with ``->``)."""
    count = 0
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields and "READ" in fields and str(pid) in fields:
            count += 1
    return count


async def eventually(check: Callable[[], bool], within: float, what: str) -> None:
    """Poll ``check`` until it holds (a generous bound: a loaded machine is slow, and a
    passing check returns as soon as it holds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if check():
            return
        if loop.time() > deadline:
            raise AssertionError(f"not reached within {within}s: {what}")
        await asyncio.sleep(0.01)


@root_only
async def test_status_by_a_user_who_cannot_write_takes_the_lock_and_waits() -> None:
    """``akri status`` run by a user who cannot open the lock file for writing still takes
    the lock (shared, read-only descriptor): while a writer holds it, the status waits, and
    prints the state once the write is done."""
    with world_readable_dir() as top:
        state = top / "state"
        store = await make_state(state)
        await store.close()
        with held_exclusive(state / LOCK_FILE):
            proc = await asyncio.create_subprocess_exec(
                *NOBODY, *AKRI, "status", "--state-dir", str(state),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=top,
            )  # fmt: skip
            await eventually(lambda: waiting_readers(proc.pid) > 0, 60, "status waits for the lock")
            assert proc.returncode is None  # blocked, not failed
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert NAME in out.decode() and "1=n1" in out.decode()


@root_only
@pytest.mark.parametrize("lock_file", [True, False], ids=["with-lock-file", "no-lock-file"])
def test_status_reads_a_state_dir_on_a_read_only_mount(lock_file: bool) -> None:
    """A state directory on a read-only mount is read (under the lock when its file is there,
    validated when it is not), and the reader creates no lock file."""
    with world_readable_dir() as top:
        state = top / "state"
        store = asyncio.run(make_state(state))
        asyncio.run(store.close())
        if not lock_file:
            (state / LOCK_FILE).unlink()
        script = (
            f"mount --bind {top} {top} && mount -o remount,ro,bind {top} && "
            f"{' '.join(AKRI[:2])} '{AKRI[2]}' status --state-dir {state}"
        )
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=top,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert NAME in done.stdout and "1=n1" in done.stdout
        assert (state / LOCK_FILE).exists() == lock_file


async def test_get_waits_for_a_write_in_progress_off_the_loop(tmp_path: Path) -> None:
    """``get()`` reads on the loop when no writer holds the lock; while one does, it waits in
    a worker thread: the loop runs on (this test polls from it) and the read returns what the
    write left once the lock is released."""
    store = await make_state(tmp_path / "state")
    expected = await store.get(KEY)
    fd = os.open(tmp_path / "state" / LOCK_FILE, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # a safety net: should get() block the loop, the lock still goes (and the test fails)
    net = threading.Timer(90, lambda: fcntl.flock(fd, fcntl.LOCK_UN))
    net.start()
    try:
        reading = asyncio.create_task(store.get(KEY))
        await eventually(lambda: waiting_readers(os.getpid()) > 0, 60, "get waits in a thread")
        assert not reading.done()
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert await reading == expected
    finally:
        net.cancel()
        os.close(fd)
        await store.close()


async def test_a_read_without_a_lock_file_is_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no lock file can be opened, a read whose file was replaced between the reads of
    the file and of the journal (a compaction, then a new claim) is read again: the view is
    the state after those writes, not the old file with the newer journal."""
    state = tmp_path / "state"
    store = await make_state(state, capacity=4)
    await store.close()
    (state / LOCK_FILE).unlink()
    path = state / "instances" / f"{NAME}.json"
    before = read_state_dir(state)[0]
    compacted = before.evolve(
        device_usage={**before.device_usage, f"{NAME}-2": "n2"},
        resource_version=str(int(before.resource_version or 0) + 1),
    )
    newest_rv = str(int(compacted.resource_version or 0) + 1)
    real_read = consistent_read._read
    interfered: list[Path] = []

    def read_with_writes_in_between(file: Path) -> bytes | None:
        if file.suffix == journal.SUFFIX and not interfered:
            interfered.append(file)  # another process compacts and claims right now
            atomic_write_json(path, compacted.to_dict())
            journal.remove(path)
            journal.append(path, journal.EMPTY, journal.record_line(newest_rv, {f"{NAME}-3": "n3"}))
        return real_read(file)

    monkeypatch.setattr(consistent_read, "_read", read_with_writes_in_between)
    [seen] = read_state_dir(state)
    assert interfered
    assert seen.resource_version == newest_rv
    assert seen.device_usage == {
        f"{NAME}-0": "", f"{NAME}-1": "n1", f"{NAME}-2": "n2", f"{NAME}-3": "n3"
    }  # fmt: skip
    assert not (state / LOCK_FILE).exists()  # a reader never makes the lock file


def test_status_says_so_when_an_unlocked_read_never_settles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a lock file, an Instance file replaced during every one of the bounded reads
    is a one-line message and exit 4 (unavailable), not a traceback nor "corrupt"."""
    state = tmp_path / "state"

    async def made() -> None:
        await (await make_state(state)).close()

    asyncio.run(made())
    (state / LOCK_FILE).unlink()
    real_read = consistent_read._read
    reads = iter(range(10**6))

    def always_replaced(file: Path) -> bytes | None:
        data = real_read(file)
        if file.suffix == ".json" and data is not None:
            return data + b" " * next(reads)  # another write each time
        return data

    monkeypatch.setattr(consistent_read, "_read", always_replaced)
    assert cli.main(["status", "--state-dir", str(state)]) == 4
    err = capsys.readouterr().err
    assert err.startswith("akri status: ") and "changed during each of 50 reads" in err
    assert len(err.splitlines()) == 1
