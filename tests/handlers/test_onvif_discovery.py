"""The onvif handler against fake cameras (tests/doubles/fake_onvif.py) over real WS-Discovery
multicast and real SOAP over HTTP, on the loopback interface: Probe, Hello between Probes,
Bye, wrong credentials, unreachable SOAP endpoints, a camera that moves, and the agent's
Instances for a camera. Every test filters on its own cameras' uuids, so other WS-Discovery
traffic on the host cannot disturb it. Skipped (with the reason) where multicast over
loopback does not work."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import uuid as uuid_module
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.core.model.configuration import parse_configuration
from agent.core.model.instance import Instance
from agent.core.store.base import ConfigurationEvent, EventType
from agent.core.store.local import LocalInstanceStore
from agent.node.discovery.manager import DiscoveryManager, GraceSettings
from discovery_handlers.base import Device
from discovery_handlers.onvif import OnvifHandler, parse_details
from discovery_handlers.onvif.filters import Action
from discovery_handlers.registry import HandlerRegistry
from tests.doubles.fake_onvif import FakeCamera
from tests.paths import FIXTURES

FIXTURES = FIXTURES / "onvif"
DEADLINE = 15.0  # generous: polling, never a timed assertion


def _loopback_multicast() -> str | None:
    """None if a datagram to 239.255.255.250 on lo reaches a listener; else why not."""
    receiver = sender = None
    try:
        receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        receiver.bind(("", 0))
        port = receiver.getsockname()[1]
        receiver.setsockopt(
            socket.IPPROTO_IP,
            socket.IP_ADD_MEMBERSHIP,
            struct.pack("4s4s", socket.inet_aton("239.255.255.250"), socket.inet_aton("127.0.0.1")),
        )
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sender.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        sender.sendto(b"ping", ("239.255.255.250", port))
        receiver.settimeout(2)
        receiver.recv(16)
        return None
    except OSError as error:
        return f"multicast over loopback does not work here: {error}"
    finally:
        for sock in (receiver, sender):
            if sock is not None:
                sock.close()


_REASON = _loopback_multicast()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def details(*uuids: str, extra: str = "", interval: float = 3600) -> str:
    items = ", ".join(f'"{u}"' for u in uuids)
    return (
        "interfaces: [lo]\n"
        "discoveryTimeoutSeconds: 0.5\n"
        f"probeIntervalSeconds: {interval}\n"
        f"uuids: {{action: Include, items: [{items}]}}\n" + extra
    )


def new_uuid() -> str:
    return str(uuid_module.uuid4())


class Collector:
    """Consumes ``discover()`` in the background; waits for lists by polling."""

    def __init__(self, handler: OnvifHandler, text: str, properties: Any = None) -> None:
        self.lists: list[list[Device]] = []
        self._changed = asyncio.Event()
        self._stream: Any = handler.discover(text, properties or {})
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for devices in self._stream:
            self.lists.append(devices)
            self._changed.set()

    async def wait_for(
        self, predicate: Callable[[list[Device]], bool], within: float = DEADLINE
    ) -> list[Device]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            if self._task.done():
                self._task.result()
                raise AssertionError("discovery stream ended")
            if self.lists and predicate(self.lists[-1]):
                return self.lists[-1]
            remaining = deadline - loop.time()
            if remaining <= 0:
                latest = [d.id for d in self.lists[-1]] if self.lists else None
                raise AssertionError(f"condition not reached; latest device list: {latest}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._stream.aclose()


def uuids_of(devices: list[Device]) -> set[str]:
    return {d.properties["ONVIF_DEVICE_UUID"] for d in devices}


@contextlib.asynccontextmanager
async def cameras(*made: FakeCamera) -> Any:
    try:
        yield made
    finally:
        for camera in made:
            await camera.stop(bye=False)


async def test_probe_hello_and_bye() -> None:
    first = FakeCamera(uuid=new_uuid(), mac="02:00:00:00:00:01")
    second = FakeCamera(uuid=new_uuid(), http_host="127.0.0.2", mac="02:00:00:00:00:02")
    async with cameras(first, second):
        await first.start(hello=False)  # found by the Probe only
        collector = Collector(OnvifHandler(), details(first.uuid, second.uuid))
        try:
            devices = await collector.wait_for(lambda d: uuids_of(d) == {first.uuid})
            (device,) = devices
            assert device.id == f"{first.xaddr}-{first.uuid}"
            assert dict(device.properties) == {
                "ONVIF_DEVICE_SERVICE_URL": first.xaddr,
                "ONVIF_DEVICE_UUID": first.uuid,
                "ONVIF_DEVICE_IP_ADDRESS": "127.0.0.1",
                "ONVIF_DEVICE_MAC_ADDRESS": "02:00:00:00:00:01",
            }
            # the next Probe is an hour away: only the Hello can bring the second camera
            second.answer_probes = False
            await second.start()
            devices = await collector.wait_for(lambda d: uuids_of(d) == {first.uuid, second.uuid})
            by_uuid = {d.properties["ONVIF_DEVICE_UUID"]: d for d in devices}
            assert by_uuid[second.uuid].properties["ONVIF_DEVICE_IP_ADDRESS"] == "127.0.0.2"
            await second.stop()  # Bye
            await collector.wait_for(lambda d: uuids_of(d) == {first.uuid})
        finally:
            await collector.close()


async def test_a_silent_camera_is_gone_after_the_next_probe() -> None:
    camera = FakeCamera(uuid=new_uuid())
    async with cameras(camera):
        await camera.start()
        collector = Collector(OnvifHandler(), details(camera.uuid, interval=1))
        try:
            await collector.wait_for(lambda d: uuids_of(d) == {camera.uuid})
            camera.answer_probes = False  # still serves SOAP, but no Bye and no ProbeMatch
            await collector.wait_for(lambda d: d == [])
            camera.answer_probes = True
            await collector.wait_for(lambda d: uuids_of(d) == {camera.uuid})
        finally:
            await collector.close()


async def test_a_silent_camera_is_gone_when_the_probe_interval_equals_the_window() -> None:
    """The round that ends and the next Probe fall due together: the ending round is judged
    first (a new round first would push its end on, and the camera would never go)."""
    camera = FakeCamera(uuid=new_uuid())
    async with cameras(camera):
        await camera.start()
        text = details(camera.uuid, interval=1).replace(
            "discoveryTimeoutSeconds: 0.5", "discoveryTimeoutSeconds: 1"
        )
        collector = Collector(OnvifHandler(), text)
        try:
            await collector.wait_for(lambda d: uuids_of(d) == {camera.uuid})
            camera.answer_probes = False
            await collector.wait_for(lambda d: d == [])
        finally:
            await collector.close()


async def test_hostile_datagrams_and_soap_replies_leave_the_handler_running() -> None:
    """Entity bombs, garbage and oversized datagrams on the WS-Discovery group, and a
    "camera" whose SOAP answers are entity bombs: nothing offered for them, no crash, and a
    real camera's Hello still works afterwards."""
    from aiohttp import web

    from tests.handlers.test_onvif_units import BILLION_LAUGHS, EXTERNAL_ENTITY

    bombs_served: list[float] = []

    async def bomb(_request: web.Request) -> web.Response:
        bombs_served.append(asyncio.get_running_loop().time())
        return web.Response(body=BILLION_LAUGHS, content_type="application/soap+xml")

    app = web.Application()
    app.router.add_post("/onvif/device_service", bomb)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    hostile = FakeCamera(
        uuid=new_uuid(), xaddr_override=f"http://127.0.0.1:{port}/onvif/device_service"
    )
    real = FakeCamera(uuid=new_uuid(), http_host="127.0.0.2")
    real.answer_probes = False  # only its Hello, after the attacks, can bring it
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
    async with cameras(hostile, real):
        collector = Collector(OnvifHandler(), details(hostile.uuid, real.uuid, interval=1))
        try:
            await asyncio.sleep(0.3)
            for data in (BILLION_LAUGHS, EXTERNAL_ENTITY, b"\xff\x00garbage", b"<a>" * 40000):
                with contextlib.suppress(OSError):  # the oversized one may be refused
                    sender.sendto(data, ("239.255.255.250", 3702))
            await hostile.start()  # Hello and ProbeMatches pointing at the bomb
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE
            while not bombs_served:  # the handler asked, and got an entity bomb back
                assert loop.time() < deadline, "the hostile camera was never queried"
                await asyncio.sleep(0.05)
            await real.start()
            devices = await collector.wait_for(lambda d: real.uuid in uuids_of(d))
            assert hostile.uuid not in uuids_of(devices)
            assert all(hostile.uuid not in uuids_of(listed) for listed in collector.lists)
        finally:
            sender.close()
            await collector.close()
            await runner.cleanup()


