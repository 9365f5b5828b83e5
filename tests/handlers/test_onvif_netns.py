"""The onvif handler and fake cameras in another network namespace, joined to this one by a
veth pair: WS-Discovery multicast crosses a real (virtual) link instead of loopback, and
SOAP goes over it to the cameras' own addresses. The cameras are separate processes
(``ip netns exec … python -m tests.doubles.fake_onvif``). Needs root and ``ip``; skipped with the
reason otherwise (CI runs as root)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid as uuid_module
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from discovery_handlers.onvif import OnvifHandler
from tests.doubles.fake_onvif import FakeCamera
from tests.handlers.test_onvif_discovery import Collector, uuids_of
from tests.paths import REPO

ROOT = REPO
# this namespace's end of the link holds an address of it: per process, so two suites run at
# once on one host (as root) do not route each other's cameras (the link names are per process)
SUBNET = f"10.231.{os.getpid() % 200 + 20}"
HOST_ADDRESS = f"{SUBNET}.1"
CAMERA_ADDRESSES = (f"{SUBNET}.2", f"{SUBNET}.3")


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces and a veth pair)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _ip(*args: str, namespace: str | None = None) -> None:
    command = (
        ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    )
    subprocess.run(command, check=True, capture_output=True, text=True)


@dataclass
class Link:
    namespace: str
    host_interface: str


@pytest.fixture
def link() -> Iterator[Link]:
    """Namespace ``akri-onvif-<pid>`` with the cameras' addresses on its end of a veth pair;
    this namespace's end has ``HOST_ADDRESS``."""
    tag = f"{os.getpid() % 100000}"
    namespace, host, camera = f"akri-onvif-{tag}", f"aoh{tag}", f"aoc{tag}"
    created = subprocess.run(["ip", "netns", "add", namespace], capture_output=True, text=True)
    if created.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {created.stderr.strip()}")
    try:
        _ip("link", "add", host, "type", "veth", "peer", "name", camera, "netns", namespace)
        _ip("addr", "add", f"{HOST_ADDRESS}/24", "dev", host)
        _ip("link", "set", host, "up")
        for address in CAMERA_ADDRESSES:
            _ip("addr", "add", f"{address}/24", "dev", camera, namespace=namespace)
        _ip("link", "set", camera, "up", namespace=namespace)
        _ip("link", "set", "lo", "up", namespace=namespace)
        yield Link(namespace, host)
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", host], capture_output=True, check=False)


