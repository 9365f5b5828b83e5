"""External discovery handlers (issue 16): a local agent and handler processes over real unix
sockets, speaking Akri's ``v0`` protocol.

The handlers are ``akri handler debugEcho`` (our embedded handler served externally) and
``tests/doubles/proto_only_handler.py``, a handler written only from the .proto (stubs generated at
test time, nothing imported from the agent), which can also misbehave on purpose.
"""

from __future__ import annotations

import re
import shutil
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.harness.agent_process import AgentProcess, describe_all, instance_files, poll_until
from tests.paths import DOUBLES, REPO

ROOT = REPO
EXAMPLE = ROOT / "examples" / "debug-echo.yaml"  # the same file the embedded handler runs
PROTO_ONLY = [sys.executable, str(DOUBLES / "proto_only_handler.py")]
OFFLINE = "akri.sh/offline"


def configuration(name: str, handler: str, capacity: int = 1) -> str:
    return (
        "apiVersion: akri.sh/v0\nkind: Configuration\n"
        f"metadata: {{name: {name}}}\n"
        f"spec:\n  discoveryHandler:\n    name: {handler}\n    discoveryDetails: ''\n"
        f"  capacity: {capacity}\n"
    )


class Setup:
    def __init__(self, base: Path) -> None:
        # short paths: a unix socket path must stay under 108 bytes
        self.base = base
        self.dir = base / "dh"
        self.state = base / "state"
        self.stubs = base / "stubs"
        self.processes: list[AgentProcess] = []

    def agent(self, *configs: Path, extra: Sequence[str] = ()) -> AgentProcess:
        args = [
            "--local",
            "--no-debug-echo",
            "--state-dir",
            str(self.state),
            "--node-name",
            "n1",
            "--discovery-handlers-dir",
            str(self.dir),
            "--poll-interval",
            "0.2",
            *extra,
        ]
        for config in configs:
            args += ["--config", str(config)]
        process = AgentProcess(args, label="agent")
        self.processes.append(process)
        return process

    def echo_handler(self, *extra: str) -> AgentProcess:
        process = AgentProcess(
            [
                "debugEcho",
                "--discovery-handlers-dir",
                str(self.dir),
                "--debug-echo-availability-file",
                str(self.base / "avail"),
                *extra,
            ],
            command="handler",
            label="akri handler debugEcho",
        )
        self.processes.append(process)
        return process

    def proto_only(
        self, name: str, socket: str, devices: Sequence[str], mode: str = "normal", *extra: str
    ) -> AgentProcess:
        process = AgentProcess(
            [
                "--stubs",
                str(self.stubs),
                "--dir",
                str(self.dir),
                "--name",
                name,
                "--socket",
                str(self.dir / socket),
                "--devices",
                ",".join(devices),
                "--mode",
                mode,
                *extra,
            ],
            program=PROTO_ONLY,
            label=f"proto-only {name} {mode}",
        )
        self.processes.append(process)
        return process

    def write(self, name: str, text: str) -> Path:
        path = self.base / name
        path.write_text(text)
        return path

    def instances(self, configuration_name: str | None = None) -> dict[str, dict[str, Any]]:
        return {
            name: item
            for name, item in instance_files(self.state).items()
            if configuration_name is None or item["spec"]["configurationName"] == configuration_name
        }

    def logs(self) -> str:
        return describe_all(self.processes)


@pytest.fixture
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("ext")
    s = Setup(base)
    yield s
    for process in s.processes:
        process.cleanup()
    shutil.rmtree(base, ignore_errors=True)


def ids(instances: dict[str, dict[str, Any]], key: str) -> set[str]:
    return {i["spec"]["brokerProperties"].get(key, "") for i in instances.values()}


def test_the_embedded_handlers_configuration_runs_on_an_external_handler(setup: Setup) -> None:
    agent = setup.agent(EXAMPLE)
    agent.wait_for_log("no discovery handler named 'debugEcho'.*starts when a handler")
    assert setup.instances() == {}
    handler = setup.echo_handler()
    handler.wait_for_log("registered debugEcho with the agent")
    found = poll_until(
        lambda: ids(setup.instances(), "DEBUG_ECHO_DESCRIPTION") == {"foo0", "foo1"},
        timeout=10,
        message=setup.logs,
    )
    assert found
    agent.wait_for_log(r"discovery handler debugEcho registered at .*debugEcho\.sock")


