"""udev discovery with pyudev: the machine's real /sys, and hotplug with umockdev.

The hotplug tests (``test_testbed_*``) need a umockdev testbed, i.e. a process started under
``umockdev-wrapper`` (LD_PRELOAD of libumockdev-preload, which redirects /sys, /dev and the
uevent netlink socket). Preloading that into the whole test session would hide the real /sys
from tests.paths import FIXTURES, REPO
from every other test, so ``test_umockdev_hotplug_suite`` re-runs this file under
``umockdev-wrapper`` in a subprocess, selecting only the testbed tests, and fails with the
inner output if any of them fails. A plain ``pytest`` run therefore covers everything; the
testbed tests themselves show as skipped in the outer run. They run as root only (as in CI)
and need ``apt-get install umockdev``; otherwise the suite test is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.configuration import parse_configuration
from agent.core.model.instance import Instance
from agent.core.store.base import ConfigurationEvent, EventType
from agent.core.store.local import LocalInstanceStore
from agent.node.discovery.manager import DiscoveryManager, GraceSettings
from discovery_handlers.base import Device, DeviceSpec, DiscoveryHandler
from discovery_handlers.registry import HandlerRegistry
from discovery_handlers.udev import UdevHandler
from discovery_handlers.udev.rules import parse_rule
from discovery_handlers.udev.watcher import UdevWatcher, Uevent
from tests.doubles import udev_testbed
from tests.paths import FIXTURES as TEST_FIXTURES
from tests.paths import REPO

pytest.importorskip("pyudev")

IN_TESTBED = os.environ.get("AKRI_UDEV_TESTBED") == "1" and udev_testbed.preloaded()
FIXTURES = TEST_FIXTURES / "udev"

needs_testbed = pytest.mark.skipif(
    not IN_TESTBED,
    reason="runs inside umockdev-wrapper, started by test_umockdev_hotplug_suite",
)
real_sys_only = pytest.mark.skipif(IN_TESTBED, reason="needs the real /sys")

CAMERA = "/devices/pci0000:00/0000:00:14.0/usb1/1-1"
INTERFACE = CAMERA + "/1-1:1.0"
VIDEO0 = INTERFACE + "/video4linux/video0"
VIDEO1 = INTERFACE + "/video4linux/video1"
SERIAL = "/devices/pci0000:00/0000:00:14.0/usb1/1-2"
TTY = SERIAL + "/1-2:1.0/ttyUSB0/tty/ttyUSB0"


def details(*rules: str, extra: str = "") -> str:
    lines = ["udevRules:"] + [f"  - '{rule}'" for rule in rules]
    return "\n".join(lines) + "\n" + extra


def ids(devices: list[Device]) -> list[str]:
    return [device.id for device in devices]


class Collector:
    """Consumes a handler's ``discover()`` stream in the background."""

    def __init__(self, handler: DiscoveryHandler, discovery_details: str) -> None:
        self.lists: list[list[Device]] = []
        self._changed = asyncio.Event()
        self._stream: Any = handler.discover(discovery_details, {})
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for devices in self._stream:
            self.lists.append(devices)
            self._changed.set()

    async def wait_for(
        self, predicate: Callable[[list[Device]], bool], within: float = 5.0
    ) -> list[Device]:
        """The latest list once it satisfies ``predicate``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            if self._task.done():
                self._task.result()  # re-raise a handler failure
                raise AssertionError("discovery stream ended")
            if self.lists and predicate(self.lists[-1]):
                return self.lists[-1]
            remaining = deadline - loop.time()
            if remaining <= 0:
                latest = ids(self.lists[-1]) if self.lists else None
                raise AssertionError(f"condition not reached; latest device list: {latest}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._stream.aclose()


# -- the real /sys (no root needed) ------------------------------------------------------


@real_sys_only
async def test_real_sys_net_finds_lo() -> None:
    collector = Collector(UdevHandler(), details('SUBSYSTEM=="net"'))
    try:
        devices = await collector.wait_for(lambda d: True)
    finally:
        await collector.close()
    by_id = {device.id: device for device in devices}
    lo = by_id["/devices/virtual/net/lo"]
    assert dict(lo.properties) == {"UDEV_DEVPATH": "/devices/virtual/net/lo"}
    assert lo.device_specs == () and lo.mounts == ()  # no device node
    # exactly the interfaces sysfs lists
    expected = {
        os.path.realpath(f"/sys/class/net/{name}").removeprefix("/sys")
        for name in os.listdir("/sys/class/net")
    }
    assert set(by_id) == expected


@real_sys_only
async def test_real_sys_attributes_and_negation() -> None:
    rules = ('SUBSYSTEM=="net", KERNEL=="lo", ATTR{ifindex}=="1", ATTRS{address}=="00:*"',)
    collector = Collector(UdevHandler(), details(*rules))
    others = Collector(UdevHandler(), details('SUBSYSTEM=="net", KERNEL!="lo"'))
    try:
        assert ids(await collector.wait_for(lambda d: True)) == ["/devices/virtual/net/lo"]
        assert "/devices/virtual/net/lo" not in ids(await others.wait_for(lambda d: True))
    finally:
        await collector.close()
        await others.close()


@real_sys_only
async def test_real_sys_device_node_becomes_a_device_spec() -> None:
    if not Path("/sys/class/mem/null").exists():
        pytest.skip("no /sys/class/mem/null here")
    devpath = os.path.realpath("/sys/class/mem/null").removeprefix("/sys")
    handler = UdevHandler()
    collector = Collector(
        handler, details('KERNEL=="null", SUBSYSTEM=="mem"', extra="permissions: r")
    )
    try:
        (device,) = await collector.wait_for(lambda d: True)
    finally:
        await collector.close()
    assert device.id == devpath
    assert dict(device.properties) == {"UDEV_DEVPATH": devpath, "UDEV_DEVNODE": "/dev/null"}
    assert device.device_specs == (DeviceSpec("/dev/null", "/dev/null", "r"),)


def test_monitor_source_selection(tmp_path: Path) -> None:
    control = tmp_path / "control"
    assert UdevHandler(udevd_control=control).source() == "kernel"  # no udevd
    control.touch()
    assert UdevHandler(udevd_control=control).source() == "udev"
    assert UdevHandler(monitor_source="kernel", udevd_control=control).source() == "kernel"
    with pytest.raises(ValueError, match="monitor_source"):
        UdevHandler(monitor_source="hal")
    handler = UdevHandler()
    assert handler.name == "udev" and handler.shared is False


class _FakeMonitor:
    def __init__(self, results: list[Any]) -> None:
        self.results = results

    def poll(self, timeout: float | None = None) -> Any:
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


class _FakeEvent:
    def __init__(self, action: str, devpath: str, old: str | None = None) -> None:
        self.action = action
        self.device_path = devpath
        self.properties = {"DEVPATH_OLD": old} if old else {}


@real_sys_only
def test_drain_reports_lost_events_and_reads_moves() -> None:
    watcher = UdevWatcher((parse_rule('SUBSYSTEM=="net"'),), "kernel")
    try:
        watcher.monitor = _FakeMonitor(
            [_FakeEvent("move", "/devices/b", "/devices/a"), _FakeEvent("add", "/devices/c"), None]
        )
        assert watcher.drain() == (
            [Uevent("move", "/devices/b", "/devices/a"), Uevent("add", "/devices/c")],
            False,
        )
        watcher.monitor = _FakeMonitor([OSError(errno.ENOBUFS, "No buffer space")])
        assert watcher.drain() == ([], True)
        watcher.monitor = _FakeMonitor([OSError(errno.EBADF, "bad")])
        with pytest.raises(OSError):
            watcher.drain()
        # a move forgets the old subtree and re-reads the new path
        watcher.full_scan()
        assert "/devices/virtual/net/lo" in watcher.found
        watcher.apply(
            [Uevent("move", "/devices/virtual/net/nonexistent", "/devices/virtual/net/lo")]
        )
        assert "/devices/virtual/net/lo" not in watcher.found
        watcher.apply([Uevent("add", "/devices/virtual/net/lo")])
        assert "/devices/virtual/net/lo" in watcher.found
        watcher.apply([Uevent("remove", "/devices/virtual/net")])
        assert not any(path.startswith("/devices/virtual/net/") for path in watcher.found)
    finally:
        watcher.close()
    # devices outside /devices are never enumerated, so their events are ignored too
    modules = UdevWatcher((parse_rule('SUBSYSTEM=="module"'),), "kernel")
    try:
        modules.full_scan()
        assert modules.found == {}
        for name in sorted(os.listdir("/sys/module"))[:3]:
            modules.apply([Uevent("add", f"/module/{name}")])
        assert modules.found == {}
    finally:
        modules.close()


# -- real kernel uevents (root): a veth pair in a private network namespace ---------------

_NETNS_SCRIPT = """
import asyncio, json, sys
from discovery_handlers.udev import UdevHandler