async def test_credentials_wrong_ones_are_not_offered_and_discovery_goes_on() -> None:
    locked = FakeCamera(uuid=new_uuid(), username="admin", password="right")
    other = FakeCamera(uuid=new_uuid(), http_host="127.0.0.2", username="op", password="pw")
    late = FakeCamera(uuid=new_uuid(), http_host="127.0.0.3", username="admin", password="ok")
    properties = {
        "username_default": b"admin",
        "password_default": b"wrong",
        f"username_{other.uuid.replace('-', '_')}": b"op",
        f"password_{other.uuid.replace('-', '_')}": b"pw",
        "device_credential_list": b'["late"]',
        "late": f'{{"{late.uuid}": {{"username": "admin", "password": "ok"}}}}'.encode(),
    }
    async with cameras(locked, other, late):
        await locked.start()
        await other.start()
        collector = Collector(
            OnvifHandler(), details(locked.uuid, other.uuid, late.uuid, interval=1), properties
        )
        try:
            await collector.wait_for(lambda d: uuids_of(d) == {other.uuid})
            assert "GetDeviceInformation" in locked.calls  # it was asked, and refused
            await late.start()
            await collector.wait_for(lambda d: uuids_of(d) == {other.uuid, late.uuid})
            # a few more Probe rounds: the locked camera is asked again, never offered
            calls = locked.calls.count("GetDeviceInformation")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE
            while locked.calls.count("GetDeviceInformation") < calls + 2:
                assert loop.time() < deadline, "the locked camera was not asked again"
                await asyncio.sleep(0.05)
            assert uuids_of(collector.lists[-1]) == {other.uuid, late.uuid}
            assert "GetNetworkInterfaces" not in locked.calls
        finally:
            await collector.close()


