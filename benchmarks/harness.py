"""Start and stop what the benchmarks measure: the API-server double (in this process, on its
own thread), kubelet doubles (in this process, on the benchmark's event loop) and ``akri
agent`` processes (real subprocesses, cluster mode, exactly as a DaemonSet runs them).

Every subprocess is recorded in :data:`PROCESSES` and killed by PID on the way out (normal
exit, exception, SIGINT/SIGTERM, or interpreter exit). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.node.deviceplugin.views import configuration_resource, instance_resource  # noqa: E402
from tests.doubles.apiserver import ApiServerDouble, ThreadedApiServer  # noqa: E402
from tests.doubles.kubelet_double import KubeletDouble  # noqa: E402

T = TypeVar("T")

CRDS = [ROOT / "crds" / "akri-configuration-crd.yaml", ROOT / "crds" / "akri-instance-crd.yaml"]
INSTANCES = "instances.akri.sh"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
AGENT_COMMAND = (sys.executable, "-m", "agent.cli", "agent")  # how the DaemonSet runs it
# Variables the agent reads: removed so a developer's shell cannot change what is measured.
AGENT_ENV_PREFIXES = ("AKRI_",)
AGENT_ENV_VARS = ("AGENT_NODE_NAME", "ENABLE_DEBUG_ECHO", "DEBUG_ECHO_INSTANCES_SHARED")


def log(message: str) -> None:
    """Progress on stderr (stdout carries only the JSON result)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Waiting
# --------------------------------------------------------------------------------------------


class WaitTimeout(TimeoutError):
    """A bounded wait ran out; the message says what was awaited."""


async def wait_until(
    predicate: Callable[[], T], *, within: float, what: str, interval: float = 0.01
) -> T:
    """Poll ``predicate`` until it returns something truthy (bounded by ``within`` s)."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"not reached within {within:.0f}s: {what}")
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------------------------
# Subprocess bookkeeping
# --------------------------------------------------------------------------------------------


class ProcessRegistry:
    """Every subprocess we start; :meth:`kill_all` kills them one by one, by PID."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def add(self, proc: subprocess.Popen[bytes]) -> None:
        self._procs[proc.pid] = proc

    def discard(self, proc: subprocess.Popen[bytes]) -> None:
        self._procs.pop(proc.pid, None)

    def kill_all(self) -> None:
        for pid, proc in list(self._procs.items()):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            self._procs.pop(pid, None)


PROCESSES = ProcessRegistry()
# the agents' own measure of their event-loop lag (agent/ops/loop_monitor.py), in ms, as each
# agent reported it when it stopped cleanly
LOOP_LAGS: list[float] = []


