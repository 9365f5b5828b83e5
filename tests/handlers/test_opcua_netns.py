"""The opcua handler against real OPC UA servers in another network namespace, joined to this
one by a veth pair: asyncua's own servers (one plain, several registered with a discovery
server through RegisterServer and RegisterServer2), a discovery server with FindServersOnNetwork
(``tests/doubles/opcua_servers.py``), and servers that misbehave. The servers are separate
processes (``ip netns exec … python -m tests.doubles.opcua_servers``), started once for the
module; the handler runs here, in the test's event loop, and reaches them over the link.
Needs root and ``ip``; skipped with the reason otherwise (CI runs as root)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.configuration import parse_configuration
from agent.core.model.instance import Instance
from agent.core.store.base import ConfigurationEvent, EventType
from agent.core.store.local import LocalInstanceStore
from agent.node.discovery.manager import DiscoveryManager, GraceSettings
from discovery_handlers.base import Device, report_problems_to
from discovery_handlers.opcua import OpcuaHandler
from discovery_handlers.registry import HandlerRegistry
from tests.harness.agent_process import AgentProcess
from tests.paths import REPO

TAG = f"{os.getpid() % 100000}"
SUBNET = f"10.233.{os.getpid() % 200 + 20}"
HOST_ADDRESS = f"{SUBNET}.1"
A_HOST, LDS_HOST, BAD_HOST = f"{SUBNET}.2", f"{SUBNET}.3", f"{SUBNET}.4"
LDS = f"opc.tcp://{LDS_HOST}:4840/"
A = f"opc.tcp://{A_HOST}:4840/"
B = f"opc.tcp://{LDS_HOST}:48402/"
C = f"opc.tcp://{LDS_HOST}:48403/"
D_LISTENS = f"opc.tcp://{LDS_HOST}:48404/"
D_ADVERTISED = "opc.tcp://plc-d.invalid:48404/"  # .invalid never resolves (RFC 6761)
E = f"opc.tcp://{A_HOST}:48405/"
GARBAGE = f"opc.tcp://{BAD_HOST}:4840/"
SILENT = f"opc.tcp://{BAD_HOST}:4841/"
HUGE = f"opc.tcp://{BAD_HOST}:4842/"
UNRESOLVABLE = "opc.tcp://akri-no-such-plc.invalid:4840/"
DEADLINE = 120.0  # generous (servers start slowly on a loaded machine); never a timed assertion


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and a veth pair)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _ip(*args: str, namespace: str | None = None) -> None:
    command = ["ip", *args] if namespace is None else ["ip", "-n", namespace, *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


@dataclass
class ServerProcess:
    """A ``tests.doubles.opcua_servers`` process and what it printed."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.strip())

    def connections(self, name: str) -> int:
        return self.lines.count(f"connection {name}")

    def wait_ready(self, names: list[str], deadline: float) -> None:
        while not all(any(line.startswith(f"ready {n} ") for line in self.lines) for n in names):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"servers {names} not ready; printed: {self.lines}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def start_servers(namespace: str, specs: list[dict[str, Any]]) -> ServerProcess:
    process = subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, "-m", "tests.doubles.opcua_servers",
         json.dumps(specs)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    server = ServerProcess(process)
    threading.Thread(target=server.pump, daemon=True).start()
    return server


E_SPEC = [{"kind": "server", "name": "Server E", "endpoint": E}]