def test_a_restarted_handler_s_devices_are_kept_while_it_is_down(setup: Setup) -> None:
    """A rolling update of the handler's DaemonSet: the stream breaks, the handler comes back.
    A failing handler is not an empty list (issue 11 case 4): with an offline grace of 0 the
    Instances would be deleted at once if the break dropped the endpoint's devices."""
    agent = setup.agent(EXAMPLE, extra=["--shared-offline-grace", "0"])
    handler = setup.echo_handler()
    poll_until(lambda: len(setup.instances()) == 2, timeout=10, message=setup.logs)
    before = setup.instances()
    mark = agent.mark()
    handler.kill()
    agent.wait_for_log("debugEcho at .*its last list is kept while it is dialled again", since=mark)
    restarted = setup.echo_handler()
    restarted.wait_for_log("registered debugEcho with the agent")
    agent.wait_for_log(r"debugEcho at .* is back: 2 device\(s\)", since=mark, timeout=10)
    assert setup.instances().keys() == before.keys()
    assert not agent.matching("device not seen by|forgotten", since=mark), setup.logs()
    annotations = [i["metadata"].get("annotations", {}) for i in setup.instances().values()]
    assert not any(OFFLINE in a for a in annotations)


def test_the_handler_registers_again_when_the_agent_restarts(setup: Setup) -> None:
    agent = setup.agent(EXAMPLE, extra=["--shared-offline-grace", "60"])
    handler = setup.echo_handler()
    poll_until(lambda: len(setup.instances()) == 2, timeout=10, message=setup.logs)
    mark = handler.mark()
    assert agent.stop() == 0
    again = setup.agent(EXAMPLE, extra=["--shared-offline-grace", "60"])
    handler.wait_for_log("registered debugEcho with the agent", since=mark, timeout=10)
    again.wait_for_log("discovery handler debugEcho registered", timeout=10)
    again.wait_for_log(r"debugEcho reports 2 device\(s\)", timeout=10)
    assert len(setup.instances()) == 2


def test_a_handler_written_from_the_proto_alone_registers_and_streams(setup: Setup) -> None:
    config = setup.write("c.yaml", configuration("proto", "protoOnly"))
    agent = setup.agent(config)
    client = setup.proto_only("protoOnly", "p.sock", ["dev-a", "dev-b"])
    client.wait_for_log("REGISTERED", timeout=60)  # the first run generates the stubs
    client.wait_for_log("DISCOVER ''", timeout=10)
    poll_until(
        lambda: ids(setup.instances("proto"), "PROTO_ONLY_ID") == {"dev-a", "dev-b"},
        timeout=10,
        message=setup.logs,
    )
    # the only error: the Configuration waited for its handler until it registered
    assert [e for e in agent.errors() if "no discovery handler named" not in e] == []


def test_two_endpoints_under_one_name_are_merged(setup: Setup) -> None:
    config = setup.write("c.yaml", configuration("merged", "protoOnly"))
    setup.agent(config)
    first = setup.proto_only("protoOnly", "a.sock", ["x", "y"])
    second = setup.proto_only("protoOnly", "b.sock", ["y", "z"])
    for client in (first, second):
        client.wait_for_log("REGISTERED", timeout=60)
    poll_until(
        lambda: ids(setup.instances("merged"), "PROTO_ONLY_ID") == {"x", "y", "z"},
        timeout=10,
        message=setup.logs,
    )
    assert len(setup.instances("merged")) == 3  # y once
    agent = setup.processes[0]
    mark = agent.mark()
    second.kill()
    # a broken stream keeps that endpoint's part of the list while it is dialled again...
    agent.wait_for_log("protoOnly at .*b.sock.*its last list is kept", since=mark)
    assert ids(setup.instances("merged"), "PROTO_ONLY_ID") == {"x", "y", "z"}
    # ... until it reports again: now without z
    setup.proto_only("protoOnly", "b.sock", ["y"]).wait_for_log("REGISTERED", timeout=60)
    poll_until(
        lambda: ids(setup.instances("merged"), "PROTO_ONLY_ID") == {"x", "y"},
        timeout=10,
        message=setup.logs,
    )


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("duplicate", "appears twice in one list"),
        ("flood", "device lists per second"),
        ("silent", "sent no device list within 2s"),
        ("huge", "over 4 MiB"),
        ("garbage", "sent a message that is not a DiscoverResponse"),
    ],
)
def test_a_misbehaving_handler_is_cut_off_and_the_others_go_on(
    setup: Setup, mode: str, why: str
) -> None:
    good = setup.write("good.yaml", configuration("good", "goodHandler"))
    bad = setup.write("bad.yaml", configuration("bad", "badHandler"))
    agent = setup.agent(good, bad, extra=["--discovery-handler-first-list-timeout", "2"])
    setup.proto_only("goodHandler", "g.sock", ["g1", "g2"]).wait_for_log("REGISTERED", timeout=60)
    setup.proto_only("badHandler", "b.sock", ["b1"], mode).wait_for_log("REGISTERED", timeout=60)
    agent.wait_for_log(f"discovery handler badHandler at .* cut off: .*{why}", timeout=15)
    poll_until(lambda: len(setup.instances("good")) == 2, timeout=10, message=setup.logs)
    # a flood's first lists were accepted (the burst), as was garbage's first list: they are
    # kept while the endpoint is cut off (a failing handler is not an empty list)
    kept = {"b1"} if mode in ("flood", "garbage") else set()
    poll_until(
        lambda: ids(setup.instances("bad"), "PROTO_ONLY_ID") == kept,
        timeout=10,
        message=setup.logs,
    )
    assert agent.running
    # the good handler's stream was not disturbed: still 2, and no cut-off of it
    assert not agent.matching("goodHandler at .* cut off")


