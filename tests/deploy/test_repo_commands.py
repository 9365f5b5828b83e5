"""Every shell block of README.md and docs/*.md is run as written, or excluded here with a reason.

Issue 34.10: a block that fails on first paste is a bug. Each block is taken from the page
itself (never a copy kept here) and run with bash from the repository root:

- local blocks (the quick start, the external handler example) in a mount namespace whose
  ``/tmp`` is a fresh directory, so their fixed paths (``/tmp/akri-state``, ...) meet no other
  run on the machine (root only, as CI runs; skipped with the reason elsewhere);
- cluster blocks with ``kubectl`` against the API-server double, and the agent processes the
  DaemonSet would start (its container's environment, from the object the block applied).

:data:`BLOCKS` says, for every block, which test runs it, or why none does; a block added to a
page without an entry there fails :func:`test_every_shell_block_is_run_or_excluded`, and the
excluded ones are listed (skipped, with their reason) by :func:`test_excluded_block`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.apiserver.threaded import ThreadedApiServer
from tests.harness.agent_process import AgentProcess, clean_env, poll_until
from tests.paths import REPO

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.M | re.S)
VENV_BIN = Path(sys.executable).parent
KUBECTL = shutil.which("kubectl", path=str(VENV_BIN)) or shutil.which("kubectl")

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
needs_private_tmp = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")),
    reason="runs the block in a mount namespace with a private /tmp: needs root, unshare and "
    "nsenter (CI runs as root)",
)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    text: str

    @property
    def first_line(self) -> str:
        return self.text.strip().splitlines()[0]


def all_blocks() -> list[Block]:
    return [
        Block(str(page.relative_to(ROOT)), text)
        for page in PAGES
        for text in SHELL_BLOCK.findall(page.read_text())
    ]


# (page, start of the block's first line) -> how it is run, or "excluded: why"
BLOCKS: dict[tuple[str, str], str] = {
    ("README.md", "bash scripts/run-local.sh"): "test_the_quick_start_runs_as_written",
    ("README.md", ".venv/bin/akri status"): "test_the_quick_start_runs_as_written",
    ("README.md", "bash scripts/test.sh"): "test_ci_runs_the_readme_test_command (CI runs it "
    "as written; it is the command that runs this test)",
    ("README.md", "helm install akri deploy/helm/akri"): (
        "test_helm_lifecycle.py::test_the_readme_helm_blocks_run_as_written"
    ),
    ("README.md", "helm uninstall akri -n akri --wait"): (
        "test_helm_lifecycle.py::test_the_readme_helm_blocks_run_as_written"
    ),
    ("docs/install.md", "kubectl get akric -A -o yaml > akri-configurations.yaml"): (
        "excluded: it moves a running Akri release (Akri's own chart and images, which do not "
        "run here) to ours; its last two commands run elsewhere: `kubectl replace -f crds/` "
        "in tests/deploy/test_crd_install.py, helm install with a values file in "
        "tests/deploy/test_helm_values.py (Akri's values.yaml) and test_helm_lifecycle.py"
    ),
    ("README.md", "kubectl apply -k deploy/overlays/debug-echo"): (
        "test_the_cluster_install_runs_as_written"
    ),
    ("docs/handlers.md", ".venv/bin/akri agent --local --no-debug-echo"): (
        "test_the_external_handler_example_runs_as_written"
    ),
    ("docs/install.md", "kubectl get akrii -A -o jsonpath"): (
        "test_the_uninstall_finalizer_loop_runs_as_written"
    ),
    ("docs/install.md", "kubectl delete configurations.akri.sh --all -A"): (
        "tests/deploy/test_uninstall.py::test_the_uninstall_in_the_documented_order_ends_by_itself"
    ),
    ("docs/crds.md", "kubectl apply -f crds/"): (
        "tests/deploy/test_crd_install.py::test_the_install_block_runs_as_written"
    ),
    ("docs/crds.md", "kubectl get akric -A -o jsonpath"): (
        "test_the_capacity_check_runs_as_written"
    ),
    ("docs/dra.md", "kubectl apply -f deploy/base/deviceclass.yaml"): (
        "test_the_dra_usage_block_runs_as_written"
    ),
    ("docs/metrics.md", ".venv/bin/python -c 'import sys, yaml;"): (
        "test_the_promtool_block_runs_as_written"
    ),
    ("docs/install.md", "pip install ."): "excluded: installs into whichever Python is active; "
    "scripts/test.sh and scripts/run-local.sh make the same install into .venv, and the quick "
    "start's test runs run-local.sh",
    ("docs/crds.md", ".venv/bin/python -m pytest tests/deploy/test_crds.py"): "excluded: a test "
    "command; the suite runs tests/deploy/test_crds.py itself",
    ("docs/metrics.md", "kubectl apply -k deploy/overlays/monitoring"): "excluded: needs the "
    "Prometheus Operator's CRDs (monitoring.coreos.com); tests/deploy/test_monitoring.py renders "
    "and checks that overlay",
    ("docs/mqtt.md", "mosquitto_pub"): "excluded: needs an MQTT broker on localhost; "
    "tests/handlers/test_mqtt_discovery.py publishes such announcements to a mosquitto it starts",
    ("docs/performance.md", ".venv/bin/python benchmarks/run.py --quick"): "excluded: benchmarks "
    "run for minutes; their figures are in benchmarks/results-*.json",
    ("docs/performance.md", ".venv/bin/python -m benchmarks.instance_cost"): "excluded: a "
    "benchmark of minutes; its figures are in benchmarks/results-instance-cost.json",
    ("docs/performance.md", ".venv/bin/python -m benchmarks.fleet --kubeconfig"): "excluded: "
    "needs a real API server; the same benchmark runs on the double as benchmarks/run.py "
    "--only fleet (figures in benchmarks/results-fleet.json)",
    ("docs/performance.md", "python3 -m venv /tmp/govenv"): "excluded: builds the Go peer "
    "(a Go toolchain from PyPI and a clone of squat/generic-device-plugin) for the benchmark",
    ("docs/performance.md", ".venv/bin/python benchmarks/run.py --only peer"): "excluded: a "
    "benchmark against the Go peer built by the block before",
}


def entry_for(block: Block) -> list[tuple[str, str]]:
    return [key for key in BLOCKS if key[0] == block.page and block.first_line.startswith(key[1])]


def block(page: str, starts: str) -> str:
    """The text of the one shell block of ``page`` whose first line starts with ``starts``."""
    (found,) = [b.text for b in all_blocks() if b.page == page and b.first_line.startswith(starts)]
    return found


def commands(text: str) -> list[str]:
    """A block's commands, one per line as a user pastes them (continuation lines joined)."""
    return [c for c in re.sub(r"\\\n", " ", text).splitlines() if c.strip()]