@dataclass
class Network:
    namespace: str
    servers: dict[str, ServerProcess]  # by group: lds, ab, cd, hostile, e


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    """Namespace ``akri-opcua-<pid>`` with the servers' addresses on its end of a veth pair, and
    every server running: the discovery server (LDS with FindServersOnNetwork) on
    ``LDS_HOST:4840``; A (ClientAndServer, asyncua's default) on ``A_HOST:4840``, registered
    with RegisterServer2 (mDNS capability HD); B (Server) registered with RegisterServer2 (DA);
    C registered with RegisterServer; D registered and describing itself as
    ``plc-d.invalid:48404``; the garbage, silent and huge servers on ``BAD_HOST``; and E (in
    a process of its own, for the test that stops it)."""
    namespace, host, peer = f"akri-opcua-{TAG}", f"aoph{TAG}", f"aopc{TAG}"
    created = subprocess.run(["ip", "netns", "add", namespace], capture_output=True, text=True)
    if created.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {created.stderr.strip()}")
    servers: dict[str, ServerProcess] = {}
    try:
        _ip("link", "add", host, "type", "veth", "peer", "name", peer, "netns", namespace)
        _ip("addr", "add", f"{HOST_ADDRESS}/24", "dev", host)
        _ip("link", "set", host, "up")
        for address in (A_HOST, LDS_HOST, BAD_HOST):
            _ip("addr", "add", f"{address}/24", "dev", peer, namespace=namespace)
        _ip("link", "set", peer, "up", namespace=namespace)
        _ip("link", "set", "lo", "up", namespace=namespace)
        registered = {"register": LDS}
        groups: dict[str, list[dict[str, Any]]] = {
            "lds": [{"kind": "discovery", "name": "LDS", "endpoint": LDS}],
            "ab": [
                {"kind": "server", "name": "Server A", "endpoint": A, **registered,
                 "mdns": {"capabilities": ["HD"]}},
                {"kind": "server", "name": "Server B", "endpoint": B, "type": "server",
                 "product": "urn:acme:plc", **registered, "mdns": {"capabilities": ["DA"]}},
            ],
            "cd": [
                {"kind": "server", "name": "Server C", "endpoint": C, "type": "server",
                 **registered},
                {"kind": "server", "name": "Server D", "endpoint": D_LISTENS, "type": "server",
                 "advertise": D_ADVERTISED, **registered},
            ],
            "hostile": [
                {"kind": "garbage", "name": "garbage", "endpoint": GARBAGE},
                {"kind": "silent", "name": "silent", "endpoint": SILENT},
                {"kind": "huge", "name": "huge", "endpoint": HUGE},
            ],
            "e": E_SPEC,
        }  # fmt: skip
        for group, specs in groups.items():
            servers[group] = start_servers(namespace, specs)
        deadline = time.monotonic() + 180  # six asyncua servers on two loaded cores
        for group, specs in groups.items():
            servers[group].wait_ready([spec["name"] for spec in specs], deadline)
        yield Network(namespace, servers)
    finally:
        for server in servers.values():
            server.stop()
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", host], capture_output=True, check=False)