@dataclass
class CameraProcess:
    uuid: str
    address: str
    process: asyncio.subprocess.Process

    async def stop(self, *, bye: bool) -> None:
        """SIGINT: the camera multicasts Bye and exits; SIGKILL: it just vanishes."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGINT if bye else signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), 10)
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


@contextlib.asynccontextmanager
async def cameras(link: Link) -> AsyncIterator[list[CameraProcess]]:
    started: list[CameraProcess] = []
    try:
        yield started
    finally:
        for camera in started:
            await camera.stop(bye=False)


async def start_camera(
    link: Link, address: str, mac: str, into: list[CameraProcess], uuid: str | None = None
) -> str:
    """A fake camera on ``address`` inside the namespace (Hello sent as it starts)."""
    uuid = uuid or str(uuid_module.uuid4())
    process = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", link.namespace,
        sys.executable, "-m", "tests.doubles.fake_onvif", "--uuid", uuid, "--interface", address,
        "--http-host", address, "--http-port", "8080", "--mac", mac,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    into.append(CameraProcess(uuid, address, process))
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 20)
    assert line.startswith(b"fake camera"), line
    return uuid


def details(link: Link, *uuids: str, extra: str = "", interval: float = 3600) -> str:
    items = ", ".join(f'"{u}"' for u in uuids)
    return (
        f"interfaces: [{link.host_interface}]\n"
        "discoveryTimeoutSeconds: 1\n"
        f"probeIntervalSeconds: {interval}\n"
        f"uuids: {{action: Include, items: [{items}]}}\n" + extra
    )


async def test_probe_hello_and_bye_across_a_veth_link(link: Link) -> None:
    async with cameras(link) as started:
        first = await start_camera(link, CAMERA_ADDRESSES[0], "02:00:00:00:01:01", started)
        second_uuid = str(uuid_module.uuid4())
        collector = Collector(OnvifHandler(), details(link, first, second_uuid))
        try:
            # the Probe goes out of the host's veth end and the answer comes back over it
            (device,) = await collector.wait_for(lambda d: uuids_of(d) == {first})
            assert device.properties["ONVIF_DEVICE_IP_ADDRESS"] == CAMERA_ADDRESSES[0]
            assert device.properties["ONVIF_DEVICE_SERVICE_URL"] == (
                f"http://{CAMERA_ADDRESSES[0]}:8080/onvif/device_service"
            )
            # the next Probe is an hour away: only the second camera's Hello can bring it
            second = await start_camera(
                link, CAMERA_ADDRESSES[1], "02:00:00:00:01:02", started, uuid=second_uuid
            )
            devices = await collector.wait_for(lambda d: uuids_of(d) == {first, second})
            by_uuid = {d.properties["ONVIF_DEVICE_UUID"]: d for d in devices}
            assert by_uuid[second].properties["ONVIF_DEVICE_IP_ADDRESS"] == CAMERA_ADDRESSES[1]
            await started[-1].stop(bye=True)  # Bye crosses the link: gone at once
            await collector.wait_for(lambda d: uuids_of(d) == {first})
        finally:
            await collector.close()


async def test_ip_address_filters_across_a_veth_link(link: Link) -> None:
    async with cameras(link) as started:
        first = await start_camera(link, CAMERA_ADDRESSES[0], "02:00:00:00:02:01", started)
        second = await start_camera(link, CAMERA_ADDRESSES[1], "02:00:00:00:02:02", started)
        include = Collector(
            OnvifHandler(),
            details(
                link, first, second, extra=f"ipAddresses: {{items: [{CAMERA_ADDRESSES[1]}]}}\n"
            ),
        )
        exclude = Collector(
            OnvifHandler(),
            details(
                link,
                first,
                second,
                extra=f"ipAddresses: {{action: Exclude, items: [{CAMERA_ADDRESSES[1]}]}}\n",
            ),
        )
        try:
            assert uuids_of(await include.wait_for(lambda d: bool(d))) == {second}
            assert uuids_of(await exclude.wait_for(lambda d: bool(d))) == {first}
        finally:
            await include.close()
            await exclude.close()


async def test_a_camera_that_vanishes_is_gone_after_the_next_probe(link: Link) -> None:
    """Killed (no Bye): the next Probe goes unanswered. The probe interval equals the window
    here, the case that once kept a silent camera forever."""
    async with cameras(link) as started:
        first = await start_camera(link, CAMERA_ADDRESSES[0], "02:00:00:00:03:01", started)
        collector = Collector(OnvifHandler(), details(link, first, interval=1))
        try:
            await collector.wait_for(lambda d: uuids_of(d) == {first})
            await started[0].stop(bye=False)  # no Bye: only the next Probe can tell
            await collector.wait_for(lambda d: not d)
        finally:
            await collector.close()


async def test_a_hello_on_another_interface_is_not_heard(link: Link) -> None:
    """The handler listens on the veth end only: a camera's Hello on loopback (its SOAP
    reachable, its uuid allowed) must not reach it — Linux would deliver it by default
    (IP_MULTICAST_ALL)."""
    elsewhere = FakeCamera(uuid=str(uuid_module.uuid4()))
    elsewhere.answer_probes = False
    async with cameras(link) as started:
        here = await start_camera(link, CAMERA_ADDRESSES[0], "02:00:00:00:04:01", started)
        collector = Collector(OnvifHandler(), details(link, here, elsewhere.uuid))
        try:
            await collector.wait_for(lambda d: uuids_of(d) == {here})
            await elsewhere.start(hello=True)
            for _ in range(5):  # repeated Hellos over a second and a half
                await asyncio.sleep(0.3)
                elsewhere.announce()
            await asyncio.sleep(0.5)
            assert all(elsewhere.uuid not in uuids_of(devices) for devices in collector.lists)
        finally:
            await collector.close()
            await elsewhere.stop(bye=False)


HANDLER_WITH_DEFAULT_INTERFACES = """
import asyncio, json, sys
from discovery_handlers.onvif import OnvifHandler
from discovery_handlers.onvif.multicast import resolve_interfaces