async def main():
    details = "udevRules: ['SUBSYSTEM==\\"net\\", KERNEL==\\"akri*\\"']"
    async for devices in UdevHandler().discover(details, {}):
        print(json.dumps([[d.id, dict(d.properties)] for d in devices]), flush=True)

asyncio.run(main())
"""


_unread: dict[int, bytes] = {}  # per handler process: bytes read past the last line


def _read_json_line(process: subprocess.Popen[str], within: float = 10.0) -> Any:
    """The handler's next device list. Reads the pipe's file descriptor directly: with a
    buffered readline(), two lines arriving together leave the second in Python's buffer,
    where select() cannot see it."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    buffer = _unread.get(process.pid, b"")
    while b"\n" not in buffer:
        ready, _, _ = select.select([fd], [], [], within)
        if not ready:
            raise AssertionError("no device list from the handler in time")
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            raise AssertionError(f"the handler exited: {process.wait()}")
        buffer += chunk
    line, _, _unread[process.pid] = buffer.partition(b"\n")
    return json.loads(line)


@real_sys_only
@pytest.mark.root
@pytest.mark.timeout(120)
def test_real_kernel_uevents_in_a_network_namespace() -> None:
    """No umockdev: the kernel's own uevents (source "kernel", no udevd) for a veth pair
    created and deleted in a private network namespace (``ip netns exec`` mounts its /sys)."""
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (CI runs as root)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (ip) is not installed")
    namespace = f"akri-udev-{os.getpid()}"
    created = subprocess.run(["ip", "netns", "add", namespace], capture_output=True, text=True)
    if created.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {created.stderr.strip()}")
    process = None
    try:
        process = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-c", _NETNS_SCRIPT],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert _read_json_line(process) == []
        subprocess.run(
            [
                "ip",
                "-n",
                namespace,
                "link",
                "add",
                "akri0",
                "type",
                "veth",
                "peer",
                "name",
                "akri1",
            ],
            check=True,
        )
        devices = _read_json_line(process)
        while len(devices) < 2:  # the two ends may arrive in separate batches
            devices = _read_json_line(process)
        assert devices == [
            ["/devices/virtual/net/akri0", {"UDEV_DEVPATH": "/devices/virtual/net/akri0"}],
            ["/devices/virtual/net/akri1", {"UDEV_DEVPATH": "/devices/virtual/net/akri1"}],
        ]
        subprocess.run(["ip", "-n", namespace, "link", "del", "akri0"], check=True)
        devices = _read_json_line(process)
        while devices:
            devices = _read_json_line(process)
    finally:
        if process is not None:
            process.kill()
            process.wait()
        subprocess.run(["ip", "netns", "del", namespace], check=False)


