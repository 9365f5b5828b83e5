"""``instance_cost``: what one served Instance costs the agent, and the Instance budget holding.

For each size N one agent (cluster mode, ``akri agent`` as a process, API-server double and
kubelet double) serves one debugEcho Configuration with N devices of capacity 1: N
instance-level plugins + 1 configuration-level plugin. Once every plugin is registered and
listing, and the agent has gone quiet, it reads the agent's VmRSS and its open file
descriptors (``/proc/<pid>/fd``, by kind). The per-Instance cost is the least-squares slope
over the sizes (``per_instance_kib``, ``per_instance_fds``); ``base_mib`` is the intercept.

At the largest size the kubelet is then restarted ``--restarts`` times (every plugin gets a
new server and re-registers) and the RSS read after each: ``per_instance_kib_after_kubelet_
restarts`` is the worst of them over the base.

Then the budget: a Configuration reporting ``over`` devices to an agent started with
``--max-instances limit``: ``budget_plugins`` (registered, must be ``limit + 1``) and the RSS.

``default_budget``: the largest budget whose steady RSS stays within ``1 - headroom`` of the
DaemonSet's memory limit (deploy/base/daemonset.yaml); ``after_restarts_budget``: the largest
whose worst RSS after kubelet restarts stays within 90 % of it. ``agent/node/discovery/
budget.py``'s ``DEFAULT_MAX_INSTANCES`` is at most the smaller of the two.

    .venv/bin/python -m benchmarks.instance_cost --out benchmarks/results-instance-cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    AgentOptions,
    ApiServer,
    debug_echo_configuration,
    log,
    rss_mb,
    start_node,
    wait_until,
)

DAEMONSET_LIMIT_MIB = 384  # deploy/base/daemonset.yaml, resources.limits.memory
HEADROOM = 1 / 3


def fd_kinds(pid: int) -> Counter[str]:
    """The process's open descriptors by kind (socket, anon_inode:[eventfd], pipe, file...)."""
    kinds: Counter[str] = Counter()
    directory = Path(f"/proc/{pid}/fd")
    for entry in os.listdir(directory):
        try:
            target = os.readlink(directory / entry)
        except OSError:
            continue  # closed meanwhile
        kind = target.split(":", 1)[0] if ":" in target else "file"
        if target.startswith("anon_inode:"):
            kind = target
        kinds[kind] += 1
    return kinds


async def serve(
    n: int, limit: int | None, options: AgentOptions, restarts: int = 0
) -> dict[str, Any]:
    """One agent serving one Configuration of ``n`` devices (``limit``: --max-instances);
    then ``restarts`` kubelet restarts (every plugin re-registers), RSS after each."""
    api = ApiServer()
    api.start()
    try:
        name = f"cost{n}"
        api.api.create(debug_echo_configuration(name, [f"d{i}" for i in range(n)], 1))
        extra = ("--max-instances", str(limit if limit is not None else 0))
        node = await start_node(
            api, "bench-cost", AgentOptions(**{**options.__dict__, "extra_args": extra})
        )
        try:
            agent = node.start_agent()
            served = min(n, limit) if limit is not None else n
            plugins = served + 1

            def registered() -> int:
                agent.check_running()
                return len({r.resource_name for r in node.kubelet.registrations})

            started = time.monotonic()
            await wait_until(
                lambda: registered() >= plugins,
                within=600,
                what=f"{plugins} plugins",
                interval=0.2,
            )
            up = time.monotonic() - started
            await asyncio.sleep(3)
            await api.quiet(1.0, within=120)
            kinds = fd_kinds(agent.pid)
            rss = round(rss_mb(agent.pid), 1)
            after_restarts = []
            for _ in range(restarts):
                await node.kubelet.restart()
                await wait_until(
                    lambda: registered() >= plugins,
                    within=600,
                    what=f"{plugins} plugins re-registered",
                    interval=0.2,
                )
                await asyncio.sleep(3)
                await api.quiet(1.0, within=120)
                after_restarts.append(round(rss_mb(agent.pid), 1))
            return {
                "devices": n,
                "limit": limit,
                "instances": len(api.instances(name)),
                "plugins": registered(),
                "startup_s": round(up, 1),
                "rss_mib": rss,
                "fds": sum(kinds.values()),
                "fds_by_kind": dict(sorted(kinds.items())),
                "rss_after_kubelet_restarts_mib": after_restarts,
            }
        finally:
            await node.close()
    finally:
        api.stop()


def slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (slope, intercept)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    a = sxy / sxx
    return a, my - a * mx


async def run(sizes: list[int], over: int, limit: int, restarts: int) -> dict[str, Any]:
    options = AgentOptions()
    runs = []
    for n in sizes:
        log(f"instance_cost: {n} instances")
        runs.append(await serve(n, None, options, restarts=restarts if n == max(sizes) else 0))
        log(f"instance_cost: {runs[-1]['rss_mib']} MiB, {runs[-1]['fds']} fds")
    per_kib, base_mib = slope([(r["instances"], r["rss_mib"]) for r in runs])
    per_fds, base_fds = slope([(r["instances"], r["fds"]) for r in runs])
    per_kib *= 1024
    # the budget must hold after kubelet restarts too: each re-creates every plugin's server,
    # and the old ones' memory is not all given back (docs/performance.md)
    largest = max(runs, key=lambda r: r["instances"])
    worst = max([largest["rss_mib"], *largest["rss_after_kubelet_restarts_mib"]])
    worst_kib = (worst - base_mib) * 1024 / largest["instances"]
    usable = DAEMONSET_LIMIT_MIB * (1 - HEADROOM)
    default_budget = int((usable - base_mib) * 1024 / per_kib)
    after_restarts_budget = int((DAEMONSET_LIMIT_MIB * 0.9 - base_mib) * 1024 / worst_kib)
    log(f"instance_cost: budget {limit} with {over} devices")
    budget = await serve(over, limit, options)
    return {
        "runs": runs,
        "per_instance_kib": round(per_kib, 1),
        "base_mib": round(base_mib, 1),
        "per_instance_fds": round(per_fds, 2),
        "base_fds": round(base_fds, 1),
        "daemonset_limit_mib": DAEMONSET_LIMIT_MIB,
        "headroom": round(HEADROOM, 3),
        "default_budget": default_budget,
        "per_instance_kib_after_kubelet_restarts": round(worst_kib, 1),
        # the largest budget within 90 % of the limit at the worst RSS after kubelet restarts
        "after_restarts_budget": after_restarts_budget,
        "budget_run": budget,
        "budget_holds": budget["instances"] == limit and budget["plugins"] == limit + 1,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200,600,1000")
    parser.add_argument("--over", type=int, default=3000, help="devices in the budget run")
    parser.add_argument("--limit", type=int, default=500, help="--max-instances in it")
    parser.add_argument("--restarts", type=int, default=3, help="kubelet restarts, largest size")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {
        "section": "instance_cost",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        **asyncio.run(run(sizes, args.over, args.limit, args.restarts)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