def test_endpoints_outside_the_directory_are_refused(setup: Setup) -> None:
    config = setup.write("c.yaml", configuration("outside", "protoOnly"))
    agent = setup.agent(config)
    agent.wait_for_log("registration served on")
    elsewhere = setup.base / "elsewhere.sock"
    client = setup.proto_only(
        "protoOnly", "p.sock", ["a"], "normal", "--register-as", str(elsewhere)
    )
    client.wait_for_log("REFUSED PERMISSION_DENIED .*outside the handler directory", timeout=60)
    assert client.wait_exit(10) == 3
    agent.wait_for_log("registration refused: handler protoOnly: socket .* is outside")
    assert setup.instances() == {}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_with_pod_ip_the_handler_serves_on_a_network_port_and_registers_it(
    setup: Setup,
) -> None:
    """Like Akri's handlers in a pod: ``POD_IP`` set → ``Discover`` on ``$POD_IP:--port`` and a
    ``NETWORK`` registration ``http://$POD_IP:port`` (loopback is an address of this node)."""
    agent = setup.agent(EXAMPLE)
    agent.wait_for_log("registration served on")
    port = free_port()
    handler = AgentProcess(
        [
            "debugEcho",
            *("--discovery-handlers-dir", str(setup.dir), "--port", str(port)),
            *("--debug-echo-availability-file", str(setup.base / "avail")),
        ],
        command="handler",
        env={"POD_IP": "127.0.0.1"},
        label="akri handler debugEcho (POD_IP)",
    )
    setup.processes.append(handler)
    endpoint = f"http://127.0.0.1:{port}"
    handler.wait_for_log(f"handler debugEcho serves Discover at {re.escape(endpoint)}")
    handler.wait_for_log("registered debugEcho with the agent")
    agent.wait_for_log(f"discovery handler debugEcho registered at {re.escape(endpoint)}")
    assert not (setup.dir / "debugEcho.sock").exists()
    poll_until(
        lambda: ids(setup.instances(), "DEBUG_ECHO_DESCRIPTION") == {"foo0", "foo1"},
        timeout=10,
        message=setup.logs,
    )


def discover_status(target: str, details: str) -> Any:
    """The status a ``Discover`` call with ``details`` ends with (read within 10 s)."""
    import grpc

    from agent.protos.akri.discovery.v0 import discovery_pb2, discovery_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = discovery_pb2_grpc.DiscoveryHandlerStub(channel)
        call = stub.Discover(discovery_pb2.DiscoverRequest(discovery_details=details), timeout=10)
        try:
            for _response in call:
                pass
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("name", ["udev", "onvif", "mdns", "mqtt", "opcua"])
def test_each_embedded_handler_runs_as_an_external_one(setup: Setup, name: str) -> None:
    """``akri handler NAME`` starts and answers ``Discover`` on ``<dir>/NAME.sock`` (no agent
    needed: it keeps trying to register). The directory comes from Akri's variable
    ``DISCOVERY_HANDLERS_DIRECTORY``. Unparseable discoveryDetails are refused by the handler
    itself (INVALID_ARGUMENT, before anything is probed or a broker is dialled), which proves
    that the named handler serves the socket."""
    import grpc

    handler = AgentProcess(
        [name],
        command="handler",
        env={"DISCOVERY_HANDLERS_DIRECTORY": str(setup.dir)},
        label=f"akri handler {name}",
    )
    setup.processes.append(handler)
    socket_path = setup.dir / f"{name}.sock"
    handler.wait_for_log(f"handler {name} serves Discover at {re.escape(str(socket_path))}")
    status = discover_status(f"unix://{socket_path}", "{ not: [yaml")
    assert status == grpc.StatusCode.INVALID_ARGUMENT, handler.describe()
    assert handler.running
    assert handler.stop() == 0
    assert not socket_path.exists()
