"""Issue 15: /healthz, /readyz and /metrics during allocations, a blocked loop failing the
liveness probe, JSON logs without discoveryProperties values, ``akri version``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.core.kube import make_kube_client
from agent.core.store.cas import DEFAULT_RETRY
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.node.app import Agent
from agent.ops.health import HealthServer
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.kubelet_double import KubeletDouble
from tests.harness.agent_process import AgentProcess, akri_command, clean_env
from tests.harness.dp_nodes import node_settings, one_device_configuration, start_dp_node
from tests.harness.k8s_nodes import CRDS, eventually
from tests.node.dra.test_dra_e2e import claim_and_prepare, published

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


def value_or_zero(
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """A counter's value, 0 when it has no sample yet (the counters are process-wide: other
    tests in this process may have added to them, so the checks below compare deltas)."""
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = await fetch(f"{base}/metrics")
    assert status == 200, text
    return samples(text)


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
        # the restarted agent's device lists reach kubelet a moment after it registers (the
        # scheduler sends no pod before kubelet posts them allocatable: neither does the test;
        # seen admitting too early on a loaded machine)
        await eventually(
            lambda: node.kubelet.allocatable(IL) > 0 and node.kubelet.allocatable(CL) > 0,
            30,
            "allocatable",
        )

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
        assert value(found, "akri_slot_writes_total", operation="claim") >= 2
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


async def test_probes_answer_while_the_store_waits_for_the_crds(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Before: the health server started after the store, which waits up to 300 s for the
    CRDs, so the liveness probe failed (connection refused) and kubelet restarted a
    starting agent in a loop; /readyz could never say "starting"."""
    api.create(one_device_configuration("cam", ("foo0",), 1))
    api.fail(404, verb="list", resource="configurations", times=None)  # CRDs not served yet
    port = free_port()
    base = Path(tempfile.mkdtemp(prefix="node-a-", dir="/tmp"))
    settings = replace(
        node_settings(api, "node-a", base), health_port=port, health_address="127.0.0.1"
    )
    assert settings.device_plugin_dir is not None
    settings.device_plugin_dir.mkdir(parents=True)
    kubelet = KubeletDouble(
        settings.device_plugin_dir, settings.pod_resources_socket, reregistration="kubelet"
    )
    await kubelet.start()
    store = KubernetesInstanceStore(
        make_kube_client(settings.kubeconfig), KubernetesSettings("node-a", request_timeout=5)
    )
    agent = Agent(settings, store, freeze_gc=False)
    starting = asyncio.create_task(agent.start())
    url = f"http://127.0.0.1:{port}"
    try:
        # the store has been refused twice: it is waiting for the CRDs
        await eventually(
            lambda: len(api.requests_for("list", "configurations")) >= 2, what="two lists"
        )
        assert (await fetch(f"{url}/healthz")) == (200, "ok\n")
        status, body = await fetch(f"{url}/readyz")
        assert status == 503 and "not ready: starting: the store has not synced" in body, body
        assert (await fetch(f"{url}/metrics"))[0] == 200  # scraping a starting agent works
        assert not starting.done()
        api.clear_faults()  # the CRDs are installed
        await asyncio.wait_for(starting, 30)
        await kubelet.wait_registered(IL, timeout=10)
        await until(lambda: ready(f"{url}/readyz"), "ready once synced and registered")
    finally:
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
        await agent.stop()
        await kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_busy_health_port_stops_a_cluster_agent_with_a_clear_message(tmp_path: Path) -> None:
    """Before: the agent logged a warning and ran without its port, so with hostNetwork and
    the port taken on the node the liveness probe failed forever (restart after restart)."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(  # never reached: the health port is the first thing bound
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {}}]\n"
    )
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            akri_command(
                "agent", "--kubeconfig", str(kubeconfig), "--node-name", "n1",
                "--health-port", str(port), "--health-address", "127.0.0.1",
                "--device-plugin-dir", str(tmp_path / "dp"),
                "--pod-resources-socket", str(tmp_path / "pr.sock"),
                "--plugins-registry-dir", str(tmp_path / "reg"),
                "--dra-plugin-dir", str(tmp_path / "dra"), "--cdi-dir", str(tmp_path / "cdi"),
                "--discovery-handlers-dir", str(tmp_path / "dh"),
            ),
            capture_output=True, text=True, env=clean_env(), timeout=30,
        )  # fmt: skip
    assert done.returncode == 5, done.stderr
    assert f"health port 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "--health-port" in done.stderr and "in use" in done.stderr, done.stderr


async def test_dra_conflict_reclaim_and_api_error_metrics(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """The metrics the first test does not reach: discovery response time, the
    NodePrepareResources histogram, the ``dra`` holder, CAS conflicts and give-ups, API
    errors by code, reclaimed slots; and /readyz waiting for the DRA driver."""
    api.create(one_device_configuration("cam", ("foo0",), 3))
    port = free_port()
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    dra_kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    try:
        settings = replace(node.agent.settings, health_port=port, health_address="127.0.0.1")
        await node.restart_agent(settings)
        base = f"http://127.0.0.1:{port}"
        await node.kubelet.wait_registered(IL, timeout=10)
        await node.kubelet.wait_registered(CL, timeout=10)

        async def only_dra_missing() -> bool:
            status, body = await fetch(f"{base}/readyz")
            return status == 503 and body == "not ready: DRA driver not registered with kubelet\n"

        await until(only_dra_missing, "not ready: only the DRA driver unregistered")
        await dra_kubelet.start()
        await dra_kubelet.wait_for_registration("akri.sh", timeout=5)
        await until(lambda: ready(f"{base}/readyz"), "ready once the DRA driver registered")

        before = await scrape(base)
        response_time = value(
            before, "akri_discovery_response_time_count", configuration="default/cam"
        )
        assert response_time >= 1
        assert value(before, "akri_discovery_response_time_bucket",
                     configuration="default/cam", le="+Inf") == response_time  # fmt: skip

        # a DRA claim prepared through one stale write (409, retried on a fresh read)
        await eventually(lambda: len(published(api).get("cam-8120fe", [])) == 3)
        api.fail(409, verb="update", resource="instances", times=1)
        uid, results = await claim_and_prepare(api, dra_kubelet, "node-a", "c1")
        assert results[uid].devices
        found = await scrape(base)
        slot = {"namespace": "default", "instance": "cam-8120fe"}
        assert value(found, "akri_instance_slots", **slot, holder="dra") == 1
        assert value(found, "akri_instance_slots", **slot, holder="free") == 2

        def grew(name: str, by: float = 1, **labels: str) -> bool:
            return value_or_zero(found, name, **labels) >= value_or_zero(
                before, name, **labels) + by  # fmt: skip

        assert grew("akri_node_prepare_resources_seconds_count")
        assert grew("akri_node_prepare_resources_seconds_bucket", le="+Inf")
        assert grew("akri_slot_write_conflicts_total", operation="claim")
        assert grew("akri_api_request_errors_total", code="409")
        assert not grew("akri_slot_write_retries_exhausted_total", operation="claim")

        # every write refused: the Allocate gives up after the retry policy's attempts
        before = found
        api.fail(409, verb="update", resource="instances", times=None)
        refused = await node.kubelet.admit_pod("default", "refused", [("c", {IL: 1})])
        api.clear_faults()
        assert not refused.admitted
        found = await scrape(base)
        assert grew("akri_slot_write_retries_exhausted_total", operation="claim")
        assert grew("akri_slot_write_conflicts_total", by=DEFAULT_RETRY.attempts, operation="claim")

        # a pod that is gone: its slot is reclaimed and counted
        before = found
        pod = await node.kubelet.admit_pod("default", "il", [("c", {IL: 1})])
        assert pod.admitted
        await node.kubelet.delete_pod("default", "il")

        async def reclaimed() -> bool:
            nonlocal found
            found = await scrape(base)
            return grew("akri_slots_reclaimed_total", kind="device_plugin")

        await until(reclaimed, "the gone pod's slot reclaimed and counted")
    finally:
        await dra_kubelet.stop()
        await node.stop()


def test_settings_default_the_health_port_by_mode() -> None:
    from agent.node.settings import AGENT_OPTIONS, CLUSTER_HEALTH_PORT, AgentSettings, resolve

    class Args:
        pass

    cluster = AgentSettings.from_values(resolve(Args(), AGENT_OPTIONS, {}))  # type: ignore[arg-type]
    local = AgentSettings.from_values(resolve(Args(), AGENT_OPTIONS, {"AKRI_LOCAL": "1"}))  # type: ignore[arg-type]
    assert (cluster.health_port, local.health_port) == (CLUSTER_HEALTH_PORT, 0)
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


def test_refused_slice_writes_and_dropped_events_are_exported() -> None:
    from types import SimpleNamespace

    from agent.node.metrics import NodeCollector

    agent = SimpleNamespace(
        publisher=SimpleNamespace(refused_writes=3),
        store=SimpleNamespace(events_dropped=2),
        reclaimer=None,
        dra_reclaimer=None,
        plugins=None,
        dra=None,
    )
    exported = {
        sample.name: sample.value
        for family in NodeCollector(agent)._node_counters()  # type: ignore[arg-type]
        for sample in family.samples
    }
    assert exported["akri_resource_slice_writes_refused_total"] == 3
    assert exported["akri_events_dropped_total"] == 2
    local = SimpleNamespace(  # local store: no Events
        publisher=None,
        store=SimpleNamespace(),
        reclaimer=None,
        dra_reclaimer=None,
        plugins=None,
        dra=None,
    )
    exported = {
        sample.name: sample.value
        for family in NodeCollector(local)._node_counters()  # type: ignore[arg-type]
        for sample in family.samples
    }
    assert exported["akri_resource_slice_writes_refused_total"] == 0
    assert exported["akri_events_dropped_total"] == 0