async def test_unreachable_soap_endpoint_is_not_offered() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    dead = FakeCamera(
        uuid=new_uuid(), xaddr_override=f"http://127.0.0.1:{dead_port}/onvif/device_service"
    )
    alive = FakeCamera(uuid=new_uuid())
    async with cameras(dead, alive):
        await dead.start()
        collector = Collector(OnvifHandler(), details(dead.uuid, alive.uuid))
        try:
            # the first round ends with the dead camera known but not offered
            await collector.wait_for(lambda d: d == [])
            await alive.start()
            devices = await collector.wait_for(lambda d: bool(d))
            assert uuids_of(devices) == {alive.uuid}
        finally:
            await collector.close()


async def test_camera_without_credentials_configured_is_offered_without_ip_and_mac() -> None:
    """As Akri (PR #640): the camera answers, GetNetworkInterfaces is refused, no filter on
    IP/MAC → offered without them; with an IP filter → not offered."""
    camera = FakeCamera(uuid=new_uuid(), username="admin", password="secret")
    async with cameras(camera):
        await camera.start()
        plain = Collector(OnvifHandler(), details(camera.uuid))
        filtered = Collector(
            OnvifHandler(),
            details(camera.uuid, extra="ipAddresses: {action: Exclude, items: [10.9.9.9]}\n"),
        )
        try:
            (device,) = await plain.wait_for(lambda d: bool(d))
            assert set(device.properties) == {"ONVIF_DEVICE_SERVICE_URL", "ONVIF_DEVICE_UUID"}
            assert await filtered.wait_for(lambda d: True) == []
        finally:
            await plain.close()
            await filtered.close()


