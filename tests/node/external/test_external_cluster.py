"""External discovery handlers in cluster mode (issue 16): the agent against the API-server
double, handler processes written only from the .proto (``tests/doubles/proto_only_handler.py``)
registering over the real unix socket. A well-behaved handler's devices become Instances in
the API; a misbehaving one is cut off with a ``DiscoveryHandlerCutOff`` Event on the
Configurations that use it, and nothing of the other changes."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.instance import Instance
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.agent_process import AgentProcess
from tests.harness.dp_nodes import DpNode, start_dp_node
from tests.harness.k8s_nodes import CRDS, eventually
from tests.paths import DOUBLES

PROTO_ONLY = [sys.executable, str(DOUBLES / "proto_only_handler.py")]


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


@pytest.fixture
def processes() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for process in started:
        process.cleanup()


def configuration(name: str, handler: str) -> dict[str, Any]:
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "discoveryHandler": {"name": handler, "discoveryDetails": ""},
            "capacity": 1,
        },
    }


def events(api: ApiServerDouble, reason: str, configuration: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.list("events")
        if e.get("reason") == reason
        and e["involvedObject"]["kind"] == "Configuration"
        and e["involvedObject"]["name"] == configuration
    ]


def ids(api: ApiServerDouble, configuration: str) -> set[str]:
    found = (Instance.from_dict(o) for o in api.list("instances.akri.sh"))
    return {
        i.broker_properties.get("PROTO_ONLY_ID", "")
        for i in found
        if i.configuration_name == configuration
    }


async def handler(
    node: DpNode,
    stubs: Path,
    processes: list[AgentProcess],
    name: str,
    devices: list[str],
    mode: str,
) -> AgentProcess:
    directory = node.agent.settings.discovery_handlers_dir
    process = AgentProcess(
        [
            *("--stubs", str(stubs), "--dir", str(directory), "--name", name),
            *("--socket", str(directory / f"{name}.sock"), "--devices", ",".join(devices)),
            *("--mode", mode),
        ],
        program=PROTO_ONLY,
        label=f"proto-only {name} {mode}",
    )
    processes.append(process)
    # the agent runs in this event loop: wait in a thread
    await asyncio.to_thread(process.wait_for_log, "REGISTERED", timeout=60)
    return process


async def test_a_cut_off_handler_gets_an_event_on_its_configuration_in_cluster_mode(
    api: ApiServerDouble, tmp_path: Path, processes: list[AgentProcess]
) -> None:
    api.create(configuration("good", "goodHandler"))
    api.create(configuration("bad", "badHandler"))
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        # both wait for their handler (the Event says so) until it registers
        await eventually(
            lambda: events(api, "UnknownDiscoveryHandler", "bad") != [], what="waiting"
        )
        stubs = tmp_path / "stubs"
        await handler(node, stubs, processes, "goodHandler", ["g1", "g2"], "normal")
        await handler(node, stubs, processes, "badHandler", ["b1"], "duplicate")
        await eventually(lambda: ids(api, "good") == {"g1", "g2"}, within=10, what="good")
        await eventually(
            lambda: events(api, "DiscoveryHandlerCutOff", "bad") != [],
            within=10,
            what="the cut-off Event",
        )
        (event,) = events(api, "DiscoveryHandlerCutOff", "bad")
        assert event["involvedObject"]["namespace"] == "default"
        assert event["type"] == "Warning"
        assert "discovery handler badHandler at" in event["message"]
        assert "appears twice in one list" in event["message"]
        assert ids(api, "bad") == set()
        assert events(api, "DiscoveryHandlerCutOff", "good") == []
        assert ids(api, "good") == {"g1", "g2"}
    finally:
        await node.stop()
