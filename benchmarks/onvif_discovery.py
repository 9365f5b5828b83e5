"""The onvif handler's latency (issue 13), local mode, fake cameras
(``tests/doubles/fake_onvif.py``:
real WS-Discovery multicast and SOAP over HTTP) on the loopback interface:

- ``onvif_hello_to_instance_ms``: a camera starts and multicasts Hello → its Instance file
  written by the agent (p50/p99 over ``hello_samples`` cameras, one at a time; the agent's
  next Probe is an hour away, so only the Hello can bring it);
- ``onvif_probe_cycle_ms``: ``cameras`` fake cameras already up (no Hello) → the agent
  starts and sends its Probe (seen by a listener on the multicast group) → every camera's
  Instance file written. Target: within ``discoveryTimeoutSeconds`` + 1 s.

Skipped with a reason where multicast over loopback does not work.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
import uuid as uuid_module
from typing import Any

from benchmarks.local_agent import LocalAgent, wait_for_instances
from benchmarks.stats import summarize
from tests.doubles.fake_onvif import FakeCamera

MULTICAST = "239.255.255.250"
PORT = 3702
DISCOVERY_TIMEOUT = 1.0  # discoveryTimeoutSeconds of the probe-cycle Configuration


def _configuration(uuids: list[str], *, discovery_timeout: float, probe_interval: float) -> str:
    items = ", ".join(f'"{u}"' for u in uuids)
    return (
        "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: cams}\nspec:\n"
        "  discoveryHandler:\n    name: onvif\n    discoveryDetails: |\n"
        "      interfaces: [lo]\n"
        f"      discoveryTimeoutSeconds: {discovery_timeout}\n"
        f"      probeIntervalSeconds: {probe_interval}\n"
        f"      uuids: {{action: Include, items: [{items}]}}\n"
        "  capacity: 1\n"
    )


class ProbeWatch(asyncio.DatagramProtocol):
    """Joins the WS-Discovery group on lo and notes when the first Probe goes by."""

    def __init__(self) -> None:
        self.first_probe: float | None = None

    def datagram_received(self, data: bytes, addr: Any) -> None:
        # the WS-Addressing Action of a Probe ends ".../discovery/Probe" (ProbeMatches,
        # Hello and Bye end otherwise)
        if self.first_probe is None and b"/discovery/Probe<" in data:
            self.first_probe = time.monotonic()


async def _watch_probes() -> tuple[asyncio.DatagramTransport, ProbeWatch]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("0.0.0.0", PORT))
    membership = struct.pack("4s4s", socket.inet_aton(MULTICAST), socket.inet_aton("127.0.0.1"))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, watch = await loop.create_datagram_endpoint(ProbeWatch, sock=sock)
    return transport, watch


async def measure_hello(samples: int) -> dict[str, Any]:
    cameras = [FakeCamera(uuid=str(uuid_module.uuid4())) for _ in range(samples)]
    for camera in cameras:
        camera.answer_probes = False  # only its Hello can announce it
    configuration = _configuration(
        [c.uuid for c in cameras], discovery_timeout=0.5, probe_interval=3600
    )
    agent = LocalAgent(configuration, "onvif-hello-")
    latencies: list[float] = []
    try:
        files = agent.files("ONVIF_DEVICE_UUID")
        await asyncio.sleep(2.0)  # the agent is up, its first (empty) probe cycle done
        for camera in cameras:
            sent = time.monotonic()
            await camera.start(hello=True)
            done = await wait_for_instances(files, {camera.uuid}, 10, agent)
            latencies.append((done - sent) * 1000)
    finally:
        lag = agent.stop()
        for camera in cameras:
            await camera.stop(bye=False)
    return {
        **summarize(latencies),
        "loop_lag_max_ms": lag,
        "method": "fake camera started (HTTP up, then Hello multicast on lo) → its Instance "
        "file in the agent's state directory (polled every 1 ms); the Probe interval is 1 h",
    }


async def measure_probe_cycle(count: int) -> dict[str, Any]:
    cameras = [
        FakeCamera(uuid=str(uuid_module.uuid4()), mac=f"02:00:00:00:{i // 256:02x}:{i % 256:02x}")
        for i in range(count)
    ]
    for camera in cameras:
        await camera.start(hello=False)
    transport, watch = await _watch_probes()
    configuration = _configuration(
        [c.uuid for c in cameras], discovery_timeout=DISCOVERY_TIMEOUT, probe_interval=3600
    )
    started = time.monotonic()
    agent = LocalAgent(configuration, "onvif-probe-")
    try:
        files = agent.files("ONVIF_DEVICE_UUID")
        done = await wait_for_instances(files, {c.uuid for c in cameras}, 30, agent)
    finally:
        lag = agent.stop()
        transport.close()
        for camera in cameras:
            await camera.stop(bye=False)
    if watch.first_probe is None:
        raise RuntimeError("no Probe seen on the WS-Discovery group")
    return {
        "ms": round((done - watch.first_probe) * 1000, 1),
        "cameras": count,
        "discovery_timeout_s": DISCOVERY_TIMEOUT,
        "loop_lag_max_ms": lag,
        "agent_start_to_probe_ms": round((watch.first_probe - started) * 1000, 1),
        "method": f"{count} fake cameras on lo answering Probes (no Hello) → the agent's "
        "first Probe seen on the group → every camera's Instance file written",
    }


async def measure_onvif(hello_samples: int, cameras: int) -> dict[str, Any]:
    from tests.handlers.test_onvif_discovery import _loopback_multicast

    reason = _loopback_multicast()
    if reason is not None:
        return {"skipped": reason}
    return {
        "onvif_hello_to_instance_ms": await measure_hello(hello_samples),
        "onvif_probe_cycle_ms": await measure_probe_cycle(cameras),
    }