# -- the umockdev runner -------------------------------------------------------------------


@real_sys_only
@pytest.mark.root
@pytest.mark.timeout(300)
def test_umockdev_hotplug_suite() -> None:
    """Runs the ``test_testbed_*`` tests of this file under umockdev-wrapper."""
    if os.geteuid() != 0:
        pytest.skip("umockdev hotplug tests run as root only (CI runs them as root)")
    reason = udev_testbed.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    env = {**os.environ, "AKRI_UDEV_TESTBED": "1"}
    command = [
        udev_testbed.WRAPPER,
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "testbed_",
        str(Path(__file__).relative_to(REPO)),
    ]
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=280, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"umockdev hotplug tests failed:\n{output}"
    assert " passed" in output and " skipped" not in output and "no tests ran" not in output, output


# -- hotplug inside the umockdev testbed ----------------------------------------------------


@pytest.fixture
def testbed() -> Any:
    with udev_testbed.Testbed() as bed:
        yield bed


def sys_path(devpath: str) -> str:
    return "/sys" + devpath


def record(name: str) -> str:
    return (FIXTURES / name).read_text()


def camera_on_port_3() -> str:
    """The camera plugged into another port: umockdev cannot re-create a device node it
    created before in the same testbed, so a replug uses new names (1-3, video2, video3)."""
    text = record("usb-camera.umockdev").replace("bus/usb/001/002", "bus/usb/001/004")
    text = text.replace("usb1/1-1", "usb1/1-3").replace("1-1:1.0", "1-3:1.0")
    return text.replace("video1", "video3").replace("video0", "video2")


VIDEO2 = "/devices/pci0000:00/0000:00:14.0/usb1/1-3/1-3:1.0/video4linux/video2"


