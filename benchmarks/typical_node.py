"""The memory of a typical node (issue 27), the figure the DaemonSet's memory request comes from:
the ``scale`` scenario (benchmarks/scale.py: one agent in cluster mode, DRA on as the DaemonSet
runs it, against the API-server and kubelet doubles) with 50 Instances of capacity 4, then one
kubelet restart (re-registration keeps the old servers' memory for a while).

    python benchmarks/typical_node.py --out benchmarks/results-typical-node.json

``rss_mb`` after the start, ``rss_mb_after_idle`` after the idle window and ``rss_peak_mb``
(VmHWM, which includes the kubelet restart) are in MiB, as the scale section reports them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import PROCESSES, ROOT, AgentOptions, ApiServer, log
from benchmarks.scale import ScalePlan, run_scale

TYPICAL_INSTANCES = 50  # "a typical node" of issue 27: up to 50 Instances


async def measure(instances: int, idle_seconds: float) -> dict[str, Any]:
    api = ApiServer()
    api.start()
    try:
        plan = ScalePlan(
            instances=instances,
            idle_seconds=idle_seconds,
            measure_restart=True,
            measure_shutdown=False,
        )
        return await run_scale(api, plan, AgentOptions())
    finally:
        api.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=TYPICAL_INSTANCES)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    log(f"typical node: {args.instances} Instances (load average {os.getloadavg()[0]:.2f})")
    try:
        scale = asyncio.run(measure(args.instances, args.idle_seconds))
    finally:
        PROCESSES.kill_all()
    result = {
        "typical_node": scale,
        "env": {
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "git_commit": commit,
            "load_average_before": round(os.getloadavg()[0], 2),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if "error" in scale else 0


if __name__ == "__main__":
    sys.exit(main())
