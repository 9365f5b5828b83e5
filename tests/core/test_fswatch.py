"""DirectoryWatch: inotify wake-ups for the names asked for, polling where it cannot watch."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from agent.core.aio import fswatch
from agent.core.aio.fswatch import DirectoryWatch


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
