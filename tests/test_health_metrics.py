"""Issue 15: /healthz, /readyz and /metrics during allocations, a blocked loop failing the
liveness probe, JSON logs without discoveryProperties values, ``akri version``."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.health import HealthServer
from tests.agent_process import AgentProcess, akri_command, clean_env
from tests.apiserver import ApiServerDouble
from tests.dp_nodes import one_device_configuration, start_dp_node
from tests.k8s_nodes import CRDS

IL = "akri.sh/cam-8120fe"
CL = "akri.sh/cam"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def fetch(url: str) -> tuple[int, str]:
    return await asyncio.to_thread(get, url)


async def until(check: Callable[[], Awaitable[bool]], what: str, within: float = 10.0) -> None:
    """Poll ``check`` (HTTP from a thread: the agent under test shares this loop)."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {within}s: {what}")
        await asyncio.sleep(0.05)


async def ready(url: str) -> bool:
    return (await fetch(url))[0] == 200


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    result = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            result[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return result


def value(
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def test_pages() -> None:
    problems: list[str] = []
    server = HealthServer("127.0.0.1", 0, lambda: problems, lambda: b"m 1\n")
    assert server.page("GET", "/healthz")[0] == 200
    assert server.page("GET", "/readyz")[:2] == (200, "text/plain")
    problems.append("DRA driver not registered with kubelet")
    status, _type, body = server.page("GET", "/readyz?verbose")
    assert status == 503 and b"DRA driver not registered" in body
    assert server.page("GET", "/metrics")[2] == b"m 1\n"
    assert server.page("POST", "/healthz")[0] == 405
    assert server.page("GET", "/nope")[0] == 404


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def test_probes_and_metrics_during_allocations(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(one_device_configuration("cam", ("foo0",), 3))
    port = free_port()
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        # the same node again, with its health port (the fixture's settings have it off)
        settings = replace(node.agent.settings, health_port=port, health_address="127.0.0.1")
        await node.restart_agent(settings)
        base = f"http://127.0.0.1:{port}"
        await node.kubelet.wait_registered(IL, timeout=10)
        await node.kubelet.wait_registered(CL, timeout=10)
        await until(lambda: ready(f"{base}/readyz"), "ready")
        assert (await fetch(f"{base}/healthz")) == (200, "ok\n")

        pod1 = await node.kubelet.admit_pod("default", "il", [("c", {IL: 1})])
        pod2 = await node.kubelet.admit_pod("default", "cl", [("c", {CL: 1})])
        assert pod1.admitted and pod2.admitted
        status, text = await fetch(f"{base}/metrics")
        assert status == 200
        found = samples(text)
        instance = IL.removeprefix("akri.sh/")
        slot = {"namespace": "default", "instance": instance}
        assert value(found, "akri_instance_slots", **slot, holder="instance") == 1
        assert value(found, "akri_instance_slots", **slot, holder="configuration") == 1
        assert value(found, "akri_instance_slots", **slot, holder="free") == 1
        assert value(found, "akri_instance_count", configuration="cam", is_shared="true") == 1
        assert value(found, "akri_allocate_seconds_count", plugin="instance") >= 1
        assert value(found, "akri_allocate_seconds_count", plugin="configuration") >= 1
        assert value(found, "akri_slot_writes_total") >= 2
        assert (
            value(
                found,
                "akri_discovery_response_result",
                discovery_handler_name="debugEcho",
                response_result="success",
            )
            >= 1
        )
        state = {"configuration": "default/cam", "discovery_handler_name": "debugEcho"}
        assert value(found, "akri_discovery_handler_state", **state, state="ok") == 1
        # a kubelet restart: not ready until the plugins registered again, then counted
        await node.kubelet.restart()

        async def reregistered() -> bool:
            found = samples((await fetch(f"{base}/metrics"))[1])
            key = ("akri_kubelet_reregistrations_total", (("plugin", "device_plugin"),))
            return found.get(key) == 1

        await until(reregistered, "re-registration counted")
        await until(lambda: ready(f"{base}/readyz"), "ready again")
    finally:
        await node.stop()


async def test_a_blocked_loop_fails_the_liveness_probe(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(one_device_configuration("cam", ("foo0",), 1))
    port = free_port()
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        settings = replace(node.agent.settings, health_port=port, health_address="127.0.0.1")
        await node.restart_agent(settings)
        url = f"http://127.0.0.1:{port}/healthz"
        assert (await fetch(url)) == (200, "ok\n")

        def probe_soon() -> tuple[int, str]:
            time.sleep(0.3)  # while the loop is blocked below
            return get(url, 1.0)  # kubelet's default probe timeout

        # submitted now (run_in_executor does not wait for the loop), then the loop blocks
        probe = asyncio.get_running_loop().run_in_executor(None, probe_soon)
        time.sleep(2.5)  # the agent's loop is blocked (as a stuck handler would block it)
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            await probe
        assert (await fetch(url)) == (200, "ok\n")  # the loop turns again
    finally:
        await node.stop()


def test_settings_default_the_health_port_by_mode() -> None:
    from agent.settings import AGENT_OPTIONS, AgentSettings, resolve

    class Args:
        pass

    cluster = AgentSettings.from_values(resolve(Args(), AGENT_OPTIONS, {}))  # type: ignore[arg-type]
    local = AgentSettings.from_values(resolve(Args(), AGENT_OPTIONS, {"AKRI_LOCAL": "1"}))  # type: ignore[arg-type]
    assert (cluster.health_port, local.health_port) == (8080, 0)
    asked = resolve(Args(), AGENT_OPTIONS, {"AKRI_LOCAL": "1", "AKRI_HEALTH_PORT": "9100"})  # type: ignore[arg-type]
    assert AgentSettings.from_values(asked).health_port == 9100


SECRET = "s3cr3t-pa55word"


def test_json_logs_parse_and_never_carry_discovery_properties(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: echo}\nspec:\n"
        "  discoveryHandler:\n    name: debugEcho\n"
        '    discoveryDetails: \'descriptions: ["a", "b"]\'\n'
        f"    discoveryProperties:\n    - name: password\n      value: {SECRET}\n"
        "  capacity: 1\n"
    )
    port = free_port()
    agent = AgentProcess(
        [
            "--local",
            "--state-dir",
            str(tmp_path / "state"),
            "--config",
            str(config),
            "--node-name",
            "n1",
            "--discovery-handlers-dir",
            str(tmp_path / "dh"),
            "--debug-echo-availability-file",
            str(tmp_path / "avail"),
            "--log-format",
            "json",
            "--log-level",
            "DEBUG",
            "--health-port",
            str(port),
            "--health-address",
            "127.0.0.1",
        ],
        label="agent (json logs)",
    )
    try:
        agent.wait_for_log('"instance": "echo-', timeout=10)
        status, text = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and SECRET not in text
        assert agent.stop() == 0
    finally:
        agent.cleanup()
    lines = [line for line in agent.lines if line.strip()]
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message", "node"} <= set(e) for e in entries)
    assert any(e.get("configuration") == "default/echo" for e in entries)
    assert not [line for line in lines if SECRET in line]


def test_version() -> None:
    import subprocess

    for args in (["version"], ["--version"]):
        done = subprocess.run(
            akri_command(*args), capture_output=True, text=True, env=clean_env(), timeout=30
        )
        assert done.returncode == 0 and done.stdout.startswith("akri 0."), done


def test_health_port_flag_is_validated() -> None:
    import subprocess

    done = subprocess.run(
        akri_command("agent", "--local", "--health-port", "70000"),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert done.returncode == 2 and "must be 0 (off) to 65535" in done.stderr
