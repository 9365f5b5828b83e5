"""Latency figures on one node (one agent process, one kubelet double):

* ``discovery_to_kubelet_ms`` — a new debugEcho Configuration is written to the API double →
  the kubelet double receives the first ListAndWatch message listing the new device's slots
  Healthy (the full path: watch event, handler start, Instance create, plugin start, plugin
  registration, kubelet dial, ListAndWatch);
* ``discovery_online_flip_ms`` — the availability file goes OFFLINE → ONLINE → ListAndWatch
  lists the slots Healthy again (bounded by debugEcho's 0.5 s file poll, see docs);
* ``allocate_il_ms`` / ``allocate_cl_ms`` — the Allocate RPC round trip seen by the kubelet
  double during a pod admission; the Instance write is part of it (checked afterwards);
* ``reclaim_ms`` — pod deleted in the kubelet double → its slot free in the API double;
* ``kubelet_restart_reregister_ms`` — ``kubelet.restart()`` → every plugin registered again;
* ``dra_prepare_ms`` — the DRA kubelet double's ``NodePrepareResources`` round trip for a claim
  the scheduler emulator allocated from the agent's ResourceSlices.

Start and end times are ``time.monotonic()`` of this process: the kubelet double records its
receive times with the same clock.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import (
    AgentOptions,
    ApiServer,
    Node,
    RunqueueWindow,
    WaitTimeout,
    agent_flags,
    debug_echo_configuration,
    expected_resources,
    registered_since,
    start_node,
    wait_node_ready,
    wait_until,
)
from benchmarks.stats import ms, summarize
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import (
    RESOURCE_CLAIMS,
    AllocationError,
    allocate_claim,
    create_claim,
)

ALLOC = "alloc"
FLIP = "flip"
HEALTHY = "Healthy"
NODE = "bench-a"
DRA_DRIVER = "akri.sh"
ADMISSION_STEPS = {
    "il": "(device choice + Allocate)",
    "cl": "(GetPreferredAllocation + Allocate)",
}


@dataclass(frozen=True)
class LatencyPlan:
    discovery: int
    flips: int
    allocations: int  # per plugin kind
    restarts: int
    reclaim_spacing: float  # mean seconds between pod deletions
    alloc_devices: int = 64  # capacity 4 each: 256 slots for the IL + CL pods
    dra_claims: int = 20  # claims prepared (and unprepared) one after another


@dataclass(frozen=True)
class HeldPod:
    """A live pod and the Instance slot it holds in the API."""

    pod: str
    instance: str
    slot: str
    value: str


class LatencyBench:
    """One agent with Configurations ``alloc`` (``alloc_devices`` devices, capacity 4) and
    ``flip`` (one device, capacity 1)."""

    def __init__(
        self, api: ApiServer, plan: LatencyPlan, rng: random.Random, options: AgentOptions
    ) -> None:
        self.api = api
        self.options = options
        self.agent_command: list[str] | None = None  # e.g. benchmarks/profiled_agent.py
        self.plan = plan
        self.rng = rng
        self.node: Node | None = None
        self.resources: set[str] = set()
        self.pods: list[HeldPod] = []

    @property
    def kubelet(self) -> Any:
        assert self.node is not None
        return self.node.kubelet

    async def setup(self) -> dict[str, Any]:
        devices = [f"a{i}" for i in range(self.plan.alloc_devices)]
        self.api.api.create(debug_echo_configuration(ALLOC, devices, 4))
        self.api.api.create(debug_echo_configuration(FLIP, ["flip0"], 1))
        self.node = await start_node(self.api, NODE, self.options)
        agent = self.node.start_agent(self.agent_command)
        self.resources = await wait_node_ready(
            self.api, self.node, [ALLOC, FLIP], len(devices) + 1, within=90
        )
        return {
            "node": NODE,
            "plugins": len(self.resources),
            "ready_s": round(time.monotonic() - agent.started, 2),
        }

    async def close(self) -> list[str]:
        problems: list[str] = []
        if self.node is not None:
            if self.node.agent is not None:
                problems = self.node.agent.problems()
            await self.node.close()
        return problems

    async def timed(self, run: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """``run()``'s result plus how long the agent and this process (the doubles) waited
        for a CPU during it (other load on the machine shows up here)."""
        assert self.node is not None and self.node.agent is not None
        window = RunqueueWindow({"agent": self.node.agent.pid, "doubles": os.getpid()})
        result = await run()
        result["runqueue_wait_percent"] = window.result()
        return result

    def _check_agent(self) -> None:
        assert self.node is not None and self.node.agent is not None
        self.node.agent.check_running()

    async def _wait_listed(
        self, mark: int, accept: Callable[[Any], bool], within: float, what: str
    ) -> Any:
        """The first ListAndWatch event (from log index ``mark``) that ``accept`` takes."""
        log = self.kubelet.list_and_watch_log
        index = [mark]

        def found() -> Any:
            self._check_agent()
            while index[0] < len(log):
                event = log[index[0]]
                index[0] += 1
                if accept(event):
                    return event
            return None

        try:
            return await self.kubelet.wait_for(found, within, poll=0.02)
        except TimeoutError:
            raise WaitTimeout(f"not within {within:.0f}s: {what}") from None

    # ---------------------------------------------------------------- discovery

    async def discovery(self) -> dict[str, Any]:
        total: list[float] = []
        to_create: list[float] = []
        to_register: list[float] = []
        phases: list[dict[str, float | None]] = []
        for i in range(self.plan.discovery):
            name = f"disc-{i}"
            prefix = f"akri.sh/{name}-"  # its IL resource; the CL one is "akri.sh/disc-<i>"
            mark = len(self.kubelet.list_and_watch_log)
            requests = self.api.request_mark()
            start = time.monotonic()
            self.api.api.create(debug_echo_configuration(name, [f"dev-{i}"], 2))
            event = await self._wait_listed(
                mark,
                lambda e, p=prefix: e.resource_name.startswith(p) and HEALTHY in e.devices.values(),
                within=15,
                what=f"{name}: its device listed Healthy",
            )
            total.append(event.time - start)
            creates = [
                r
                for r in self.api.requests_since(requests)
                if r.verb == "create" and r.resource == "instances"
            ]
            if creates:
                to_create.append(creates[0].time - start)
            regs = [
                r.time
                for r in self.kubelet.registrations
                if r.resource_name == event.resource_name and r.time >= start
            ]
            if regs:
                to_register.append(regs[0] - start)
            phases.append(
                {
                    "total": round((event.time - start) * 1000, 1),
                    "instance_create_request": _ms(creates[0].time - start) if creates else None,
                    "plugin_registered": _ms(regs[0] - start) if regs else None,
                }
            )
            # remove it again so every sample starts from the same state
            assert self.node is not None and self.node.agent is not None
            since = self.node.agent.log_mark()
            self.api.api.delete("configurations.akri.sh", name, "default")
            await wait_until(
                lambda n=name: not self.api.instances(n),
                within=15,
                what=f"{name}: Instance deleted after its Configuration",
                interval=0.02,
            )
            # ... and wait until the agent has stopped both plugins (it logs the CL one last):
            # stopping a plugin holds up the agent's plugin sync for 0.2 s each (see
            # docs/performance.md), which would otherwise spill into the next sample
            await self.node.agent.wait_log(
                f"stopped configuration device plugin for {name}\n", since=since, within=15
            )
            await asyncio.sleep(0.05)
        return {
            **summarize(ms(total)),
            "method": "new Configuration (1 debugEcho device) written to the API → first "
            "ListAndWatch listing its slots Healthy; the Configuration is deleted between "
            "samples and the next sample starts once the agent has removed its plugins",
            "slowest_ms": sorted(phases, key=lambda p: -(p["total"] or 0))[:3],
            "breakdown_p50_ms": {
                "to_instance_create_request": _p50(to_create),
                "to_plugin_registered": _p50(to_register),
            },
        }

    async def online_flip(self) -> dict[str, Any]:
        assert self.node is not None
        flip_il = next(r for r in self.resources if r.startswith(f"akri.sh/{FLIP}-"))
        samples: list[float] = []
        try:
            for _ in range(self.plan.flips):
                mark = len(self.kubelet.list_and_watch_log)
                self.node.set_available(False)
                await self._wait_listed(
                    mark,
                    lambda e: e.resource_name == flip_il and HEALTHY not in e.devices.values(),
                    within=10,
                    what=f"{flip_il} Unhealthy after OFFLINE",
                )
                await asyncio.sleep(self.rng.uniform(0.05, 0.5))
                mark = len(self.kubelet.list_and_watch_log)
                start = time.monotonic()
                self.node.set_available(True)
                event = await self._wait_listed(
                    mark,
                    lambda e: (
                        e.resource_name == flip_il
                        and bool(e.devices)
                        and all(h == HEALTHY for h in e.devices.values())
                    ),
                    within=10,
                    what=f"{flip_il} Healthy after ONLINE",
                )
                samples.append(event.time - start)
        finally:
            self.node.set_available(True)
        # every plugin back to Healthy before the next measurement
        await wait_until(
            lambda: all(self.kubelet.allocatable(r) > 0 for r in self.resources),
            within=15,
            what="all plugins Healthy again after the flips",
            interval=0.05,
        )
        return {
            **summarize(ms(samples)),
            "method": "availability file OFFLINE → ONLINE (shared device in its offline grace) "
            "→ ListAndWatch listing it Healthy; includes debugEcho's file poll (every 0.5 s)",
        }

    # ---------------------------------------------------------------- allocate

    async def allocate(self, kind: str) -> dict[str, Any]:
        """``kind``: "il" (``akri.sh/alloc-<digest>``) or "cl" (``akri.sh/alloc``)."""
        assert self.node is not None
        il_resources = sorted(r for r in self.resources if r.startswith(f"akri.sh/{ALLOC}-"))
        cl_resource = f"akri.sh/{ALLOC}"
        rpc: list[float] = []
        admission: list[float] = []
        verified = 0
        requests = self.api.request_mark()
        for i in range(self.plan.allocations):
            resource = il_resources[i % len(il_resources)] if kind == "il" else cl_resource
            pod = f"{kind}-{i}"
            mark = len(self.kubelet.allocate_timings)
            result = await asyncio.wait_for(
                self.kubelet.admit_pod("default", pod, [("c", {resource: 1})]), 20
            )
            if not result.admitted:
                raise RuntimeError(f"pod {pod} ({resource}) not admitted: {result.message}")
            timing = [t for t in self.kubelet.allocate_timings[mark:] if t.pod == pod and t.ok][-1]
            rpc.append(timing.seconds)
            admission.append((result.finished or time.monotonic()) - result.started)
            held = self._held_slot(kind, pod, resource, result.devices(resource)[0])
            if held is None:
                raise RuntimeError(f"pod {pod}: no slot held for it in the API after Allocate")
            verified += 1
            self.pods.append(held)
            await asyncio.sleep(0.05)
        return {
            **summarize(ms(rpc)),
            "admission_ms": summarize(ms(admission)),
            "slots_verified_in_api": verified,
            # API requests the agent made during the measurement ("verb resource status")
            "api_requests": _request_counts(self.api.requests_since(requests)),
            "method": "Allocate RPC round trip measured in the kubelet double (includes the "
            "resourceVersion-checked Instance write); admission_ms is the whole pod admission "
            + ADMISSION_STEPS[kind],
        }

    def _held_slot(self, kind: str, pod: str, resource: str, device: str) -> HeldPod | None:
        """The API slot held for ``device`` right after the Allocate returned."""
        if kind == "il":
            instance = resource.removeprefix("akri.sh/")
            obj = self.api.instance(instance) or {}
            usage = (obj.get("spec") or {}).get("deviceUsage") or {}
            if usage.get(device) == NODE:
                return HeldPod(pod, instance, device, NODE)
            return None
        value = f"C:{device}:{NODE}"
        for obj in self.api.instances(ALLOC):
            for slot, held in ((obj.get("spec") or {}).get("deviceUsage") or {}).items():
                if held == value:
                    return HeldPod(pod, obj["metadata"]["name"], slot, value)
        return None

    # ---------------------------------------------------------------- reclaim

    async def reclaim(self) -> dict[str, Any]:
        """Delete the pods of :meth:`allocate` one by one (random spacing, so deletions fall at
        every phase of the reclaim period) and time each slot until it is free in the API.

        The slots of pods not deleted yet are watched too: one found free while its pod still
        runs is a *premature release* (the slot could be given to a second pod) and is not a
        latency sample; nor is a deleted pod's slot freed sooner than the reclaim grace allows
        (it was freed as a side effect of releasing another slot)."""
        if not self.pods:
            raise RuntimeError("no pods from the allocate measurement to delete")
        grace = self.options.reclaim_grace
        pods = list(self.pods)
        self.rng.shuffle(pods)
        deleted: dict[HeldPod, float] = {}
        samples: list[float] = []
        premature: list[str] = []
        early: list[str] = []

        async def delete_all() -> None:
            for held in pods:
                deleted[held] = time.monotonic()
                await self.kubelet.delete_pod("default", held.pod)
                await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.plan.reclaim_spacing)

        deleter = asyncio.create_task(delete_all())
        try:
            deadline = time.monotonic() + len(pods) * self.plan.reclaim_spacing * 1.5 + 30
            pending = set(pods)
            while pending:
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"{len(pending)} slot(s) not reclaimed in time")
                self._check_agent()
                usage = {
                    name: (obj.get("spec") or {}).get("deviceUsage") or {}
                    for name in {p.instance for p in pending}
                    if (obj := self.api.instance(name)) is not None
                }
                now = time.monotonic()
                for held in list(pending):
                    if usage.get(held.instance, {}).get(held.slot) == held.value:
                        continue
                    pending.discard(held)
                    what = f"{held.pod}: {held.instance}/{held.slot} ({held.value})"
                    if held not in deleted:
                        premature.append(what)
                    elif now - deleted[held] < grace:
                        early.append(f"{what} after {(now - deleted[held]) * 1000:.0f} ms")
                    else:
                        samples.append(now - deleted[held])
                await asyncio.sleep(0.01)
            await asyncio.wait_for(deleter, 10)
        finally:
            deleter.cancel()
            self.pods = []
        return {
            **summarize(ms(samples)),
            "premature_releases": len(premature),
            "freed_before_grace": len(early),
            "examples": (premature[:3] + early[:3]) or None,
            "method": "pod deleted in the kubelet double → its slot free in the Instance "
            f"(API double's store polled every 10 ms; reclaim interval "
            f"{self.options.reclaim_interval:g} s, grace {grace:g} s)",
        }

    # ---------------------------------------------------------------- kubelet restart

    async def kubelet_restart(self) -> dict[str, Any]:
        resources = expected_resources(self.api.instances(), NODE)
        samples: list[float] = []
        socket_back: list[float] = []
        for _ in range(self.plan.restarts):
            start = time.monotonic()
            await self.kubelet.restart()
            if self.kubelet.started_at is not None:
                socket_back.append(self.kubelet.started_at - start)
            last = await wait_until(
                lambda s=start: (
                    self._check_agent(),
                    registered_since(self.kubelet, resources, s),
                )[1],
                within=20,
                what=f"{len(resources)} plugins re-registered after a kubelet restart",
                interval=0.01,
            )
            samples.append(last - start)
            await wait_until(
                lambda: all(self.kubelet.allocatable(r) > 0 for r in resources),
                within=20,
                what="devices listed again after the restart",
                interval=0.05,
            )
            await asyncio.sleep(0.5)
        return {
            **summarize(ms(samples)),
            "plugins": len(resources),
            "kubelet_socket_back_p50_ms": _p50(socket_back),
            "method": "kubelet.restart() called → the last of the node's plugins registered "
            "again (the agent notices the new kubelet.sock through inotify; polling every 0.2 s "
            "only where inotify is unavailable)",
        }

    # ---------------------------------------------------------------- DRA prepare

    async def dra_prepare(self) -> dict[str, Any]:
        """For each sample: a ResourceClaim is created and allocated on this node by the
        scheduler emulator (from the agent's ResourceSlices), then the DRA kubelet double calls
        ``NodePrepareResources`` (timed: the RPC round trip, which includes the Instance write
        claiming the slot and the CDI spec file), then ``NodeUnprepareResources`` (timed too)
        when the pod goes, and the claim is deleted so every sample starts from free slots."""
        assert self.node is not None
        if "--dra" not in agent_flags():
            return {"skipped": "this agent version has no DRA kubelet plugin"}
        kubelet = TimedDraKubelet(self.node.base / "plugins_registry", NODE, self.api.api)
        await kubelet.start()
        prepare: list[float] = []
        unprepare: list[float] = []
        verified = 0
        requests = self.api.request_mark()
        try:
            await kubelet.wait_for_registration(DRA_DRIVER, timeout=20)
            for i in range(self.plan.dra_claims):
                name = f"dra-{i}"
                claim = create_claim(self.api.api, "default", name)
                uid = claim["metadata"]["uid"]
                pod = f"pod-{name}"
                await wait_until(
                    lambda n=name, p=pod: _try_allocate(self.api.api, n, p),
                    within=15,
                    what=f"claim {name} allocated from the agent's ResourceSlices",
                    interval=0.02,
                )
                await kubelet.prepare(pod, [("default", uid, name)])
                prepare.append(kubelet.timings["NodePrepareResources"][-1])
                if any(
                    value == f"D:{uid}:{NODE}"
                    for obj in self.api.instances(ALLOC)
                    for value in ((obj.get("spec") or {}).get("deviceUsage") or {}).values()
                ):
                    verified += 1
                await kubelet.remove_pod(pod)
                unprepare.append(kubelet.timings["NodeUnprepareResources"][-1])
                self.api.api.delete(RESOURCE_CLAIMS, name, "default")
                await asyncio.sleep(0.05)
        finally:
            await kubelet.stop()
        return {
            **summarize(ms(prepare)),
            "unprepare_ms": summarize(ms(unprepare)),
            "slots_verified_in_api": verified,
            "api_requests": _request_counts(self.api.requests_since(requests)),
            "method": "NodePrepareResources round trip seen by the DRA kubelet double for one "
            "allocated claim (includes reading the claim, the resourceVersion-checked Instance "
            "write and the CDI spec); unprepare_ms is NodeUnprepareResources after the pod went",
        }


def _try_allocate(api: Any, claim: str, pod: str) -> bool:
    """Allocate ``claim`` on the node like the scheduler would; False while nothing fits yet
    (the agent's slices may still be catching up with freed slots)."""
    try:
        allocate_claim(api, "default", claim, NODE, pod_name=pod, pod_uid=pod)
    except AllocationError:
        return False
    return True


class TimedDraKubelet(DraKubeletDouble):
    """The DRA kubelet double, also recording each RPC's round trip (seconds, by method)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timings: dict[str, list[float]] = {}

    async def _call(self, registration: Any, service: str, method: str, claims: Any) -> Any:
        start = time.monotonic()
        response = await super()._call(registration, service, method, claims)
        self.timings.setdefault(method, []).append(time.monotonic() - start)
        return response


def _request_counts(requests: list[Any]) -> dict[str, int]:
    counts = Counter(f"{r.verb} {r.resource} {r.status}" for r in requests if r.verb != "watch")
    return dict(sorted(counts.items()))


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _p50(seconds: list[float]) -> float | None:
    return summarize(ms(seconds))["p50"] if seconds else None
