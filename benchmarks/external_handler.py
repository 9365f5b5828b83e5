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
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from agent.protos.akri.discovery.v0 import discovery_pb2 as pb
from agent.protos.akri.discovery.v0 import discovery_pb2_grpc
from benchmarks.harness import PROCESSES, ROOT
from benchmarks.local_mode import compiled_env
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


class _InstanceFiles:
    """The BENCH_IDs of the Instance files in the state directory; each file is read once."""

    def __init__(self, state: Path) -> None:
        self.directory = state / "instances"
        self.ids: dict[str, str] = {}  # file name -> BENCH_ID

    def seen(self) -> set[str]:
        if self.directory.is_dir():
            for name in os.listdir(self.directory):
                if name.endswith(".json") and name not in self.ids:
                    try:
                        item = json.loads((self.directory / name).read_text())
                    except (OSError, ValueError):
                        continue  # a partly visible write: read again next time
                    self.ids[name] = item["spec"]["brokerProperties"].get("BENCH_ID", "")
        return set(self.ids.values())


async def measure_external_handler(samples: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="ext-", dir="/tmp"))
    handlers_dir, state = base / "dh", base / "state"
    handlers_dir.mkdir()
    config = base / "c.yaml"
    config.write_text(CONFIGURATION)
    log_file = (base / "agent.log").open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before any timing
        [
            sys.executable, "-m", "agent.cli", "agent", "--local", "--no-debug-echo",
            "--state-dir", str(state), "--config", str(config),
            "--discovery-handlers-dir", str(handlers_dir), "--node-name", "bench",
        ],
        cwd=ROOT, env=compiled_env(), stdout=log_file, stderr=subprocess.STDOUT,
    )  # fmt: skip
    PROCESSES.add(proc)
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
        files = _InstanceFiles(state)
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
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        PROCESSES.discard(proc)
        log_file.close()
        shutil.rmtree(base, ignore_errors=True)
    return {
        "external_handler_to_instance_ms": {
            **summarize(results),
            "method": "a device added to an external handler's Discover stream (unix socket, "
            "registered via agent-registration.sock) → its Instance file in the local state "
            "directory (polled every 1 ms; each sample adds one device to a growing list)",
        }
    }
