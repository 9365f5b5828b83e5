"""Where the scale figures go: the agent with N Instances under cProfile / tracemalloc.

    python benchmarks/profile_scale.py --instances 1000 --out /tmp/akri-profile [--memory]

Writes into ``--out``: ``cpu-1.txt`` (startup until every plugin registered), ``cpu-2.txt``
(the idle window), ``cpu-3.txt`` (a kubelet restart until every plugin re-registered); with
``--memory`` no startup profile but ``mem-<k>.txt`` (tracemalloc top allocation sites) at the
same points; and
``summary.json`` (RSS, timings, SIGTERM → exit). Profiling slows the agent down: use
``benchmarks/run.py`` for the figures themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    PROCESSES,
    ApiServer,
    cpu_seconds,
    debug_echo_configuration,
    log,
    rss_mb,
    start_node,
    wait_until,
)

HERE = Path(__file__).resolve().parent


async def profile(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    api = ApiServer()
    api.start()
    n = args.instances
    api.api.create(debug_echo_configuration("scale", [f"s{i}" for i in range(n)], 4))
    node = await start_node(api, "bench-p")
    summary: dict[str, Any] = {"instances": n, "memory_traced": args.memory}
    try:
        own = [str(out)]
        if args.memory:
            own.append("--tracemalloc")
        elif not args.skip_startup:
            own.append("--profile-startup")
        command = [sys.executable, str(HERE / "profiled_agent.py"), *own, "--"]
        agent = node.start_agent(command)
        kubelet = node.kubelet

        def registered() -> bool:
            agent.check_running()
            return len({r.resource_name for r in kubelet.registrations}) >= n + 1

        await wait_until(registered, within=args.timeout, what="all plugins registered")
        summary["startup_s"] = round(time.monotonic() - agent.started, 2)
        summary["startup_cpu_s"] = round(cpu_seconds(agent.pid), 2)
        os.kill(agent.pid, signal.SIGUSR2)  # cpu-1 (+ mem-1)
        await asyncio.sleep(3)
        summary["rss_mb"] = round(rss_mb(agent.pid), 1)

        os.kill(agent.pid, signal.SIGUSR1)
        cpu = cpu_seconds(agent.pid)
        await asyncio.sleep(args.idle)
        summary["idle_cpu_percent_profiled"] = round(
            (cpu_seconds(agent.pid) - cpu) / args.idle * 100, 2
        )
        os.kill(agent.pid, signal.SIGUSR2)  # cpu-2 (+ mem-2)
        await asyncio.sleep(1)

        os.kill(agent.pid, signal.SIGUSR1)
        start = time.monotonic()
        await kubelet.restart()
        await wait_until(
            lambda: len({r.resource_name for r in kubelet.registrations}) >= n + 1,
            within=args.timeout,
            what="all plugins re-registered",
        )
        summary["kubelet_restart_reregister_s"] = round(time.monotonic() - start, 2)
        os.kill(agent.pid, signal.SIGUSR2)  # cpu-3 (+ mem-3)
        await asyncio.sleep(1)

        log(f"profile: SIGTERM, waiting up to {args.shutdown_grace:.0f}s")
        shutdown = await agent.stop(args.shutdown_grace)
        summary["shutdown_s"] = round(shutdown, 2) if shutdown is not None else None
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "agent.log").write_text(agent.log_path.read_text(errors="replace"))
        return summary
    finally:
        await node.close()
        api.stop()
        PROCESSES.kill_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument(
        "--memory",
        action="store_true",
        help="trace allocations instead of profiling the startup (the idle window and the "
        "kubelet restart are still profiled)",
    )
    parser.add_argument(
        "--skip-startup", action="store_true", help="do not profile the startup (faster)"
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--shutdown-grace", type=float, default=300.0)
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(asyncio.run(profile(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
