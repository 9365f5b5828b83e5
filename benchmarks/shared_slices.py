"""Shared ResourceSlices with many DRA agents (issue 36, issue 33.1): N agent processes (cluster
mode, DRA on, one Node object each, labelled ``kubernetes.io/hostname``) against the API-server
double, which sends a write's watch events before its answer as a real API server may
(docs/testing-apiserver-double.md); one debugEcho Configuration with D shared devices.

Phases, each measured until the slices are what the scheduler needs — every shared Instance's
pool is one slice whose ``nodeSelector`` lists exactly the Instance's serving nodes (``nodes``
without the draining ones) and whose devices are its free slots with the Configuration's
properties:

* **join**: the devices appear on every node at once (a burst: the pool's first node changes
  while nodes join);
* **capacity**: the Configuration's capacity changes;
* **property**: a broker property changes (every device's attributes);
* **loss**: the first half of the nodes (the publishers) lose the devices;
* **rejoin**: they see them again (the publishers take the pools back);
* **delete**: the Configuration is deleted, until no Instance and no shared slice is left
  (the orphaned pools are deleted by the first node each lists).

Per phase: seconds until converged (``converged: false`` when the bound passed first: the
figures then cover the bound), and until the Instances alone were done; ResourceSlice writes
that succeeded, 409 conflicts (on create, update and delete), 404s (a delete of a slice already
gone), conflicts per successful write (the goal: at most 1), requests by verb and status.
Agents are separate processes on the host's cores.

    python -m benchmarks.shared_slices [--agents 10] [--devices 2] [--capacity 2] \
        [--within 120] [--out results.json]

To measure another agent version (e.g. "before"), run it from a checkout of that version
that has this file and the double (the agents are started with ``python -m agent.cli`` from the
current directory).
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
    agents_started,
    debug_echo_configuration,
    log,
    start_node,
    wait_until,
)

CONFIGURATION = "shared"
SLICES = "resourceslices.resource.k8s.io"
DRAINING = "akri.sh/draining"


@dataclass(frozen=True)
class SharedSlicesPlan:
    agents: int = 10
    devices: int = 2
    capacity: int = 2
    offline_grace: float = 1.0  # seconds a node keeps a lost shared device (default: 300)
    within: float = 120.0  # bound on each convergence wait


def configuration(plan: SharedSlicesPlan, capacity: int, model: str) -> dict[str, Any]:
    config = debug_echo_configuration(
        CONFIGURATION, [f"cam{i}" for i in range(plan.devices)], capacity
    )
    config["spec"]["brokerProperties"] = {"MODEL": model}
    return config


def serving(instance: dict[str, Any]) -> list[str]:
    nodes = set(instance["spec"].get("nodes") or [])
    annotations = instance["metadata"].get("annotations") or {}
    draining = {n for n in str(annotations.get(DRAINING, "")).split(",") if n}
    return sorted(nodes - draining or nodes)


def selected(obj: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for term in obj["spec"].get("nodeSelector", {}).get("nodeSelectorTerms") or []:
        for requirement in term.get("matchExpressions") or []:
            names += requirement.get("values") or []
    return sorted(names)


def instances_ready(api: ApiServer, nodes: set[str], capacity: int) -> bool:
    """The Instances alone are done: each lists ``nodes`` with ``capacity`` (none left for no
    ``nodes``)."""
    instances = api.instances(CONFIGURATION)
    if not nodes:
        return not instances
    return bool(instances) and all(
        set(i["spec"].get("nodes") or []) == nodes and i["spec"].get("capacity") == capacity
        for i in instances
    )


def converged(api: ApiServer, nodes: set[str], capacity: int, model: str) -> bool:
    """Every Instance lists ``nodes``; its pool is one slice for its serving nodes with
    ``capacity`` devices carrying MODEL=``model``; no other shared pool exists. With no
    ``nodes``: no Instance and no shared pool is left."""
    instances = {i["metadata"]["name"]: i for i in api.instances(CONFIGURATION)}
    if not nodes:
        return not instances and not any(
            "nodeSelector" in obj["spec"] for obj in api.api.list(SLICES)
        )
    if not instances or any(set(i["spec"].get("nodes") or []) != nodes for i in instances.values()):
        return False
    pools: dict[str, list[dict[str, Any]]] = {}
    for obj in api.api.list(SLICES):
        if "nodeSelector" in obj["spec"]:
            pools.setdefault(obj["spec"]["pool"]["name"], []).append(obj)
    if set(pools) != set(instances):
        return False
    for name, objs in pools.items():
        if len(objs) != 1 or selected(objs[0]) != serving(instances[name]):
            return False
        devices = objs[0]["spec"].get("devices") or []
        if len(devices) != capacity or any(
            (d.get("attributes") or {}).get("MODEL") != {"string": model} for d in devices
        ):
            return False
    return True


def slice_figures(requests: Sequence[Any]) -> dict[str, Any]:
    writes = [
        r
        for r in requests
        if r.resource == "resourceslices" and r.verb in ("create", "update", "delete")
    ]
    ok = sum(1 for r in writes if r.status is not None and r.status < 300)
    conflicts = sum(1 for r in writes if r.status == 409)
    return {
        "slice_writes_ok": ok,
        "slice_conflicts": conflicts,
        "slice_not_found": sum(1 for r in writes if r.status == 404),
        "slice_conflicts_per_successful_write": round(conflicts / ok, 3) if ok else None,
        "slice_requests_by_verb": dict(
            sorted(
                Counter(
                    f"{r.verb} {r.status}"
                    for r in requests
                    if r.resource == "resourceslices" and r.verb != "watch"
                ).items()
            )
        ),
        "requests": sum(1 for r in requests if r.verb != "watch"),
    }


async def measure(plan: SharedSlicesPlan, options: AgentOptions) -> dict[str, Any]:
    api = ApiServer()
    api.start()
    nodes: list[Node] = []
    results: dict[str, Any] = {"agents": plan.agents, "devices": plan.devices}
    try:
        options = replace(options, shared_offline_grace=plan.offline_grace)
        names = [f"node-{i:03d}" for i in range(plan.agents)]
        api.create_nodes(names)
        api.api.create(configuration(plan, plan.capacity, "m1"))
        nodes = [await start_node(api, name, options) for name in names]
        for node in nodes:
            node.set_available(False)
            node.start_agent()

        await wait_until(
            lambda: agents_started(nodes), within=plan.within, what="agents started", interval=0.1
        )
        await api.quiet()

        async def phase(name: str, act: Any, nodes_: set[str], capacity: int, model: str) -> None:
            mark = api.request_mark()
            began = time.monotonic()
            act()
            done = True
            instances_at: list[float] = []

            def check() -> bool:
                if not instances_at and instances_ready(api, nodes_, capacity):
                    instances_at.append(time.monotonic() - began)
                return converged(api, nodes_, capacity, model)

            try:
                await wait_until(
                    check,
                    within=plan.within,
                    what=f"{name}: slices converged",
                    interval=0.02,
                )
            except WaitTimeout:
                done = False  # the figures until the bound still say what happened
            seconds = time.monotonic() - began
            await api.quiet()
            figures = {
                "converged": done,
                "seconds": round(seconds, 2),
                # when the Instances alone were done (the slices follow them)
                "instances_seconds": round(instances_at[0], 2) if instances_at else None,
                **slice_figures(api.requests_since(mark)),
            }
            results[name] = figures
            log(
                f"shared slices N={plan.agents} {name}: {seconds:.2f}s, "
                f"{figures['slice_writes_ok']} writes, {figures['slice_conflicts']} conflicts"
            )

        everyone = set(names)
        half = nodes[: plan.agents // 2]
        rest = {n.name for n in nodes[plan.agents // 2 :]}
        capacity = plan.capacity + 1

        def online(which: Sequence[Node], value: bool) -> None:
            for node in which:
                node.set_available(value)

        await phase("join", lambda: online(nodes, True), everyone, plan.capacity, "m1")
        await phase(
            "capacity",
            lambda: api.api.apply(configuration(plan, capacity, "m1")),
            everyone,
            capacity,
            "m1",
        )
        await phase(
            "property",
            lambda: api.api.apply(configuration(plan, capacity, "m2")),
            everyone,
            capacity,
            "m2",
        )
        await phase("loss", lambda: online(half, False), rest, capacity, "m2")
        await phase("rejoin", lambda: online(half, True), everyone, capacity, "m2")
        await phase(
            "delete",
            lambda: api.api.delete("configurations.akri.sh", CONFIGURATION, "default"),
            set(),
            capacity,
            "m2",
        )
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
    parser.add_argument("--within", type=float, default=120.0, help="bound per phase (s)")
    parser.add_argument("--out", help="also write the JSON figures to this file")
    parser.add_argument("--logs", help="copy the agents' logs into this directory")
    args = parser.parse_args(argv)
    plan = SharedSlicesPlan(
        agents=args.agents, devices=args.devices, capacity=args.capacity, within=args.within
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
