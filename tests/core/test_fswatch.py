"""DirectoryWatch: inotify wake-ups for the names asked for, polling where it cannot watch."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from agent.core.aio import fswatch
from agent.core.aio.fswatch import DirectoryWatch


@pytest.fixture(autouse=True)
def host_inotify(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from a fresh process's inotify state (a refusal met by an earlier
    test is remembered process-wide for minutes), on a host that can give one instance:
    ``fs.inotify.max_user_instances`` is per user, and other software (or other test runs
    on a shared machine) may have used it up, which no code of ours can change."""
    monkeypatch.setattr(fswatch, "_REFUSALS", fswatch._Refusals())
    monkeypatch.setattr(fswatch, "STATS", fswatch.InotifyStats())
    if fswatch._inotify_module is None:
        pytest.skip("asyncinotify is not importable here")
    try:
        fswatch._inotify_module.Inotify().close()
    except OSError as error:
        pytest.skip(
            f"this host gives no inotify instance now ({error}): its user's "
            "fs.inotify.max_user_instances is used up by other processes"
        )


async def test_a_created_socket_wakes_it_and_other_names_do_not(tmp_path: Path) -> None:
    watch = DirectoryWatch([tmp_path], fallback=3600, interesting=lambda n, _r: n.endswith(".sock"))
    try:
        assert await watch.changed(within=0.05) is False  # arms the watch; nothing yet
        assert watch.using_inotify
        waiter = asyncio.ensure_future(watch.changed())
        (tmp_path / "checkpoint").write_text("x")  # not interesting
        await asyncio.sleep(0.05)
        assert not waiter.done()
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(tmp_path / "kubelet.sock"))
        assert await asyncio.wait_for(waiter, 5) is True
        server.close()
        os.unlink(tmp_path / "kubelet.sock")
        assert await asyncio.wait_for(watch.changed(), 5) is True  # removal too
    finally:
        watch.close()


async def test_a_missing_directory_is_polled_until_it_exists(tmp_path: Path) -> None:
    later = tmp_path / "later"
    watch = DirectoryWatch([later], fallback=0.05)
    try:
        assert await watch.changed() is False  # the fallback period, not a change
        assert not watch.using_inotify
        later.mkdir()
        await watch.changed(within=0.05)
        assert watch.using_inotify
    finally:
        watch.close()


async def test_without_inotify_it_polls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fswatch, "_inotify_module", None)
    watch = DirectoryWatch([tmp_path], fallback=0.01)
    assert await watch.changed() is False and not watch.using_inotify
    watch.close()


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> fswatch.InotifyStats:
    """Module state as in a fresh process."""
    stats = fswatch.InotifyStats()
    monkeypatch.setattr(fswatch, "_REFUSALS", fswatch._Refusals())
    monkeypatch.setattr(fswatch, "STATS", stats)
    return stats


async def test_one_inotify_instance_serves_every_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_state: fswatch.InotifyStats
) -> None:
    """Before: one inotify instance per DirectoryWatch (three per agent), each a share of the
    user's fs.inotify.max_user_instances."""
    real = fswatch._inotify_module.Inotify
    opened: list[object] = []

    def counting() -> object:
        instance = real()
        opened.append(instance)
        return instance

    monkeypatch.setattr(fswatch._inotify_module, "Inotify", counting)
    dirs = [tmp_path / name for name in ("a", "b", "c")]
    for directory in dirs:
        directory.mkdir()
    watches = [DirectoryWatch([d], fallback=3600) for d in dirs]
    twice = DirectoryWatch([dirs[0]], fallback=3600)  # the same directory, another watch
    try:
        for watch in [*watches, twice]:
            watch.arm()
            assert watch.using_inotify
        assert len(opened) == 1 and fresh_state.instances_opened == 1
        waiters = [asyncio.ensure_future(w.changed()) for w in [*watches, twice]]
        (dirs[1] / "x").write_text("x")
        assert await asyncio.wait_for(waiters[1], 5) is True
        await asyncio.sleep(0.05)
        assert not any(w.done() for i, w in enumerate(waiters) if i != 1)
        (dirs[0] / "y").write_text("y")
        assert await asyncio.wait_for(waiters[0], 5) is True
        assert await asyncio.wait_for(waiters[3], 5) is True  # both watches of it hear it
        waiters[2].cancel()
    finally:
        for watch in [*watches, twice]:
            watch.close()


