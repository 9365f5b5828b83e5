"""What following ResourceClaims costs an agent (issue 33.5): one ``akri agent`` process in
cluster mode against the API-server double holding ``--claims`` ResourceClaims (10,000 by
default: 1 % allocated ``akri.sh`` devices, the rest another driver's, each with a spec, an
allocation, a node selector and a pod in ``reservedFor``, ~1 KB of JSON like a real claim).

Two nodes' views, one agent each (run one after the other):

* ``dra``: a node on the DRA path (kubelet 1.36, ``containerd://2.1.0``, the extended-resource
  DeviceClasses present);
* ``device-plugins``: a node whose device plugins serve ``akri.sh/*`` while its DRA driver
  runs (``containerd://1.6.20``, and ``--extended-resources device-plugins`` so that an
  agent from before the runtime check takes the same path).

Per node: the agent's RSS (``VmRSS``), peak RSS (``VmHWM``) and CPU seconds once started and
settled, the time to its "agent started" line (the first claim list comes before the device
plugins start), the requests it made for ResourceClaims (by verb) and in total; and after a
churn of ``--churn`` other-driver claims and 10 akri.sh claims changing status, the same again
with the watch events the API server sent for claims.

    .venv/bin/python -m benchmarks.claims_followed [--claims 10000] [--source DIR]

``--source DIR`` runs the agent from another source tree (``PYTHONPATH=DIR python -P -m
agent.cli agent``: the code before a change, checked out with ``git worktree add``); the
doubles are this tree's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from typing import Any

from benchmarks.harness import (
    AGENT_COMMAND,
    AgentOptions,
    ApiServer,
    cpu_seconds,
    debug_echo_configuration,
    log,
    rss_mb,
    start_node,
)

CLAIMS = "resourceclaims.resource.k8s.io"
NAMESPACES = 20


def claim_body(index: int, driver: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": f"claim-{index:05d}",
            "namespace": f"ns-{index % NAMESPACES}",
            "labels": {"app": f"app-{index % 97}"},
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.example.com",
                            "selectors": [
                                {"cel": {"expression": "device.attributes['x'].model == 'a'"}}
                            ],
                        },
                    }
                ]
            }
        },
    }


def allocation(index: int, driver: str, node: str) -> dict[str, Any]:
    pool = node if driver == "akri.sh" else f"{node}-gpus"
    device = f"cam-{index:06x}-0" if driver == "akri.sh" else f"gpu-{index % 8}"
    return {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": driver, "pool": pool, "device": device}]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
            "allocationTimestamp": "2026-11-27T10:00:00Z",
        },
        "reservedFor": [{"resource": "pods", "name": f"pod-{index}", "uid": f"uid-{index:08d}"}],
    }


def fill(server: ApiServer, count: int) -> None:
    api = server.api
    rt = api.resource(CLAIMS)
    for index in range(count):
        driver = "akri.sh" if index % 100 == 0 else "gpu.example.com"
        node = f"other-{index % 50}"
        body = claim_body(index, driver, node)
        created = api.store.create(rt, "v1", body["metadata"]["namespace"], body)
        created["status"] = allocation(index, driver, node)
        api.store.update(
            rt, "v1", body["metadata"]["namespace"], body["metadata"]["name"], created,
            subresource="status",
        )  # fmt: skip


def churn(server: ApiServer, count: int, claims: int, round_: str) -> None:
    """``count`` other-driver claims and 10 akri.sh claims change their status (another pod
    in ``reservedFor``, named after ``round_``)."""
    api = server.api
    rt = api.resource(CLAIMS)
    akri = [i for i in range(0, claims, 100)][:10]
    others = [i for i in range(claims) if i % 100][:count]
    for index in [*others, *akri]:
        name, namespace = f"claim-{index:05d}", f"ns-{index % NAMESPACES}"
        claim = api.get(CLAIMS, name, namespace)
        assert claim is not None
        claim["status"]["reservedFor"].append(
            {"resource": "pods", "name": f"pod-{index}-{round_}", "uid": f"uid-{index}-{round_}"}
        )
        api.store.update(rt, "v1", namespace, name, claim, subresource="status")


def node_object(server: ApiServer, name: str, runtime: str) -> None:
    api = server.api
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        }
    )
    node = api.get("nodes", name) or {}
    info = {"kubeletVersion": "v1.36.2", "containerRuntimeVersion": runtime}
    api.store.update(
        api.resource("nodes"), "v1", None, name, {**node, "status": {"nodeInfo": info}},
        subresource="status",
    )  # fmt: skip


def install_classes(server: ApiServer) -> None:
    from agent.core.deviceclasses import InstanceRef, desired_device_classes
    from agent.core.model.keys import ObjectKey

    key = ObjectKey("default", "cam")
    for device_class in desired_device_classes(
        [key], [InstanceRef("cam-8120fe", key)], lambda k: True
    ).values():
        server.api.create(device_class)


def claim_verbs(requests: list[Any]) -> dict[str, int]:
    return dict(Counter(r.info.verb for r in requests if r.info.resource == "resourceclaims"))


async def measure_node(
    server: ApiServer, name: str, runtime: str, extra: list[str], command: list[str], churns: int,
    claims: int, settle: float,
) -> dict[str, Any]:  # fmt: skip
    node_object(server, name, runtime)
    node = await start_node(server, name, AgentOptions(extra_args=tuple(extra)))
    mark = server.request_mark()
    started = time.monotonic()
    agent = node.start_agent(command)
    try:
        await agent.wait_log("agent started on node", since=0, within=120)
        ready = time.monotonic() - started
        await asyncio.sleep(settle)  # the claim list and watch, the slices, the first lists
        requests = server.requests_since(mark)
        on_dra = bool(agent.log_lines(f"on node {name}: DRA"))
        result: dict[str, Any] = {
            "path": "dra" if on_dra else "device-plugins",
            "start_s": round(ready, 2),
            "rss_mb": round(rss_mb(agent.pid), 1),
            "peak_rss_mb": round(rss_mb(agent.pid, "VmHWM"), 1),
            "claim_requests": claim_verbs(requests),
            "requests": len(requests),
            "cpu_s": round(cpu_seconds(agent.pid), 2),
        }
        mark = server.request_mark()
        events_before = server.api.watch_events_sent["resourceclaims"]
        churn(server, churns, claims, name)
        await asyncio.sleep(settle)
        requests = server.requests_since(mark)
        result["churn"] = {
            "claims_changed": churns + 10,
            "watch_events_sent": server.api.watch_events_sent["resourceclaims"] - events_before,
            "claim_requests": claim_verbs(requests),
            "rss_mb": round(rss_mb(agent.pid), 1),
            "peak_rss_mb": round(rss_mb(agent.pid, "VmHWM"), 1),
            "cpu_s": round(cpu_seconds(agent.pid) - result["cpu_s"], 2),
        }
        result["problems"] = agent.problems()[:5]
        return result
    finally:
        await node.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    command = list(AGENT_COMMAND)
    if args.source:
        command = ["env", f"PYTHONPATH={args.source}", sys.executable, "-P", "-m", "agent.cli"]
        command.append("agent")
    server = ApiServer(history_size=max(50_000, 3 * args.claims))
    server.start()
    try:
        started = time.monotonic()
        fill(server, args.claims)
        log(f"{args.claims} claims in the double in {time.monotonic() - started:.1f}s")
        install_classes(server)
        server.api.create(debug_echo_configuration("cam", ("foo0",), 2))
        results: dict[str, Any] = {
            "claims": args.claims,
            "akri_claims": len(range(0, args.claims, 100)),
            "source": args.source or "this tree",
        }
        results["dra"] = await measure_node(
            server, "node-dra", "containerd://2.1.0", [], command, args.churn, args.claims,
            args.settle,
        )  # fmt: skip
        results["device-plugins"] = await measure_node(
            server, "node-dp", "containerd://1.6.20", ["--extended-resources", "device-plugins"],
            command, args.churn, args.claims, args.settle,
        )  # fmt: skip
        return results
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--claims", type=int, default=10_000)
    parser.add_argument("--churn", type=int, default=1_000)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--source", default="", help="run the agent from this source tree")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args)), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
