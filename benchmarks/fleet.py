"""``fleet``: what the rest of the cluster costs one agent (issue 41, DESIGN invariant 11).

One agent (cluster mode, ``akri agent`` as a process, node ``fleet-me``) serves one local
debugEcho device of the Configuration ``fleet-cams``. The other nodes of a large cluster are
simulated by their Instances: ``--sizes`` of them (cumulative), each a local device of
another node (``shared: false``, one node in ``nodes``), labelled as our agents label what they
write, ten per node — and by each such node's local DRA pool (one ``akri.sh`` ResourceSlice
per foreign node, ``spec.nodeName`` that node, a device per camera). Figures:

* ``rss_mb``: the agent's VmRSS on the empty cluster (``0``) and with each number of foreign
  Instances created while it runs (each the median of a few readings once it has gone idle),
  and ``rss_after_restart_mb``: started again with the largest number already there;
* ``start_requests``: the agent's requests to the API server from its start until it served
  its own device (the list pages grow with what it lists);
* ``churn``: the other nodes update their Instances at ``--rate`` writes/s for ``--seconds``
  (each write flips the one slot of one foreign Instance between free and held by its node,
  as their pods come and go): the agent's CPU in % of one core during the churn and during as
  long an idle window before it (``cpu_percent``, ``idle_cpu_percent``; the churn's own cost
  is the difference), its log lines and its requests meanwhile;
* ``slice_churn``: the other nodes rewrite their local ResourceSlices at the same rate (each
  write flips one device attribute of one foreign node's pool, as a pool's content changes
  when its devices do): the same figures. The agent still lists and watches every ``akri.sh``
  slice (docs/performance.md, the per-node cost model): this is what that costs;
* ``own_instance_served``: its own Instance still lists it and its plugin offers the device.

Against the API-server double (default), or a real API server: ``--kubeconfig FILE`` (an
admin's: the benchmark creates the CRDs' objects and deletes them again, labelled
``akri.sh/bench=fleet``; the akri.sh CRDs must be installed, ``kubectl apply -f crds/``). The
agent runs here either way, with the kubelet double; against a real server its requests are
not counted (``null``).

``--before-root DIR``: also measure the agent of another checkout (e.g. a git worktree of an
earlier commit: ``git worktree add /tmp/before <commit>``), first, in the same run; the result
is then ``{"before": ..., "after": ...}``.

    .venv/bin/python -m benchmarks.fleet --sizes 1000,5000,10000 --out benchmarks/results-fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.core.kube import ApiError, KubeClient, make_kube_client, resource_path
from agent.core.model.naming import akri_digest, device_key, instance_name
from agent.core.model.node_labels import with_node_labels
from agent.node.deviceplugin.views import configuration_resource, instance_resource
from agent.node.dra.name_paths import DRA, MODE_LABEL
from agent.node.dra.publisher import POOL_LABEL
from agent.node.dra.slices import DRIVER
from benchmarks.harness import (
    AGENT_COMMAND,
    PROCESSES,
    AgentOptions,
    ApiServer,
    Node,
    TimedKubelet,
    cpu_ns,
    debug_echo_configuration,
    healthy_listed,
    log,
    rss_mb,
    wait_until,
)

CONFIGURATION = "fleet-cams"
NODE = "fleet-me"
OWN_DEVICE = "me-cam"
CAMERAS_PER_NODE = 10
BENCH_LABEL = "akri.sh/bench"
INSTANCES = resource_path("akri.sh", "v0", "instances", "default")
CONFIGURATIONS = resource_path("akri.sh", "v0", "configurations", "default")
SLICES = resource_path("resource.k8s.io", "v1", "resourceslices")


@dataclass(frozen=True)
class FleetPlan:
    """Sizes, churn and waits (``quick``: what CI's time budget allows)."""

    sizes: tuple[int, ...] = (1000, 5000, 10000)
    rate: float = 50.0  # foreign writes per second
    seconds: float = 60.0  # of churn (and of the idle window before it)
    within: float = 300.0  # bound of every wait
    restart: bool = True
    controller: bool = True  # the controller's cost at the largest size (double only)


QUICK = FleetPlan(sizes=(1000,), seconds=15.0, within=180.0, controller=False)


def foreign_node(index: int) -> str:
    """The node of foreign Instance ``index``: ten cameras per node, as in the issue's
    cluster (10,000 Instances on 1,000 nodes)."""
    return f"fleet-{index // CAMERAS_PER_NODE:05d}"


def foreign_instance(index: int) -> dict[str, Any]:
    """Another node's local camera, as our agent on that node writes it."""
    node = foreign_node(index)
    name = f"{CONFIGURATION}-{index:07x}"  # 7 hex: never one of this node's 6-hex names
    body: dict[str, Any] = {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {"akri.sh/configuration": CONFIGURATION, BENCH_LABEL: "fleet"},
            "annotations": {"akri.sh/device-digest": f"{index:032x}"},
        },
        "spec": {
            "configurationName": CONFIGURATION,
            "cdiName": f"akri.sh/{CONFIGURATION}={index:07x}",
            "capacity": 1,
            "shared": False,
            "nodes": [node],
            "deviceUsage": {f"{name}-0": ""},
            "brokerProperties": {"DEBUG_ECHO_DESCRIPTION": f"camera {index} of {node}"},
        },
    }
    return with_node_labels(body)