def remove_camera(bed: udev_testbed.Testbed) -> None:
    for path in (VIDEO1, VIDEO0, INTERFACE, CAMERA):  # children first, like the kernel
        bed.remove(sys_path(path))


@needs_testbed
@pytest.mark.root
@pytest.mark.parametrize("source", [None, "udev"])  # None: automatic = kernel (no udevd)
async def test_testbed_hotplug_add_change_remove(testbed: Any, source: str | None) -> None:
    handler = UdevHandler(monitor_source=source)
    rule = (
        'SUBSYSTEM=="video4linux", ENV{ID_V4L_CAPABILITIES}==":capture:", ATTRS{idVendor}=="046d"'
    )
    collector = Collector(handler, details(rule, extra="permissions: rw"))
    try:
        await collector.wait_for(lambda d: d == [])  # nothing at start
        testbed.add_from_string(record("usb-camera.umockdev"))
        (camera,) = await collector.wait_for(lambda d: ids(d) == [VIDEO0])
        assert dict(camera.properties) == {"UDEV_DEVPATH": VIDEO0, "UDEV_DEVNODE": "/dev/video0"}
        assert camera.device_specs == (DeviceSpec("/dev/video0", "/dev/video0", "rw"),)
        assert Path("/dev/video0").exists()

        # the device's own property changes: it stops matching, then matches again
        testbed.set_property(sys_path(VIDEO0), "ID_V4L_CAPABILITIES", ":video_output:")
        testbed.uevent(sys_path(VIDEO0), "change")
        await collector.wait_for(lambda d: d == [])
        testbed.set_property(sys_path(VIDEO0), "ID_V4L_CAPABILITIES", ":capture:")
        testbed.uevent(sys_path(VIDEO0), "change")
        await collector.wait_for(lambda d: ids(d) == [VIDEO0])

        # a parent's attribute changes: the child is re-evaluated (ATTRS walks up)
        testbed.set_attribute(sys_path(CAMERA), "idVendor", "0000")
        testbed.uevent(sys_path(CAMERA), "change")
        await collector.wait_for(lambda d: d == [])
        testbed.set_attribute(sys_path(CAMERA), "idVendor", "046d")
        testbed.uevent(sys_path(CAMERA), "change")
        await collector.wait_for(lambda d: ids(d) == [VIDEO0])

        remove_camera(testbed)
        await collector.wait_for(lambda d: d == [])
        # plugged in again (into another port): seen as well
        testbed.add_from_string(camera_on_port_3())
        await collector.wait_for(lambda d: ids(d) == [VIDEO2])
    finally:
        await collector.close()
    # each list differs from the previous one: no duplicate reports
    assert all(a != b for a, b in zip(collector.lists, collector.lists[1:], strict=False))


@needs_testbed
@pytest.mark.root
async def test_testbed_attrs_through_the_parent_chain(testbed: Any) -> None:
    # present before discovery starts: found by the initial scan
    testbed.add_from_string(record("usb-camera.umockdev"))
    testbed.add_from_string(record("ftdi-serial.umockdev"))
    serial = Collector(
        UdevHandler(),
        details('SUBSYSTEM=="tty", ATTRS{idVendor}=="0403", ATTRS{idProduct}=="6001"'),
    )
    by_kernels = Collector(
        UdevHandler(), details('SUBSYSTEM=="video4linux", KERNELS=="1-1", ATTRS{idProduct}=="0825"')
    )
    # idVendor is on the usb device, bInterfaceClass on the interface: no common ancestor
    split = Collector(
        UdevHandler(),
        details('SUBSYSTEM=="tty", ATTRS{idVendor}=="0403", ATTRS{bInterfaceClass}=="ff"'),
    )
    wrong_vendor = Collector(
        UdevHandler(), details('SUBSYSTEM=="video4linux", ATTRS{idVendor}=="0403"')
    )
    try:
        (tty,) = await serial.wait_for(lambda d: len(d) == 1)
        assert tty.id == TTY
        assert dict(tty.properties) == {"UDEV_DEVPATH": TTY, "UDEV_DEVNODE": "/dev/ttyUSB0"}
        assert ids(await by_kernels.wait_for(lambda d: True)) == [VIDEO0, VIDEO1]
        assert await split.wait_for(lambda d: True) == []
        assert await wrong_vendor.wait_for(lambda d: True) == []
        # unplug the adapter: only the serial Configuration changes
        for path in (TTY, SERIAL + "/1-2:1.0/ttyUSB0", SERIAL + "/1-2:1.0", SERIAL):
            testbed.remove(sys_path(path))
        await serial.wait_for(lambda d: d == [])
        assert ids(by_kernels.lists[-1]) == [VIDEO0, VIDEO1] and len(by_kernels.lists) == 1
    finally:
        for collector in (serial, by_kernels, split, wrong_vendor):
            await collector.close()


