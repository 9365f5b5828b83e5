"""The mdns handler against real ``zeroconf`` publishers on loopback (multicast works on
``lo`` here; each test uses its own service type, so other mDNS traffic cannot interfere):
services appear, change TXT, say goodbye; filters; bad TXT; the device cap. And the pure
parts: discoveryDetails, filters and the property mapping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable

import pytest

from discovery_handlers.base import Device, InvalidDiscoveryDetailsError, report_problems_to
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
        self,
        service_type: str,
        instance: str,
        port: int,
        txt: dict[object, object],
        address: str = "127.0.0.1",
    ) -> object:
        from zeroconf.asyncio import AsyncServiceInfo

        return AsyncServiceInfo(
            service_type,
            f"{instance}.{service_type}",
            addresses=[socket.inet_aton(address)],
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
        self,
        service_type: str,
        instance: str,
        port: int,
        txt: dict[object, object],
        address: str = "127.0.0.1",
    ) -> None:
        info = self.info(service_type, instance, port, txt, address)
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
        self.events: list[tuple[str, str]] = []  # (reason, message) the handler reported

        async def record(reason: str, message: str) -> None:
            self.events.append((reason, message))

        # as the agent does in the task that runs discover(); the task copies this context
        report_problems_to(record)
        self.task = asyncio.ensure_future(self._run(text))

    async def _run(self, text: str) -> None:
        async for devices in MdnsHandler().discover(text, {}):
            self.lists.append(devices)

    def names(self) -> set[str]:
        return {d.properties["MDNS_NAME"] for d in self.lists[-1]} if self.lists else set()

    def device(self, name: str) -> Device:
        return next(d for d in self.lists[-1] if d.properties["MDNS_NAME"] == name)

    async def until(self, check: Callable[[], object], what: str, within: float = 60.0) -> None:
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
        # the cap: a log line and an Event, once (not for every list)
        assert [reason for reason, _ in capped.events] == ["DeviceCapReached"]
        assert "maxDevices (2)" in capped.events[0][1]
        assert filtered.events == []
    finally:
        await filtered.close()
        await capped.close()


@needs_multicast
async def test_an_address_change_updates_the_device(
    publisher: Publisher, service_type: str
) -> None:
    await publisher.add(service_type, "Sensor", 8000, {"v": "1"})
    follower = Follower(details(service_type))
    try:
        await follower.until(lambda: follower.names() == {"Sensor"}, "the sensor")
        before = follower.device("Sensor")
        assert before.properties["MDNS_ADDRESSES"] == "127.0.0.1"
        # RFC 6762 §10.2: a cache-flush answer replaces only records received more than 1 s
        # before it (an answer's own burst is kept); a real address change comes later
        await asyncio.sleep(1.2)
        # same instance, same TXT, the host's A record now says 127.0.0.2
        await publisher.update(service_type, "Sensor", 8000, {"v": "1"}, address="127.0.0.2")
        await follower.until(
            lambda: follower.device("Sensor").properties["MDNS_ADDRESSES"] == "127.0.0.2",
            "the new address",
        )
        assert follower.device("Sensor").id == before.id  # the same device (and Instance)
    finally:
        await follower.close()


PUBLISH_AND_HANG = """
import asyncio, socket, sys
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

async def main():
    zc = AsyncZeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    service_type = sys.argv[1]
    info = AsyncServiceInfo(
        service_type, "Shortlived." + service_type, addresses=[socket.inet_aton("127.0.0.1")],
        port=9, server="shortlived.local.", host_ttl=2, other_ttl=2,
    )
    await (await zc.async_register_service(info))
    print("registered", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@needs_multicast
async def test_a_publisher_that_dies_without_goodbye_is_gone_when_the_ttl_runs_out(
    service_type: str,
) -> None:
    """SIGKILL: no goodbye packet; the records (TTL 2 s) expire from the browser's cache."""
    import sys

    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PUBLISH_AND_HANG, service_type, stdout=asyncio.subprocess.PIPE
    )
    follower: Follower | None = None
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        assert line.strip() == b"registered", line
        follower = Follower(details(service_type))
        await follower.until(lambda: follower.names() == {"Shortlived"}, "the service")
        process.kill()
        await process.wait()
        # gone once its SRV/A records (TTL 2 s) expired and a new query got no answer
        await follower.until(lambda: follower.names() == set(), "expired", within=40)
    finally:
        if follower is not None:
            await follower.close()
        if process.returncode is None:
            process.kill()
            await process.wait()