async def test_filters_on_scopes_ip_and_mac() -> None:
    lobby = FakeCamera(uuid=new_uuid(), scopes=("onvif://www.onvif.org/name/Lobby",))
    yard = FakeCamera(
        uuid=new_uuid(),
        http_host="127.0.0.2",
        mac="02:00:00:00:00:AA",
        scopes=("onvif://www.onvif.org/name/Yard",),
    )
    async with cameras(lobby, yard):
        await lobby.start()
        await yard.start()
        both = (lobby.uuid, yard.uuid)
        scope = Collector(
            OnvifHandler(),
            details(*both, extra='scopes: {items: ["onvif://www.onvif.org/name/Yard"]}\n'),
        )
        mac = Collector(
            OnvifHandler(),
            details(*both, extra="macAddresses: {action: Exclude, items: [02:00:00:00:00:aa]}\n"),
        )
        ip = Collector(OnvifHandler(), details(*both, extra="ipAddresses: {items: [127.0.0.2]}\n"))
        try:
            assert uuids_of(await scope.wait_for(lambda d: bool(d))) == {yard.uuid}
            assert uuids_of(await mac.wait_for(lambda d: bool(d))) == {lobby.uuid}
            assert uuids_of(await ip.wait_for(lambda d: bool(d))) == {yard.uuid}
            excluded = Collector(
                OnvifHandler(),
                details(
                    *both, extra=f"uuids: {{action: Exclude, items: [{lobby.uuid.upper()}]}}\n"
                ).replace(
                    f'uuids: {{action: Include, items: ["{lobby.uuid}", "{yard.uuid}"]}}\n', ""
                ),
            )
            try:
                devices = await excluded.wait_for(lambda d: yard.uuid in uuids_of(d))
                assert lobby.uuid not in uuids_of(devices)
            finally:
                await excluded.close()
        finally:
            for collector in (scope, mac, ip):
                await collector.close()


async def test_hello_updates_a_known_camera() -> None:
    camera = FakeCamera(uuid=new_uuid(), mac="02:00:00:00:00:01")
    async with cameras(camera):
        await camera.start()
        collector = Collector(OnvifHandler(), details(camera.uuid))
        try:
            (before,) = await collector.wait_for(lambda d: bool(d))
            # new metadata, same address: same id (same Instance), new properties
            camera.mac = "02:00:00:00:00:02"
            camera.metadata_version += 1
            camera.announce()
            (after,) = await collector.wait_for(
                lambda d: bool(d) and d[0].properties["ONVIF_DEVICE_MAC_ADDRESS"].endswith("02")
            )
            assert after.id == before.id
            # a new XAddr: Akri's id contains the service URL, so the device id follows it
            old_url = camera.xaddr
            await camera.move()
            (moved,) = await collector.wait_for(
                lambda d: bool(d) and d[0].properties["ONVIF_DEVICE_SERVICE_URL"] != old_url
            )
            assert moved.id == f"{camera.xaddr}-{camera.uuid}"
        finally:
            await collector.close()


def test_akri_onvif_video_configuration_loads() -> None:
    document = yaml.safe_load((FIXTURES / "akri-onvif-video.yaml").read_text())
    configuration = parse_configuration(document)
    assert configuration.discovery_handler.name == "onvif"
    handler = OnvifHandler()
    text = configuration.discovery_handler.discovery_details
    assert handler.validate(text) == []
    parsed = parse_details(text)
    assert parsed.ip_addresses is not None and parsed.ip_addresses.action is Action.EXCLUDE
    assert parsed.ip_addresses.items == ("10.0.0.1", "10.0.0.2")
    assert parsed.mac_addresses is not None and parsed.mac_addresses.items == ()
    assert parsed.scopes is not None and parsed.scopes.action is Action.INCLUDE
    assert len(parsed.scopes.items) == 2
    assert parsed.discovery_timeout == 2 and parsed.probe_interval == 10