@needs_testbed
@pytest.mark.root
async def test_testbed_group_recursive(testbed: Any) -> None:
    rules = ('SUBSYSTEM=="usb", ATTR{idVendor}=="046d"', 'SUBSYSTEM=="video4linux"')
    grouped = Collector(UdevHandler(), details(*rules, extra="groupRecursive: true"))
    flat = Collector(UdevHandler(), details(*rules))
    try:
        await grouped.wait_for(lambda d: d == [])
        testbed.add_from_string(record("usb-camera.umockdev"))
        (group,) = await grouped.wait_for(lambda d: len(d) == 1 and len(d[0].device_specs) == 3)
        assert group.id == CAMERA
        assert dict(group.properties) == {
            "UDEV_DEVPATH": CAMERA,
            "UDEV_DEVNODE_0": "/dev/bus/usb/001/002",
            "UDEV_DEVNODE_1": "/dev/video0",
            "UDEV_DEVNODE_2": "/dev/video1",
        }
        assert [spec.host_path for spec in group.device_specs] == [
            "/dev/bus/usb/001/002",
            "/dev/video0",
            "/dev/video1",
        ]
        assert ids(await flat.wait_for(lambda d: len(d) == 3)) == [CAMERA, VIDEO0, VIDEO1]
        testbed.remove(sys_path(VIDEO1))
        (group,) = await grouped.wait_for(lambda d: len(d) == 1 and len(d[0].device_specs) == 2)
        assert "UDEV_DEVNODE_2" not in group.properties
        testbed.remove(sys_path(VIDEO0))
        testbed.remove(sys_path(INTERFACE))
        testbed.remove(sys_path(CAMERA))
        await grouped.wait_for(lambda d: d == [])
        await flat.wait_for(lambda d: d == [])
    finally:
        await grouped.close()
        await flat.close()


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@needs_testbed
@pytest.mark.root
async def test_testbed_end_to_end_instance_follows_the_device(testbed: Any, tmp_path: Path) -> None:
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    registry = HandlerRegistry()
    registry.register(UdevHandler())
    manager = DiscoveryManager(store, registry, "node-a", GraceSettings(local=0, shared=300))
    await manager.start()
    configuration = parse_configuration(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Configuration",
            "metadata": {"name": "akri-udev-video"},
            "spec": {
                "discoveryHandler": {
                    "name": "udev",
                    "discoveryDetails": details(
                        'KERNEL=="video[0-9]*", ENV{ID_V4L_CAPABILITIES}==":capture:"',
                        extra="permissions: rw",
                    ),
                },
                "capacity": 2,
                "brokerProperties": {"RESOLUTION_WIDTH": "640"},
            },
        }
    )

    def instances() -> list[Instance]:
        return store.list_cached(configuration.key)

    try:
        await manager.handle_configuration_event(
            ConfigurationEvent(EventType.ADDED, configuration.key, configuration)
        )
        await asyncio.sleep(0.2)
        assert instances() == []
        testbed.add_from_string(record("usb-camera.umockdev"))
        await until(lambda: len(instances()) == 1)
        (instance,) = instances()
        assert instance.name.startswith("akri-udev-video-")
        assert instance.nodes == ("node-a",) and instance.shared is False
        assert instance.capacity == 2
        assert dict(instance.broker_properties) == {
            "UDEV_DEVPATH": VIDEO0,
            "UDEV_DEVNODE": "/dev/video0",
            "RESOLUTION_WIDTH": "640",
        }
        device = manager.device_for(instance.name)
        assert device is not None and device.id == VIDEO0
        assert device.device_specs == (DeviceSpec("/dev/video0", "/dev/video0", "rw"),)
        remove_camera(testbed)
        await until(lambda: instances() == [])
        # plugged in again (into another port): a new Instance for the new devpath
        testbed.add_from_string(camera_on_port_3())
        await until(lambda: len(instances()) == 1)
        (again,) = instances()
        assert again.name != instance.name
        assert again.broker_properties["UDEV_DEVNODE"] == "/dev/video2"
    finally:
        await manager.close()
        await store.close()
