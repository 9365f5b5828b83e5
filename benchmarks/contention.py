"""``contention``: 3 agent processes on 3 simulated nodes (3 kubelet doubles), 50 shared
Instances of capacity 2 (100 slots), and 300 pod admissions launched at once, each asking for
one device through IL (a random Instance) or CL (the Configuration), half and half.

Each kubelet double admits its pods one at a time (like the kubelet's device manager), so the
three nodes race each other for the same slots through resourceVersion-checked writes.

Then half of the live pods are deleted, the reclaimers free their slots, and 150 more
admissions race for them (churn + refill), and finally every pod is deleted.

Audits of the API Instances against the kubelet doubles' live pods, after the burst, after the
churn and after the refill (``double_allocations`` is the worst of the three, must be 0; it is
``unbacked_devices + over_capacity``):

* ``unbacked_devices`` — a device of a live pod whose slot in the API does not name that pod's
  node (free: it can be given to a second pod — ``unbacked_slot_free_in_api``; someone else's:
  it has been);
* ``shared_slots`` — a slot used by two live pods (the second is always an unbacked one);
* ``over_capacity`` — slots held beyond an Instance's capacity;

``final_leaked_slots`` counts the slots still held after every pod was deleted and the
reclaimers ran (must be 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.harness import (
    AgentOptions,
    ApiServer,
    Node,
    RunqueueWindow,
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
    refill: int = 150  # admissions after half of the pods were deleted and reclaimed
    # shorter than the defaults (1 s / 3 s) to keep the run short, and harder on the agent:
    # the window between a claim and kubelet listing the container is closer to the grace
    reclaim_interval: float = 0.5
    reclaim_grace: float = 1.0


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
    # an IL device id *is* the slot: (instance, slot) -> every live pod using it
    holders: dict[tuple[str, str], list[str]] = defaultdict(list)
    unbacked: list[str] = []
    unbacked_ids: set[str] = set()
    freed_in_use = 0
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
                            if not slots:
                                unbacked.append(f"{who} (no slot holds this vdev)")
                                unbacked_ids.add(who)
                            for slot in slots[:1]:
                                holders[slot].append(who)
                            continue
                        instance = resource.removeprefix("akri.sh/")
                        value = (specs.get(instance, {}).get("deviceUsage") or {}).get(device)
                        holders[(instance, device)].append(who)
                        if value != node.name:
                            unbacked.append(f"{who} (slot value in the API: {value!r})")
                            unbacked_ids.add(who)
                            freed_in_use += not value
    shared = {f"{i}/{s}": who for (i, s), who in holders.items() if len(who) > 1}
    shared_count = sum(len(who) - 1 for who in shared.values())
    # a slot shared by live pods always involves an unbacked one, unless the API itself backs
    # both (impossible with one value per slot, but counted if it happens)
    shared_all_backed = sum(
        len(who) - 1 for who in shared.values() if not unbacked_ids.intersection(who)
    )
    return {
        "double_allocations": len(unbacked) + over_capacity + shared_all_backed,
        "shared_slots": shared_count,
        "unbacked_devices": len(unbacked),
        "unbacked_slot_free_in_api": freed_in_use,
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
    options = replace(
        options, reclaim_interval=plan.reclaim_interval, reclaim_grace=plan.reclaim_grace
    )
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
        audits: dict[str, dict[str, Any]] = {}

        # 1. the burst
        pids = {n.name: n.agent.pid for n in nodes if n.agent} | {"doubles": os.getpid()}
        window = RunqueueWindow(pids)
        burst = await _burst(nodes, il_resources, plan, rng, range(plan.pods))
        burst["runqueue_wait_percent"] = window.result()
        audits["after_burst"] = audit(api, nodes)
        held_after_burst = held_slots(api)
        conflicts = _conflicts(api, mark)

        # 2. churn: half of the pods go away, the reclaimers free their slots; the other
        #    half must keep theirs
        live = [(node, pod) for node in nodes for pod in node.kubelet.pods()]
        for node, pod in rng.sample(live, len(live) // 2):
            await node.kubelet.delete_pod(pod.namespace, pod.name)
        await asyncio.sleep(plan.reclaim_interval + plan.reclaim_grace + 0.75)
        audits["after_churn"] = audit(api, nodes)

        # 3. refill: new pods race for the freed slots
        refill: dict[str, Any] | None = None
        if plan.refill:
            first = plan.pods
            numbers = range(first, first + plan.refill)
            refill = await _burst(nodes, il_resources, plan, rng, numbers)
            audits["after_refill"] = audit(api, nodes)
        timings = [
            t.seconds
            for node, m in zip(nodes, timing_marks, strict=True)
            for t in node.kubelet.allocate_timings[m:]
        ]
        conflicts_total = _conflicts(api, mark)

        # 4. every pod goes away; the reclaimers must free every slot
        for node in nodes:
            for pod in list(node.kubelet.pods()):
                await node.kubelet.delete_pod(pod.namespace, pod.name)
        freed_start = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await wait_until(
                lambda: held_slots(api) == 0, within=30, what="all slots free", interval=0.05
            )
        leaked = held_slots(api)
        worst = max(a["double_allocations"] for a in audits.values())
        return {
            "nodes": plan.nodes,
            "instances": plan.instances,
            "capacity": plan.capacity,
            "pods": plan.pods,
            "reclaim": f"interval {plan.reclaim_interval:g} s, grace {plan.reclaim_grace:g} s",
            **burst,
            "refill": refill,
            "allocate_ms": summarize(ms(timings)),
            "double_allocations": worst,
            "audits": audits,
            "slots_held_after_burst": held_after_burst,
            "cas_conflicts": conflicts,
            "cas_conflicts_with_refill": conflicts_total,
            "cas_conflicts_startup": startup_conflicts,
            "final_leaked_slots": leaked,
            "all_freed_s": round(time.monotonic() - freed_start, 2) if leaked == 0 else None,
            "agent_problems": [p for n in nodes if n.agent for p in n.agent.problems()][:5],
        }
    finally:
        await asyncio.gather(*(node.close() for node in nodes), return_exceptions=True)


async def _burst(
    nodes: list[Node],
    il_resources: list[str],
    plan: ContentionPlan,
    rng: random.Random,
    numbers: range,
) -> dict[str, Any]:
    """Admit pods ``p<k>`` for every k in ``numbers`` at once, round-robin over the nodes."""

    async def admit(k: int) -> Any:
        node = nodes[k % len(nodes)]
        resource = rng.choice(il_resources) if rng.random() < plan.il_share else CL
        return await node.kubelet.admit_pod("default", f"p{k}", [("c", {resource: 1})])

    start = time.monotonic()
    results = await asyncio.wait_for(
        asyncio.gather(*(admit(k) for k in numbers), return_exceptions=True), 180
    )
    elapsed = time.monotonic() - start
    admitted = [r for r in results if not isinstance(r, BaseException) and r.admitted]
    refusals = Counter(
        (r.grpc_code.name if r.grpc_code else "kubelet: no device")
        for r in results
        if not isinstance(r, BaseException) and not r.admitted
    )
    return {
        "attempts": len(numbers),
        "admitted": len(admitted),
        "refused": dict(sorted(refusals.items())),
        "admission_exceptions": [repr(r) for r in results if isinstance(r, BaseException)][:3]
        or None,
        "burst_s": round(elapsed, 2),
        "claims_per_s": round(len(admitted) / elapsed, 1),
        "admissions_per_s": round(len(numbers) / elapsed, 1),
    }


def _conflicts(api: ApiServer, mark: int) -> int:
    """409 answers to Instance writes in the request log since ``mark``."""
    return sum(1 for r in api.requests_since(mark) if r.resource == "instances" and r.status == 409)