async def test_agent_instance_for_a_camera(tmp_path: Path) -> None:
    """Through the DiscoveryManager: one shared Instance named as Akri names it."""
    import hashlib

    camera = FakeCamera(uuid=new_uuid())
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    registry = HandlerRegistry()
    registry.register(OnvifHandler())
    manager = DiscoveryManager(store, registry, "node-a", GraceSettings(local=0, shared=0))
    await manager.start()
    configuration = parse_configuration(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Configuration",
            "metadata": {"name": "cams"},
            "spec": {
                "discoveryHandler": {"name": "onvif", "discoveryDetails": details(camera.uuid)},
                "capacity": 2,
            },
        }
    )

    def instances() -> list[Instance]:
        return store.list_cached(configuration.key)

    async def until(predicate: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while not predicate():
            assert loop.time() < deadline, f"not reached; instances: {instances()}"
            await asyncio.sleep(0.05)

    try:
        await camera.start()
        await manager.handle_configuration_event(
            ConfigurationEvent(EventType.ADDED, configuration.key, configuration)
        )
        await until(lambda: len(instances()) == 1)
        (instance,) = instances()
        device_id = f"{camera.xaddr}-{camera.uuid}"
        digest = hashlib.blake2b(device_id.encode(), digest_size=3).hexdigest()
        assert instance.name == f"cams-{digest}"
        assert instance.shared is True and instance.nodes == ("node-a",)
        assert instance.broker_properties["ONVIF_DEVICE_UUID"] == camera.uuid
        await camera.stop()
        await until(lambda: instances() == [])
    finally:
        await camera.stop(bye=False)
        await manager.close()
        await store.close()


class EventRecordingStore(LocalInstanceStore):
    """The local store, keeping the Configuration Events the agent records."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, str, str]] = []  # (configuration, reason, message)
        self.event_added = asyncio.Event()

    async def record_raw_configuration_event(
        self, raw: Any, reason: str, message: str, *, warning: bool = True
    ) -> None:
        self.events.append((raw["metadata"]["name"], reason, message))
        self.event_added.set()


async def test_cameras_not_offered_give_an_event_without_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the DiscoveryManager: a camera that rejects the credentials and one whose SOAP
    endpoint does not answer each give a log line and an Event on the Configuration, once
    (not every Probe round), and neither the username nor the password appear anywhere."""
    caplog.set_level("DEBUG")
    password = "S3cret-pa55word"
    username = "camera-operator"
    locked = FakeCamera(uuid=new_uuid(), username=username, password="the-right-one")
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    dead = FakeCamera(
        uuid=new_uuid(),
        http_host="127.0.0.2",
        xaddr_override=f"http://127.0.0.1:{dead_port}/onvif/device_service",
    )
    store = EventRecordingStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    registry = HandlerRegistry()
    registry.register(OnvifHandler())
    manager = DiscoveryManager(store, registry, "node-a", GraceSettings(local=0, shared=0))
    await manager.start()
    configuration = parse_configuration(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Configuration",
            "metadata": {"name": "locked-cams"},
            "spec": {
                "discoveryHandler": {
                    "name": "onvif",
                    "discoveryDetails": details(locked.uuid, dead.uuid, interval=0.5),
                    "discoveryProperties": [
                        {"name": "username_default", "value": username},
                        {"name": "password_default", "value": password},
                    ],
                },
                "capacity": 1,
            },
        }
    )

    def reasons() -> list[str]:
        return [reason for name, reason, _ in store.events if name == "locked-cams"]

    try:
        async with cameras(locked, dead):
            await locked.start()
            await dead.start()
            await manager.handle_configuration_event(
                ConfigurationEvent(EventType.ADDED, configuration.key, configuration)
            )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE
            wanted = {"OnvifCredentialsRejected", "OnvifCameraNotAnswering"}
            while not wanted <= set(reasons()):
                assert loop.time() < deadline, f"no such Events; recorded: {store.events}"
                store.event_added.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(store.event_added.wait(), 0.5)
            # more Probe rounds ask both cameras again: no new Event for the same problem
            calls = locked.calls.count("GetDeviceInformation")
            while locked.calls.count("GetDeviceInformation") < calls + 2:
                assert loop.time() < deadline, "the locked camera was not asked again"
                await asyncio.sleep(0.05)
            assert sorted(reasons()) == sorted(wanted)
            assert store.list_cached(configuration.key) == []
        messages = {reason: message for _, reason, message in store.events}
        assert locked.uuid in messages["OnvifCredentialsRejected"]
        assert dead.uuid in messages["OnvifCameraNotAnswering"]
        for _, _, message in store.events:
            assert password not in message and username not in message
        logged = "\n".join(record.getMessage() for record in caplog.records)
        assert f"not offering camera {locked.uuid}" in logged
        assert password not in logged and username not in logged
    finally:
        await manager.close()
        await store.close()


