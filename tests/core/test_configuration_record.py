"""Local mode: what the API server would keep about a Configuration survives restarts.

Issue 23, item 6: two files defining the same Configuration — the one that was there first
keeps it, also after a restart (before, the first file in path order took it over, so the
running definition changed under its pods). Item 7c: a Configuration's creationTimestamp
decides which namespace owns a contested name; it was only in memory, so after a restart both
namespaces got the same time and the owner could move (its Instances then started draining).
Both are recorded in ``STATE_DIR/configurations.json``.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.core.model.instance import Instance
from agent.core.store import config_files
from agent.core.store.base import CorruptStateError
from agent.core.store.local import CONFIGURATIONS_FILE, LocalInstanceStore
from agent.node.discovery.ownership import Ownership
from tests.harness.k8s_nodes import debug_echo_configuration

REAL_WRITE = os.write


def configuration(namespace: str, capacity: int) -> dict[str, Any]:
    document = debug_echo_configuration("cam", ("foo0",), capacity)
    document["metadata"]["namespace"] = namespace
    return document


class Clock:
    """``config_files._now``, moved by hand (creation times have whole seconds)."""

    def __init__(self) -> None:
        self.now = "2026-01-01T00:00:00Z"

    def __call__(self) -> str:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    fake = Clock()
    monkeypatch.setattr(config_files, "_now", fake)
    yield fake


async def started(state: Path, configs: Path) -> LocalInstanceStore:
    store = LocalInstanceStore(state, [configs], poll_interval=0.05)
    await store.start()
    return store


async def test_the_owning_file_keeps_a_duplicate_across_restarts(
    tmp_path: Path, clock: Clock
) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    state = tmp_path / "state"
    (configs / "b.yaml").write_text(yaml.safe_dump(configuration("default", 2)))
    store = await started(state, configs)
    try:
        # a.yaml (first in path order) defines it too, later: b.yaml keeps it
        (configs / "a.yaml").write_text(yaml.safe_dump(configuration("default", 3)))
        store._config_files.scan()
        store._config_files.scan()  # applied once two looks agree
        (running,) = store.configurations()
        assert running.capacity == 2
    finally:
        await store.close()
    restarted = await started(state, configs)
    try:
        (running,) = restarted.configurations()
        assert running.capacity == 2  # still b.yaml's, not the first file in path order
        recorded = json.loads((state / CONFIGURATIONS_FILE).read_text())
        assert recorded["configurations"]["default/cam"]["file"] == str(
            (configs / "b.yaml").resolve()
        )
        # b.yaml drops it: a.yaml takes over, and keeps it after the next restart
        (configs / "b.yaml").write_text("")
        restarted._config_files.scan()
        restarted._config_files.scan()
        (running,) = restarted.configurations()
        assert running.capacity == 3
    finally:
        await restarted.close()
    again = await started(state, configs)
    try:
        (configs / "b.yaml").write_text(yaml.safe_dump(configuration("default", 2)))
        again._config_files.scan()
        again._config_files.scan()
        (running,) = again.configurations()
        assert running.capacity == 3
    finally:
        await again.close()


async def test_a_contested_name_keeps_its_owner_across_restarts(
    tmp_path: Path, clock: Clock
) -> None:
    """Namespace ``zz`` configured ``cam`` first, ``aa`` a minute later; both have Instances
    (``aa``'s still draining), so the older Configuration owns the name. After a restart the
    owner must still be ``zz`` (before: both got the restart's time, and ``aa`` won the tie)."""
    configs = tmp_path / "configs"
    configs.mkdir()
    state = tmp_path / "state"
    (configs / "zz.yaml").write_text(yaml.safe_dump(configuration("zz", 1)))
    store = await started(state, configs)
    try:
        clock.now = "2026-01-01T00:01:00Z"
        (configs / "aa.yaml").write_text(yaml.safe_dump(configuration("aa", 1)))
        store._config_files.scan()
        store._config_files.scan()
        for namespace, name in (("zz", "cam-aaaaaa"), ("aa", "cam-bbbbbb")):
            await store.create(
                Instance(
                    name=name,
                    namespace=namespace,
                    configuration_name="cam",
                    capacity=1,
                    nodes=("n1",),
                    device_usage={f"{name}-0": "n1"},
                )
            )
        assert Ownership(store).owner("cam") == "zz"
    finally:
        await store.close()
    clock.now = "2026-01-01T05:00:00Z"  # the restart
    restarted = await started(state, configs)
    try:
        created = {c.key.namespace: c.creation_timestamp for c in restarted.configurations()}
        assert created == {"zz": "2026-01-01T00:00:00Z", "aa": "2026-01-01T00:01:00Z"}
        assert Ownership(restarted).owner("cam") == "zz"
    finally:
        await restarted.close()


async def test_a_record_that_cannot_be_written_is_retried(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    state = tmp_path / "state"
    full = [True]

    def write(fd: int, data: bytes | memoryview) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if full[0] and CONFIGURATIONS_FILE in target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return REAL_WRITE(fd, data)

    monkeypatch.setattr(os, "write", write)
    (configs / "b.yaml").write_text(yaml.safe_dump(configuration("default", 2)))
    store = await started(state, configs)
    try:
        assert [c.capacity for c in store.configurations()] == [2]  # running regardless
        assert not (state / CONFIGURATIONS_FILE).exists()
        full[0] = False
        store._config_files.scan()  # the next scan writes it
        assert (
            "default/cam" in json.loads((state / CONFIGURATIONS_FILE).read_text())["configurations"]
        )
    finally:
        await store.close()


@pytest.mark.parametrize(
    "content",
    [
        b"{",
        b"[]",
        b'{"version": 1, "configurations": {"cam": {}}}',
        b'{"version": 1, "configurations": {"default/cam": {"file": "/x", '
        b'"creationTimestamp": 5}}}',
    ],
)
async def test_a_broken_record_stops_the_start(tmp_path: Path, content: bytes) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / CONFIGURATIONS_FILE).write_bytes(content)
    store = LocalInstanceStore(state, [], poll_interval=0.05)
    with pytest.raises(CorruptStateError, match=CONFIGURATIONS_FILE):
        await store.start()
    await store.close()