@needs_multicast
async def test_interfaces_by_name(publisher: Publisher, service_type: str) -> None:
    await publisher.add(service_type, "On lo", 80)
    by_name = Follower(f"serviceTypes: ['{service_type}']\ninterfaces: [lo]\n")
    try:
        await by_name.until(lambda: by_name.names() == {"On lo"}, "found through lo")
    finally:
        await by_name.close()
    unknown = Follower(f"serviceTypes: ['{service_type}']\ninterfaces: [nosuch0]\n")
    with pytest.raises(OSError, match="no interface named 'nosuch0'"):
        await unknown.task


@needs_multicast
async def test_a_flood_of_services_stays_bounded(
    publisher: Publisher, service_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    """maxDevices 1: at most two service instances are kept or resolved; the others are
    ignored with one Event, and the list is capped with another. More of them later (or the
    same ones announced again) repeat neither Event: the two caps are two problems (once one
    subject, each message ended the other's quiet time, and a parallel run saw four)."""
    caplog.set_level(logging.DEBUG, logger="discovery_handlers.mdns")
    follower = Follower(details(service_type, "maxDevices: 1\n"))
    try:
        await follower.until(lambda: follower.lists, "a first (empty) list")
        await asyncio.gather(
            *(publisher.add(service_type, f"flood-{index}", 80 + index) for index in range(5))
        )
        await follower.until(
            lambda: (
                {reason for reason, _ in follower.events} == {"DeviceCapReached"}
                and len(follower.events) == 2
            ),
            "two DeviceCapReached Events (kept names, offered devices)",
        )
        messages = " | ".join(message for _, message in follower.events)
        assert "more than 2 service instances" in messages and "maxDevices (1)" in messages
        assert len(follower.names()) == 1
        caplog.clear()
        await publisher.add(service_type, "flood-5", 85)
        await follower.until(
            lambda: any(
                r.levelno == logging.DEBUG and "more than 2 service instances" in r.getMessage()
                for r in caplog.records
            ),
            "flood-5 over the cap, its problem logged at debug level only",
        )
        assert len(follower.events) == 2, follower.events
    finally:
        await follower.close()


def send_pointers(publisher: Publisher, service_type: str, instances: list[str]) -> None:
    """Announce service instances by their PTR records only: nobody answers the queries
    that resolve them, so each resolution takes resolveTimeoutSeconds and holds a slot."""
    from zeroconf import const
    from zeroconf._dns import DNSPointer
    from zeroconf._protocol.outgoing import DNSOutgoing

    out = DNSOutgoing(const._FLAGS_QR_RESPONSE | const._FLAGS_AA)
    for instance in instances:
        pointer = DNSPointer(
            service_type, const._TYPE_PTR, const._CLASS_IN, 120, f"{instance}.{service_type}"
        )
        out.add_answer_at_time(pointer, 0)
    publisher.zc.zeroconf.async_send(out)


@needs_multicast
async def test_names_the_instance_filter_excludes_take_no_slot(
    publisher: Publisher, service_type: str
) -> None:
    """maxDevices 1 (two slots) and instanceNames cam-*: six announced names that fail the
    filter (and would take the resolve timeout each) are never resolved, so the camera
    announced after them is found and the cap is never reached."""
    follower = Follower(
        details(
            service_type,
            "maxDevices: 1\nresolveTimeoutSeconds: 3\n"
            "instanceNames: {action: Include, items: ['cam-*']}\n",
        )
    )
    try:
        await follower.until(lambda: follower.lists, "a first (empty) list")
        send_pointers(publisher, service_type, [f"ghost-{index}" for index in range(6)])
        await publisher.add(service_type, "cam-real", 80)
        await follower.until(lambda: follower.names() == {"cam-real"}, "the camera")
        assert follower.events == []
    finally:
        await follower.close()


@needs_multicast
async def test_names_over_the_cap_are_resolved_when_a_slot_frees(
    publisher: Publisher, service_type: str
) -> None:
    """maxDevices 1 (two slots): six names that never resolve fill both slots (a cap
    Event); a real service announced meanwhile waits in the backlog (zeroconf will not
    report it again) and is found once the stuck resolutions time out."""
    follower = Follower(details(service_type, "maxDevices: 1\nresolveTimeoutSeconds: 3\n"))
    try:
        await follower.until(lambda: follower.lists, "a first (empty) list")
        # the slots stay taken (3 rounds of 3 s) well past the late service's announcements,
        # which could otherwise reach the browser again as "Updated"
        send_pointers(publisher, service_type, [f"stuck-{index}" for index in range(6)])
        await follower.until(
            lambda: [reason for reason, _ in follower.events] == ["DeviceCapReached"],
            "the cap Event (both slots taken)",
        )
        await publisher.add(service_type, "late", 80)
        await follower.until(lambda: follower.names() == {"late"}, "the late service", 40)
        assert "resolved when a slot frees" in follower.events[0][1]
    finally:
        await follower.close()


async def test_an_expired_service_is_asked_again_before_it_is_gone() -> None:
    """One missed answer after the records expired does not remove a live service: it is
    asked up to RECHECK_ATTEMPTS times, with backoff, and not after it left."""
    from discovery_handlers.mdns.handler import RECHECK_ATTEMPTS, answer_within

    assert RECHECK_ATTEMPTS >= 3
    answers: list[object | None] = [None, "info"]
    asked = 0

    async def ask() -> object | None:
        nonlocal asked
        asked += 1
        return answers.pop(0) if answers else None

    assert await answer_within(RECHECK_ATTEMPTS, ask, lambda: True, backoff=0.01) == "info"
    assert asked == 2
    asked = 0
    assert await answer_within(RECHECK_ATTEMPTS, ask, lambda: True, backoff=0.01) is None
    assert asked == RECHECK_ATTEMPTS
    asked = 0
    assert await answer_within(RECHECK_ATTEMPTS, ask, lambda: False, backoff=0.01) is None
    assert asked == 1  # said goodbye meanwhile: not asked again
    asked = 0
    assert await answer_within(1, ask, lambda: True, backoff=0.01) is None
    assert asked == 1


def test_recheck_delay_skips_expired_records() -> None:
    """Records already expired but not yet cleaned from the cache do not count (they gave a
    delay of 0: a resolution every 0.2 s); never sooner than MIN_RECHECK."""
    from discovery_handlers.mdns.handler import FALLBACK_RECHECK, MIN_RECHECK, recheck_delay

    now = 1_000_000.0
    assert recheck_delay([now - 5000, now + 30_000, now + 60_000], now) == 30.0
    assert recheck_delay([now - 5000, now - 1], now) == MIN_RECHECK
    assert recheck_delay([now + 100], now) == MIN_RECHECK
    assert recheck_delay([], now) == FALLBACK_RECHECK


def test_the_zeroconf_apis_used_exist() -> None:
    """The calls outside zeroconf's documented API that the handler makes exist in the
    installed zeroconf (a new release that drops them fails here, not in production)."""
    import inspect

    from zeroconf import current_time_millis
    from zeroconf._cache import DNSCache
    from zeroconf._dns import DNSRecord

    for method in (
        "get_by_details",
        "get_all_by_details",
        "current_entry_with_name_and_alias",
        "async_remove_records",
    ):
        assert callable(getattr(DNSCache, method, None)), method
    assert callable(getattr(DNSRecord, "get_expiration_time", None))
    assert isinstance(current_time_millis(), float | int)
    cache = DNSCache()
    assert cache.get_by_details("x.local.", 33, 1) is None
    assert list(cache.get_all_by_details("x.local.", 1, 1)) == []
    assert cache.current_entry_with_name_and_alias("_x._tcp.local.", "a._x._tcp.local.") is None
    assert len(inspect.signature(DNSRecord.get_expiration_time).parameters) == 2


def test_a_changed_zeroconf_cache_api_degrades_to_a_fixed_recheck(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """If zeroconf's cache API changes, the handler asks again every FALLBACK_RECHECK s
    (it never stops rechecking) and says so once."""
    from discovery_handlers.mdns import handler

    caplog.set_level("DEBUG", logger="discovery_handlers.mdns")
    handler._private_api_warned.clear()

    class Changed:
        def get_by_details(self, name: str) -> None:  # a changed signature
            return None

    assert handler._recheck_in(object(), "a._x._tcp.local.", "a.local.") == (
        handler.FALLBACK_RECHECK
    )
    assert handler._recheck_in(Changed(), "a._x._tcp.local.", "a.local.") == (
        handler.FALLBACK_RECHECK
    )
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "does not work as expected" in warnings[0].getMessage()


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