async def test_a_flood_of_fake_cameras_gives_a_bounded_number_of_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Hellos with 30 random uuids, each naming a closed port (every query fails at once):
    each fake camera is logged (debug beyond the budget) but at most BUDGET of them become
    warnings and Events in the budget window, not one Event per uuid."""
    from discovery_handlers.base import BUDGET, report_problems_to
    from discovery_handlers.onvif.wsdiscovery import MULTICAST_IPV4, PORT

    caplog.set_level("DEBUG", logger="discovery_handlers.onvif")
    events: list[tuple[str, str]] = []

    async def record(reason: str, message: str) -> None:
        events.append((reason, message))

    report_problems_to(record)  # as the agent does for the task that runs discover()
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    fakes = [
        FakeCamera(uuid=new_uuid(), xaddr_override=f"http://127.0.0.1:{dead_port}/onvif/x{i}")
        for i in range(30)
    ]
    assert len(fakes) > 2 * BUDGET
    collector = Collector(OnvifHandler(), details(*(f.uuid for f in fakes)))

    def not_offered() -> set[str]:
        return {
            fake.uuid
            for fake in fakes
            for record in caplog.records
            if f"not offering camera {fake.uuid}" in record.getMessage()
        }

    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        await collector.wait_for(lambda d: d == [])  # listening, first round over
        sender.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        for fake in fakes:
            sender.sendto(fake.hello(), (MULTICAST_IPV4, PORT))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while len(not_offered()) < len(fakes):
            assert loop.time() < deadline, f"only {len(not_offered())} fake cameras were asked"
            await asyncio.sleep(0.05)
        for _ in range(3):  # the Event tasks started by the last reports run
            await asyncio.sleep(0)
        assert len(events) == BUDGET, events
        warnings = [
            r for r in caplog.records if r.levelname == "WARNING" and "not offering" in r.message
        ]
        assert len(warnings) == BUDGET
    finally:
        sender.close()
        await collector.close()


async def test_a_unicast_hello_is_not_heard() -> None:
    """A Hello sent by unicast to the node's WS-Discovery port (as a pod could, through the
    node's address, with a real camera's uuid and its own XAddr) is not heard: only the
    group's datagrams on the chosen interfaces are. The multicast Hello sent after it is.
    (The handler uses a port of its own here, so no fake camera's listener shares it.)"""
    from discovery_handlers.onvif.wsdiscovery import MULTICAST_IPV4

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    real = FakeCamera(uuid=new_uuid(), answer_probes=False)
    spoofed = FakeCamera(uuid=new_uuid())
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    async with cameras(real):
        await real.start(hello=False)
        spoofed.xaddr_override = real.xaddr  # a SOAP service that answers
        collector = Collector(OnvifHandler(port=port, ipv6=False), details(real.uuid, spoofed.uuid))
        try:
            await collector.wait_for(lambda d: d == [])  # listening, first round over
            sender.setsockopt(
                socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1")
            )
            sender.sendto(spoofed.hello(), ("127.0.0.1", port))
            sender.sendto(real.hello(), (MULTICAST_IPV4, port))
            devices = await collector.wait_for(lambda d: real.uuid in uuids_of(d))
            assert spoofed.uuid not in uuids_of(devices)
            assert all(spoofed.uuid not in uuids_of(listed) for listed in collector.lists)
        finally:
            sender.close()
            await collector.close()


def test_the_helm_charts_onvif_configuration_loads_unchanged() -> None:
    """Akri's chart, rendered with its defaults (onvif.configuration.enabled=true): valid
    against our Configuration CRD, accepted by our model and by the handler (no warnings),
    and every filter the chart writes is Akri's 'Exclude nothing'."""
    from tests.doubles.crd_pipeline import (
        CONFIGURATION_CRD,
        cel_violations,
        load_crd,
        schema_errors,
        schema_of,
        spec_only,
        unknown_fields,
    )

    text = (FIXTURES / "helm-onvif-configuration.yaml").read_text()
    (document,) = [d for d in yaml.safe_load_all(text) if d]
    schema = schema_of(load_crd(CONFIGURATION_CRD))
    assert schema_errors(document, schema) == []
    assert unknown_fields(spec_only(document), schema) == []
    assert cel_violations(document, schema) == []
    configuration = parse_configuration(document)
    assert configuration.name == "akri-onvif" and configuration.capacity == 1
    assert configuration.discovery_handler.name == "onvif"
    details_text = configuration.discovery_handler.discovery_details
    assert details_text.startswith("ipAddresses: \n")  # as the template writes it
    assert OnvifHandler().validate(details_text) == []
    parsed = parse_details(details_text)
    for kind in (parsed.ip_addresses, parsed.mac_addresses, parsed.scopes, parsed.uuids):
        assert kind is not None and kind.action is Action.EXCLUDE and kind.items == ()
    assert parsed.discovery_timeout == 1 and parsed.interfaces == ()
