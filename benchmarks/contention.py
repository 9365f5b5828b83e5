"""``contention``: 3 agent processes on 3 simulated nodes (3 kubelet doubles), 50 shared
Instances of capacity 2 (100 slots), and 300 pod admissions launched at once, each asking for
one device through IL (a random Instance) or CL (the Configuration), half and half.

Each kubelet double admits its pods one at a time (like the kubelet's device manager), so the
three nodes race each other for the same slots through resourceVersion-checked writes.

Checks, after the burst (``double_allocations`` is the sum, must be 0):

* ``shared_slots`` — an API slot backing devices of two live pods;
* ``unbacked_devices`` — a device of a live pod whose slot does not name that pod's node (its
  slot could be given to someone else);
* ``over_capacity`` — slots held beyond an Instance's capacity;

then every pod is deleted and ``final_leaked_slots`` counts the slots still held after the
reclaimers ran (must be 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import (
    AgentOptions,
    ApiServer,
    Node,
    debug_echo_configuration,
    log,
    start_node,
    wait_node_ready,
    wait_until,
)
from benchmarks.stats import ms, summarize

SHARED = "shared"
CL = f"akri.sh/{SHARED}"


@dataclass(frozen=True)
class ContentionPlan:
    nodes: int = 3
    instances: int = 50
    capacity: int = 2
    pods: int = 300
    il_share: float = 0.5


def _usage(api: ApiServer) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj["spec"] for obj in api.instances(SHARED)}


def held_slots(api: ApiServer) -> int:
    return sum(
        1 for spec in _usage(api).values() for v in spec.get("deviceUsage", {}).values() if v
    )


def audit(api: ApiServer, nodes: list[Node]) -> dict[str, Any]:
    """Compare live pods in every kubelet double with the slots in the API."""
    specs = _usage(api)
    by_value: dict[str, list[tuple[str, str]]] = defaultdict(list)
    over_capacity = 0
    for name, spec in specs.items():
        usage = spec.get("deviceUsage") or {}
        held = [slot for slot, value in usage.items() if value]
        over_capacity += max(0, len(held) - int(spec.get("capacity", 0)))
        for slot in held:
            by_value[usage[slot]].append((name, slot))
    holders: dict[tuple[str, str], list[str]] = defaultdict(list)
    unbacked: list[str] = []
    duplicated_vdevs = 0
    live = 0
    for node in nodes:
        for pod in node.kubelet.pods():
            if not pod.admitted:
                continue
            live += 1
            for container in pod.containers:
                for resource, ids in container.devices.items():
                    for device in ids:
                        who = f"{node.name}/{pod.name}:{device}"
                        if resource == CL:
                            slots = by_value.get(f"C:{device}:{node.name}", [])
                            duplicated_vdevs += max(0, len(slots) - 1)
                        else:
                            instance = resource.removeprefix("akri.sh/")
                            value = (specs.get(instance, {}).get("deviceUsage") or {}).get(device)
                            slots = [(instance, device)] if value == node.name else []
                        if not slots:
                            unbacked.append(who)
                        for slot in slots[:1]:
                            holders[slot].append(who)
    shared = {f"{i}/{s}": who for (i, s), who in holders.items() if len(who) > 1}
    shared_count = sum(len(who) - 1 for who in shared.values())
    return {
        "double_allocations": shared_count + len(unbacked) + over_capacity,
        "shared_slots": shared_count,
        "unbacked_devices": len(unbacked),
        "over_capacity": over_capacity,
        "vdevs_held_twice": duplicated_vdevs,
        "live_pods": live,
        "examples": (list(shared.items())[:3] + unbacked[:3]) or None,
    }


async def run_contention(
    api: ApiServer, plan: ContentionPlan, options: AgentOptions, rng: random.Random
) -> dict[str, Any]:
    descriptions = [f"c{i}" for i in range(plan.instances)]
    api.api.create(debug_echo_configuration(SHARED, descriptions, plan.capacity))
    nodes: list[Node] = []
    try:
        for i in range(plan.nodes):
            nodes.append(await start_node(api, f"bench-c{i}", options))
        startup_mark = api.request_mark()
        for node in nodes:
            node.start_agent()
        await wait_until(
            lambda: (
                [n.agent.check_running() for n in nodes if n.agent]
                and len(specs := _usage(api)) == plan.instances
                and all(len(s.get("nodes") or []) == plan.nodes for s in specs.values())
            ),
            within=120,
            what=f"{plan.instances} shared Instances listing all {plan.nodes} nodes",
            interval=0.1,
        )
        for node in nodes:
            await wait_node_ready(api, node, [SHARED], plan.instances, within=120)
        startup_conflicts = _conflicts(api, startup_mark)
        log(f"contention: {len(nodes)} agents ready")

        il_resources = sorted(f"akri.sh/{name}" for name in _usage(api))
        mark = api.request_mark()
        timing_marks = [len(n.kubelet.allocate_timings) for n in nodes]

        async def admit(k: int) -> Any:
            node = nodes[k % len(nodes)]
            resource = rng.choice(il_resources) if rng.random() < plan.il_share else CL
            return await node.kubelet.admit_pod("default", f"p{k}", [("c", {resource: 1})])

        start = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*(admit(k) for k in range(plan.pods)), return_exceptions=True), 180
        )
        elapsed = time.monotonic() - start
        admitted = [r for r in results if not isinstance(r, BaseException) and r.admitted]
        crashed = [repr(r) for r in results if isinstance(r, BaseException)]
        refusals = Counter(
            (r.grpc_code.name if r.grpc_code else "kubelet: no device")
            for r in results
            if not isinstance(r, BaseException) and not r.admitted
        )
        checks = audit(api, nodes)
        conflicts = _conflicts(api, mark)
        timings = [
            t.seconds
            for node, m in zip(nodes, timing_marks, strict=True)
            for t in node.kubelet.allocate_timings[m:]
        ]
        held_after_burst = held_slots(api)

        # every pod goes away; the reclaimers (1 s / 3 s) must free every slot
        for node in nodes:
            for pod in list(node.kubelet.pods()):
                await node.kubelet.delete_pod(pod.namespace, pod.name)
        freed_start = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await wait_until(
                lambda: held_slots(api) == 0, within=30, what="all slots free", interval=0.1
            )
        leaked = held_slots(api)
        return {
            "nodes": plan.nodes,
            "instances": plan.instances,
            "capacity": plan.capacity,
            "pods": plan.pods,
            "admitted": len(admitted),
            "refused": dict(sorted(refusals.items())),
            "admission_exceptions": crashed[:3] or None,
            "burst_s": round(elapsed, 2),
            "claims_per_s": round(len(admitted) / elapsed, 1),
            "admissions_per_s": round(plan.pods / elapsed, 1),
            "allocate_ms": summarize(ms(timings)),
            "double_allocations": checks.pop("double_allocations"),
            "checks": checks,
            "slots_held_after_burst": held_after_burst,
            "cas_conflicts": conflicts,
            "cas_conflicts_startup": startup_conflicts,
            "final_leaked_slots": leaked,
            "all_freed_s": round(time.monotonic() - freed_start, 2) if leaked == 0 else None,
            "agent_problems": [p for n in nodes if n.agent for p in n.agent.problems()][:5],
        }
    finally:
        await asyncio.gather(*(node.close() for node in nodes), return_exceptions=True)


def _conflicts(api: ApiServer, mark: int) -> int:
    """409 answers to Instance writes in the request log since ``mark``."""
    return sum(1 for r in api.requests_since(mark) if r.resource == "instances" and r.status == 409)
