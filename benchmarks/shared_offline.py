"""Shared pools that follow the nodes seeing their devices (issue 33.1): N DRA agent processes
against the API-server double (as ``benchmarks/shared_slices.py``: one Node object each,
labelled ``kubernetes.io/hostname``; the double sends a write's watch events before its answer),
one debugEcho Configuration with D shared devices, the default shared offline grace (300 s),
so nodes that lose the devices stay in the Instances for the whole benchmark.

Phases, each measured until every shared pool is one slice that selects exactly the nodes that
should have it, tainted ``akri.sh/offline`` exactly when it should be, with one device per slot:

* **publisher_offline**: the first node (every pool's publisher) loses the devices: the pools
  select the others, untainted;
* **publisher_online**: it sees them again: all nodes;
* **half_offline**: the first half of the nodes lose them: the other half, untainted;
* **all_offline**: the other half too: every node, tainted;
* **all_online**: every node sees them again at once: every node, untainted;
* **blink**: the first node's devices blink (``--blinks`` times, 0.1 s offline, 0.1 s online),
  measured until the pools select every node again, untainted.

Per phase: seconds until converged (``converged: false`` when the bound passed first); for a
phase that starts tainted, until every pool was untainted (schedulable on some node again:
``untainted_seconds``); whether a pool was tainted at any moment (``tainted_during``); then,
counted until the double has been quiet for a second: Instance writes (the nodes' offline marks
are server-side applies, ``patch``) and their 409s, ResourceSlice writes and their 409s,
requests by verb and status.

    python -m benchmarks.shared_offline [--agents 10] [--devices 2] [--capacity 2] \
        [--blinks 20] [--within 60] [--out results.json]

An agent version without offline marks ("before") is measured by running this file from a
checkout of that version (the agents are started with ``python -m agent.cli`` from the current
directory); its phases that cannot converge say ``converged: false``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    AgentOptions,
    ApiServer,
    Node,
    WaitTimeout,
    debug_echo_configuration,
    log,
    start_node,
    wait_until,
)

CONFIGURATION = "shared"
SLICES = "resourceslices.resource.k8s.io"
OFFLINE_TAINT = "akri.sh/offline"


@dataclass(frozen=True)
class SharedOfflinePlan:
    agents: int = 10
    devices: int = 2
    capacity: int = 2
    blinks: int = 20
    within: float = 60.0  # bound on each convergence wait


def selected(obj: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for term in obj["spec"].get("nodeSelector", {}).get("nodeSelectorTerms") or []:
        for requirement in term.get("matchExpressions") or []:
            names += requirement.get("values") or []
    return sorted(names)


def pools_are(api: ApiServer, nodes: list[str], tainted: bool, devices: int, slots: int) -> bool:
    """Every one of the ``devices`` shared pools is one slice selecting ``nodes`` with
    ``slots`` devices, all tainted ``akri.sh/offline`` or none (``tainted``)."""
    pools: dict[str, list[dict[str, Any]]] = {}
    for obj in api.api.list(SLICES):
        if "nodeSelector" in obj["spec"]:
            pools.setdefault(obj["spec"]["pool"]["name"], []).append(obj)
    if len(pools) != devices:
        return False
    for objs in pools.values():
        if len(objs) != 1 or selected(objs[0]) != sorted(nodes):
            return False
        found = objs[0]["spec"].get("devices") or []
        if len(found) != slots:
            return False
        if any(
            any(t.get("key") == OFFLINE_TAINT for t in d.get("taints") or []) != tainted
            for d in found
        ):
            return False
    return True


def untainted(api: ApiServer, devices: int) -> bool:
    """Every one of the ``devices`` shared pools has devices and none is tainted: the device
    can be scheduled on at least one node."""
    pools = [obj for obj in api.api.list(SLICES) if "nodeSelector" in obj["spec"]]
    return len({obj["spec"]["pool"]["name"] for obj in pools}) == devices and all(
        (obj["spec"].get("devices") or [])
        and not any(d.get("taints") for d in obj["spec"].get("devices") or [])
        for obj in pools
    )


def write_figures(requests: Sequence[Any]) -> dict[str, Any]:
    def of(resource: str) -> list[Any]:
        return [
            r
            for r in requests
            if r.resource == resource and r.verb in ("create", "update", "patch", "delete")
        ]

    instances, slices = of("instances"), of("resourceslices")
    return {
        "instance_writes_ok": sum(1 for r in instances if r.status is not None and r.status < 300),
        "instance_conflicts": sum(1 for r in instances if r.status == 409),
        "slice_writes_ok": sum(1 for r in slices if r.status is not None and r.status < 300),
        "slice_conflicts": sum(1 for r in slices if r.status == 409),
        "requests_by_verb": dict(
            sorted(
                Counter(
                    f"{r.resource} {r.verb} {r.status}"
                    for r in requests
                    if r.resource in ("instances", "resourceslices") and r.verb != "watch"
                ).items()
            )
        ),
        "requests": sum(1 for r in requests if r.verb != "watch"),
    }


async def measure(plan: SharedOfflinePlan, options: AgentOptions) -> dict[str, Any]:
    api = ApiServer()
    api.start()
    nodes: list[Node] = []
    results: dict[str, Any] = {"agents": plan.agents, "devices": plan.devices}
    try:
        options = replace(options, shared_offline_grace=300.0)
        names = [f"node-{i:03d}" for i in range(plan.agents)]
        api.create_nodes(names)
        config = debug_echo_configuration(
            CONFIGURATION, [f"cam{i}" for i in range(plan.devices)], plan.capacity
        )
        api.api.create(config)
        nodes = [await start_node(api, name, options) for name in names]
        for node in nodes:
            node.start_agent()

        def ready() -> bool:
            for node in nodes:
                assert node.agent is not None
                node.agent.check_running()
            return pools_are(api, names, False, plan.devices, plan.capacity)

        await wait_until(ready, within=max(plan.within, 120), what="every node in every pool")
        await api.quiet()

        def online(which: Sequence[Node], value: bool) -> None:
            for node in which:
                node.set_available(value)

        async def phase(name: str, act: Any, expected: list[str], tainted: bool) -> None:
            mark = api.request_mark()
            began = time.monotonic()
            was_tainted = not untainted(api, plan.devices)
            await act()
            done = True
            usable_at: list[float] = []
            seen_tainted: list[bool] = []

            def check() -> bool:
                if untainted(api, plan.devices):
                    if was_tainted and not usable_at:
                        usable_at.append(time.monotonic() - began)
                elif not seen_tainted:
                    seen_tainted.append(True)
                return pools_are(api, expected, tainted, plan.devices, plan.capacity)

            try:
                await wait_until(
                    check, within=plan.within, what=f"{name}: pools converged", interval=0.02
                )
            except WaitTimeout:
                done = False  # the figures until the bound still say what happened
            seconds = time.monotonic() - began
            await api.quiet()
            figures = {
                "converged": done,
                "seconds": round(seconds, 2),
                # tainted before: when every pool could be scheduled again on some node
                "untainted_seconds": round(usable_at[0], 2) if usable_at else None,
                # a pool was tainted at some point of the phase (the device unschedulable on
                # every node)
                "tainted_during": bool(seen_tainted),
                **write_figures(api.requests_since(mark)),
            }
            results[name] = figures
            log(
                f"shared offline N={plan.agents} {name}: {seconds:.2f}s, instance writes "
                f"{figures['instance_writes_ok']} ({figures['instance_conflicts']} 409), slice "
                f"writes {figures['slice_writes_ok']} ({figures['slice_conflicts']} 409)"
            )

        first, half, other = nodes[:1], nodes[: plan.agents // 2], nodes[plan.agents // 2 :]
        rest = names[plan.agents // 2 :]

        async def set_online(which: Sequence[Node], value: bool) -> None:
            online(which, value)

        async def blink() -> None:
            for _ in range(plan.blinks):
                online(first, False)
                await asyncio.sleep(0.1)
                online(first, True)
                await asyncio.sleep(0.1)

        await phase("publisher_offline", lambda: set_online(first, False), names[1:], False)
        await phase("publisher_online", lambda: set_online(first, True), names, False)
        await phase("half_offline", lambda: set_online(half, False), rest, False)
        await phase("all_offline", lambda: set_online(other, False), names, True)
        await phase("all_online", lambda: set_online(nodes, True), names, False)
        await phase("blink", blink, names, False)
        results["agent_problems"] = [
            line for node in nodes if node.agent for line in node.agent.problems()
        ][:5]
        return results
    finally:
        await asyncio.gather(*(node.close(grace=5.0) for node in nodes))
        api.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=2)
    parser.add_argument("--blinks", type=int, default=20)
    parser.add_argument("--within", type=float, default=60.0, help="bound per phase (s)")
    parser.add_argument("--out", help="also write the JSON figures to this file")
    parser.add_argument("--logs", help="copy the agents' logs into this directory")
    args = parser.parse_args(argv)
    plan = SharedOfflinePlan(
        agents=args.agents,
        devices=args.devices,
        capacity=args.capacity,
        blinks=args.blinks,
        within=args.within,
    )
    options = AgentOptions(logs_dir=Path(args.logs) if args.logs else None)
    figures = asyncio.run(measure(plan, options))
    text = json.dumps(figures, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