class Collector:
    """Consumes ``discover()`` in a task of its own, which also collects the problems the
    handler reports (what the agent turns into Events)."""

    def __init__(self, text: str) -> None:
        self.lists: list[list[Device]] = []
        self.problems: list[tuple[str, str]] = []
        self._changed = asyncio.Event()
        self._stream: Any = OpcuaHandler().discover(text, {})
        self._task = asyncio.create_task(self._run())

    async def _record(self, reason: str, message: str) -> None:
        self.problems.append((reason, message))
        self._changed.set()

    async def _run(self) -> None:
        report_problems_to(self._record)
        async for devices in self._stream:
            self.lists.append(devices)
            self._changed.set()

    async def until(self, check: Callable[[], bool], what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while not check():
            if self._task.done():
                self._task.result()
                raise AssertionError("discovery stream ended")
            if loop.time() > deadline:
                latest = [d.id for d in self.lists[-1]] if self.lists else None
                raise AssertionError(f"{what}: not reached; latest {latest}, {self.problems}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.5)

    async def ids_become(self, wanted: set[str]) -> list[Device]:
        await self.until(lambda: bool(self.lists) and ids(self.lists[-1]) == wanted, str(wanted))
        return self.lists[-1]

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._stream.aclose()


def ids(devices: list[Device]) -> set[str]:
    return {device.id for device in devices}


def standard(*urls: str, extra: str = "") -> str:
    listed = ", ".join(f"'{url}'" for url in urls)
    return f"opcuaDiscoveryMethod:\n  standard:\n    discoveryUrls: [{listed}]\n{extra}"


async def test_two_servers_one_behind_a_discovery_server_one_filtered_out_by_name(
    network: Network,
) -> None:
    """A asked directly (and listed by the discovery server too: once), B behind the discovery
    server, C filtered out by name, D under the discovery server's host (its own name does
    not resolve), the discovery server itself not a device."""
    excluded = Collector(
        standard(A, LDS, extra="applicationNames: {action: Exclude, items: ['Server C']}\n")
    )
    included = Collector(
        standard(A, LDS, extra="applicationNames: {action: Include, items: ['Server B']}\n")
    )
    substituted = f"opc.tcp://{LDS_HOST}:48404/"  # D's port on the host that was asked
    try:
        devices = await excluded.ids_become({A, B, substituted})
        by_id = {device.id: device for device in devices}
        assert by_id[B].properties == {
            "OPCUA_DISCOVERY_URL": B,
            "OPCUA_APPLICATION_URI": "urn:akri-py:tests:Server B",
            "OPCUA_APPLICATION_NAME": "Server B",
            "OPCUA_PRODUCT_URI": "urn:acme:plc",
        }
        assert by_id[A].properties["OPCUA_APPLICATION_NAME"] == "Server A"
        assert by_id[substituted].properties["OPCUA_APPLICATION_NAME"] == "Server D"
        await included.ids_become({B})
        assert excluded.problems == [] and included.problems == []
    finally:
        await excluded.close()
        await included.close()


async def test_a_server_naming_a_host_that_does_not_resolve_gets_akris_id(
    network: Network,
) -> None:
    """D describes itself as plc-d.invalid: asked at its address, it is offered under the URL
    that was asked — the id, and so the Instance name, Akri gives it (PR #584)."""
    collector = Collector(standard(D_LISTENS))
    try:
        (device,) = await collector.ids_become({D_LISTENS})
        assert device.properties["OPCUA_DISCOVERY_URL"] == D_LISTENS
    finally:
        await collector.close()


async def test_multicast_lists_the_servers_with_the_capabilities_asked_for(
    network: Network,
) -> None:
    """FindServersOnNetwork: the servers registered with an mDNS configuration (A, B; not C
    and D), filtered by capability on the discovery server; each asked what it is."""
    every = Collector(f"opcuaDiscoveryMethod:\n  multicast:\n    discoveryUrls: ['{LDS}']\n")
    data_access = Collector(
        "opcuaDiscoveryMethod:\n  multicast:\n"
        f"    discoveryUrls: ['{LDS}']\n    serverCapabilities: [da]\n"
    )
    try:
        devices = await every.ids_become({A, B})
        capabilities = {d.id: d.properties["OPCUA_SERVER_CAPABILITIES"] for d in devices}
        assert capabilities == {A: "HD", B: "DA"}
        (device,) = await data_access.ids_become({B})
        assert device.properties["OPCUA_APPLICATION_URI"] == "urn:akri-py:tests:Server B"
    finally:
        await every.close()
        await data_access.close()


async def test_broken_servers_cost_one_error_each_and_the_good_one_is_offered(
    network: Network,
) -> None:
    """Garbage, silence, a 1.8 MB answer and a host that does not resolve: each is one
    reported problem naming it — not one per round, and nothing else is disturbed."""
    collector = Collector(
        standard(
            A, GARBAGE, SILENT, HUGE, UNRESOLVABLE,
            extra="timeoutSeconds: 3\nrecheckIntervalSeconds: 0.5\nretryIntervalSeconds: 0.2\n",
        )
    )  # fmt: skip
    hostile = network.servers["hostile"]
    before = {name: hostile.connections(name) for name in ("garbage", "silent", "huge")}
    try:
        await collector.ids_become({A})
        # three rounds: each broken server asked three times (a timeout of 3 s, so that a
        # loaded machine does not turn its answer into another kind of failure)
        await collector.until(
            lambda: all(hostile.connections(n) >= before[n] + 3 for n in before),
            "three rounds of calls to the broken servers",
        )
        messages = sorted(message for _reason, message in collector.problems)
        assert len(messages) == 4, messages
        assert [m.split(": ", 2)[1] for m in messages] == sorted(
            f"discovery URL {url}" for url in (GARBAGE, SILENT, HUGE, UNRESOLVABLE)
        )
        text = "\n".join(messages)
        assert f"{GARBAGE}: answered with bytes that are not OPC UA" in text
        assert f"{SILENT}: no answer within 3 s (waiting for its Acknowledge)" in text
        assert f"{HUGE}: sent a FindServers response of more than 1048576 bytes" in text
        assert f"{UNRESOLVABLE}: its host does not resolve" in text
        reasons = {reason for reason, _message in collector.problems}
        assert reasons == {"OpcuaServerBroken", "OpcuaServerUnreachable"}
        assert ids(collector.lists[-1]) == {A}
    finally:
        await collector.close()


async def test_a_stopped_server_is_gone_after_the_grace_and_back_when_it_returns(
    network: Network, tmp_path: Path
) -> None:
    """Through the agent's DiscoveryManager: one shared Instance named as Akri names it; the
    server killed, the Instance goes once the offline grace has passed (not before); the
    server started again, the Instance is back (how fast: benchmarks/opcua_discovery.py)."""
    grace = 3.0
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    registry = HandlerRegistry()
    registry.register(OpcuaHandler())
    manager = DiscoveryManager(store, registry, "node-a", GraceSettings(local=0, shared=grace))
    await manager.start()
    configuration = parse_configuration(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Configuration",
            "metadata": {"name": "plcs"},
            "spec": {
                "discoveryHandler": {
                    "name": "opcua",
                    "discoveryDetails": standard(
                        E,
                        extra="recheckIntervalSeconds: 1\nretryIntervalSeconds: 0.3\n"
                        "timeoutSeconds: 1\n",
                    ),
                },
                "capacity": 2,
            },
        }
    )
    name = f"plcs-{hashlib.blake2b(E.encode(), digest_size=3).hexdigest()}"

    def instances() -> list[Instance]:
        return store.list_cached(configuration.key)

    async def until(check: Callable[[], bool], what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while not check():
            assert loop.time() < deadline, f"{what}: not reached; instances: {instances()}"
            await asyncio.sleep(0.05)

    try:
        await manager.handle_configuration_event(
            ConfigurationEvent(EventType.ADDED, configuration.key, configuration)
        )
        await until(lambda: [i.name for i in instances()] == [name], "the Instance")
        (instance,) = instances()
        assert instance.shared and instance.nodes == ("node-a",)
        assert instance.broker_properties["OPCUA_DISCOVERY_URL"] == E
        assert instance.broker_properties["OPCUA_APPLICATION_NAME"] == "Server E"
        network.servers["e"].stop()
        stopped = time.monotonic()
        await until(lambda: instances() == [], "the Instance gone")
        assert time.monotonic() - stopped >= grace  # a lower bound: the grace was kept
        network.servers["e"] = start_servers(network.namespace, E_SPEC)
        await until(lambda: [i.name for i in instances()] == [name], "the Instance back")
    finally:
        await manager.close()
        await store.close()


def test_akri_handler_opcua_streams_a_server_over_akris_protocol(
    network: Network, tmp_path: Path
) -> None:
    """``akri handler opcua``: the same handler as an external process; Akri's
    ``Discover`` answers with server A and its properties."""
    import grpc

    from agent.protos.akri.discovery.v0 import discovery_pb2, discovery_pb2_grpc

    handler = AgentProcess(
        ["opcua"],
        command="handler",
        env={"DISCOVERY_HANDLERS_DIRECTORY": str(tmp_path)},
        label="akri handler opcua",
    )
    try:
        socket_path = tmp_path / "opcua.sock"
        handler.wait_for_log(
            f"handler opcua serves Discover at {re.escape(str(socket_path))}", timeout=30
        )
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            stub = discovery_pb2_grpc.DiscoveryHandlerStub(channel)
            call = stub.Discover(
                discovery_pb2.DiscoverRequest(discovery_details=standard(A)), timeout=DEADLINE
            )
            first = next(iter(call))
            call.cancel()
        (device,) = first.devices
        assert device.id == A
        assert device.properties["OPCUA_DISCOVERY_URL"] == A
        assert device.properties["OPCUA_APPLICATION_NAME"] == "Server A"
        assert handler.stop(timeout=20) == 0
    finally:
        handler.cleanup()
