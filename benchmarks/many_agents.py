"""Many agents sharing devices (issue 28): N agent processes, one node name each, in cluster
mode against the API-server double, one debugEcho Configuration of shared devices.

Per N (10, 25, 50 by default):

* **start**: all N agents start together while the devices are offline (the startup of N
  Python processes on the host's cores is measured apart from the join);
* **join**: the devices come online on every node at once; the time until every Instance
  lists every node, the API requests the agents made (in total, per agent, by verb),
  Instance conflicts (409 on a checked write or apply) per successful Instance write (two
  nodes creating one Instance at once, AlreadyExists, counted apart), writes given up
  (``gave up updating`` / ``could not take`` log lines), watch events the API server sent,
  and the agents' CPU seconds and RSS;
* **edit**: the Configuration's capacity changes; the same figures until every Instance has
  it (one write per Instance expected: the node that sorts first writes it);
* **loss**: half the agents stop seeing the devices (``--shared-offline-grace`` short, so the
  departure is measured, not the grace); the same figures until every Instance lists only
  the other half;
* **delete** (issue 36): once every node is back in every Instance (not measured), the
  Configuration is deleted while no slot is held; the same figures until no Instance of it
  is left (Kubernetes' garbage collector, here the double's, deletes them; the
  ``akri.sh/slots`` finalizer keeps each until it is removed);
* **delete with held slots**: the Configuration is created again, every node joins (not
  measured), and pods on three nodes hold slots (two nodes on one Instance, one on another)
  through the instance-level device plugin; the Configuration is deleted (figures until the
  Instances holding nothing are gone: ``delete_held``), then the pods end (figures until the
  last Instance is gone: ``pods_end``; its time includes the reclaimer's
  ``--reclaim-grace``, the wait before a slot kubelet no longer lists is freed).

The agents are separate processes as in production; they share the host's two cores, so the
times include waiting for a core (the runqueue wait is reported).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.harness import (
    AgentOptions,
    ApiServer,
    Node,
    RunqueueWindow,
    agents_started,
    cpu_seconds,
    debug_echo_configuration,
    log,
    rss_mb,
    start_node,
    wait_until,
)

CONFIGURATION = "many"


@dataclass(frozen=True)
class ManyAgentsPlan:
    agents: tuple[int, ...] = (10, 25, 50)
    devices: int = 5
    capacity: int = 10
    offline_grace: float = 1.0  # seconds a node keeps a lost shared device (default: 300)
    within: float = 300.0  # bound on each convergence wait


def _instance_writes(requests: Sequence[Any]) -> dict[str, int]:
    instances = [r for r in requests if r.resource == "instances" and r.verb != "watch"]
    writes = [r for r in instances if r.verb in ("create", "update", "patch", "delete")]
    return {
        "writes_ok": sum(1 for r in writes if r.status < 300),
        # a stale resourceVersion (or uid) precondition: the write is decided again
        "conflicts": sum(1 for r in writes if r.status == 409 and r.verb != "create"),
        # two nodes creating one Instance at once: the loser joins it (AlreadyExists)
        "create_races": sum(1 for r in writes if r.status == 409 and r.verb == "create"),
        "applies": sum(1 for r in writes if r.verb == "patch" and r.status < 300),
    }


def _phase(
    api: ApiServer,
    nodes: Sequence[Node],
    mark: int,
    events_before: int,
    cpu_before: dict[int, float],
    seconds: float,
    runqueue: dict[str, float | None],
    gave_up_before: int,
) -> dict[str, Any]:
    requests = [r for r in api.requests_since(mark) if r.verb != "watch"]
    by_verb = Counter(f"{r.verb} {r.resource} {r.status}" for r in requests)
    writes = _instance_writes(requests)
    agents = [n.agent for n in nodes if n.agent is not None]
    cpu = [cpu_seconds(a.pid) - cpu_before[a.pid] for a in agents]
    rss = [rss_mb(a.pid) for a in agents]
    n = len(agents)
    instance_requests = [r for r in requests if r.resource == "instances"]
    return {
        "seconds": round(seconds, 2),  # until the state converged (not the settling after)
        "requests": len(requests),
        "requests_per_agent": round(len(requests) / n, 2),
        "instance_requests_per_agent": round(len(instance_requests) / n, 2),
        "requests_by_verb": dict(sorted(by_verb.items())),
        "instance_writes_ok": writes["writes_ok"],
        "instance_applies_ok": writes["applies"],
        "conflicts": writes["conflicts"],
        "create_races": writes["create_races"],
        "conflicts_per_successful_write": (
            round(writes["conflicts"] / writes["writes_ok"], 3) if writes["writes_ok"] else None
        ),
        "retries_exhausted": _gave_up(agents) - gave_up_before,
        "watch_events_sent": sum(api.api.watch_events_sent.values()) - events_before,
        "agent_cpu_seconds_mean": round(sum(cpu) / n, 3),
        "agent_cpu_seconds_max": round(max(cpu), 3),
        "agent_rss_mb_mean": round(sum(rss) / n, 1),
        "agent_rss_mb_max": round(max(rss), 1),
        "runqueue_wait_percent": runqueue,
    }


def _gave_up(agents: Sequence[Any]) -> int:
    """Writes given up so far (their log lines, over the agents' whole logs)."""
    return sum(
        len(a.log_lines("gave up updating")) + len(a.log_lines("could not take")) for a in agents
    )


def _nodes_of_every_instance(api: ApiServer) -> list[set[str]]:
    return [set(obj["spec"].get("nodes") or []) for obj in api.instances(CONFIGURATION)]


async def measure_n(n: int, plan: ManyAgentsPlan, options: AgentOptions) -> dict[str, Any]:
    api = ApiServer()
    api.start()
    nodes: list[Node] = []
    try:
        options = replace(options, shared_offline_grace=plan.offline_grace)
        api.api.create(
            debug_echo_configuration(
                CONFIGURATION, [f"cam{i}" for i in range(plan.devices)], plan.capacity
            )
        )
        # their Node objects, as in a cluster: a shared pool's publisher is the first node
        # whose Node serves (a node without one counts as deleted)
        api.create_nodes(f"node-{i:03d}" for i in range(n))
        nodes = [await start_node(api, f"node-{i:03d}", options) for i in range(n)]
        for node in nodes:
            node.set_available(False)
        names = {node.name for node in nodes}
        started = time.monotonic()
        for node in nodes:
            node.start_agent()
        pids = {node.name: node.agent.pid for node in nodes if node.agent is not None}

        await wait_until(
            lambda: agents_started(nodes),
            within=plan.within,
            what=f"{n} agents started",
            interval=0.1,
        )
        start_s = time.monotonic() - started
        await api.quiet(2.0, within=60)

        agents = [node.agent for node in nodes if node.agent is not None]

        # every node sees the devices at once
        gave_up = _gave_up(agents)
        mark = api.request_mark()
        events = sum(api.api.watch_events_sent.values())
        cpu_before = _cpu(nodes)
        window = RunqueueWindow({**pids})
        started = time.monotonic()
        for node in nodes:
            node.set_available(True)

        def joined() -> bool:
            found = _nodes_of_every_instance(api)
            return len(found) == plan.devices and all(nodes_ == names for nodes_ in found)

        await wait_until(joined, within=plan.within, what=f"{n} nodes in every Instance")
        join_s = time.monotonic() - started
        await _settled(api)
        join = _phase(
            api, nodes, mark, events, cpu_before, join_s, _summary(window.result()), gave_up
        )
        log(
            f"many agents N={n}: joined in {join_s:.2f}s, {join['requests_per_agent']} "
            f"requests/agent, {join['conflicts']} conflicts"
        )
        await api.quiet(2.0, within=60)

        # a Configuration edit: the capacity of every Instance changes
        gave_up = _gave_up(agents)
        mark = api.request_mark()
        events = sum(api.api.watch_events_sent.values())
        cpu_before = _cpu(nodes)
        window = RunqueueWindow({**pids})
        started = time.monotonic()
        edited = debug_echo_configuration(
            CONFIGURATION, [f"cam{i}" for i in range(plan.devices)], plan.capacity + 2
        )
        api.api.apply(edited)

        def resized() -> bool:
            found = api.instances(CONFIGURATION)
            return len(found) == plan.devices and all(
                obj["spec"].get("capacity") == plan.capacity + 2 for obj in found
            )

        await wait_until(resized, within=plan.within, what="every Instance resized")
        edit_s = time.monotonic() - started
        await _settled(api)  # the nodes that had nothing to write: nothing
        edit = _phase(
            api, nodes, mark, events, cpu_before, edit_s, _summary(window.result()), gave_up
        )
        log(f"many agents N={n}: edit applied with {edit['instance_writes_ok']} writes")

        # half the agents lose the devices
        leaving = nodes[: n // 2]
        staying = {node.name for node in nodes[n // 2 :]}
        gave_up = _gave_up(agents)
        mark = api.request_mark()
        events = sum(api.api.watch_events_sent.values())
        cpu_before = _cpu(nodes)
        window = RunqueueWindow({**pids})
        started = time.monotonic()
        for node in leaving:
            node.set_available(False)

        def left() -> bool:
            found = _nodes_of_every_instance(api)
            return len(found) == plan.devices and all(nodes_ == staying for nodes_ in found)

        await wait_until(left, within=plan.within, what=f"{len(leaving)} nodes gone")
        loss_s = time.monotonic() - started
        await _settled(api)
        loss = _phase(
            api, nodes, mark, events, cpu_before, loss_s, _summary(window.result()), gave_up
        )
        log(
            f"many agents N={n}: half left in {loss_s:.1f}s (grace {plan.offline_grace}s "
            f"included), {loss['conflicts']} conflicts"
        )
        await api.quiet(2.0, within=60)

        # every node sees the devices again (not measured): the deletes start from N nodes
        for node in leaving:
            node.set_available(True)
        await wait_until(joined, within=plan.within, what=f"{n} nodes back in every Instance")
        await _settled(api)

        def measure(name: str, act: Callable[[], Any], done: Callable[[], bool]) -> Any:
            return _measured(api, nodes, pids, agents, name, act, done, plan.within)

        def gone() -> bool:
            return not api.instances(CONFIGURATION)

        def delete_configuration() -> None:
            api.api.delete("configurations.akri.sh", CONFIGURATION, "default")

        delete = await measure("delete", delete_configuration, gone)
        log(
            f"many agents N={n}: deleted in {delete['seconds']}s, "
            f"{delete['requests_per_agent']} requests/agent, {delete['conflicts']} conflicts"
        )
        await api.quiet(2.0, within=60)

        # the same with slots held on three nodes
        api.api.create(
            debug_echo_configuration(
                CONFIGURATION, [f"cam{i}" for i in range(plan.devices)], plan.capacity
            )
        )
        await wait_until(joined, within=plan.within, what=f"{n} nodes in every new Instance")
        await _settled(api)
        held = await _hold_slots(api, nodes)

        def only_held_left() -> bool:
            left = api.instances(CONFIGURATION)
            return {o["metadata"]["name"] for o in left} == set(held.values()) and all(
                o["metadata"].get("deletionTimestamp") for o in left
            )

        delete_held = await measure("delete_held", delete_configuration, only_held_left)

        async def end_pods() -> None:
            for node in nodes:
                if node.name in held:
                    await node.kubelet.delete_pod("default", f"holder-{node.name}")

        pods_end = await measure("pods_end", end_pods, gone)
        log(
            f"many agents N={n}: with held slots, the others gone in "
            f"{delete_held['seconds']}s ({delete_held['conflicts']} conflicts), the held ones "
            f"{pods_end['seconds']}s after their pods ended ({pods_end['conflicts']} conflicts)"
        )
        problems = [line for node in nodes if node.agent for line in node.agent.problems()]
        return {
            "agents": n,
            "start_s": round(start_s, 2),
            "join": join,
            "edit": edit,
            "loss_of_half": loss,
            "delete": delete,
            "delete_held": {**delete_held, "holders": held},
            "pods_end": {**pods_end, "reclaim_grace_s": options.reclaim_grace},
            "offline_grace_s": plan.offline_grace,
            "agent_problems": problems[:5],
        }
    finally:
        await asyncio.gather(*(node.close(grace=5.0) for node in nodes))
        api.stop()


async def _measured(
    api: ApiServer,
    nodes: Sequence[Node],
    pids: dict[str, int],
    agents: Sequence[Any],
    name: str,
    act: Callable[[], Any],
    done: Callable[[], bool],
    within: float,
) -> dict[str, Any]:
    """One phase: ``act`` (a function, or one returning an awaitable), then the figures
    until ``done`` holds and the agents settled."""
    gave_up = _gave_up(agents)
    mark = api.request_mark()
    events = sum(api.api.watch_events_sent.values())
    cpu_before = _cpu(nodes)
    window = RunqueueWindow({**pids})
    started = time.monotonic()
    outcome = act()
    if asyncio.iscoroutine(outcome):
        await outcome
    await wait_until(done, within=within, what=name)
    seconds = time.monotonic() - started
    await _settled(api)
    return _phase(api, nodes, mark, events, cpu_before, seconds, _summary(window.result()), gave_up)


async def _hold_slots(api: ApiServer, nodes: Sequence[Node]) -> dict[str, str]:
    """Pods on three nodes take one slot each through the instance-level device plugin: the
    first and the middle node on the first Instance, the last node on the second. Returns
    node -> Instance."""
    names = sorted(o["metadata"]["name"] for o in api.instances(CONFIGURATION))
    plan = {nodes[0].name: names[0], nodes[len(nodes) // 2].name: names[0]}
    plan[nodes[-1].name] = names[1]
    taken: dict[str, int] = {}
    for node in nodes:
        instance = plan.get(node.name)
        if instance is None:
            continue
        resource = f"akri.sh/{instance}"
        # a slot of its own for each pod: another node's Unhealthy list may still be on its way
        slot = f"{instance}-{taken.setdefault(instance, 0)}"
        taken[instance] += 1
        for attempt in range(5):
            await wait_until(
                lambda k=node.kubelet, r=resource, d=slot: d in k.healthy_devices(r),
                within=60,
                what=f"{slot} offered on {node.name}",
            )
            try:
                pod = await node.kubelet.admit_pod(
                    "default",
                    f"holder-{node.name}",
                    [("c", {resource: 1})],
                    choose={resource: [slot]},
                )
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # the plugin of the Instance's previous incarnation (same name) went away
                # under the call: its successor registers; try again
                log(f"{node.name}: Allocate of {slot} cut off (attempt {attempt + 1})")
                await asyncio.sleep(1.0)
                continue
            if not pod.admitted:
                raise RuntimeError(f"{node.name}: the holder pod was refused: {pod.message}")
            break
        else:
            raise RuntimeError(f"{node.name}: no Allocate of {slot} got through")

    def recorded() -> bool:
        usage = [
            value
            for obj in api.instances(CONFIGURATION)
            for value in (obj["spec"].get("deviceUsage") or {}).values()
        ]
        return sorted(v for v in usage if v) == sorted(plan)

    await wait_until(recorded, within=60, what="held slots recorded")
    return plan


def _cpu(nodes: Sequence[Node]) -> dict[int, float]:
    return {n.agent.pid: cpu_seconds(n.agent.pid) for n in nodes if n.agent is not None}


def _summary(runqueue: dict[str, float | None] | Any) -> dict[str, float | None]:
    if not isinstance(runqueue, dict):
        return {}
    values = [v for v in runqueue.values() if isinstance(v, int | float)]
    if not values:
        return {}
    return {"mean": round(sum(values) / len(values), 1), "max": round(max(values), 1)}


async def _settled(api: ApiServer) -> None:
    """After a phase converged: until no request came and no watch event was sent for a
    second, so that its requests and the watch events it caused (still being written to slow,
    CPU-starved agents when the state converged) are all counted in it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        mark, events = api.request_mark(), sum(api.api.watch_events_sent.values())
        await asyncio.sleep(1.0)
        quiet = not [r for r in api.requests_since(mark) if r.verb != "watch"]
        if quiet and sum(api.api.watch_events_sent.values()) == events:
            return


async def run_many_agents(plan: ManyAgentsPlan, options: AgentOptions) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for n in plan.agents:
        try:
            results[str(n)] = await measure_n(n, plan, options)
        except Exception as exc:  # one N failing still reports the others
            results[str(n)] = {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}
    return results
