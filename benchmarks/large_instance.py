"""``allocate_large_instance_ms`` in cluster mode (issue 17): one agent process against the
API-server double, one debugEcho Instance of capacity 1000, and 1,000 Allocates of different
slots through its instance-level plugin, each the round trip seen by the kubelet double.
Every Allocate is a resourceVersion-checked write of the Instance in the API double, so this
includes the HTTP round trip that local mode does not have. The local-mode figure is in
benchmarks/local_mode.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.harness import (
    LOOP_LAGS,
    AgentOptions,
    ApiServer,
    debug_echo_configuration,
    doubles_without_gc,
    start_node,
    wait_node_ready,
)
from benchmarks.stats import summarize

CONFIGURATION = "big"


async def measure_large_instance_cluster(
    allocations: int, capacity: int, options: AgentOptions | None = None
) -> dict[str, Any]:
    api = ApiServer()
    api.start()
    samples: list[float] = []
    mark = len(LOOP_LAGS)
    node = None
    try:
        api.api.create(debug_echo_configuration(CONFIGURATION, ["cam"], capacity))
        node = await start_node(api, "bench-large", options)
        node.start_agent()
        resources = await wait_node_ready(api, node, [CONFIGURATION], 1, within=90)
        resource = next(r for r in resources if r != f"akri.sh/{CONFIGURATION}")
        deadline = time.monotonic() + 30
        while node.kubelet.allocatable(resource) < capacity:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{resource} never listed {capacity} devices")
            await asyncio.sleep(0.01)
        with doubles_without_gc():
            for index in range(allocations):
                pod = await node.kubelet.admit_pod(
                    "default", f"p{index}", [("c", {resource: 1})], start_containers=False
                )
                if not pod.admitted:
                    raise RuntimeError(f"pod {index} not admitted: {pod.message}")
                timing = node.kubelet.allocate_timings[-1]
                assert timing.ok and timing.pod == f"p{index}"
                samples.append(timing.seconds)
    finally:
        if node is not None:
            await node.close()
        api.stop()
    lags = LOOP_LAGS[mark:]
    return {
        "allocate_large_instance_ms": {
            **summarize([s * 1000 for s in samples]),
            "mode": "cluster",
            "capacity": capacity,
        },
        "loop_lag_max_ms": max(lags) if lags else None,
    }