def foreign_slice(node: str) -> dict[str, Any]:
    """Another node's local DRA pool, as our agent on that node publishes it: one
    ResourceSlice (``spec.nodeName`` that node) with a device per camera slot, labelled with
    its mode. Every node of a DRA cluster has one (issue 41: the agent must not pay for them)."""
    devices = [
        {
            "name": f"cam-{i}",
            "attributes": {
                "configuration": {"string": CONFIGURATION},
                "slot": {"int": i},
            },
        }
        for i in range(CAMERAS_PER_NODE)
    ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "generateName": f"akri.sh-{node}-",
            "labels": {POOL_LABEL: node, MODE_LABEL: DRA, BENCH_LABEL: "fleet"},
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


class Cluster:
    """Where the Instances live: the API-server double in this process, or a real server."""

    def __init__(self, kubeconfig: Path | None) -> None:
        self.kubeconfig = kubeconfig
        self.double: ApiServer | None = None
        self.client: KubeClient | None = None
        if kubeconfig is None:
            self.double = ApiServer()
            self.double.start()
        else:
            self.client = make_kube_client(str(kubeconfig))

    def write_kubeconfig(self, path: Path) -> Path:
        if self.double is not None:
            return self.double.api.write_kubeconfig(path)
        assert self.kubeconfig is not None
        shutil.copy(self.kubeconfig, path)
        return path

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.double is not None:
            return self.double.api.create(obj)
        assert self.client is not None
        path = {"Configuration": CONFIGURATIONS, "ResourceSlice": SLICES}.get(
            obj["kind"], INSTANCES
        )
        return await self.client.create(path, obj, request_timeout=30)

    async def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.double is not None:
            return self.double.api.apply(obj)
        assert self.client is not None
        path = SLICES if obj["kind"] == "ResourceSlice" else INSTANCES
        return await self.client.replace(
            f"{path}/{obj['metadata']['name']}", obj, request_timeout=30
        )

    async def instance(self, name: str) -> dict[str, Any] | None:
        if self.double is not None:
            return self.double.instance(name)
        assert self.client is not None
        try:
            return await self.client.get(f"{INSTANCES}/{name}", request_timeout=30)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def request_mark(self) -> int | None:
        return self.double.request_mark() if self.double is not None else None

    def requests_since(self, mark: int | None) -> dict[str, int] | None:
        """The agent's requests since ``mark`` by verb (the double's log; None on a real
        server). Everything else here writes in-process, not over HTTP."""
        if self.double is None or mark is None:
            return None
        verbs: dict[str, int] = {}
        for request in self.double.requests_since(mark):
            verbs[request.verb] = verbs.get(request.verb, 0) + 1
        return dict(sorted(verbs.items()))

    async def close(self) -> None:
        if self.client is not None:
            slices = SLICES
            # the agent's own Instance only: every foreign one carries the configuration label
            # too, and a 10,000-object deletecollection outlasts a real API server's 60 s
            # request timeout (504; seen on the real 1.36 server)
            mine = {"labelSelector": f"akri.sh/configuration={CONFIGURATION},!{BENCH_LABEL}"}
            try:
                # the agent's own Instance holds the akri.sh/slots finalizer, which only a
                # running agent removes: taken off here, the agent being stopped
                found, _ = await self.client.list_all(INSTANCES, params=mine)
                for obj in found:
                    if obj["metadata"].get("finalizers"):
                        await self.client.request(
                            "PATCH",
                            f"{INSTANCES}/{obj['metadata']['name']}",
                            body={"metadata": {"finalizers": None}},
                            content_type="application/merge-patch+json",
                            request_timeout=30,
                        )
            except Exception as error:
                log(f"fleet: removing the agent's finalizers failed: {error}")
            for path, selector in (
                (INSTANCES, mine),
                (INSTANCES, {"labelSelector": f"{BENCH_LABEL}=fleet"}),
                (CONFIGURATIONS, {"labelSelector": f"{BENCH_LABEL}=fleet"}),
                (slices, {"labelSelector": f"{BENCH_LABEL}=fleet"}),  # the foreign pools
                # the agent's DRA pool of its node (its own Instance's slots)
                (slices, {"fieldSelector": f"spec.nodeName={NODE}"}),
            ):
                # a deletecollection the server times out goes on deleting there: asked again
                # until nothing matches (each pass deletes what the last one had left)
                for attempt in range(1, 6):
                    try:
                        await self.client.request(
                            "DELETE", path, params=selector, request_timeout=120
                        )
                        break
                    except Exception as error:
                        log(f"fleet: cleaning up {path} ({selector}), pass {attempt}: {error}")
            await self.client.close()
        if self.double is not None:
            self.double.stop()


def fleet_options(options: AgentOptions) -> AgentOptions:
    """``options`` with this node's camera a local device too (debugEcho's are shared by
    default)."""
    return replace(options, extra_args=(*options.extra_args, "--no-debug-echo-shared"))


def agent_command(root: Path | None) -> list[str]:
    """``akri agent``, from this checkout or from ``root``'s."""
    if root is None:
        return list(AGENT_COMMAND)
    bootstrap = (
        f"import runpy, sys; sys.path.insert(0, {str(root)!r}); "
        "sys.argv[0] = 'akri'; runpy.run_module('agent.cli', run_name='__main__')"
    )
    return [sys.executable, "-c", bootstrap, "agent"]


async def new_node(cluster: Cluster, options: AgentOptions) -> Node:
    base = Path(tempfile.mkdtemp(prefix="bench-", dir="/tmp"))
    plugin_dir = base / "dp"
    plugin_dir.mkdir()
    kubelet = TimedKubelet(plugin_dir, base / "pr.sock", reregistration="kubelet")
    await kubelet.start()
    kubeconfig = cluster.write_kubeconfig(base / "kubeconfig")
    node = Node(NODE, base, kubelet, kubeconfig, base / "avail", options)
    node.set_available(True)
    return node


async def idle_rss(pid: int, within: float) -> float:
    """The median of five VmRSS readings once the agent has gone idle (under 5 % of a core
    for a second), bounded by ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        before = cpu_ns(pid)
        await asyncio.sleep(1.0)
        if (cpu_ns(pid) - before) / 1e9 < 0.05:
            break
    readings = []
    for _ in range(5):
        readings.append(rss_mb(pid))
        await asyncio.sleep(0.2)
    return round(statistics.median(readings), 1)


def log_lines_since(path: Path, offset: int) -> list[str]:
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace").splitlines()


async def serving(cluster: Cluster, node: Node, own: str, within: float) -> None:
    """Wait until the agent's own Instance lists it and its plugins offer the device."""
    assert node.agent is not None
    agent = node.agent
    resources = {instance_resource(own), configuration_resource(CONFIGURATION)}
    deadline = time.monotonic() + within
    while True:
        agent.check_running()
        obj = await cluster.instance(own)
        if obj is not None and NODE in (obj["spec"].get("nodes") or []):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{own} not created within {within:.0f}s")
        await asyncio.sleep(0.1)
    await wait_until(
        lambda: (agent.check_running(), healthy_listed(node.kubelet, resources))[1],
        within=within,
        what=f"plugins of {own} registered with a Healthy device",
        interval=0.05,
    )


async def create_foreign(
    cluster: Cluster, start: int, stop: int, slices: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Create foreign Instances ``start``..``stop``-1 (16 at a time on a real server), and the
    local ResourceSlice of each foreign node they bring (its first camera's index, appended to
    ``slices`` as created); returns the Instances."""
    created: list[dict[str, Any]] = []
    batch = 1 if cluster.double is not None else 16
    for first in range(start, stop, batch):
        indexes = range(first, min(first + batch, stop))
        bodies = [foreign_instance(i) for i in indexes]
        created += await asyncio.gather(*(cluster.create(b) for b in bodies))
        pools = [foreign_slice(foreign_node(i)) for i in indexes if i % CAMERAS_PER_NODE == 0]
        made = await asyncio.gather(*(cluster.create(b) for b in pools))
        if slices is not None:
            slices += made
    return created


async def rewrite_paced(
    cluster: Cluster,
    objects: list[dict[str, Any]],
    rate: float,
    seconds: float,
    change: Callable[[dict[str, Any], int], None],
) -> int:
    """Write ``objects`` one after the other at ``rate`` writes/s for ``seconds``, each after
    ``change(obj, n)`` (the ``n``-th write); returns the number of writes."""
    writes = int(rate * seconds)
    started = time.monotonic()
    for n in range(writes):
        delay = started + n / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        index = n % len(objects)
        change(objects[index], n)
        objects[index] = await cluster.replace(objects[index])
    return writes


async def churn(
    cluster: Cluster, objects: list[dict[str, Any]], rate: float, seconds: float
) -> int:
    """Flip the slot of one foreign Instance after the other at ``rate`` writes/s."""

    def flip_slot(obj: dict[str, Any], _n: int) -> None:
        slot = f"{obj['metadata']['name']}-0"
        usage = obj["spec"]["deviceUsage"]
        usage[slot] = "" if usage[slot] else obj["spec"]["nodes"][0]

    return await rewrite_paced(cluster, objects, rate, seconds, flip_slot)


async def churn_slices(
    cluster: Cluster, slices: list[dict[str, Any]], rate: float, seconds: float
) -> int:
    """Flip an attribute of one foreign node's local slice after the other at ``rate``
    writes/s."""

    def flip_attribute(obj: dict[str, Any], n: int) -> None:
        attributes = obj["spec"]["devices"][n // len(slices) % CAMERAS_PER_NODE]["attributes"]
        attributes["busy"] = {"bool": not attributes.get("busy", {}).get("bool", False)}

    return await rewrite_paced(cluster, slices, rate, seconds, flip_attribute)


async def cpu_during(cluster: Cluster, agent: Any, work: Any) -> dict[str, Any]:
    """The agent's CPU, log lines and requests while ``work()`` runs (its writes count)."""
    offset = agent.log_mark()
    mark = cluster.request_mark()
    before = cpu_ns(agent.pid)
    started = time.monotonic()
    writes = await work()
    elapsed = time.monotonic() - started
    await asyncio.sleep(1.0)  # the last events reach the agent
    used = (cpu_ns(agent.pid) - before) / 1e9
    lines = log_lines_since(agent.log_path, offset)
    return {
        "writes": writes,
        "seconds": round(elapsed, 1),
        "writes_per_s": round(writes / elapsed, 1),
        "cpu_percent": round(used / (elapsed + 1.0) * 100, 2),
        "log_lines": len(lines),
        "log_line_example": lines[0][:200] if lines else None,
        "requests": cluster.requests_since(mark),
    }


async def run_fleet(
    plan: FleetPlan,
    options: AgentOptions,
    *,
    kubeconfig: Path | None = None,
    agent_root: Path | None = None,
) -> dict[str, Any]:
    """One agent against ``plan.sizes`` foreign Instances and their churn (module doc)."""
    cluster = Cluster(kubeconfig)
    node: Node | None = None
    command = agent_command(agent_root)
    own = instance_name(CONFIGURATION, akri_digest(device_key(OWN_DEVICE, NODE, False)))
    result: dict[str, Any] = {
        "agent": str(agent_root) if agent_root else "this checkout",
        "api_server": "real (kubeconfig)" if kubeconfig else "double",
        "own_instance": own,
    }
    try:
        configuration = debug_echo_configuration(CONFIGURATION, [OWN_DEVICE], 1)
        configuration["metadata"]["labels"] = {BENCH_LABEL: "fleet"}
        await cluster.create(configuration)
        node = await new_node(cluster, options)
        mark = cluster.request_mark()
        agent = node.start_agent(command)
        await serving(cluster, node, own, plan.within)
        result["start_requests_empty"] = cluster.requests_since(mark)
        rss = {"0": await idle_rss(agent.pid, plan.within)}
        log(f"fleet: empty cluster: {rss['0']} MiB")
        objects: list[dict[str, Any]] = []
        slices: list[dict[str, Any]] = []
        creation_lines = 0
        for size in plan.sizes:
            offset = agent.log_mark()
            objects += await create_foreign(cluster, len(objects), size, slices)
            rss[str(size)] = await idle_rss(agent.pid, plan.within)
            creation_lines += len(log_lines_since(agent.log_path, offset))
            log(f"fleet: {size} foreign Instances: {rss[str(size)]} MiB")
        result["rss_mb"] = rss
        result["log_lines_while_created"] = creation_lines
        if plan.restart:
            await agent.stop(10.0, quiet=True)
            mark = cluster.request_mark()
            started = time.monotonic()
            agent = node.start_agent(command)
            await serving(cluster, node, own, plan.within)
            result["start_s_with_foreign"] = round(time.monotonic() - started, 2)
            result["start_requests"] = cluster.requests_since(mark)
            result["rss_after_restart_mb"] = await idle_rss(agent.pid, plan.within)
            log(f"fleet: restarted with {len(objects)}: {result['rss_after_restart_mb']} MiB")
        # an idle window, then as long a churn: the agent's CPU in each
        before = cpu_ns(agent.pid)
        await asyncio.sleep(plan.seconds)
        idle = (cpu_ns(agent.pid) - before) / 1e9
        result["churn"] = {
            **await cpu_during(
                cluster, agent, lambda: churn(cluster, objects, plan.rate, plan.seconds)
            ),
            "idle_cpu_percent": round(idle / plan.seconds * 100, 2),
        }  # fmt: skip
        log(f"fleet: churn: {result['churn']}")
        if slices:
            result["slice_churn"] = await cpu_during(
                cluster, agent, lambda: churn_slices(cluster, slices, plan.rate, plan.seconds)
            )
            log(f"fleet: slice churn: {result['slice_churn']}")
        mine = await cluster.instance(own)
        result["own_instance_served"] = bool(
            mine is not None
            and NODE in (mine["spec"].get("nodes") or [])
            and healthy_listed(node.kubelet, {instance_resource(own)})
        )
        result["problems"] = agent.problems()[:5]
        if plan.controller and cluster.double is not None:
            await agent.stop(10.0, quiet=True)
            result["controller"] = await controller_cost(cluster.double, objects, plan, node.base)
        return result
    finally:
        if node is not None:
            await node.close()
        await cluster.close()


async def controller_cost(
    api: ApiServer, objects: list[dict[str, Any]], plan: FleetPlan, base: Path
) -> dict[str, Any]:
    """``akri controller`` (one per cluster, a full view) with the same foreign Instances and
    their nodes (Ready Node objects): its RSS once idle, and its CPU in the same churn."""
    from benchmarks.controller import _leading, _node, _ready, _start

    for name in sorted({foreign_node(i) for i in range(len(objects))} | {NODE}):
        api.api.create(_node(name))
        _ready(api, name, True)
    process, _port = _start(api, base)
    try:
        await _leading(api, process, plan.within)
        rss = await idle_rss(process.pid, plan.within)
        log(f"fleet: controller with {len(objects)} Instances: {rss} MiB")
        before = cpu_ns(process.pid)
        started = time.monotonic()
        writes = await churn(api_cluster(api), objects, plan.rate, plan.seconds)
        elapsed = time.monotonic() - started
        await asyncio.sleep(1.0)
        used = (cpu_ns(process.pid) - before) / 1e9
        return {
            "instances": len(objects),
            "nodes": len({foreign_node(i) for i in range(len(objects))}) + 1,
            "rss_mb": rss,
            "rss_peak_mb": round(rss_mb(process.pid, "VmHWM"), 1),
            "churn_writes": writes,
            "churn_cpu_percent": round(used / (elapsed + 1.0) * 100, 2),
        }
    finally:
        await process.stop(10.0, quiet=True)


def api_cluster(api: ApiServer) -> Cluster:
    """A :class:`Cluster` over an already running double (for :func:`churn`)."""
    cluster = Cluster.__new__(Cluster)
    cluster.kubeconfig, cluster.double, cluster.client = None, api, None
    return cluster


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,5000,10000", help="foreign Instances, cumulative")
    parser.add_argument("--rate", type=float, default=50.0, help="foreign writes per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="of churn (and idle)")
    parser.add_argument("--within", type=float, default=300.0, help="bound of every wait")
    parser.add_argument("--no-restart", action="store_true", help="skip the restart phase")
    parser.add_argument(
        "--no-controller", action="store_true", help="skip the controller's cost (double only)"
    )
    parser.add_argument("--kubeconfig", type=Path, help="a real API server instead of the double")
    parser.add_argument("--before-root", type=Path, help="also measure this checkout's agent")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    return parser


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    plan = FleetPlan(
        sizes=tuple(int(s) for s in args.sizes.split(",") if s),
        rate=args.rate,
        seconds=args.seconds,
        within=args.within,
        restart=not args.no_restart,
        controller=not args.no_controller and args.kubeconfig is None,
    )
    options = fleet_options(AgentOptions())
    settings = {"plan": plan.__dict__, "node": NODE, "configuration": CONFIGURATION}
    if args.before_root is None:
        return {"settings": settings, **await run_fleet(plan, options, kubeconfig=args.kubeconfig)}
    before = await run_fleet(
        replace(plan, controller=False),  # the same controller either way: measured once
        options,
        kubeconfig=args.kubeconfig,
        agent_root=args.before_root.resolve(),
    )
    after = await run_fleet(plan, options, kubeconfig=args.kubeconfig)
    return {"settings": settings, "before": before, "after": after}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = asyncio.run(amain(args))
    finally:
        PROCESSES.kill_all()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