def test_every_shell_block_is_run_or_excluded() -> None:
    unhandled = [f"{b.page}: {b.first_line}" for b in all_blocks() if len(entry_for(b)) != 1]
    assert not unhandled, "add these blocks to BLOCKS (a test, or a reason): " + "; ".join(
        unhandled
    )
    stale = [key for key in BLOCKS if not any(key in entry_for(b) for b in all_blocks())]
    assert not stale, f"BLOCKS entries matching no block: {stale}"


@pytest.mark.parametrize(
    "key", [k for k, how in BLOCKS.items() if how.startswith("excluded:")], ids=" ".join
)
def test_excluded_block(key: tuple[str, str]) -> None:
    pytest.skip(f"{key[0]}: `{key[1]}` {BLOCKS[key]}")


def test_ci_runs_the_readme_test_command() -> None:
    command = block("README.md", "bash scripts/test.sh").strip()
    assert command == "bash scripts/test.sh"
    ci_lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert command in ci_lines


# -- local blocks, in a private /tmp ---------------------------------------------------------


# `unshare ... bash -c BIND _ DIR BLOCK`: DIR becomes /tmp, then BLOCK runs as written
BIND = 'mount --bind "$1" /tmp && exec bash -c "$2"'


class PrivateTmp:
    """Shell blocks run from the repository root in one mount namespace whose ``/tmp`` is
    ``directory``. The first (:meth:`start`) makes the namespace; later ones enter it, as a
    second terminal of the same machine would see the same files."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir()
        self.directory = directory
        # a new terminal's PATH: the venv is not activated (the pages say .venv/bin/akri)
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != VENV_BIN]
        self.env = clean_env({"PATH": os.pathsep.join(path)})
        self.env.pop("VIRTUAL_ENV", None)
        self.first: AgentProcess | None = None

    def start(self, text: str, label: str) -> AgentProcess:
        assert self.first is None
        self.first = AgentProcess(
            ["_", str(self.directory), text],
            program=["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", BIND],
            env=self.env,
            cwd=ROOT,
            label=label,
            session=True,
        )
        return self.first

    def run(self, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """One command in the namespace of :meth:`start`'s process, to its end."""
        assert self.first is not None and self.first.running, self.first and self.first.describe()
        enter = ["nsenter", "-t", str(self.first.proc.pid), "-m", f"--wd={ROOT}"]
        return subprocess.run(
            [*enter, "bash", "-c", command],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )


@pytest.fixture
def private_tmp(tmp_path: Path) -> Iterator[PrivateTmp]:
    if str(ROOT).startswith("/tmp/"):
        pytest.skip("the repository is under /tmp, which the blocks' private /tmp would hide")
    shells = PrivateTmp(tmp_path / "tmp")
    try:
        yield shells
    finally:
        if shells.first is not None:
            shells.first.cleanup()


