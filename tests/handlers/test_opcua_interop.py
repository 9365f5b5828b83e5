"""The opcua handler against another OPC UA stack: node-opcua (npm, pinned with a lockfile in
``tests/interop/node_opcua/``; ``scripts/test.sh`` — so ``.ci/run`` — installs it with
``npm ci`` when node is on the machine). A node-opcua local discovery server
(node-opcua-server-discovery) with servers registered with it over secure channels with their
own certificates, and a server asked directly: what an industrial user runs.

- ``standard`` on the discovery server, its URL written as Akri's chart writes it (with a
  trailing slash), and a server that is both configured (``…:port/``) and registered
  (node-opcua writes its own URL without the slash): each server once, the discovery server
  never (issue 42.4: the two spellings were two targets, two FindServers per period);
- ``applicationNames`` Exclude, then an edit of the filter: the excluded server's device goes.

Skipped, with the reason, only when ``node`` is not installed. Servers on loopback: no root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.core.model.configuration import Configuration, parse_configuration
from agent.core.store.base import ConfigurationEvent, EventType
from agent.core.store.local import LocalInstanceStore
from agent.node.discovery.manager import DiscoveryManager, GraceSettings
from discovery_handlers.base import Device
from discovery_handlers.opcua import OpcuaHandler, transport
from discovery_handlers.registry import HandlerRegistry
from tests.doubles.opcua_servers import free_ports
from tests.paths import REPO

PACKAGE = REPO / "tests" / "interop" / "node_opcua"
DEADLINE = 100.0  # certificates are made at the first start: slow on a loaded machine


def _why_not() -> str | None:
    if shutil.which("node") is None:
        return "needs node (and npm) for node-opcua: apt-get install nodejs npm"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@pytest.fixture(scope="module")
def node_opcua(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A node-opcua discovery server, servers A and B registered with it, server C not;
    their URLs by name once each printed ``ready`` (and A and B are registered)."""
    if not (PACKAGE / "node_modules" / "node-opcua-server").is_dir():
        pytest.fail(
            f"node-opcua is not installed: npm ci --prefix {PACKAGE} (scripts/test.sh does it)"
        )
    lds, a, b, c = free_ports(4)
    spec = {
        "pki": str(tmp_path_factory.mktemp("pki")),
        "lds": {"port": lds},
        "servers": [
            {"name": "Server A", "port": a, "register": True},
            {"name": "Server B", "port": b, "register": True},
            {"name": "Server C", "port": c},
        ],
    }
    process = subprocess.Popen(
        ["node", "servers.js", json.dumps(spec)],
        cwd=PACKAGE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        urls: dict[str, str] = {}
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("ready "):
                name, url = line[len("ready ") :].strip().rsplit(" ", 1)
                urls[name] = url
            if len(urls) == 4:
                break
        assert len(urls) == 4, f"node-opcua servers did not start (exit {process.poll()})"
        yield urls
    finally:
        process.kill()
        process.wait(10)


def _details(urls: list[str], **fields: Any) -> str:
    return yaml.safe_dump(
        {
            "opcuaDiscoveryMethod": {"standard": {"discoveryUrls": urls}},
            "recheckIntervalSeconds": 1,
            **fields,
        }
    )


async def _until_list(stream: AsyncIterator[list[Device]], wanted: set[str]) -> list[Device]:
    """The first list whose ids are exactly ``wanted`` (registrations take a while)."""
    async with asyncio.timeout(DEADLINE):
        async for devices in stream:
            if {device.id for device in devices} == wanted:
                return devices
    raise AssertionError("discovery ended")


async def test_node_opcua_discovery_server_and_servers_each_found_once(
    node_opcua: dict[str, str],
) -> None:
    lds, a, b, c = (node_opcua[n] for n in ("LDS", "Server A", "Server B", "Server C"))
    assert not a.endswith("/") and not c.endswith("/")  # node-opcua's own spelling
    calls: list[str] = []
    rounds_done = asyncio.Event()

    async def counted(url: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(url.rstrip("/"))
        if calls.count(lds) >= 5:
            rounds_done.set()
        return await real(url, *args, **kwargs)

    real = transport.find_servers
    stream = OpcuaHandler().discover(_details([lds + "/", c + "/"]), {})
    transport.find_servers = counted  # type: ignore[assignment]
    try:
        # C is configured as ``…/`` and describes itself without the slash: one device
        devices = await _until_list(stream, {a, b, c})
        by_id = {device.id: device for device in devices}
        assert by_id[a].properties["OPCUA_APPLICATION_NAME"] == "Server A"
        assert by_id[a].properties["OPCUA_APPLICATION_URI"] == "urn:akri-py:interop:Server A"
        assert by_id[c].properties["OPCUA_APPLICATION_NAME"] == "Server C"
        # and one target: asked once per period, like the others
        calls.clear()
        rounds_done.clear()
        next_list = asyncio.ensure_future(anext(stream))  # keep discovery running
        try:
            async with asyncio.timeout(DEADLINE):
                await rounds_done.wait()
        finally:
            next_list.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await next_list
        rounds = {url: calls.count(url) for url in calls}
        assert set(rounds) == {lds, a, b, c}, rounds
        assert rounds[c] <= rounds[lds] + 1, rounds  # not twice per period
    finally:
        transport.find_servers = real  # type: ignore[assignment]
        await stream.aclose()


async def test_node_opcua_servers_through_the_application_names_filter(
    node_opcua: dict[str, str],
) -> None:
    lds, a, b = (node_opcua[n] for n in ("LDS", "Server A", "Server B"))
    excluded = _details([lds], applicationNames={"action": "Exclude", "items": ["Server B"]})
    stream = OpcuaHandler().discover(excluded, {})
    try:
        await _until_list(stream, {a})
    finally:
        await stream.aclose()
    included = _details([lds], applicationNames={"action": "Include", "items": ["Server B"]})
    stream = OpcuaHandler().discover(included, {})
    try:
        await _until_list(stream, {b})
    finally:
        await stream.aclose()


async def test_a_filter_edit_removes_the_unselected_servers_instance_without_the_grace(
    node_opcua: dict[str, str], tmp_path: Path
) -> None:
    """Issue 42.6 end to end, through the agent's DiscoveryManager with Akri's 300 s shared
    grace: ``applicationNames`` edited to exclude Server B, its Instance goes as soon as the
    restarted discovery's first list is in (before: it stayed offline for the grace, as if
    the PLC had gone); Server A's stays."""
    lds, a, b = (node_opcua[n] for n in ("LDS", "Server A", "Server B"))
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    registry = HandlerRegistry()
    registry.register(OpcuaHandler())
    manager = DiscoveryManager(store, registry, "node-a", GraceSettings(local=0, shared=300))
    await manager.start()

    def configuration(names: list[str]) -> Configuration:
        details = _details([lds + "/"], applicationNames={"action": "Exclude", "items": names})
        return parse_configuration(
            {
                "apiVersion": "akri.sh/v0",
                "kind": "Configuration",
                "metadata": {"name": "plcs"},
                "spec": {
                    "discoveryHandler": {"name": "opcua", "discoveryDetails": details},
                    "capacity": 1,
                },
            }
        )

    def urls() -> set[str]:
        return {
            i.broker_properties["OPCUA_DISCOVERY_URL"]
            for i in store.list_cached(configuration([]).key)
        }

    async def until(check: Any) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while not check():
            assert loop.time() < deadline, f"not reached; instances of {urls()}"
            await asyncio.sleep(0.05)

    first = configuration([])
    try:
        await manager.handle_configuration_event(
            ConfigurationEvent(EventType.ADDED, first.key, first)
        )
        await until(lambda: urls() == {a, b})
        edited = configuration(["Server B"])
        await manager.handle_configuration_event(
            ConfigurationEvent(EventType.MODIFIED, edited.key, edited)
        )
        await until(lambda: urls() == {a})  # within DEADLINE (100 s), far below the grace
        assert manager.offline_instances() == frozenset()  # gone, not offline
    finally:
        await manager.close()
        await store.close()


def test_the_lockfile_pins_node_opcua() -> None:
    lock = json.loads((PACKAGE / "package-lock.json").read_text())
    pinned = lock["packages"]["node_modules/node-opcua-server"]["version"]
    assert (
        pinned
        == json.loads((PACKAGE / "package.json").read_text())["dependencies"]["node-opcua-server"]
    )
    assert os.path.exists(PACKAGE / "servers.js")
