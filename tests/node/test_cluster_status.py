"""``akri status --kubeconfig`` against the API-server double: Configurations and Instances
of every namespace, slot holders and health, table and JSON; a clear error without a
cluster."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.kube.kubeconfig import load_config
from agent.core.model.instance import Instance
from agent.node.status import StatusSource, choose_source
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.agent_process import clean_env
from tests.harness.dp_nodes import one_device_configuration
from tests.harness.k8s_nodes import CRDS


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def no_cluster_env(**overrides: str) -> dict[str, str]:
    """An environment with no cluster configured (no $KUBECONFIG, not in a pod)."""
    env = clean_env()
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        env.pop(name, None)
    env.update(overrides)
    return env


async def akri(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=no_cluster_env() if env is None else env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_status_reads_the_cluster(api: ApiServerDouble, tmp_path: Path) -> None:
    api.create(one_device_configuration("cam", ("foo0",), 2))
    other = one_device_configuration("cam", ("foo0",), 1)
    other["metadata"]["namespace"] = "lab"
    api.create(other)
    instance = Instance(
        name="cam-8120fe",
        configuration_name="cam",
        capacity=2,
        shared=True,
        nodes=("node-a", "node-b"),
        device_usage={"cam-8120fe-0": "node-a", "cam-8120fe-1": ""},
        annotations={"akri.sh/offline": "node-b"},
    )
    api.create(instance.to_dict())
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")

    code, out, err = await akri("status", "--kubeconfig", str(kubeconfig))
    assert code == 0, err
    assert "lab/cam" in out and "debugEcho" in out
    line = next(row for row in out.splitlines() if row.startswith("cam-8120fe"))
    assert "node-a,node-b" in line and "offline (node-b)" in line and "0=node-a 1=-" in line
    config_row = next(row for row in out.splitlines() if row.startswith("cam "))
    assert config_row.split()[-2:] == ["1", "1/2"]  # one Instance, 1 of 2 slots used

    code, out, err = await akri("status", "--kubeconfig", str(kubeconfig), "-o", "json")
    assert code == 0, err
    body = json.loads(out)
    (item,) = body["instances"]
    assert item["spec"]["deviceUsage"] == {"cam-8120fe-0": "node-a", "cam-8120fe-1": ""}
    # the Configurations too (before: only the Instances), CRD-shaped
    configurations = body["configurations"]
    assert [c["metadata"] for c in configurations] == [
        {"name": "cam"},
        {"name": "cam", "namespace": "lab"},
    ]
    assert configurations[0]["spec"]["discoveryHandler"]["name"] == "debugEcho"
    assert configurations[0]["spec"]["capacity"] == 2

    code, out, _err = await akri("status", "--kubeconfig", str(kubeconfig), "-n", "lab")
    assert code == 0 and "cam-8120fe" not in out and "lab/cam" in out


async def test_status_without_a_reachable_cluster_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "none.yaml"
    code, _out, err = await akri("status", "--kubeconfig", str(missing))
    assert code == 4 and "cannot read the cluster" in err


async def test_status_reads_the_cluster_that_kubeconfig_names(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Before: without --kubeconfig/--cluster, ``akri status`` read /var/lib/akri/state even
    with $KUBECONFIG set (the issue: default in-cluster/KUBECONFIG)."""
    api.create(one_device_configuration("cam", ("foo0",), 2))
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    for variable in ("KUBECONFIG", "AKRI_KUBECONFIG"):
        env = no_cluster_env(**{variable: str(kubeconfig)})
        code, out, err = await akri("status", "-o", "json", env=env)
        assert code == 0, err
        assert [c["metadata"]["name"] for c in json.loads(out)["configurations"]] == ["cam"]
    # --local (or --state-dir) reads the state directory even then
    state = tmp_path / "state"
    state.mkdir()
    env = no_cluster_env(KUBECONFIG=str(kubeconfig), AKRI_STATE_DIR=str(state))
    code, out, err = await akri("status", "--local", "-o", "json", env=env)
    assert (code, json.loads(out)) == (0, []), err
    code, out, err = await akri("status", "--state-dir", str(state), env=env)
    assert code == 0 and "(no instances)" in out, err


async def test_status_without_a_cluster_reads_the_state_directory(tmp_path: Path) -> None:
    state = tmp_path / "state"
    code, _out, err = await akri("status", env=no_cluster_env(AKRI_STATE_DIR=str(state)))
    assert code == 1 and f"state directory {state} does not exist" in err
    assert "$AKRI_STATE_DIR is set" in err and "--kubeconfig" in err  # says what else to do
    state.mkdir()
    code, out, err = await akri("status", env=no_cluster_env(AKRI_STATE_DIR=str(state)))
    assert code == 0 and "(no instances)" in out, err