async def test_emfile_falls_back_to_polling_with_one_warning_and_retries_rarely(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_state: fswatch.InotifyStats,
) -> None:
    """inotify_init failing (the user's instances used up by other software): before, every
    changed() call tried again and logged a warning (10,682 lines in 3 minutes, 44 agents)."""
    import errno
    import logging

    real = fswatch._inotify_module.Inotify
    attempts: list[int] = []
    refuse = True

    def inotify_init() -> object:
        attempts.append(1)
        if refuse:
            raise OSError(errno.EMFILE, "Too many open files")
        return real()

    clock = [1000.0]
    monkeypatch.setattr(fswatch._inotify_module, "Inotify", inotify_init)
    monkeypatch.setattr(fswatch, "_now", lambda: clock[0])
    watches = [DirectoryWatch([tmp_path], fallback=0.001) for _ in range(3)]
    try:
        with caplog.at_level(logging.DEBUG, logger="agent.core.aio.fswatch"):
            for _ in range(50):
                for watch in watches:
                    assert await watch.changed() is False
                    assert not watch.using_inotify
            warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            assert "inotify unavailable" in warnings[0].getMessage()
            assert "EMFILE" in warnings[0].getMessage() or "Too many" in warnings[0].getMessage()
            assert len(attempts) == 1  # not retried within RETRY_INTERVAL
            assert fresh_state.fallbacks == {"instance": 1} and not fresh_state.available

            clock[0] += fswatch.RETRY_INTERVAL  # minutes later: tried again, quietly
            await watches[0].changed()
            assert len(attempts) == 2 and not watches[0].using_inotify
            assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1

            refuse = False  # the instances were given back
            clock[0] += fswatch.RETRY_INTERVAL
            for watch in watches:
                watch.arm()
                assert watch.using_inotify
            assert len(attempts) == 3 and fresh_state.available
            assert any("inotify works again" in r.getMessage() for r in caplog.records)
            waiter = asyncio.ensure_future(watches[2].changed())
            (tmp_path / "new").write_text("x")
            assert await asyncio.wait_for(waiter, 5) is True
    finally:
        for watch in watches:
            watch.close()


async def test_a_refused_watch_enospc_polls_with_one_warning(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_state: fswatch.InotifyStats,
) -> None:
    """max_user_watches reached: the directory is polled, one warning, counted."""
    import errno
    import logging

    def no_watch(self: object, path: object, mask: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fswatch._inotify_module.Inotify, "add_watch", no_watch)
    watch = DirectoryWatch([tmp_path], fallback=0.001)
    try:
        with caplog.at_level(logging.WARNING, logger="agent.core.aio.fswatch"):
            for _ in range(20):
                assert await watch.changed() is False
        assert len(caplog.records) == 1 and "watch" in caplog.records[0].getMessage()
        assert fresh_state.fallbacks == {"watch": 1}
    finally:
        watch.close()


def test_the_fallbacks_are_exported(fresh_state: fswatch.InotifyStats) -> None:
    from prometheus_client import generate_latest

    from agent.ops.metrics import registry_for

    fresh_state.fallbacks["instance"] = 2
    fresh_state.available = False
    text = generate_latest(registry_for()).decode()
    assert 'akri_inotify_fallbacks_total{kind="instance"} 2.0' in text
    assert 'akri_inotify_fallbacks_total{kind="watch"} 0.0' in text
    assert "akri_inotify_available 0.0" in text
