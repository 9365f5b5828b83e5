"""The network handlers' latency (issue 14), local mode, real peers on loopback:

- ``mqtt_announce_to_instance_ms``: a retained announcement published to a real mosquitto →
  its Instance file written by the agent (p50/p99 over ``samples`` devices, one at a time);
- ``mqtt_connect_retained_ms``: ``retained`` announcements (1,000 in the full run) already
  on the broker → the agent starts → all their Instances written;
- ``mdns_announce_to_instance_ms``: a service registered by a ``zeroconf`` publisher →
  its Instance file.

Skipped with a reason where mosquitto is missing or loopback multicast does not work.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.local_agent import LocalAgent, wait_for_instances
from benchmarks.stats import summarize


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _mqtt_configuration(port: int) -> str:
    return (
        "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: mq}\nspec:\n"
        "  discoveryHandler:\n    name: mqtt\n    discoveryDetails: |\n"
        f"      broker: {{host: 127.0.0.1, port: {port}}}\n"
        "      topics: ['bench/#']\n      maxDevices: 2000\n  capacity: 1\n"
    )


async def measure_mqtt(samples: int, retained: int) -> dict[str, Any]:
    mosquitto = shutil.which("mosquitto") or shutil.which("/usr/sbin/mosquitto")
    if mosquitto is None:
        return {"skipped": "mosquitto is not installed"}
    import aiomqtt

    base = Path(tempfile.mkdtemp(prefix="mq-", dir="/tmp"))
    port = _free_port()
    (base / "m.conf").write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n")
    broker = subprocess.Popen(  # noqa: ASYNC220 - started once, before any timing
        [mosquitto, "-c", str(base / "m.conf")], stderr=subprocess.DEVNULL
    )
    results: dict[str, Any] = {}
    try:
        await asyncio.sleep(0.3)
        async with aiomqtt.Client("127.0.0.1", port) as client:
            for index in range(retained):
                body = json.dumps({"id": f"r{index}", "properties": {"bench_id": f"r{index}"}})
                await client.publish(f"bench/r/{index}", body, qos=1, retain=True)
            started = time.monotonic()
            agent = LocalAgent(_mqtt_configuration(port), "mqb-", ["--shared-offline-grace", "0"])
            try:
                files = agent.files("MQTT_BENCH_ID")
                await wait_for_instances(files, {f"r{i}" for i in range(retained)}, 120, agent)
                results["mqtt_connect_retained_ms"] = {
                    "ms": round((time.monotonic() - started) * 1000, 1),
                    "announcements": retained,
                    "method": "agent process start (retained announcements already on the "
                    "broker) → every Instance file written",
                }
                latencies = []
                for index in range(samples):
                    device = f"s{index}"
                    body = json.dumps({"id": device, "properties": {"bench_id": device}})
                    sent = time.monotonic()
                    await client.publish(f"bench/s/{index}", body, qos=1, retain=True)
                    await wait_for_instances(files, {device}, 10, agent)
                    latencies.append((time.monotonic() - sent) * 1000)
                    await asyncio.sleep(0.02)
                results["mqtt_announce_to_instance_ms"] = {
                    **summarize(latencies),
                    "method": "retained announcement published (QoS 1 acknowledged) → its "
                    "Instance file in the state directory (polled every 1 ms)",
                }
            finally:
                results["loop_lag_max_ms"] = agent.stop()
    finally:
        broker.terminate()
        broker.wait(10)
        shutil.rmtree(base, ignore_errors=True)
    return results


async def measure_mdns(samples: int) -> dict[str, Any]:
    from zeroconf import IPVersion
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    service_type = f"_ab{secrets.token_hex(4)}._tcp.local."
    configuration = (
        "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: md}\nspec:\n"
        "  discoveryHandler:\n    name: mdns\n    discoveryDetails: |\n"
        f"      serviceTypes: ['{service_type}']\n      interfaces: ['127.0.0.1']\n"
        "  capacity: 1\n"
    )
    publisher = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    agent = LocalAgent(configuration, "mdb-", ["--shared-offline-grace", "0"])
    latencies = []
    try:
        files = agent.files("MDNS_TXT_BENCH_ID")
        await asyncio.sleep(1.5)  # the agent is up and browsing
        for index in range(samples):
            device = f"m{index}"
            info = AsyncServiceInfo(
                service_type,
                f"bench {index}.{service_type}",
                addresses=[socket.inet_aton("127.0.0.1")],
                port=8000 + index,
                properties={"bench_id": device},
                server=f"bench-{index}.local.",
            )
            sent = time.monotonic()
            # register's probing (RFC 6762 §8.1: three probes 250 ms apart) is the
            # publisher's, not the agent's: skip it, announce at once
            await publisher.async_register_service(info, cooperating_responders=True)
            await wait_for_instances(files, {device}, 10, agent)
            latencies.append((time.monotonic() - sent) * 1000)
    finally:
        lag = agent.stop()
        await publisher.async_unregister_all_services()
        await publisher.async_close()
    return {
        "loop_lag_max_ms": lag,
        "mdns_announce_to_instance_ms": {
            **summarize(latencies),
            "method": "service registered by a zeroconf publisher on lo (announced without "
            "probing) → its Instance file (polled every 1 ms)",
        },
    }
