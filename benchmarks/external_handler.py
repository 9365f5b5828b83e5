"""``external_handler_to_instance_ms`` (issue 16): a device appearing in an external
handler's ``Discover`` stream → its Instance written by the agent.

One ``akri agent --local`` process (no embedded debugEcho) and, in this process, a handler
serving ``v0.DiscoveryHandler/Discover`` on a unix socket in the agent's handler directory,
registered through ``agent-registration.sock`` like any external handler. Each sample adds one
device to the handler's list and sends the new full list; the time runs until the Instance
file for that device is in the state directory (the local store writes it atomically, with
fsync), seen by polling the directory every millisecond.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from agent.protos.akri.discovery.v0 import discovery_pb2 as pb
from agent.protos.akri.discovery.v0 import discovery_pb2_grpc
from benchmarks.local_agent import LocalAgent
from benchmarks.stats import summarize

HANDLER = "benchExternal"
CONFIGURATION = (
    "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: ext}\n"
    f"spec:\n  discoveryHandler:\n    name: {HANDLER}\n    discoveryDetails: ''\n"
    "  capacity: 1\n"
)


class _Handler(discovery_pb2_grpc.DiscoveryHandlerServicer):
    def __init__(self) -> None:
        self.ids: list[str] = []
        self.changed = asyncio.Event()
        self.sent: dict[str, float] = {}
        self.connected = asyncio.Event()

    async def Discover(
        self, request: pb.DiscoverRequest, context: Any
    ) -> AsyncIterator[pb.DiscoverResponse]:
        self.connected.set()
        while True:
            ids = list(self.ids)
            now = time.monotonic()
            for i in ids:
                self.sent.setdefault(i, now)
            yield pb.DiscoverResponse(
                devices=[pb.Device(id=i, properties={"BENCH_ID": i}) for i in ids]
            )
            await self.changed.wait()
            self.changed.clear()


async def measure_external_handler(samples: int) -> dict[str, Any]:
    agent = LocalAgent(CONFIGURATION, "ext-")
    handlers_dir = agent.handlers_dir
    handler = _Handler()
    server = grpc.aio.server()
    discovery_pb2_grpc.add_DiscoveryHandlerServicer_to_server(handler, server)
    socket = handlers_dir / f"{HANDLER}.sock"
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    results: list[float] = []
    try:
        registration = handlers_dir / "agent-registration.sock"
        deadline = time.monotonic() + 30
        while not registration.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the agent never served agent-registration.sock")
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"unix://{registration}") as channel:
            await discovery_pb2_grpc.RegistrationStub(channel).RegisterDiscoveryHandler(
                pb.RegisterDiscoveryHandlerRequest(
                    name=HANDLER, endpoint=str(socket), endpoint_type=0, shared=False
                ),
                timeout=10,
            )
        await asyncio.wait_for(handler.connected.wait(), 30)
        files = agent.files("BENCH_ID")
        for index in range(samples):
            device = f"dev-{index}"
            handler.ids.append(device)
            handler.changed.set()
            limit = time.monotonic() + 10
            while device not in files.seen():
                if time.monotonic() > limit:
                    raise RuntimeError(f"no Instance for {device} within 10 s")
                await asyncio.sleep(0.001)
            seen = time.monotonic()
            results.append((seen - handler.sent[device]) * 1000)
            await asyncio.sleep(0.02)
    finally:
        await server.stop(0)
        lag = agent.stop()
    return {
        "loop_lag_max_ms": lag,
        "external_handler_to_instance_ms": {
            **summarize(results),
            "method": "a device added to an external handler's Discover stream (unix socket, "
            "registered via agent-registration.sock) → its Instance file in the local state "
            "directory (polled every 1 ms; each sample adds one device to a growing list)",
        },
    }
