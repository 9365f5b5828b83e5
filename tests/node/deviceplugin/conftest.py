"""Fixtures of the device-plugin tests: a short temp dir (unix socket paths), the kubelet
double, an in-memory store and a factory of running DevicePluginManagers."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.ledger.ledger import SlotLedger
from agent.node.deviceplugin.manager import DevicePluginManager
from agent.node.discovery.ownership import Ownership, ServedInstances
from tests.doubles.kubelet_double import KubeletDouble
from tests.doubles.memory_store import MemoryStore
from tests.node.deviceplugin.support import NODE, Factory, Source


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dpm-", dir="/tmp"))  # unix socket paths are short
    (path / "dp").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(base: Path) -> AsyncIterator[KubeletDouble]:
    double = KubeletDouble(base / "dp", base / "pr.sock", reregistration="kubelet")
    await double.start()
    yield double
    await double.stop()


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    memory = MemoryStore()
    yield memory
    await memory.close()


@pytest.fixture
async def make_manager(store: MemoryStore, kubelet: KubeletDouble) -> AsyncIterator[Factory]:
    managers: list[DevicePluginManager] = []

    async def make(**kwargs: Any) -> DevicePluginManager:
        kwargs.setdefault("kubelet_poll", 3600)  # tests poll with check_sockets()
        served = ServedInstances(store, Ownership(store))
        manager = DevicePluginManager(
            served, SlotLedger(store, NODE), Source(), kubelet.device_plugin_dir, **kwargs
        )
        await manager.start()
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        await manager.close()
