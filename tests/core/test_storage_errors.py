"""Atomic means atomic: short writes, full disks, read-only and failing file systems.

Non-root cases inject the failures into ``os.write``/``os.fsync`` (only for the agent's own
temp files); root-only cases use a real 256 KiB tmpfs filled to the brim and a read-only bind
remount, as the review did (they skip with a reason elsewhere; CI runs as root).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.core.ledger.decisions import Owner
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.store import files
from agent.core.store.base import StorageError, StoreUnavailableError
from agent.core.store.files import TMP_PREFIX, atomic_write_bytes, atomic_write_json
from agent.core.store.local import (
    COUNTER_FILE,
    LocalInstanceStore,
    instance_path,
    load_instance_file,
)

REAL_WRITE = os.write
REAL_FSYNC = os.fsync


def _is_temp(fd: int) -> bool:
    try:
        return TMP_PREFIX in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False


def _temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob(f"{TMP_PREFIX}*")]


def make(name: str = "cfg-abcdef", capacity: int = 4) -> Instance:
    return Instance(
        name=name,
        configuration_name="cfg",
        capacity=capacity,
        nodes=("n1",),
        device_usage={f"{name}-{i}": "" for i in range(capacity)},
    )


# -- injected failures (any user) ---------------------------------------------------------------
def test_short_writes_are_completed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def dribble(fd: int, data: bytes | memoryview) -> int:
        if not _is_temp(fd):
            return REAL_WRITE(fd, data)
        calls.append(len(data))
        return REAL_WRITE(fd, bytes(data[:7]))  # a short write, as a signal or full disk gives

    monkeypatch.setattr(os, "write", dribble)
    target = tmp_path / "state.json"
    payload = {"key": "x" * 100, "n": list(range(20))}
    atomic_write_json(target, payload)
    monkeypatch.undo()
    assert len(calls) > 10  # it really was written in pieces
    assert files.read_json(target) == payload


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param(errno.ENOSPC, id="ENOSPC"),
        pytest.param(errno.EDQUOT, id="EDQUOT"),
        pytest.param(errno.EIO, id="EIO"),
        pytest.param(0, id="no-progress"),
    ],
)
def test_a_failed_write_leaves_the_old_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failure: int
) -> None:
    target = tmp_path / "state.json"
    atomic_write_json(target, {"old": True})
    written = []

    def fill_up(fd: int, data: bytes | memoryview) -> int:
        if not _is_temp(fd):
            return REAL_WRITE(fd, data)
        if not written:
            written.append(1)
            return REAL_WRITE(fd, bytes(data[:5]))  # part of it fits
        if failure == 0:
            return 0
        raise OSError(failure, os.strerror(failure))

    monkeypatch.setattr(os, "write", fill_up)
    with pytest.raises(StorageError) as caught:
        atomic_write_json(target, {"new": "x" * 1000})
    monkeypatch.undo()
    assert isinstance(caught.value, StoreUnavailableError)
    assert caught.value.path == str(target)
    expected = errno.errorcode[failure or errno.ENOSPC]
    assert expected in str(caught.value) and str(target) in str(caught.value)
    assert files.read_json(target) == {"old": True}
    assert _temp_files(tmp_path) == []  # the partial temp file does not hold the space


def test_a_failed_fsync_leaves_the_old_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    target = tmp_path / "state.json"
    atomic_write_bytes(target, b"old\n")

    def failing_fsync(fd: int) -> None:
        if _is_temp(fd):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        REAL_FSYNC(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StorageError, match="EIO"):
        atomic_write_bytes(target, b"new\n")
    monkeypatch.undo()
    assert target.read_bytes() == b"old\n"
    assert _temp_files(tmp_path) == []


async def test_store_refuses_then_recovers_without_restart(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A claim on a full disk is refused with a StorageError, the cache and the file keep the
    old version, and the same claim succeeds once space returns (same store, no restart)."""
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    try:
        ledger = SlotLedger(store, "n1")
        created = await store.create(make())
        full = [True]

        def maybe_full(fd: int, data: bytes | memoryview) -> int:
            # the Instance's temp file or its slot journal: whichever records the claim
            if full[0] and "cfg-abcdef" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return REAL_WRITE(fd, data)

        monkeypatch.setattr(os, "write", maybe_full)
        slot = "cfg-abcdef-1"
        with pytest.raises(StorageError, match="No space left on device"):
            await ledger.claim(created.key, slot, Owner.instance_level("n1"))
        path = instance_path(tmp_path / "state" / "instances", created.key)
        assert load_instance_file(path) == created  # the old file, whole
        assert store.get_cached(created.key) == created  # nothing granted in memory either
        assert _temp_files(tmp_path) == []
        full[0] = False
        result = await ledger.claim(created.key, slot, Owner.instance_level("n1"))
        assert result.changed and result.instance.device_usage[slot] == "n1"
        assert load_instance_file(path).device_usage[slot] == "n1"
    finally:
        await store.close()


