"""Issue 17, "quiet when idle": the kernel wakes the agent instead of a poll, work costs what
changed, and a local debugEcho agent imports only what it uses.

Each test is built so that the polling (or O(capacity)) version of the code fails it: the
device-plugin manager is given an hour-long poll interval, the reclaimer a fake clock that
never advances by itself, and the index a capacity-1000 Instance whose parse count is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.store.local import LocalInstanceStore
from agent.node.deviceplugin.held_slots import HeldIndex
from agent.node.deviceplugin.reclaimer import SlotReclaimer
from agent.node.kubelet.state import KubeletView
from tests.doubles.kubelet_double import KubeletDouble
from tests.doubles.memory_store import MemoryStore
from tests.node.deviceplugin.support import CL, Factory, il, instance, registered
from tests.paths import REPO

ROOT = REPO
NODE = "n1"


# --------------------------------------------------------------------- inotify, not polling


async def test_a_kubelet_restart_is_noticed_without_any_poll(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    """``kubelet_poll`` is an hour and nobody calls ``check_sockets()``: only inotify can
    tell the manager that kubelet re-created its socket."""
    for i in range(3):
        store.put(instance(i))
    manager = await make_manager(kubelet_poll=3600)
    resources = [il(i) for i in range(3)] + [CL]
    await registered(kubelet, resources)
    restarted = await kubelet.restart()
    await registered(kubelet, resources, after=restarted)
    assert manager.kubelet_restarts == 1
    assert manager.socket_watch is None or manager.socket_watch.using_inotify


async def test_a_removed_plugin_socket_is_noticed_without_any_poll(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    store.put(instance(0))
    manager = await make_manager(kubelet_poll=3600)
    await registered(kubelet, [il(0), CL])
    endpoint = manager.instance_plugins[instance(0).name]
    await asyncio.wait_for(endpoint.registered.wait(), 10)
    assert endpoint.socket_path is not None
    old = endpoint.socket_path
    since = time.monotonic()
    old.unlink()
    await kubelet.wait_registered(il(0), 20, after=since)
    assert endpoint.socket_path != old and endpoint.socket_path.exists()
    assert manager.kubelet_restarts == 0


# ------------------------------------------------------------------ reclaim: nothing to do


class _ParkedClock:
    """A clock that never moves; a reclaimer sleeping on it parks until cancelled."""

    def __init__(self) -> None:
        self.sleeps = 0

    def now(self) -> float:
        return 100.0

    async def sleep(self, _seconds: float) -> None:
        self.sleeps += 1
        await asyncio.Future()


class _SocketKubelet:
    """pod-resources as a socket path: available once the file exists; counts ``List``s."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.lists = 0
        self.listed = asyncio.Event()

    def available(self) -> bool:
        return self.socket.exists()

    def socket_identity(self) -> tuple[int, int] | None:
        return (1, 1) if self.socket.exists() else None

    async def view(self) -> KubeletView:
        self.lists += 1
        self.listed.set()
        return KubeletView({}, {}, 100.0)


def _held_instance(name: str, capacity: int, held: dict[int, str]) -> Instance:
    usage = {f"{name}-{i}": held.get(i, "") for i in range(capacity)}
    return Instance(
        name=name,
        configuration_name="cfg",
        capacity=capacity,
        nodes=(NODE,),
        shared=False,
        device_usage=usage,
    )


class _Said(logging.Handler):
    """Sets ``event`` when a record containing ``text`` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def test_no_list_while_the_pod_resources_socket_is_missing_then_a_pass_when_it_appears(
    tmp_path: Path,
) -> None:
    state = LocalInstanceStore(tmp_path / "state")
    await state.start()
    await state.create(_held_instance("cam-aaaaaa", 2, {0: NODE}))
    clock = _ParkedClock()
    kubelet = _SocketKubelet(tmp_path / "pod-resources" / "kubelet.sock")
    kubelet.socket.parent.mkdir()
    reclaimer = SlotReclaimer(
        SlotLedger(state, NODE, clock=clock.now),
        state.list_cached,
        kubelet,
        clock=clock.now,
        sleep=clock.sleep,
        events=state.subscribe_instances,
    )
    said = _Said("reclaim is off")
    logger = logging.getLogger("agent.node.deviceplugin.reclaimer")
    logger.addHandler(said)
    task = asyncio.create_task(reclaimer.run())
    try:
        await asyncio.wait_for(said.event.wait(), 10)
        # it holds a slot, yet with no socket it neither asks kubelet nor ticks its clock
        assert kubelet.lists == 0 and clock.sleeps == 0
        kubelet.socket.touch()  # kubelet starts: the directory watch wakes the reclaimer
        await asyncio.wait_for(kubelet.listed.wait(), 10)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        logger.removeHandler(said)
        reclaimer.close()
        await state.close()


# ------------------------------------------------------------------ costs of what changed


def test_a_claim_on_a_capacity_1000_instance_parses_one_slot() -> None:
    index = HeldIndex(NODE)
    before = _held_instance("big-abcdef", 1000, {5: NODE})
    index.update(before)
    first = index.parsed
    after = before.evolve(device_usage={**before.device_usage, "big-abcdef-700": NODE})
    index.update(after)
    assert index.parsed - first == 1
    released = after.evolve(device_usage={**after.device_usage, "big-abcdef-5": ""})
    index.update(released)
    assert index.parsed - first == 2
    unchanged = released.evolve(resource_version="99")  # no slot changed: nothing parsed
    index.update(unchanged)
    assert index.parsed - first == 2


async def test_local_state_files_are_compact_json(tmp_path: Path) -> None:
    """At capacity 1000 the pretty-printed file was 37.5 KB per claim."""
    state = LocalInstanceStore(tmp_path / "state")
    await state.start()
    try:
        await state.create(_held_instance("big-abcdef", 1000, {}))
    finally:
        await state.close()
    text = (tmp_path / "state" / "instances" / "big-abcdef.json").read_text()
    assert text.count("\n") == 1 and ": " not in text and ", " not in text
    assert json.loads(text)["spec"]["capacity"] == 1000
    assert len(text) < 26_000  # 1000 slots of `"big-abcdef-N":""`, and little else


# ------------------------------------------------------------------ imports of a local agent

_LOCAL_IMPORTS = """
import json, sys
from agent.cli import main  # what the `akri` console script imports
from agent.node.settings import AGENT_OPTIONS, AgentSettings, add_options, resolve
from agent.node.app import import_what_settings_need, build_handlers
import argparse
parser = argparse.ArgumentParser()
add_options(parser, AGENT_OPTIONS)
settings = AgentSettings.from_values(resolve(parser.parse_args(sys.argv[1:]), AGENT_OPTIONS, {}))
import_what_settings_need(settings)
build_handlers(settings)
print(json.dumps(sorted(sys.modules)))
"""


def test_a_local_debug_echo_agent_imports_no_other_handler_nor_cluster_client() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LOCAL_IMPORTS, "--local", "--debug-echo"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    loaded = set(json.loads(done.stdout))
    assert "discovery_handlers.debug_echo" in loaded
    unwanted = (
        "pyudev",
        "discovery_handlers.udev",
        "discovery_handlers.onvif",
        "discovery_handlers.mdns",
        "discovery_handlers.mqtt",
        "discovery_handlers.opcua",
        "asyncua",
        "zeroconf",
        "aiomqtt",
        "aiohttp",
        "kubernetes",
        "agent.core.kube",
        "agent.node.dra",
        "grpc",
    )
    found = sorted(m for m in loaded if m.startswith(unwanted))
    assert found == []