async def main():
    print(json.dumps([i.label for i in resolve_interfaces([])]), flush=True)
    async for devices in OnvifHandler(ipv6=False).discover(sys.argv[1], {}):
        print(json.dumps(sorted(d.properties["ONVIF_DEVICE_UUID"] for d in devices)), flush=True)

asyncio.run(main())
"""


@pytest.fixture
def two_links() -> Iterator[tuple[str, list[Link]]]:
    """A namespace for the handler, joined by a veth pair each to two camera namespaces on
    different subnets (no default route anywhere): (handler namespace, [link A, link B])."""
    tag = f"{os.getpid() % 100000}"
    handler_ns = f"akri-onvif-h{tag}"
    created = subprocess.run(["ip", "netns", "add", handler_ns], capture_output=True, text=True)
    if created.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {created.stderr.strip()}")
    made = [handler_ns]
    links = []
    try:
        _ip("link", "set", "lo", "up", namespace=handler_ns)
        for index, subnet in enumerate(("10.231.78", "10.231.79")):
            camera_ns = f"akri-onvif-c{index}{tag}"
            subprocess.run(["ip", "netns", "add", camera_ns], check=True, capture_output=True)
            made.append(camera_ns)
            host_end, camera_end = f"adh{index}{tag}", f"adc{index}{tag}"
            _ip("link", "add", host_end, "netns", handler_ns, "type", "veth",
                "peer", "name", camera_end, "netns", camera_ns)  # fmt: skip
            _ip("addr", "add", f"{subnet}.1/24", "dev", host_end, namespace=handler_ns)
            _ip("link", "set", host_end, "up", namespace=handler_ns)
            _ip("addr", "add", f"{subnet}.2/24", "dev", camera_end, namespace=camera_ns)
            _ip("link", "set", camera_end, "up", namespace=camera_ns)
            _ip("link", "set", "lo", "up", namespace=camera_ns)
            links.append(Link(camera_ns, host_end))
        # a third veth end, up but without an address (like a pod's host end): not chosen
        _ip("link", "add", f"adx{tag}", "type", "veth", "peer", "name", f"ady{tag}",
            namespace=handler_ns)  # fmt: skip
        _ip("link", "set", f"adx{tag}", "up", namespace=handler_ns)
        _ip("link", "set", f"ady{tag}", "up", namespace=handler_ns)
        yield handler_ns, links
    finally:
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


async def test_default_interfaces_are_every_multicast_capable_one(
    two_links: tuple[str, list[Link]],
) -> None:
    """No ``interfaces`` in discoveryDetails: the handler probes and listens on both veth
    links (cameras on two subnets, no default route), not on lo or an address-less veth."""
    import json

    handler_ns, (link_a, link_b) = two_links
    async with cameras(link_a) as started:
        first = await start_camera(link_a, "10.231.78.2", "02:00:00:00:05:01", started)
        second = await start_camera(link_b, "10.231.79.2", "02:00:00:00:05:02", started)
        text = (
            "discoveryTimeoutSeconds: 1\nprobeIntervalSeconds: 3600\n"
            f'uuids: {{action: Include, items: ["{first}", "{second}"]}}\n'
        )
        handler = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", handler_ns,
            sys.executable, "-c", HANDLER_WITH_DEFAULT_INTERFACES, text,
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert handler.stdout is not None
            line = await asyncio.wait_for(handler.stdout.readline(), 20)
            chosen = json.loads(line) if line else line
            assert chosen == sorted([link_a.host_interface, link_b.host_interface]), chosen
            seen: list[str] = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while set(seen) != {first, second}:
                remaining = deadline - loop.time()
                assert remaining > 0, f"both cameras not found; last list: {seen}"
                with contextlib.suppress(TimeoutError):
                    line = await asyncio.wait_for(handler.stdout.readline(), remaining)
                    if not line:
                        assert handler.stderr is not None
                        raise AssertionError((await handler.stderr.read()).decode()[-2000:])
                    seen = json.loads(line)
        finally:
            if handler.returncode is None:
                handler.kill()
                await handler.wait()


V6_HOST = "fd00:a7::1"
V6_CAMERAS = ("fd00:a7::2", "fd00:a7::3")


def _tentative(interface: str, namespace: str | None = None) -> bool:
    command = ["ip", "-6", "addr", "show", "dev", interface, "tentative"]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    return bool(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


async def start_ipv6_camera(
    link: Link, address: str, into: list[CameraProcess], uuid: str | None = None
) -> str:
    """A fake camera that speaks WS-Discovery over ff02::c on its veth end only (its IPv4
    group membership is on the namespace's lo, which no Probe from the link reaches) and
    serves SOAP on ``address``."""
    uuid = uuid or str(uuid_module.uuid4())
    camera_interface = link.host_interface.replace("aoh", "aoc", 1)
    process = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", link.namespace,
        sys.executable, "-m", "tests.doubles.fake_onvif",
        "--uuid", uuid, "--interface", "127.0.0.1",
        "--ipv6-interface", camera_interface, "--http-host", address, "--http-port", "8080",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    into.append(CameraProcess(uuid, address, process))
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 20)
    assert line.startswith(b"fake camera"), line
    return uuid


async def test_ipv6_probe_and_hello_across_a_veth_link(link: Link) -> None:
    """WS-Discovery over IPv6 (``[ff02::c]:3702``): a camera found by the Probe and one by
    its Hello, SOAP to their IPv6 addresses; the same handler with IPv6 off finds neither
    (so IPv4 did not carry them)."""
    camera_interface = link.host_interface.replace("aoh", "aoc", 1)
    _ip("-6", "addr", "add", f"{V6_HOST}/64", "dev", link.host_interface, "nodad")
    for address in V6_CAMERAS:
        _ip("-6", "addr", "add", f"{address}/64", "dev", camera_interface, "nodad",
            namespace=link.namespace)  # fmt: skip
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    # the link-local addresses finish duplicate address detection (a state, not a delay)
    while _tentative(link.host_interface) or _tentative(camera_interface, link.namespace):
        assert loop.time() < deadline, "IPv6 addresses still tentative"
        await asyncio.sleep(0.1)
    async with cameras(link) as started:
        first = await start_ipv6_camera(link, V6_CAMERAS[0], started)
        second_uuid = str(uuid_module.uuid4())
        v4_only = Collector(OnvifHandler(ipv6=False), details(link, first, second_uuid))
        try:
            assert await v4_only.wait_for(lambda d: True) == []  # the first round's list
        finally:
            await v4_only.close()
        collector = Collector(OnvifHandler(), details(link, first, second_uuid))
        try:
            (device,) = await collector.wait_for(lambda d: uuids_of(d) == {first})
            assert device.properties["ONVIF_DEVICE_SERVICE_URL"] == (
                f"http://[{V6_CAMERAS[0]}]:8080/onvif/device_service"
            )
            # the next Probe is an hour away: only the Hello on ff02::c can bring it
            await start_ipv6_camera(link, V6_CAMERAS[1], started, uuid=second_uuid)
            await collector.wait_for(lambda d: uuids_of(d) == {first, second_uuid})
            await started[-1].stop(bye=True)  # Bye on ff02::c: gone at once
            await collector.wait_for(lambda d: uuids_of(d) == {first})
        finally:
            await collector.close()
