"""udev hotplug latency: umockdev add → Instance created → device-plugin ListAndWatch update.

``python benchmarks/udev_hotplug.py [--samples N] [--out FILE]`` prints one JSON object:
``udev_hotplug_ms`` (add → kubelet double receives the configuration-level plugin's list with
the new device) and ``udev_to_instance_ms`` (add → Instance in the store), each with ``p50``,
``p99``, ``n``. Needs root and umockdev (``apt-get install umockdev``); the script re-executes
itself under ``umockdev-wrapper``. Without them it prints ``{"skipped": "<reason>"}``.

The agent pieces run in this process (local store, discovery manager with the real
``UdevHandler`` on the netlink monitor, device-plugin manager) against the kubelet double,
because umockdev's fake /sys exists only inside the wrapped process. Each sample plugs a
camera into a new USB port (umockdev cannot re-create a device node it made before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.stats import summarize  # noqa: E402

CONFIG = """apiVersion: akri.sh/v0
kind: Configuration
metadata: {name: usbcam}
spec:
  discoveryHandler:
    name: udev
    discoveryDetails: |
      udevRules:
        - 'SUBSYSTEM=="video4linux", ENV{ID_V4L_CAPABILITIES}==":capture:", ATTRS{idVendor}=="046d"'
  capacity: 1
"""


def camera_record(index: int) -> str:
    """The fixture camera on USB port 1-<10+index> with video nodes of its own."""
    text = (REPO / "tests/fixtures/udev/usb-camera.umockdev").read_text()
    port = 10 + index
    text = text.replace("bus/usb/001/002", f"bus/usb/001/{100 + index:03d}")
    text = text.replace("usb1/1-1", f"usb1/1-{port}").replace("1-1:1.0", f"1-{port}:1.0")
    return text.replace("video1", f"video{41 + 2 * index}").replace(
        "video0", f"video{40 + 2 * index}"
    )


async def measure(samples: int) -> dict[str, Any]:
    from agent.core.ledger.ledger import SlotLedger
    from agent.core.store.local import LocalInstanceStore
    from agent.node.deviceplugin.manager import DevicePluginManager
    from agent.node.discovery.manager import DiscoveryManager, GraceSettings
    from agent.node.discovery.ownership import Ownership, ServedInstances
    from discovery_handlers.registry import HandlerRegistry
    from discovery_handlers.udev import UdevHandler
    from tests.doubles.kubelet_double import KubeletDouble
    from tests.doubles.udev_testbed import Testbed

    base = Path(tempfile.mkdtemp(prefix="udevb-", dir="/tmp"))
    (base / "dp").mkdir()
    config = base / "usbcam.yaml"
    config.write_text(CONFIG)
    kubelet = KubeletDouble(base / "dp", base / "pr.sock", reregistration="kubelet")
    store = LocalInstanceStore(base / "state", [config], poll_interval=0.2, durable=True)
    bed = Testbed()
    to_kubelet: list[float] = []
    to_instance: list[float] = []
    try:
        await kubelet.start()
        await store.start()
        registry = HandlerRegistry()
        registry.register(UdevHandler())
        ledger = SlotLedger(store, "bench-node")
        ownership = Ownership(store)
        discovery = DiscoveryManager(
            store, registry, "bench-node", GraceSettings(0, 0), ledger=ledger, ownership=ownership
        )
        plugins = DevicePluginManager(
            ServedInstances(store, ownership), ledger, discovery, base / "dp", kubelet_poll=0.2
        )
        await discovery.start()
        await plugins.start()
        await asyncio.sleep(0.5)  # initial (empty) enumeration
        loop = asyncio.get_running_loop()
        for index in range(samples):
            before = len(store.list_cached())
            started = time.monotonic()
            bed.add_from_string(camera_record(index))
            deadline = loop.time() + 10
            instance_at: float | None = None
            while loop.time() < deadline:
                if instance_at is None and len(store.list_cached()) > before:
                    instance_at = time.monotonic()
                if kubelet.allocatable("akri.sh/usbcam") >= index + 1:
                    to_kubelet.append((time.monotonic() - started) * 1000)
                    break
                await asyncio.sleep(0.001)
            else:
                raise RuntimeError(f"sample {index}: no ListAndWatch update within 10 s")
            if instance_at is not None:
                to_instance.append((instance_at - started) * 1000)
            await asyncio.sleep(0.05)
        await plugins.close()
        await discovery.close()
    finally:
        await store.close()
        await kubelet.stop()
        bed.close()
        shutil.rmtree(base, ignore_errors=True)
    return {
        "udev_hotplug_ms": summarize(to_kubelet),
        "udev_to_instance_ms": summarize(to_instance),
        "method": "umockdev testbed add (camera on a new USB port) → kubelet double holds the "
        "configuration-level plugin's list with one more Healthy device; local store, kernel "
        "netlink source (no udevd)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if os.environ.get("AKRI_UDEV_BENCH_INNER") != "1":
        reason = None
        if os.geteuid() != 0:
            reason = "needs root (umockdev testbed)"
        elif shutil.which("umockdev-wrapper") is None:
            reason = "umockdev not installed (apt-get install umockdev)"
        if reason is not None:
            result: dict[str, Any] = {"skipped": reason}
        else:
            inner = subprocess.run(
                ["umockdev-wrapper", sys.executable, __file__, "--samples", str(args.samples)],
                env={**os.environ, "AKRI_UDEV_BENCH_INNER": "1"},
                capture_output=True,
                text=True,
                timeout=300,
            )
            lines = [line for line in inner.stdout.splitlines() if line.startswith("{")]
            result = (
                json.loads(lines[-1])
                if inner.returncode == 0 and lines
                else {"error": (inner.stderr or inner.stdout)[-2000:]}
            )
        text = json.dumps(result, indent=2, sort_keys=True)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0 if "error" not in result else 1
    print(json.dumps(asyncio.run(measure(args.samples))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