def status_table(result: subprocess.CompletedProcess[str]) -> list[list[str]]:
    assert result.returncode == 0, result.stderr
    return [line.split() for line in result.stdout.splitlines()[1:] if line.strip()]


@needs_private_tmp
def test_the_quick_start_runs_as_written(private_tmp: PrivateTmp) -> None:
    """The README's quick start in two terminals: the agent (installing .venv first), then
    the second block line by line, and Ctrl-C at the end."""
    first = block("README.md", "bash scripts/run-local.sh")
    second = commands(block("README.md", ".venv/bin/akri status"))
    agent = private_tmp.start(first, "quick start")
    # run-local.sh installs the project into .venv first (seconds to a minute)
    for _ in range(2):
        agent.wait_for_log(r"instance akri-debug-echo-foo-[0-9a-f]{6} added", timeout=240)
    table, as_json, offline, online = second

    rows = poll_until(
        lambda: [r for r in status_table(private_tmp.run(table)) if r[0].startswith("akri-")],
        timeout=30,
        message=agent.describe,
    )
    assert len(rows) == 2 and all(r[1] == "akri-debug-echo-foo" for r in rows), rows
    assert all(r[2] == "my-node" for r in rows), rows  # --node-name my-node
    objects = json.loads(private_tmp.run(as_json).stdout)
    assert sorted(o["spec"]["capacity"] for o in objects) == [2, 2]

    mark = agent.mark()
    assert private_tmp.run(offline).returncode == 0
    agent.wait_for_log(r"debugEcho reports 0 device\(s\)", since=mark, timeout=30)
    mark = agent.mark()
    assert private_tmp.run(online).returncode == 0
    agent.wait_for_log(r"debugEcho reports 2 device\(s\)", since=mark, timeout=30)

    agent.signal_all(2)  # Ctrl-C in the first terminal
    assert agent.wait_exit(10) == 0, agent.describe()
    assert not agent.matching("Traceback"), agent.describe()


@needs_private_tmp
def test_the_external_handler_example_runs_as_written(private_tmp: PrivateTmp) -> None:
    """Pasted at once: the agent and the handler start in the background, `akri status`
    waits for them and shows the handler's two devices."""
    text = block("docs/handlers.md", ".venv/bin/akri agent --local --no-debug-echo")
    if not (ROOT / ".venv" / "bin" / "akri").exists():
        pytest.skip("no .venv/bin/akri: the example follows the quick start, which makes it")
    shell = private_tmp.start(text, "external handler example")
    assert shell.wait_exit(60) == 0, shell.describe()  # `akri status --wait` returned 0
    rows = [line.split() for line in shell.lines if line.startswith("akri-debug-echo-foo-")]
    assert len(rows) == 2, shell.describe()
    assert all(row[6] == "ok" for row in rows), shell.describe()
    assert shell.matching("discovery handler debugEcho registered"), shell.describe()


# -- cluster blocks, against the API-server double -------------------------------------------


def kubectl_env(api: ApiServerDouble, home: Path) -> dict[str, str]:
    home.mkdir(exist_ok=True)
    kubeconfig = api.write_kubeconfig(home / "kubeconfig")
    path = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    return clean_env({"KUBECONFIG": str(kubeconfig), "HOME": str(home), "PATH": path})


