"""``scale``: one agent with N Instances of capacity 4 on its node (one debugEcho Configuration
with N descriptions, written before the agent starts: a first start that creates them all).

* ``startup_s`` — process start → all N IL plugins + the CL plugin registered with the kubelet
  double (``listed_s``: … and each has sent a device list with Healthy devices);
* ``rss_mb`` — VmRSS of the agent after startup and again after the idle window
  (``rss_peak_mb`` is VmHWM);
* ``idle_cpu_percent`` — (utime + stime) of the agent over the idle window / wall time, in %
  of one core;
* ``api_requests_idle`` — requests the API double received during the idle window, long-lived
  watches excluded (none are re-opened in that window; a re-opened watch would be counted
  under ``api_requests_idle_by_verb.watch``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    AgentOptions,
    ApiServer,
    Node,
    RunqueueWindow,
    cpu_seconds,
    debug_echo_configuration,
    expected_resources,
    healthy_listed,
    log,
    registered_since,
    rss_mb,
    start_node,
    wait_until,
)

SCALE = "scale"
NODE = "bench-s"


@dataclass(frozen=True)
class ScalePlan:
    instances: int
    idle_seconds: float
    settle_seconds: float = 3.0  # after startup, before waiting for the agent to go quiet
    quiet_seconds: float = 1.0  # idle starts once the API saw no request for this long
    startup_timeout: float = 300.0
    # SIGTERM → exit is bounded like Kubernetes' default terminationGracePeriodSeconds
    shutdown_grace: float = 30.0
    measure_restart: bool = True  # kubelet restart with N + 1 plugins
    measure_shutdown: bool = True


async def run_scale(api: ApiServer, plan: ScalePlan, options: AgentOptions) -> dict[str, Any]:
    n = plan.instances
    api.api.create(debug_echo_configuration(SCALE, [f"s{i}" for i in range(n)], 4))
    node = await start_node(api, NODE, options)
    try:
        startup_mark = api.request_mark()
        agent = node.start_agent()
        startup_wait = RunqueueWindow({"agent": agent.pid, "doubles": os.getpid()})
        kubelet = node.kubelet
        start = agent.started

        def all_registered() -> bool:
            agent.check_running()
            return len({r.resource_name for r in kubelet.registrations}) >= n + 1

        await wait_until(
            all_registered,
            within=plan.startup_timeout,
            what=f"{n + 1} plugins registered",
            interval=0.1,
        )
        instances = api.instances(SCALE)
        resources = expected_resources(instances, NODE)
        if len(instances) != n or len(resources) != n + 1:
            raise RuntimeError(
                f"expected {n} Instances / {n + 1} plugins, got {len(instances)} / {len(resources)}"
            )
        last_registration = registered_since(kubelet, resources, start)
        assert last_registration is not None
        startup_runqueue = startup_wait.result()
        startup_requests = Counter(
            f"{r.verb} {r.resource} {r.status}".strip()
            for r in api.requests_since(startup_mark)
            if r.time <= last_registration
        )
        await wait_until(
            lambda: (agent.check_running(), healthy_listed(kubelet, resources))[1],
            within=plan.startup_timeout,
            what="every plugin listing Healthy devices",
            interval=0.1,
        )
        listed = max(kubelet.list_and_watch_last[r] for r in resources)
        log(f"scale: {n} Instances, {n + 1} plugins up in {last_registration - start:.1f}s")

        await asyncio.sleep(plan.settle_seconds)
        # finish the startup work (e.g. DRA slices still being published) before "idle"
        quiet = await _wait_quiet(api, plan.quiet_seconds, within=60)
        pid = agent.pid
        rss_start = rss_mb(pid)
        cpu_before = cpu_seconds(pid)
        mark = api.request_mark()
        idle_start = time.monotonic()
        await asyncio.sleep(plan.idle_seconds)
        cpu_after = cpu_seconds(pid)
        idle_end = time.monotonic()
        agent.check_running()
        requests = api.requests_since(mark)
        by_verb = Counter(f"{r.verb} {r.resource}".strip() for r in requests)
        non_watch = [r for r in requests if r.verb != "watch"]
        idle = {
            "instances": n,
            "plugins": n + 1,
            "startup_s": round(last_registration - start, 2),
            "listed_s": round(listed - start, 2),
            "rss_mb": round(rss_start, 1),
            "rss_mb_after_idle": round(rss_mb(pid), 1),
            "rss_peak_mb": round(rss_mb(pid, "VmHWM"), 1),
            "threads": _threads(pid),
            "idle_seconds": round(idle_end - idle_start, 1),
            "idle_started_after_s": round(idle_start - start, 2),
            "quiet_before_idle": quiet,
            "idle_cpu_percent": round((cpu_after - cpu_before) / (idle_end - idle_start) * 100, 2),
            "api_requests_idle": len(non_watch),
            "api_requests_idle_by_verb": dict(sorted(by_verb.items())),
            # requests until every plugin was registered: "verb resource HTTP-status"
            "startup_requests": dict(sorted(startup_requests.items())),
            "startup_runqueue_wait_percent": startup_runqueue,
        }
        if plan.measure_restart:
            idle["kubelet_restart_reregister_s"] = await _restart(node, resources, plan)
        if plan.measure_shutdown:
            log("scale: stopping the agent (SIGTERM)")
            shutdown = await agent.stop(plan.shutdown_grace)
            idle["shutdown_s"] = round(shutdown, 2) if shutdown is not None else None
            if shutdown is None:
                idle["shutdown_error"] = (
                    f"still running {plan.shutdown_grace:.0f}s after SIGTERM: killed (SIGKILL)"
                )
        idle["agent_problems"] = agent.problems()[:5]
        return idle
    finally:
        await node.close()


async def _wait_quiet(api: ApiServer, quiet: float, within: float) -> bool:
    """Wait until the API double received no request (watches aside) for ``quiet`` seconds.
    False if that did not happen within ``within`` seconds (the idle window starts anyway)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        requests = [r for r in api.api.requests[-200:] if r.verb != "watch"]
        last = requests[-1].time if requests else 0.0
        if time.monotonic() - last >= quiet:
            return True
        await asyncio.sleep(0.1)
    return False


async def _restart(node: Node, resources: set[str], plan: ScalePlan) -> float | dict[str, str]:
    """Seconds from ``kubelet.restart()`` until all N + 1 plugins registered again."""
    kubelet = node.kubelet
    assert node.agent is not None
    agent = node.agent
    start = time.monotonic()
    try:
        await kubelet.restart()
        last = await wait_until(
            lambda: (agent.check_running(), registered_since(kubelet, resources, start))[1],
            within=plan.startup_timeout,
            what=f"{len(resources)} plugins re-registered after a kubelet restart",
            interval=0.1,
        )
    except Exception as exc:  # reported in place; the other scale figures stand
        return {"error": f"{type(exc).__name__}: {exc}"}
    return round(last - start, 2)


def _threads(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return None
