"""The mdns handler against real ``zeroconf`` publishers on loopback (multicast works on
``lo`` here; each test uses its own service type, so other mDNS traffic cannot interfere):
services appear, change TXT, say goodbye; filters; bad TXT; the device cap. And the pure
parts: discoveryDetails, filters and the property mapping."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable

import pytest

from discovery_handlers.base import Device, InvalidDiscoveryDetailsError
from discovery_handlers.mdns import MdnsHandler
from discovery_handlers.mdns.details import parse_details
from discovery_handlers.mdns.services import Service, decode_txt, device_of, wanted


def loopback_multicast() -> bool:
    """Can a datagram sent to the mDNS group on lo be received on lo?"""
    group, port = "224.0.0.251", 0
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx:
            rx.bind(("", 0))
            port = rx.getsockname()[1]
            mreq = socket.inet_aton(group) + socket.inet_aton("127.0.0.1")
            rx.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
            rx.settimeout(1)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
                tx.setsockopt(
                    socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1")
                )
                tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
                tx.sendto(b"ping", (group, port))
            return rx.recv(16) == b"ping"
    except OSError:
        return False


needs_multicast = pytest.mark.skipif(
    not loopback_multicast(), reason="multicast on the loopback interface does not work here"
)


class Publisher:
    def __init__(self) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncZeroconf

        self.zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
        self.infos: dict[str, object] = {}

    def info(
        self, service_type: str, instance: str, port: int, txt: dict[object, object]
    ) -> object:
        from zeroconf.asyncio import AsyncServiceInfo

        return AsyncServiceInfo(
            service_type,
            f"{instance}.{service_type}",
            addresses=[socket.inet_aton("127.0.0.1")],
            port=port,
            properties=txt,
            server=f"{instance.lower().replace(' ', '-')}.local.",
        )

    async def add(
        self,
        service_type: str,
        instance: str,
        port: int = 80,
        txt: dict[object, object] | None = None,
    ) -> None:
        info = self.info(service_type, instance, port, txt or {})
        await self.zc.async_register_service(info)  # type: ignore[arg-type]
        self.infos[instance] = info

    async def update(
        self, service_type: str, instance: str, port: int, txt: dict[object, object]
    ) -> None:
        info = self.info(service_type, instance, port, txt)
        await self.zc.async_update_service(info)  # type: ignore[arg-type]
        self.infos[instance] = info

    async def remove(self, instance: str) -> None:
        await self.zc.async_unregister_service(self.infos.pop(instance))  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.zc.async_unregister_all_services()
        await self.zc.async_close()


@pytest.fixture
async def publisher() -> AsyncIterator[Publisher]:
    p = Publisher()
    yield p
    await p.close()


@pytest.fixture
def service_type() -> str:
    return f"_ak{secrets.token_hex(4)}._tcp.local."


class Follower:
    def __init__(self, text: str) -> None:
        self.lists: list[list[Device]] = []
        self.task = asyncio.ensure_future(self._run(text))

    async def _run(self, text: str) -> None:
        async for devices in MdnsHandler().discover(text, {}):
            self.lists.append(devices)

    def names(self) -> set[str]:
        return {d.properties["MDNS_NAME"] for d in self.lists[-1]} if self.lists else set()

    def device(self, name: str) -> Device:
        return next(d for d in self.lists[-1] if d.properties["MDNS_NAME"] == name)

    async def until(self, check: Callable[[], object], what: str, within: float = 15.0) -> None:
        deadline = time.monotonic() + within
        while not check():
            if self.task.done():
                self.task.result()
            if time.monotonic() > deadline:
                raise AssertionError(f"not true after {within}s: {what}; last: {self.lists[-1:]}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def details(service_type: str, extra: str = "") -> str:
    return f"serviceTypes: ['{service_type}']\ninterfaces: ['127.0.0.1']\n{extra}"


@needs_multicast
async def test_services_appear_change_and_leave(publisher: Publisher, service_type: str) -> None:
    await publisher.add(service_type, "Printer A", 631, {"ty": "Acme P1", "rp": "queue"})
    follower = Follower(details(service_type))
    try:
        await follower.until(lambda: follower.names() == {"Printer A"}, "printer A")
        device = follower.device("Printer A")
        assert device.id == f"Printer A.{service_type}"
        assert device.properties["MDNS_TYPE"] == service_type
        assert device.properties["MDNS_HOST"] == "printer-a.local."
        assert device.properties["MDNS_ADDRESSES"] == "127.0.0.1"
        assert device.properties["MDNS_PORT"] == "631"
        assert device.properties["MDNS_TXT_TY"] == "Acme P1"
        await publisher.add(service_type, "Printer B", 632)
        await follower.until(lambda: follower.names() == {"Printer A", "Printer B"}, "B too")
        await publisher.update(service_type, "Printer A", 631, {"ty": "Acme P2"})
        await follower.until(
            lambda: follower.device("Printer A").properties.get("MDNS_TXT_TY") == "Acme P2",
            "A's TXT updated",
        )
        await publisher.remove("Printer B")  # a goodbye packet
        await follower.until(lambda: follower.names() == {"Printer A"}, "B said goodbye")
    finally:
        await follower.close()


@needs_multicast
async def test_filters_bad_txt_and_the_cap(publisher: Publisher, service_type: str) -> None:
    await publisher.add(service_type, "cam-1", 80, {"secure": None, "model": "X"})
    await publisher.add(service_type, "cam-2", 8080, {"model": "Y", b"\xff\xfe": b"bad"})
    await publisher.add(service_type, "hub", 80, {"model": "X"})
    filtered = Follower(
        details(
            service_type,
            "instanceNames: {action: Include, items: ['cam-*']}\n"
            "txtRecords: {action: Exclude, items: ['secure']}\n",
        )
    )
    capped = Follower(details(service_type, "maxDevices: 2\n"))
    try:
        await filtered.until(lambda: filtered.names() == {"cam-2"}, "only cam-2 passes")
        properties = filtered.device("cam-2").properties
        assert properties["MDNS_TXT_MODEL"] == "Y"
        assert not [k for k in properties if k.startswith("MDNS_TXT_") and k != "MDNS_TXT_MODEL"]
        await capped.until(lambda: len(capped.names()) == 2, "two of three")
        assert capped.names() == {"cam-1", "cam-2"}  # the first by name
    finally:
        await filtered.close()
        await capped.close()


def test_details() -> None:
    parsed = parse_details("serviceTypes: ['_http._tcp.local', '_ipp._tcp.local.']")
    assert parsed.service_types == ("_http._tcp.local.", "_ipp._tcp.local.")
    for bad, field in [
        ("{}", "serviceTypes is required"),
        ("serviceTypes: ['http']", "serviceTypes[0]"),
        ("serviceTypes: ['_http._tcp.local.']\nmaxDevices: 0", "maxDevices"),
        ("serviceTypes: ['_http._tcp.local.']\nports: {action: Maybe, items: []}", "ports.action"),
        ("serviceTypes: ['_http._tcp.local.']\ninterfaces: ['1.2.3']", "interfaces[0]"),
    ]:
        with pytest.raises(InvalidDiscoveryDetailsError, match="mdns: discoveryDetails") as info:
            parse_details(bad)
        assert field in str(info.value)


def test_filters_and_properties() -> None:
    service = Service(
        "Cam 1._rtsp._tcp.local.", "_rtsp._tcp.local.", "cam1.local.", 554, ("10.0.0.7",),
        {"model": "X", "path": "/live", "flag": ""},
    )  # fmt: skip
    assert service.instance == "Cam 1"
    detail = parse_details

    def keep(extra: str) -> bool:
        return wanted(service, detail(f"serviceTypes: ['_rtsp._tcp.local.']\n{extra}"))

    assert keep("")
    assert keep("ports: {action: Include, items: ['55*']}")
    assert not keep("ports: {action: Exclude, items: ['554']}")
    assert keep("hostNames: {action: Include, items: ['cam?.local.']}")
    assert keep("txtRecords: {action: Include, items: ['model=X']}")
    assert not keep("txtRecords: {action: Include, items: ['model=Y']}")
    assert not keep("txtRecords: {action: Exclude, items: ['flag']}")
    assert not keep("instanceNames: {action: Include, items: []}")  # Akri: Include [] keeps none
    properties = device_of(service).properties
    assert properties["MDNS_TXT_PATH"] == "/live" and properties["MDNS_TXT_FLAG"] == ""
    txt, dropped = decode_txt({b"ok": b"1", b"\xff": b"x", b"v": b"\xfe", b"k": None})
    assert txt == {"ok": "1", "k": ""} and len(dropped) == 2