def bash(command: str, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{output}"
    return done.stdout


def node_agent(
    api: ApiServerDouble,
    node: str,
    tmp: Path,
    home: Path,
    *,
    pod: dict[str, Any] | None = None,
    kubeconfig: Path | None = None,
) -> AgentProcess:
    """The agent the DaemonSet the block applied would start on ``node``: its container's
    arguments and environment, with the kubelet's directories under ``tmp``; given its
    ``pod``, the downward API's ``metadata.name`` and ``metadata.namespace`` too. As the
    administrator unless ``kubeconfig`` is given."""
    (daemonset,) = [d for d in api.list("daemonsets.apps") if d["metadata"]["name"] == "akri-agent"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    fields = {"spec.nodeName": node}
    if pod is not None:
        fields["metadata.name"] = pod["metadata"]["name"]
        fields["metadata.namespace"] = pod["metadata"]["namespace"]
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") in fields:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    assert env.get("AKRI_NODE_NAME") == node, container
    env.update(AKRI_LOG_FORMAT="text", AKRI_DEBUG_ECHO_AVAILABILITY_FILE=str(tmp / "available"))
    kubelet = tmp / node
    args = [
        *container["args"][1:],
        "--kubeconfig", str(kubeconfig or home / "kubeconfig"),
        "--device-plugin-dir", str(kubelet / "device-plugins"),
        "--pod-resources-socket", str(kubelet / "pod-resources" / "kubelet.sock"),
        "--plugins-registry-dir", str(kubelet / "plugins_registry"),
        "--dra-plugin-dir", str(kubelet / "dra"),
        "--cdi-dir", str(kubelet / "cdi"),
        "--discovery-handlers-dir", str(kubelet / "akri"),
        "--health-port", "0",
    ]  # fmt: skip
    assert container["args"][0] == "agent", container
    return AgentProcess(args, env=env, label=node)


@needs_kubectl
def test_the_cluster_install_runs_as_written(tmp_path: Path) -> None:
    """The README's two cluster commands against the API-server double (no CRDs preloaded),
    with two agents started as the applied DaemonSet would start them."""
    install, look = commands(block("README.md", "kubectl apply -k deploy/overlays/debug-echo"))
    with ThreadedApiServer() as api:
        env = kubectl_env(api, tmp_path / "home")
        out = bash(install, env)
        assert "daemonset.apps/akri-agent created" in out, out
        assert "configuration.akri.sh/akri-debug-echo-foo created" in out, out
        agents = [node_agent(api, n, tmp_path, tmp_path / "home") for n in ("node-a", "node-b")]
        try:

            def each_node_has_two() -> list[list[str]] | None:
                rows = [line.split() for line in bash(look, env).splitlines()[1:]]
                nodes = [row[3] for row in rows if row and row[0].startswith("akri-debug-echo")]
                has_both = all("node-a" in n and "node-b" in n for n in nodes)
                return rows if len(nodes) == 2 and has_both else None

            poll_until(
                each_node_has_two,
                timeout=60,
                interval=0.5,
                message=lambda: bash(look, env) + "\n".join(a.describe() for a in agents),
            )
        finally:
            for agent in agents:
                agent.cleanup()


@needs_kubectl
def test_the_uninstall_finalizer_loop_runs_as_written(tmp_path: Path) -> None:
    """Instances left terminating by gone agents: the loop removes their finalizers, in every
    namespace, and the API server then deletes them."""
    from tests.harness.k8s_nodes import CRDS

    loop = block("docs/install.md", "kubectl get akrii -A -o jsonpath")
    with ThreadedApiServer(crds=CRDS) as api:
        for namespace, name in (("default", "cam-1a2b3c"), ("lab", "cam-4d5e6f")):
            api.create(
                {
                    "apiVersion": "akri.sh/v0",
                    "kind": "Instance",
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "finalizers": ["akri.sh/slots"],
                    },
                    "spec": {
                        "configurationName": "cam",
                        "nodes": ["gone"],
                        "shared": False,
                        "capacity": 1,
                        "deviceUsage": {f"{name}-0": "gone"},
                    },
                }
            )
        env = kubectl_env(api, tmp_path / "home")
        bash("kubectl delete akrii --all -A --wait=false", env)
        assert len(api.list("instances.akri.sh")) == 2  # kept by the finalizer
        bash(loop, env)
        assert api.list("instances.akri.sh") == []


@needs_kubectl
def test_the_capacity_check_runs_as_written(tmp_path: Path) -> None:
    from tests.harness.k8s_nodes import akri_configuration_crd, debug_echo_configuration

    check = block("docs/crds.md", "kubectl get akric -A -o jsonpath")
    with ThreadedApiServer(crds=[akri_configuration_crd(tmp_path)]) as api:
        api.create(debug_echo_configuration("cam", capacity=2))
        api.create(debug_echo_configuration("too-many", capacity=5000))
        out = bash(check, kubectl_env(api, tmp_path / "home"))
    assert out.splitlines() == ["default/cam 2", "default/too-many 5000"]


@needs_kubectl
def test_the_dra_usage_block_runs_as_written(tmp_path: Path) -> None:
    """The DeviceClass and the example claim template and Pod are accepted as written."""
    from tests.harness.k8s_nodes import CRDS

    with ThreadedApiServer(crds=CRDS) as api:
        usage = block("docs/dra.md", "kubectl apply -f deploy/base/deviceclass.yaml")
        bash(usage, kubectl_env(api, tmp_path / "home"))
        assert [c["metadata"]["name"] for c in api.list("deviceclasses.resource.k8s.io")]
        assert api.list("resourceclaimtemplates.resource.k8s.io")
        assert api.list("pods")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
@needs_private_tmp
def test_the_promtool_block_runs_as_written(private_tmp: PrivateTmp) -> None:
    """Its /tmp is private here."""
    text = block("docs/metrics.md", ".venv/bin/python -c 'import sys, yaml;")
    shell = private_tmp.start(text, "promtool")
    assert shell.wait_exit(120) == 0, shell.describe()
    assert shell.matching("SUCCESS"), shell.describe()