async def test_contradicting_status_flags_are_refused() -> None:
    code, _out, err = await akri("status", "--kubeconfig", "k", "--local")
    assert code == 2 and "--kubeconfig read the cluster, --local a local state" in err


def test_status_source_choice(tmp_path: Path) -> None:
    pod = tmp_path / "serviceaccount"
    pod.mkdir()
    (pod / "token").write_text("t")
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}

    def kind(environ: dict[str, str], **flags: object) -> str:
        asked: dict[str, object] = {
            "kubeconfig": None, "cluster": False, "local": False, "state_dir": None, **flags
        }  # fmt: skip
        return choose_source(
            environ=environ,
            service_account_dir=pod,
            **asked,  # type: ignore[arg-type]
        ).kind

    assert kind({}) == "local"
    assert kind(in_pod) == "cluster"  # `kubectl exec` into the agent
    assert kind({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "local"  # no port: not a pod
    assert kind({"KUBECONFIG": "/k"}) == "cluster"
    assert kind({"AKRI_KUBECONFIG": "/k"}) == "cluster"
    assert kind({"KUBECONFIG": "/k"}, local=True) == "local"
    assert kind(in_pod, state_dir=tmp_path) == "local"
    assert kind({"KUBECONFIG": "/k", "AKRI_LOCAL": "true"}) == "local"
    assert kind({}, cluster=True) == "cluster"
    assert kind({}, kubeconfig="/k") == "cluster"
    (pod / "token").unlink()
    assert kind(in_pod) == "local"


def test_a_local_agents_state_dir_wins_over_an_exported_kubeconfig(tmp_path: Path) -> None:
    """A developer with KUBECONFIG exported (for kubectl) runs a local agent with
    AKRI_STATE_DIR set: `akri status` must read that agent's state, not the cluster.
    Before: the cluster."""
    assert choose_source(
        kubeconfig=None,
        cluster=False,
        local=False,
        state_dir=None,
        environ={"KUBECONFIG": "/home/dev/.kube/config", "AKRI_STATE_DIR": str(tmp_path)},
    ) == StatusSource("local", "$AKRI_STATE_DIR is set")
    # asked explicitly, the cluster it is
    assert (
        choose_source(
            kubeconfig=None,
            cluster=True,
            local=False,
            state_dir=None,
            environ={"AKRI_STATE_DIR": str(tmp_path)},
        ).kind
        == "cluster"
    )


def test_in_a_pod_the_reason_names_the_service_account_not_kubeconfig(tmp_path: Path) -> None:
    """The client takes the pod's service account over $KUBECONFIG (load_config); the
    reason said "$KUBECONFIG is set" although $KUBECONFIG was not used."""
    (tmp_path / "token").write_text("t")
    environ = {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBECONFIG": "/etc/other/kubeconfig",
    }
    source = choose_source(
        kubeconfig=None,
        cluster=False,
        local=False,
        state_dir=None,
        environ=environ,
        service_account_dir=tmp_path,
    )
    assert source.kind == "cluster"
    assert source.reason.startswith(
        "running in a pod (service account) ($KUBECONFIG is not used in a pod)"
    )
    # the client agrees: it loads the in-cluster settings, not the named file
    config = load_config(environ=environ, service_account_dir=tmp_path)
    assert (config.host, config.port) == ("10.0.0.1", 443)


# -- offline devices (issue 34.9) --------------------------------------------------------------
def test_a_cluster_agent_s_offline_device_shows_in_status(tmp_path: Path) -> None:
    """A real agent (DRA path) against the API-server double: once its device goes, its
    slices carry the offline taint and ``akri status`` says so (before: ``ok``, as nothing is
    written to the Instance during the grace); back to ``ok`` when the device returns."""
    import subprocess

    from tests.doubles.apiserver.threaded import ThreadedApiServer
    from tests.harness.agent_process import AgentProcess, akri_command, poll_until
    from tests.harness.k8s_nodes import debug_echo_configuration

    kubelet = tmp_path / "node-a"
    available = tmp_path / "available"
    with ThreadedApiServer(crds=CRDS) as server:
        server.create(debug_echo_configuration("cam", descriptions=("a",), capacity=2))
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        agent = AgentProcess(
            [
                "--kubeconfig", str(kubeconfig), "--node-name", "node-a", "--debug-echo",
                "--debug-echo-availability-file", str(available),
                "--shared-offline-grace", "120", "--health-port", "0",
                "--device-plugin-dir", str(kubelet / "device-plugins"),
                "--pod-resources-socket", str(kubelet / "pod-resources" / "kubelet.sock"),
                "--plugins-registry-dir", str(kubelet / "plugins_registry"),
                "--dra-plugin-dir", str(kubelet / "dra"), "--cdi-dir", str(kubelet / "cdi"),
                "--discovery-handlers-dir", str(kubelet / "akri"),
            ]
        )  # fmt: skip

        def state() -> str:
            done = subprocess.run(
                akri_command("status", "--kubeconfig", str(kubeconfig)),
                capture_output=True, text=True, env=no_cluster_env(), timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            rows = [line.split() for line in done.stdout.splitlines() if line.startswith("cam-")]
            return " ".join(rows[0][6:-2]) if len(rows) == 1 else ""

        try:
            agent.wait_for_log(r"instance cam-[0-9a-f]{6} added", timeout=30)
            poll_until(lambda: state() == "ok", timeout=30, message=agent.describe)
            available.write_text("OFFLINE")
            poll_until(lambda: state() == "offline (node-a)", timeout=30, message=agent.describe)
            available.write_text("ONLINE")
            poll_until(lambda: state() == "ok", timeout=30, message=agent.describe)
        finally:
            agent.cleanup()


def node(name: str, capacity: dict[str, str], allocatable: dict[str, str]) -> dict[str, object]:
    return {
        "metadata": {"name": name},
        "status": {"capacity": capacity, "allocatable": allocatable},
    }


def test_kubelet_s_view_of_device_plugins_shows_unhealthy_slots() -> None:
    """Device-plugin nodes: kubelet counts Unhealthy devices in capacity, not in allocatable."""
    from agent.node.status import cluster_offline

    free = Instance(
        name="cam-8120fe",
        configuration_name="cam",
        capacity=2,
        shared=True,
        nodes=("node-a", "node-b"),
        device_usage={"cam-8120fe-0": "node-b", "cam-8120fe-1": ""},
    )
    taken = free.evolve(
        name="cam-a19705",
        device_usage={"cam-a19705-0": "node-b", "cam-a19705-1": "C:cam-0:node-b"},
    )
    nodes = [
        node("node-a", {"akri.sh/cam-8120fe": "2", "akri.sh/cam-a19705": "2"},
             {"akri.sh/cam-8120fe": "0", "akri.sh/cam-a19705": "0"}),
        node("node-b", {"akri.sh/cam-8120fe": "2"}, {"akri.sh/cam-8120fe": "2"}),
        node("node-c", {"akri.sh/cam-8120fe": "2"}, {"akri.sh/cam-8120fe": "0"}),  # not in nodes
    ]  # fmt: skip
    found = cluster_offline([free, taken], nodes, [])
    # a slot is free, yet kubelet has none healthy on node-a: offline there (or no agent);
    # the other Instance's slots are all held elsewhere: Unhealthy on node-a by design
    assert found == {free.key: ["unhealthy (node-a, kubelet)"]}
    draining = free.evolve(annotations={"akri.sh/draining": "node-a"})
    assert cluster_offline([draining], nodes, []) == {}  # its mark says so already


def test_dra_taints_name_the_node_and_long_names_match() -> None:
    from agent.node.status import cluster_offline

    long_name = "c" * 60 + "-8120fe"
    instance = Instance(
        name=long_name, configuration_name="c" * 60, capacity=1, shared=False,
        nodes=("node-a",), device_usage={f"{long_name}-0": ""},
    )  # fmt: skip
    device = {
        "name": "d0",
        "attributes": {"instance": {"string": long_name[:64]}},
        "taints": [{"key": "akri.sh/offline", "effect": "NoSchedule", "value": "node-a"}],
    }
    evicting = {**device, "taints": [{"key": "akri.sh/offline", "effect": "NoExecute"}]}
    slices = [
        {"spec": {"driver": "akri.sh", "nodeName": "node-a", "devices": [device]}},
        {"spec": {"driver": "other.example", "devices": [device]}},
        {"spec": {"driver": "akri.sh", "devices": [evicting]}},  # draining: its own mark
    ]
    assert cluster_offline([instance], [], slices) == {instance.key: ["offline (node-a)"]}