async def test_counter_write_failure_writes_no_object(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    try:
        created = await store.create(make())

        def no_counter(fd: int, data: bytes | memoryview) -> int:
            if _is_temp(fd) and COUNTER_FILE in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return REAL_WRITE(fd, data)

        monkeypatch.setattr(os, "write", no_counter)
        with pytest.raises(StorageError, match=COUNTER_FILE):
            await store.update(created.evolve(nodes=("n1", "n2")))
        monkeypatch.undo()
        assert (await store.get(created.key)) == created
    finally:
        await store.close()


# -- real file systems (root) ------------------------------------------------------------------
def _mount_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs / remount read-only"
    return None


root_only = pytest.mark.skipif(_mount_problem() is not None, reason=_mount_problem() or "")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mountpoint = tmp_path / "tmpfs"
    mountpoint.mkdir()
    try:
        _run("mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mountpoint))
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot mount a tmpfs here: {error}")
    try:
        yield mountpoint
    finally:
        _run("umount", "-l", str(mountpoint))


def _fill(directory: Path) -> list[Path]:
    """Fill the file system with 4 KiB files until it is full; returns them."""
    chunks: list[Path] = []
    while True:
        chunk = directory / f"filler-{len(chunks)}"
        try:
            with chunk.open("wb") as handle:
                handle.write(b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
            chunk.unlink(missing_ok=True)
            return chunks
        chunks.append(chunk)


def _free(chunks: list[Path], count: int | None = None) -> None:
    for chunk in chunks[: count if count is not None else len(chunks)]:
        chunk.unlink()
    del chunks[: count if count is not None else len(chunks)]


@root_only
async def test_full_tmpfs_refuses_grants_and_recovers(tmpfs: Path) -> None:
    """The review's scenario: Allocates on a nearly full 256 KiB tmpfs. The claim that does
    not fit is refused (nothing granted), the Instance file stays whole JSON, and once space
    returns the same store grants it and a restart finds it."""
    state = tmpfs / "state"
    store = LocalInstanceStore(state, poll_interval=0.05)
    await store.start()
    ledger = SlotLedger(store, "n1")
    owner = Owner.instance_level("n1")
    # ~8 KiB of JSON: more than the one page left free below
    created = await store.create(make(capacity=400))
    path = instance_path(state / "instances", created.key)
    assert path.stat().st_size > 4096
    chunks = _fill(tmpfs)
    _free(chunks, 1)  # one page free: the temp file is cut off part-way
    granted: list[str] = []
    refused: StorageError | None = None
    try:
        for index in range(10):
            slot = f"cfg-abcdef-{index}"
            try:
                await ledger.claim(created.key, slot, owner)
            except StorageError as error:
                refused = error
                break
            granted.append(slot)
        assert refused is not None, "a claim that cannot be recorded was granted"
        assert refused.errno == errno.ENOSPC
        on_disk = load_instance_file(path)  # whole, valid JSON
        held = sorted(s for s, v in on_disk.device_usage.items() if v)
        assert held == sorted(granted)  # every grant recorded, nothing else
        cached = store.get_cached(created.key)
        assert cached is not None and cached.device_usage == on_disk.device_usage
        assert _temp_files(state) == []
        _free(chunks)  # space returns
        slot = f"cfg-abcdef-{len(granted)}"
        await ledger.claim(created.key, slot, owner)
        granted.append(slot)
    finally:
        await store.close()
    restarted = LocalInstanceStore(state, poll_interval=0.05)
    await restarted.start()
    try:
        again = restarted.get_cached(created.key)
        assert again is not None
        assert sorted(s for s, v in again.device_usage.items() if v) == sorted(granted)
    finally:
        await restarted.close()


@root_only
async def test_completely_full_tmpfs_fails_on_the_counter(tmpfs: Path) -> None:
    state = tmpfs / "state"
    store = LocalInstanceStore(state, poll_interval=0.05)
    await store.start()
    try:
        created = await store.create(make())
        chunks = _fill(tmpfs)
        with pytest.raises(StorageError) as caught:
            await store.update(created.evolve(nodes=("n1", "n2")))
        assert caught.value.errno == errno.ENOSPC
        assert load_instance_file(instance_path(state / "instances", created.key)) == created
        _free(chunks)
        updated = await store.update(created.evolve(nodes=("n1", "n2")))
        assert updated.nodes == ("n1", "n2")
    finally:
        await store.close()


@pytest.fixture
def read_only_switch(tmp_path: Path) -> Iterator[Callable[[bool], None]]:
    """A directory bind-mounted on itself, and a switch that remounts it read-only or back."""
    directory = tmp_path / "bound"
    directory.mkdir()
    try:
        _run("mount", "--bind", str(directory), str(directory))
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot bind-mount here: {error}")

    def switch(read_only: bool) -> None:
        mode = "ro" if read_only else "rw"
        _run("mount", "-o", f"remount,{mode},bind", str(directory))

    try:
        yield switch
    finally:
        _run("umount", "-l", str(directory))


@root_only
async def test_read_only_state_dir_refuses_then_recovers(
    tmp_path: Path, read_only_switch: Callable[[bool], None]
) -> None:
    state = tmp_path / "bound" / "state"
    store = LocalInstanceStore(state, poll_interval=0.05)
    await store.start()
    try:
        ledger = SlotLedger(store, "n1")
        created = await store.create(make())
        owner = Owner.instance_level("n1")
        read_only_switch(True)
        with pytest.raises(StorageError) as caught:
            await ledger.claim(created.key, "cfg-abcdef-0", owner)
        assert caught.value.errno == errno.EROFS
        assert "Read-only file system (EROFS)" in str(caught.value)
        with pytest.raises(StorageError):
            await store.delete(created.key)
        assert store.get_cached(created.key) == created
        read_only_switch(False)
        result = await ledger.claim(created.key, "cfg-abcdef-0", owner)
        assert result.changed
    finally:
        await store.close()
