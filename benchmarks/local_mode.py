"""Local-mode figures (issue 17): one ``akri agent --local`` process with its device plugins
registered with a kubelet double in this process.

* ``startup_first_list_ms`` — process start (just before ``Popen``) → the kubelet double
  receives the first ListAndWatch message (3 debugEcho devices);
* ``idle_cpu_percent_small`` — CPU time of all the agent's threads (schedstat, ns) over an
  idle window with those 3 devices (no Allocate, nothing held);
* ``allocate_large_instance_ms`` — 1,000 Allocates of different slots of one Instance of
  capacity 1000 (instance-level plugin), each the round trip seen by the kubelet double;
* ``loop_lag_max_ms`` — the agent's own measure of how late its event loop ran a timer
  (agent/ops/loop_monitor.py), read from its log when it stops.

Every figure comes from recorded samples (benchmarks/stats.py); nothing is estimated.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    PROCESSES,
    ROOT,
    TimedKubelet,
    agent_env,
    cpu_ns,
    doubles_without_gc,
    log,
)
from benchmarks.stats import summarize

LAG_LINE = re.compile(r"event loop lag: max ([0-9.]+) ms")


def compiled_env() -> dict[str, str]:
    """The agent's environment, with its bytecode compiled like an installed agent's (a wheel,
    the image): this checkout may run with PYTHONDONTWRITEBYTECODE, which would make every
    start compile ~60 modules from source (~70 ms). ``__pycache__`` is git-ignored."""
    env = agent_env()
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "agent", "discovery_handlers"],
        cwd=ROOT,
        env=env,
        check=True,
    )
    return env


@dataclass(frozen=True)
class LocalPlan:
    startups: int = 5
    idle_seconds: float = 20.0
    allocations: int = 1000
    capacity: int = 1000
    external: int = 100  # devices streamed by an external handler (benchmarks/external_handler.py)
    # benchmarks/network_handlers.py: announcements measured one at a time, and retained
    # announcements already on the broker when the agent starts
    mqtt_samples: int = 50
    mqtt_retained: int = 1000
    mdns_samples: int = 20
    # benchmarks/onvif_discovery.py: Hellos measured one at a time; cameras in one probe cycle
    onvif_hello: int = 20
    onvif_cameras: int = 50


def configuration(name: str, descriptions: list[str], capacity: int) -> str:
    quoted = ", ".join(f'"{d}"' for d in descriptions)
    return (
        "apiVersion: akri.sh/v0\nkind: Configuration\n"
        f"metadata: {{name: {name}}}\n"
        "spec:\n  discoveryHandler:\n    name: debugEcho\n"
        f"    discoveryDetails: 'descriptions: [{quoted}]'\n  capacity: {capacity}\n"
    )


class LocalAgent:
    """``akri agent --local`` with device plugins, next to a kubelet double."""

    def __init__(self, config_text: str, env: dict[str, str] | None = None) -> None:
        self.env = env if env is not None else compiled_env()
        self.base = Path(tempfile.mkdtemp(prefix="akl-", dir="/tmp"))
        (self.base / "dp").mkdir()
        self.config = self.base / "config.yaml"
        self.config.write_text(config_text)
        self.kubelet = TimedKubelet(
            self.base / "dp", self.base / "pr.sock", reregistration="kubelet"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.output = self.base / "agent.log"
        self.started_at = 0.0

    async def start(self) -> None:
        await self.kubelet.start()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(  # noqa: ASYNC220 - timed from here, no await between
            [
                sys.executable,
                "-m",
                "agent.cli",
                "agent",
                "--local",
                "--state-dir",
                str(self.base / "state"),
                "--config",
                str(self.config),
                "--device-plugin-dir",
                str(self.base / "dp"),
                "--pod-resources-socket",
                str(self.base / "pr.sock"),
                "--debug-echo-availability-file",
                str(self.base / "avail"),
                "--node-name",
                "bench-local",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.output.open("wb"),
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=ROOT,
        )
        PROCESSES.add(self.proc)

    async def first_list_after_start(self, within: float = 30) -> float:
        """Seconds from Popen to the first ListAndWatch message the kubelet double got."""
        deadline = time.monotonic() + within
        while not self.kubelet.list_and_watch_log:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no ListAndWatch within {within}s:\n{self.logs()}")
            await asyncio.sleep(0.001)
        return self.kubelet.list_and_watch_log[0].time - self.started_at

    def logs(self) -> str:
        return self.output.read_text(errors="replace")[-4000:]

    async def stop(self) -> float | None:
        """SIGTERM, wait, and the loop lag the agent reported (ms)."""
        lag: float | None = None
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            PROCESSES.discard(self.proc)
            found = LAG_LINE.findall(self.output.read_text(errors="replace"))
            lag = float(found[-1]) if found else None
        await self.kubelet.stop()
        shutil.rmtree(self.base, ignore_errors=True)
        return lag


async def measure_startup(plan: LocalPlan) -> dict[str, Any]:
    samples: list[float] = []
    lags: list[float] = []
    env = compiled_env()
    for _ in range(plan.startups):
        agent = LocalAgent(configuration("startup", ["a", "b", "c"], 1), env)
        try:
            await agent.start()
            samples.append(await agent.first_list_after_start() * 1000)
        finally:
            lag = await agent.stop()
            if lag is not None:
                lags.append(lag)
    return {
        "startup_first_list_ms": summarize(samples),
        "loop_lag_max_ms": max(lags) if lags else None,
        "method": "Popen of `akri agent --local` with 3 debugEcho devices and device plugins → "
        "the kubelet double's first ListAndWatch message",
    }


async def measure_idle(plan: LocalPlan) -> dict[str, Any]:
    agent = LocalAgent(configuration("idle", ["a", "b", "c"], 2))
    try:
        await agent.start()
        await agent.first_list_after_start()
        await asyncio.sleep(3)  # startup settles (the second gc freeze)
        assert agent.proc is not None
        before = cpu_ns(agent.proc.pid)
        started = time.monotonic()
        await asyncio.sleep(plan.idle_seconds)
        used = (cpu_ns(agent.proc.pid) - before) / 1e9
        elapsed = time.monotonic() - started
    finally:
        lag = await agent.stop()
    return {
        "idle_cpu_percent_small": round(used / elapsed * 100, 4),
        "idle_seconds": round(elapsed, 1),
        "loop_lag_max_ms": lag,
    }


async def measure_large_instance(plan: LocalPlan) -> dict[str, Any]:
    agent = LocalAgent(configuration("big", ["cam"], plan.capacity))
    resource = "akri.sh/big-2a1b23"
    samples: list[float] = []
    try:
        await agent.start()
        await agent.first_list_after_start()
        resource = next(r for r in agent.kubelet.resources() if r != "akri.sh/big")
        deadline = time.monotonic() + 30
        while agent.kubelet.allocatable(resource) < plan.capacity:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{resource} never listed {plan.capacity} devices")
            await asyncio.sleep(0.01)
        with doubles_without_gc():
            for index in range(plan.allocations):
                pod = await agent.kubelet.admit_pod(
                    "default", f"p{index}", [("c", {resource: 1})], start_containers=False
                )
                if not pod.admitted:
                    raise RuntimeError(f"pod {index} not admitted: {pod.message}")
                timing = agent.kubelet.allocate_timings[-1]
                assert timing.ok and timing.pod == f"p{index}"
                samples.append(timing.seconds)
    finally:
        lag = await agent.stop()
    return {
        "allocate_large_instance_ms": {
            **summarize([s * 1000 for s in samples]),
            "mode": "local",
            "capacity": plan.capacity,
        },
        "loop_lag_max_ms": lag,
    }


async def run_local_mode(plan: LocalPlan) -> dict[str, Any]:
    """Every local-mode figure, one measurement after the other."""
    results: dict[str, Any] = {}
    log("local mode: startup")
    results["startup"] = await measure_startup(plan)
    log("local mode: idle")
    results["idle"] = await measure_idle(plan)
    log("local mode: 1000 Allocates on one Instance of capacity 1000")
    results["large_instance"] = await measure_large_instance(plan)
    return results


if __name__ == "__main__":
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    print(json.dumps(asyncio.run(run_local_mode(LocalPlan(startups=3, idle_seconds=10))), indent=2))
