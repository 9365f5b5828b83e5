"""The floor under our Allocate (issue 27): our device-plugin gRPC layer alone, timed like
``benchmarks/peer.py`` times the agent and the Go peer.

    python benchmarks/grpc_floor.py [--calls 2000]

A separate process serves one resource of 1,000 devices through ``PluginEndpoint`` and
``DevicePluginService`` (registered with the same kubelet double, its ListAndWatch stream
open) with plugin logic that does nothing: no ledger, no store, a constant response. This
process sends Allocates of one device on its own channel, one at a time, and prints p50 / p90
/ p99 / max in ms. The agent's re-grant does this plus its logic (~30 us in-process), so
this is the floor of a Python ``grpc.aio`` device plugin on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.protos.deviceplugin.v1beta1 import api_pb2
from agent.protos.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from benchmarks.harness import PROCESSES
from benchmarks.peer import PeerPlan, Plugin, _allocate, _channel_to

RESOURCE = "akri.sh/floor"


class _NoLogic:
    """Plugin logic that decides nothing: 1,000 Healthy devices, an empty response."""

    resource_name = RESOURCE
    preferred_allocation = False

    def __init__(self) -> None:
        from agent.node.deviceplugin.views import DeviceView

        self.listed = tuple(DeviceView(f"floor-{i}", True) for i in range(1000))

    def devices(self) -> tuple[object, ...]:
        return self.listed

    async def allocate(self, requests: object) -> list[api_pb2.ContainerAllocateResponse]:
        return [api_pb2.ContainerAllocateResponse()]

    def preferred(self, available: object, must_include: object, size: int) -> list[str]:
        return []


async def serve(directory: Path) -> None:
    """The plugin process: serve and register until killed."""
    from agent.node.deviceplugin.endpoint import PluginEndpoint
    from agent.node.deviceplugin.service import DevicePluginService

    endpoint = PluginEndpoint(DevicePluginService(_NoLogic()), directory)  # type: ignore[arg-type]
    await endpoint.start()
    await asyncio.Event().wait()


class Floor(Plugin):
    name = "floor"

    def command(self, plan: PeerPlan) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--serve", str(self.base / "dp")]

    def resource(self) -> str:
        return RESOURCE


async def measure(calls: int) -> list[float]:
    plan = PeerPlan(capacity=1000)
    plugin = Floor("large")
    try:
        await plugin.start(plan)
        await plugin.all_listed(plan)
        channel = await _channel_to(plugin, RESOURCE)
        try:
            stub = dp_grpc.DevicePluginStub(channel)
            for _ in range(200):  # warm-up
                await _allocate(stub, "floor-0")
            return [await _allocate(stub, "floor-0") * 1000 for _ in range(calls)]
        finally:
            await channel.close(None)
    finally:
        await plugin.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        asyncio.run(serve(args.serve))
        return 0
    try:
        samples = sorted(asyncio.run(measure(args.calls)))
    finally:
        PROCESSES.kill_all()
    n = len(samples)
    print(
        f"our gRPC layer alone, Allocate: p50 {samples[n // 2]:.3f} "
        f"p90 {samples[int(n * 0.9)]:.3f} p99 {samples[int(n * 0.99)]:.3f} "
        f"max {samples[-1]:.3f} ms (n {n})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