@contextlib.contextmanager
def doubles_without_gc() -> Iterator[None]:
    """No garbage collection in this process (the kubelet and API-server doubles) while a
    timed loop runs: they stand in for Go processes, and a full collection over the API
    double's watch history (a thousand copies of a 1000-slot Instance) paused them for up to
    300 ms, which showed up as the agent's Allocate latency. The agent keeps its own GC."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_LAG_LINE = re.compile(rb"event loop lag: max ([0-9.]+) ms")
atexit.register(PROCESSES.kill_all)


def agent_env() -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(AGENT_ENV_PREFIXES) and key not in AGENT_ENV_VARS
    }
    env.pop("KUBECONFIG", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --------------------------------------------------------------------------------------------
# /proc readings
# --------------------------------------------------------------------------------------------


def rss_mb(pid: int, field_name: str = "VmRSS") -> float:
    """``VmRSS`` (or ``VmHWM``, the peak) of a process, in MiB, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field_name} in /proc/{pid}/status")


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` in nanoseconds (schedstat: finer than the 10 ms
    ticks of utime/stime, which matters for an idle agent)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (seconds), from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
    return (utime + stime) / CLOCK_TICKS


def runqueue_wait_seconds(pid: int) -> float:
    """Time the main thread of ``pid`` spent runnable but waiting for a CPU (schedstat field 2):
    how much other load on the machine delayed it."""
    fields = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return int(fields[1]) / 1e9


class RunqueueWindow:
    """Share of a time window that processes spent waiting for a CPU, in %."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = time.monotonic()
        self.before = {name: _wait_or_none(pid) for name, pid in pids.items()}

    def result(self) -> dict[str, float | None]:
        elapsed = time.monotonic() - self.start
        out: dict[str, float | None] = {}
        for name, pid in self.pids.items():
            before, after = self.before[name], _wait_or_none(pid)
            if before is None or after is None or elapsed <= 0:
                out[name] = None
            else:
                out[name] = round((after - before) / elapsed * 100, 1)
        return out


def _wait_or_none(pid: int) -> float | None:
    try:
        return runqueue_wait_seconds(pid)
    except (OSError, IndexError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# The API-server double
# --------------------------------------------------------------------------------------------


class ApiServer:
    """The API-server double on its own thread and event loop (so that the kubelet doubles'
    receive timestamps on the benchmark loop are not delayed by the API's request handling).
    Its helpers (``create``, ``get``, ``list``, ``requests``) are thread-safe."""

    def __init__(self, *, history_size: int = 50_000, bookmark_interval: float = 60.0) -> None:
        # A real API server keeps minutes of watch history and bookmarks about once a minute.
        self._threaded = ThreadedApiServer(
            crds=[str(p) for p in CRDS],
            history_size=history_size,
            bookmark_interval=bookmark_interval,
        )
        self.api: ApiServerDouble = self._threaded.api

    def start(self) -> ApiServerDouble:
        return self._threaded.start()

    def stop(self) -> None:
        self._threaded.stop()

    def instances(self, configuration: str | None = None) -> list[dict[str, Any]]:
        selector = f"akri.sh/configuration={configuration}" if configuration else None
        return self.api.list(INSTANCES, label_selector=selector)

    def instance(self, name: str) -> dict[str, Any] | None:
        return self.api.get(INSTANCES, name, "default")

    def request_mark(self) -> int:
        """Index into the request log: pass to :meth:`requests_since`."""
        return len(self.api.requests)

    def requests_since(self, mark: int) -> list[Any]:
        return list(self.api.requests[mark:])

    async def quiet(self, seconds: float = 1.0, within: float = 60.0) -> bool:
        """Wait until no request (watches aside) came for ``seconds``: a phase's late writes
        are then counted in it. False if that did not happen within ``within`` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            mark = self.request_mark()
            await asyncio.sleep(seconds)
            if not [r for r in self.requests_since(mark) if r.verb != "watch"]:
                return True
        return False

    def create_nodes(self, names: Iterable[str]) -> None:
        """A Node object per name, labelled ``kubernetes.io/hostname=<name>`` (what shared
        DRA pools select on)."""
        for name in names:
            self.api.create(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                }
            )


def agents_started(nodes: Iterable[Node]) -> bool:
    """Whether every node's agent logged its start (raises if one has exited)."""
    started = True
    for node in nodes:
        assert node.agent is not None
        node.agent.check_running()
        started = started and bool(node.agent.log_lines("agent started on node"))
    return started


def debug_echo_configuration(
    name: str, descriptions: Sequence[str], capacity: int
) -> dict[str, Any]:
    quoted = ", ".join(f'"{d}"' for d in descriptions)
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "discoveryHandler": {
                "name": "debugEcho",
                "discoveryDetails": f"descriptions: [{quoted}]",
            },
            "capacity": capacity,
        },
    }


# --------------------------------------------------------------------------------------------
# Kubelet double with Allocate timing
# --------------------------------------------------------------------------------------------


@dataclass
class AllocateTiming:
    resource: str
    pod: str
    start: float
    end: float
    ok: bool

    @property
    def seconds(self) -> float:
        return self.end - self.start


class TimedKubelet(KubeletDouble):
    """The kubelet double, also recording when each ``Allocate`` RPC returned (the double's
    ``rpc_calls`` has only the start time)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allocate_timings: list[AllocateTiming] = []

    async def _call_allocate(self, pod: Any, alloc: Any, resource: str, ids: list[str]) -> Any:
        start = time.monotonic()
        ok = False
        try:
            response = await super()._call_allocate(pod, alloc, resource, ids)
            ok = True
            return response
        finally:
            self.allocate_timings.append(
                AllocateTiming(resource, pod.name, start, time.monotonic(), ok)
            )


# --------------------------------------------------------------------------------------------
# Agent subprocess
# --------------------------------------------------------------------------------------------


@dataclass
class AgentOptions:
    reclaim_interval: float = 1.0  # the agent's defaults: what users get
    reclaim_grace: float = 3.0
    shared_offline_grace: float = 300.0
    log_level: str = "INFO"
    extra_args: tuple[str, ...] = ()  # ``run.py --agent-arg``
    logs_dir: Path | None = None  # ``run.py --logs``: agent logs are copied there


_FLAGS: set[str] | None = None


def agent_flags() -> set[str]:
    """The flags ``akri agent`` accepts, to adapt to the version measured."""
    global _FLAGS
    if _FLAGS is None:
        from agent.node.settings import AGENT_OPTIONS

        _FLAGS = {option.flag for option in AGENT_OPTIONS}
    return _FLAGS


class AgentProcess:
    """``python -m agent.cli agent ...`` in cluster mode; output goes to a log file."""

    def __init__(
        self, args: Sequence[str], log_path: Path, command: Sequence[str] | None = None
    ) -> None:
        self.args = list(args)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()/kill()
        self.started = time.monotonic()
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            [*(command or AGENT_COMMAND), *self.args],
            cwd=ROOT,
            env=agent_env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        PROCESSES.add(self.proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def check_running(self) -> None:
        if not self.running:
            raise RuntimeError(
                f"agent exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_lines(self, needle: str) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if needle in line]

    def log_mark(self) -> int:
        """Current size of the log: pass to :meth:`wait_log` as ``since``."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    async def wait_log(self, needle: str, *, since: int, within: float) -> None:
        """Wait until a line containing ``needle`` appears in the log after byte ``since``."""
        deadline = time.monotonic() + within
        while True:
            if self._log_contains(needle.encode(), since):
                return
            self.check_running()
            if time.monotonic() > deadline:
                raise WaitTimeout(f"no log line with {needle!r} within {within:.0f}s")
            await asyncio.sleep(0.02)

    def _log_contains(self, needle: bytes, since: int) -> bool:
        with open(self.log_path, "rb") as handle:
            handle.seek(since)
            return needle in handle.read()

    def problems(self) -> list[str]:
        """ERROR lines and tracebacks in the log."""
        return self.log_lines(" ERROR ") + self.log_lines("Traceback")

    def terminate(self) -> None:
        """Send SIGTERM (what the kubelet does when the pod is deleted)."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    async def stop(self, grace: float = 5.0, *, quiet: bool = False) -> float | None:
        """SIGTERM, wait up to ``grace`` seconds (the event loop keeps running, so the
        kubelet doubles keep serving), then SIGKILL. Returns the seconds it took to exit on
        its own, or None if it had to be killed."""
        start = time.monotonic()
        self.terminate()
        try:
            while self.running:
                if time.monotonic() - start > grace:
                    if not quiet:
                        log(f"agent {self.pid} still running {grace:.1f}s after SIGTERM: killed")
                    self.kill()
                    return None
                await asyncio.sleep(0.02)
            return time.monotonic() - start
        finally:
            self._close()

    def kill(self) -> int | None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._close()
        return self.proc.returncode

    def _close(self) -> None:
        PROCESSES.discard(self.proc)
        with contextlib.suppress(OSError):
            self._log.close()
        with contextlib.suppress(OSError):
            found = _LAG_LINE.findall(self.log_path.read_bytes())
            if found:
                LOOP_LAGS.append(float(found[-1]))


# --------------------------------------------------------------------------------------------
# A simulated node: kubelet double + agent process
# --------------------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    base: Path  # short /tmp/bench-XXXX directory (unix socket paths must fit 108 bytes)
    kubelet: TimedKubelet
    kubeconfig: Path
    availability: Path
    options: AgentOptions
    agent: AgentProcess | None = None
    agents_started: list[AgentProcess] = field(default_factory=list)

    @property
    def plugin_dir(self) -> Path:
        return self.kubelet.device_plugin_dir

    def agent_args(self) -> list[str]:
        o = self.options
        return [
            "--node-name",
            self.name,
            "--kubeconfig",
            str(self.kubeconfig),
            "--device-plugin-dir",
            str(self.plugin_dir),
            # each simulated node its own handler directory, and no health port (67 agents
            # on one host would all ask for the same default port)
            "--discovery-handlers-dir",
            str(self.plugin_dir.parent / "dh"),
            "--health-port",
            "0",
            "--pod-resources-socket",
            str(self.kubelet.pod_resources_socket),
            "--reclaim-interval",
            str(o.reclaim_interval),
            "--reclaim-grace",
            str(o.reclaim_grace),
            "--shared-offline-grace",
            str(o.shared_offline_grace),
            "--debug-echo",  # off by default in cluster mode
            "--debug-echo-availability-file",
            str(self.availability),
            "--log-level",
            o.log_level,
            *self._node_local_dirs(),
            *o.extra_args,
        ]

    def _node_local_dirs(self) -> list[str]:
        """Directories the agent would otherwise share with other nodes' agents (DRA, CDI):
        per node, under its base directory, whenever this agent version has the flag."""
        flags = agent_flags()
        args: list[str] = []
        for flag, sub in (
            ("--plugins-registry-dir", "plugins_registry"),
            ("--dra-plugin-dir", "plugins/akri.sh"),
            ("--cdi-dir", "cdi"),
        ):
            if flag in flags:
                args += [flag, str(self.base / sub)]
        return args

    def start_agent(self, command: Sequence[str] | None = None) -> AgentProcess:
        """Start ``akri agent`` (or ``command`` + the same arguments, for profiling)."""
        if self.agent is not None and self.agent.running:
            raise RuntimeError(f"{self.name}: agent already running")
        self.agent = AgentProcess(self.agent_args(), self.base / "agent.log", command)
        self.agents_started.append(self.agent)
        return self.agent

    def set_available(self, online: bool) -> None:
        """Atomically write the debugEcho availability file."""
        tmp = self.availability.with_suffix(".tmp")
        tmp.write_text("ONLINE\n" if online else "OFFLINE\n")
        os.replace(tmp, self.availability)

    async def close(self, keep_dir: bool = False, grace: float = 0.3) -> None:
        """Stop the agent (SIGTERM, ``grace`` seconds, SIGKILL) and the kubelet double."""
        for agent in self.agents_started:
            if agent.running:
                await agent.stop(grace, quiet=True)
            elif agent.proc.returncode not in (0, None):
                log(f"{self.name}: agent {agent.pid} exited with {agent.proc.returncode}")
        logs = self.options.logs_dir
        if logs is not None and (self.base / "agent.log").exists():
            logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.base / "agent.log", logs / f"{self.name}-{self.base.name}.log")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.kubelet.stop(), 10)
        if not keep_dir:
            shutil.rmtree(self.base, ignore_errors=True)


async def start_node(api: ApiServer, name: str, options: AgentOptions | None = None) -> Node:
    """A kubelet double (started) and everything an agent needs; the agent is not started."""
    base = Path(tempfile.mkdtemp(prefix="bench-", dir="/tmp"))
    plugin_dir = base / "dp"
    plugin_dir.mkdir()
    kubelet = TimedKubelet(plugin_dir, base / "pr.sock", reregistration="kubelet")
    await kubelet.start()
    kubeconfig = api.api.write_kubeconfig(base / "kubeconfig")
    availability = base / "avail"
    node = Node(name, base, kubelet, kubeconfig, availability, options or AgentOptions())
    node.set_available(True)
    return node


# --------------------------------------------------------------------------------------------
# What a node should have registered
# --------------------------------------------------------------------------------------------


def expected_resources(instances: Iterable[dict[str, Any]], node: str) -> set[str]:
    """IL resources of the Instances listing ``node`` + CL resources of their Configurations."""
    wanted: set[str] = set()
    for obj in instances:
        spec = obj.get("spec") or {}
        if node in (spec.get("nodes") or []):
            wanted.add(instance_resource(obj["metadata"]["name"]))
            wanted.add(configuration_resource(spec["configurationName"]))
    return wanted


def registered_since(kubelet: KubeletDouble, resources: set[str], since: float) -> float | None:
    """Time of the last first-registration after ``since`` if every resource has one."""
    first: dict[str, float] = {}
    for reg in kubelet.registrations:
        if reg.time >= since and reg.resource_name in resources:
            first.setdefault(reg.resource_name, reg.time)
    if len(first) < len(resources):
        return None
    return max(first.values())


def healthy_listed(kubelet: KubeletDouble, resources: set[str]) -> bool:
    """Every resource registered and offering at least one Healthy device."""
    return all(kubelet.allocatable(r) > 0 for r in resources)


async def wait_node_ready(
    api: ApiServer, node: Node, configurations: Sequence[str], count: int, within: float
) -> set[str]:
    """Wait until ``count`` Instances of ``configurations`` list the node and each of their
    plugins is registered with Healthy devices. Returns the node's resources."""
    assert node.agent is not None
    agent = node.agent

    def instances_ready() -> list[dict[str, Any]] | None:
        agent.check_running()
        found = [
            obj
            for conf in configurations
            for obj in api.instances(conf)
            if node.name in (obj["spec"].get("nodes") or [])
        ]
        return found if len(found) >= count else None

    found = await wait_until(
        instances_ready,
        within=within,
        what=f"{count} Instances of {list(configurations)} on {node.name}",
        interval=0.1,
    )
    resources = expected_resources(found, node.name)
    await wait_until(
        lambda: (agent.check_running(), healthy_listed(node.kubelet, resources))[1],
        within=within,
        what=f"{len(resources)} plugins of {node.name} registered with Healthy devices",
        interval=0.05,
    )
    return resources
