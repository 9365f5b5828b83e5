"""The opcua handler's pure parts (discoveryDetails, Akri's selection rules, the tracker's
schedule, with a clock of our own) and its connection code against servers that misbehave on
purpose (``tests/doubles/opcua_servers.py``, on loopback). Real OPC UA servers (asyncua's, a
discovery server) are in ``test_opcua_netns.py``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import yaml

from agent.core.model.naming import candidate_names, device_key
from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.filters import Action, FilterList
from discovery_handlers.opcua import OpcuaHandler, parse_details
from discovery_handlers.opcua.details import (
    DEFAULT_DISCOVERY_URLS,
    OpcuaDetails,
    host_problem,
    url_key,
    warnings,
)
from discovery_handlers.opcua.servers import (
    Application,
    ApplicationType,
    Listed,
    Record,
    bad_hosts,
    chosen_url,
    device_of,
    env_value,
    hosts_of,
    listed_by_find_servers,
    listed_by_find_servers_on_network,
    offered,
    own_application,
    substitute_host,
    trimmed,
    wanted,
)
from discovery_handlers.opcua.tracker import LIST_TRUST, Call, Failure, Tracker, max_backoff
from tests.paths import FIXTURES

# -- discoveryDetails ----------------------------------------------------------------------------


def test_akris_own_examples_parse_unchanged() -> None:
    """The two documents of Akri's handler unit tests, and its Helm chart's rendering."""
    empty = parse_details("opcuaDiscoveryMethod:\n  standard: {}\n")
    assert empty.method == "standard" and empty.discovery_urls == DEFAULT_DISCOVERY_URLS
    assert empty.application_names is None
    detailed = parse_details(
        "opcuaDiscoveryMethod: \n  standard:\n    discoveryUrls:\n"
        "    - opc.tcp://127.0.0.1:4855/\napplicationNames:\n  action: Include\n  items: \n"
        '  - "Some application name" \n'
    )
    assert detailed.discovery_urls == ("opc.tcp://127.0.0.1:4855/",)
    assert detailed.application_names == FilterList(Action.INCLUDE, ("Some application name",))
    chart = yaml.safe_load((FIXTURES / "crds" / "configurations" / "opcua.yaml").read_text())
    text = chart["spec"]["discoveryHandler"]["discoveryDetails"]
    rendered = parse_details(text)
    assert rendered.discovery_urls == ("opc.tcp://10.0.0.1:4840/", "opc.tcp://10.0.0.2:4840/")
    assert rendered.application_names == FilterList(Action.EXCLUDE, ())
    assert OpcuaHandler().validate(text) == []


def test_our_fields_and_the_multicast_method() -> None:
    parsed = parse_details(
        "opcuaDiscoveryMethod:\n  multicast:\n    discoveryUrls: [opc.tcp://lds:4840/]\n"
        "    serverCapabilities: [da, HD]\n"
        "recheckIntervalSeconds: 30\nretryIntervalSeconds: 0.5\ntimeoutSeconds: 2\n"
        "maxServers: 20\n"
    )
    assert parsed == OpcuaDetails(
        method="multicast",
        discovery_urls=("opc.tcp://lds:4840/",),
        server_capabilities=("DA", "HD"),
        recheck_interval=30.0,
        retry_interval=0.5,
        timeout=2.0,
        max_servers=20,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "discoveryDetails.opcuaDiscoveryMethod is required"),
        ("applicationNames: {items: [a]}", "discoveryDetails.opcuaDiscoveryMethod is required"),
        ("opcuaDiscoveryMethod: standard", "must be a mapping with exactly one method"),
        (
            "opcuaDiscoveryMethod: {standard: {}, multicast: {}}",
            "must be a mapping with exactly one method",
        ),
        ("opcuaDiscoveryMethod: {scan: {}}", "unknown method 'scan' (known: standard, multicast)"),
        (
            "opcuaDiscoveryMethod: {standard: [x]}",
            "opcuaDiscoveryMethod.standard must be a mapping",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {discoveryUrls: opc.tcp://a:1/}}",
            "opcuaDiscoveryMethod.standard.discoveryUrls must be a list",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {discoveryUrls: [opc.tcp://a:1/, 'http://b/']}}",
            "opcuaDiscoveryMethod.standard.discoveryUrls[1] 'http://b/' must start with opc.tcp://",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {discoveryUrls: ['opc.tcp://:4840/']}}",
            "discoveryUrls[0] 'opc.tcp://:4840/' has no host",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {discoveryUrls: ['opc.tcp://a:99999/']}}",
            "discoveryUrls[0] 'opc.tcp://a:99999/' is not a URL",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {discoveryUrls: ['opc.tcp://a b:1/']}}",
            "must not contain spaces or control characters",
        ),
        (
            "opcuaDiscoveryMethod: {multicast: {serverCapabilities: [DA, 'a b']}}",
            "opcuaDiscoveryMethod.multicast.serverCapabilities[1] must be a capability",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {}}\napplicationNames: {action: Maybe, items: []}",
            "discoveryDetails.applicationNames.action must be Include or Exclude",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {}}\napplicationNames: {action: Include}",
            "discoveryDetails.applicationNames.items is required",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {}}\napplicationNames: {items: [a], cation: x}",
            "applicationNames has unknown field(s) cation",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {}}\nrecheckIntervalSeconds: 0",
            "recheckIntervalSeconds must be between 0.5 and 3600",
        ),
        (
            "opcuaDiscoveryMethod: {standard: {}}\ntimeoutSeconds: fast",
            "timeoutSeconds must be a number of seconds",
        ),
        ("opcuaDiscoveryMethod: {standard: {}}\nmaxServers: 0", "maxServers must be 1 to 10000"),
    ],
)
def test_invalid_details_name_the_field(text: str, message: str) -> None:
    with pytest.raises(InvalidDiscoveryDetailsError) as raised:
        OpcuaHandler().validate(text)
    assert message in str(raised.value)
    assert str(raised.value).startswith("opcua: ")


def test_unknown_fields_are_ignored_with_a_warning_naming_them() -> None:
    text = (
        "opcuaDiscoveryMethod:\n  standard:\n    discoveryURLs: [opc.tcp://a:1/]\n"
        "    serverCapabilities: [DA]\napplicationName: {items: [x]}\n"
    )
    found = warnings(text)
    assert any("applicationName " in w and "in discoveryDetails" in w for w in found), found
    assert any(
        "discoveryURLs, serverCapabilities in discoveryDetails.opcuaDiscoveryMethod.standard" in w
        for w in found
    ), found
    assert parse_details(text).discovery_urls == DEFAULT_DISCOVERY_URLS  # as Akri: the default
    empty = warnings("opcuaDiscoveryMethod: {standard: {discoveryUrls: []}}")
    assert any("discoveryUrls is empty" in w for w in empty)


# -- Akri's rules --------------------------------------------------------------------------------


def app(
    name: str,
    *urls: str,
    kind: ApplicationType = ApplicationType.SERVER,
    uri: str | None = None,
) -> Application:
    return Application(
        uri=uri or f"urn:{name}", product_uri="urn:product", name=name, type=kind,
        discovery_urls=urls,
    )  # fmt: skip


def test_akris_host_substitution_vectors() -> None:
    """Akri's own test of get_discovery_url_ip, and what differs on purpose."""
    server = "opc.tcp://OPCTest.invalid:50000/OPCUA/Simluation"
    assert (
        substitute_host("opc.tcp://192.168.0.1:50000", server)
        == "opc.tcp://192.168.0.1:50000/OPCUA/Simluation"
    )
    assert (
        substitute_host("opc.tcp://192.168.0.1:50000/OPCUA/Simluation", server)
        == "opc.tcp://192.168.0.1:50000/OPCUA/Simluation"
    )
    assert substitute_host("opc.tcp://10.0.0.1:4840/", "opc.tcp://plc:4840/") == (
        "opc.tcp://10.0.0.1:4840/"
    )
    assert substitute_host("opc.tcp://10.0.0.1:4840/", "opc.tcp://plc/x") == (
        "opc.tcp://10.0.0.1:4840/x"  # no port: Akri's 4840, the queried URL as it is written
    )
    # a server registered with a discovery server on its host keeps its own port (Akri would
    # give the discovery server's URL: opc.tcp://10.0.0.1:4840/x)
    assert substitute_host("opc.tcp://10.0.0.1:4840/", "opc.tcp://plc:48401/x") == (
        "opc.tcp://10.0.0.1:48401/x"
    )
    assert substitute_host("opc.tcp://[fd00::1]:4840/", "opc.tcp://plc:48401/") == (
        "opc.tcp://[fd00::1]:48401/"
    )


def test_which_applications_are_offered_and_under_which_url() -> None:
    assert wanted(app("a"), None)
    assert wanted(app("a", kind=ApplicationType.CLIENT_AND_SERVER), None)  # Akri: no
    assert not wanted(app("a", kind=ApplicationType.CLIENT), None)
    assert not wanted(app("a", kind=ApplicationType.DISCOVERY_SERVER), None)
    include = FilterList(Action.INCLUDE, ("Server A",))
    exclude = FilterList(Action.EXCLUDE, ("Server A",))
    assert wanted(app("Server A"), include) and not wanted(app("server a"), include)
    assert not wanted(app("Server A"), exclude) and wanted(app("Server B"), exclude)
    assert chosen_url(app("a", "https://a/", "opc.tcp://a:1/", "opc.tcp://b:1/")) == (
        "opc.tcp://a:1/"
    )
    assert chosen_url(app("a", "https://a/", "opc.wss://a/")) is None
    assert chosen_url(app("a")) is None
    assert chosen_url(app("a", "opc.tcp://a b:1/")) is None


def test_a_find_servers_answer_de_duplicated_and_substituted() -> None:
    answer = [
        app("LDS", "opc.tcp://10.0.0.1:4840/", kind=ApplicationType.DISCOVERY_SERVER),
        app("Server A", "opc.tcp://10.0.0.2:4840/"),
        app("Server A again", "opc.tcp://10.0.0.2:4840/"),
        app("Server B", "opc.tcp://plc-b.invalid:48402/b"),
        app("Server C", "opc.tcp://plc-c.example:4840/"),
        app("Client", "opc.tcp://10.0.0.9:4840/", kind=ApplicationType.CLIENT),
        app("Web only", "https://10.0.0.8/"),
    ]
    assert hosts_of(answer, None, 10) == ["plc-b.invalid", "plc-c.example"]
    assert hosts_of(answer, None, 1) == ["plc-b.invalid"]  # maxServers: no more lookups
    listed, skipped = listed_by_find_servers(
        "opc.tcp://10.0.0.1:4840/",
        answer,
        None,
        {"plc-b.invalid": False, "plc-c.example": True},
    )
    assert [item.url for item in listed] == [
        "opc.tcp://10.0.0.2:4840/",
        "opc.tcp://10.0.0.1:48402/b",
        "opc.tcp://plc-c.example:4840/",
    ]
    assert listed[0].application is not None and listed[0].application.name == "Server A"
    assert skipped == ["'Web only' has no usable opc.tcp DiscoveryURL"]


def test_multicast_records_filtered_by_capabilities_without_case() -> None:
    records = [
        Record(1, "A", "opc.tcp://a:4840/", ("DA", "HD")),
        Record(2, "B", "opc.tcp://b:4840/", ("hd",)),
        Record(3, "C", "https://c/", ("DA",)),
        Record(4, "A twice", "opc.tcp://a:4840/", ("DA",)),
    ]
    listed, skipped = listed_by_find_servers_on_network(records, ["da"])
    assert [item.url for item in listed] == ["opc.tcp://a:4840/"]
    assert len(skipped) == 1
    everything, _ = listed_by_find_servers_on_network(records, [])
    assert [item.url for item in everything] == ["opc.tcp://a:4840/", "opc.tcp://b:4840/"]


def test_properties_are_env_safe_and_bounded() -> None:
    hostile = Application(
        uri="urn:\x00x\ny", product_uri="p" * 5000, name="Tab\tName\x7f", type=0,
        discovery_urls=("opc.tcp://a:1/",),
    )  # fmt: skip
    device = device_of(Listed("opc.tcp://a:1/"), hostile)
    assert device.id == "opc.tcp://a:1/"
    assert device.properties == {
        "OPCUA_DISCOVERY_URL": "opc.tcp://a:1/",
        "OPCUA_APPLICATION_URI": "urn: x y",
        "OPCUA_APPLICATION_NAME": "Tab Name ",
        "OPCUA_PRODUCT_URI": "p" * 1024,
    }
    assert env_value("é" * 2000) == "é" * 1024
    record = Record(1, "A", "opc.tcp://a:1/", ("DA", "HD"))
    assert (
        device_of(Listed("opc.tcp://a:1/", record=record), hostile).properties[
            "OPCUA_SERVER_CAPABILITIES"
        ]
        == "DA,HD"
    )


def test_instance_names_are_akris_for_a_discovery_url() -> None:
    """Akri hashes a shared device's id with blake2b (3 bytes): the DiscoveryURL, verbatim."""
    url = "opc.tcp://10.0.0.1:4840/"
    digest = hashlib.blake2b(url.encode(), digest_size=3).hexdigest()
    key = device_key(url, "node-a", shared=True)
    assert next(candidate_names("akri-opcua", key)) == (f"akri-opcua-{digest}", digest)


# -- the tracker ---------------------------------------------------------------------------------

DIRECT = "opc.tcp://10.0.0.2:4840/"
LDS = "opc.tcp://10.0.0.1:4840/"
B = "opc.tcp://10.0.0.3:4840/"


def details(*urls: str, **fields: Any) -> OpcuaDetails:
    base: dict[str, Any] = {
        "discovery_urls": urls, "recheck_interval": 10.0, "retry_interval": 1.0,
        "timeout": 3.0,
    }  # fmt: skip
    return OpcuaDetails(**{**base, **fields})


def answer_direct(tracker: Tracker, now: float) -> None:
    (target,) = [t for t in tracker.take_due(now) if t.url == DIRECT]
    server = app("Server A", DIRECT)
    tracker.answered(target, now, own=[server], listing=[Listed(DIRECT, application=server)])


def test_a_server_that_answers_is_offered_and_asked_again_a_period_later() -> None:
    tracker = Tracker(details(DIRECT), now=0.0)
    assert not tracker.settled() and tracker.next_due() == 0.0
    answer_direct(tracker, 0.0)
    assert tracker.settled()
    assert [d.id for d in tracker.devices()] == [DIRECT]
    assert tracker.next_due() == 10.0 and tracker.take_due(9.9) == []
    version = tracker.version
    answer_direct(tracker, 10.0)  # the same answer again: nothing to rebuild
    assert tracker.version == version
    (target,) = tracker.take_due(20.0)
    tracker.failed(target, 20.0, Failure.UNREACHABLE)  # still offered: nothing either
    assert tracker.version == version
    (target,) = tracker.take_due(21.0)
    tracker.failed(target, 21.0, Failure.UNREACHABLE)
    assert tracker.version > version and tracker.devices() == []


def test_a_server_that_stops_is_gone_after_two_failures_and_back_after_the_retry() -> None:
    tracker = Tracker(details(DIRECT), now=0.0)
    answer_direct(tracker, 0.0)
    (target,) = tracker.take_due(10.0)
    assert tracker.failed(target, 10.0, Failure.UNREACHABLE) is False  # one lost answer
    assert [d.id for d in tracker.devices()] == [DIRECT]
    assert tracker.next_due() == 11.0  # asked again after the retry interval, not a period
    (target,) = tracker.take_due(11.0)
    assert tracker.failed(target, 11.0, Failure.UNREACHABLE) is True
    assert tracker.devices() == []
    # while it cannot be reached: the retry interval, then twice as long each time
    for then in (12.0, 14.0, 18.0):
        assert tracker.next_due() == then
        (target,) = tracker.take_due(then)
        assert tracker.failed(target, then, Failure.UNREACHABLE) is False
    # it comes back: found at the next try (8 s after it failed last, not a fixed 10 s)
    assert tracker.next_due() == 26.0
    answer_direct(tracker, 26.0)
    assert [d.id for d in tracker.devices()] == [DIRECT]


def test_an_unreachable_server_backs_off_up_to_a_cap_not_every_retry_for_ever() -> None:
    """Issue 42.5: 250 dead servers asked every second cost ~6 % of a core for ever."""
    tracker = Tracker(details(DIRECT), now=0.0)
    now, waits = 0.0, []
    for _ in range(12):
        (target,) = tracker.take_due(now)
        tracker.failed(target, now, Failure.UNREACHABLE)
        waits.append(tracker.next_due() - now)
        now = tracker.next_due()
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60]
    assert max_backoff(details(DIRECT, recheck_interval=300.0)) == 300.0
    answer_direct(tracker, now)  # back: asked at the normal period again
    assert tracker.next_due() == now + 10.0


def test_a_broken_server_is_asked_again_after_a_period_not_the_retry() -> None:
    tracker = Tracker(details(DIRECT), now=0.0)
    (target,) = tracker.take_due(0.0)
    tracker.failed(target, 0.0, Failure.BROKEN)
    assert tracker.settled() and tracker.devices() == []
    assert tracker.next_due() == 10.0
    (target,) = tracker.take_due(10.0)
    tracker.failed(target, 10.0, Failure.UNREACHABLE)
    assert tracker.next_due() == 11.0


def test_servers_behind_a_discovery_server_are_asked_themselves() -> None:
    tracker = Tracker(details(LDS), now=0.0)
    (lds,) = tracker.take_due(0.0)
    server_b = app("Server B", B)
    tracker.answered(lds, 0.0, own=[server_b], listing=[Listed(B, application=server_b)])
    assert not tracker.settled() and tracker.devices() == []  # B not asked yet
    (b,) = tracker.take_due(0.0)
    assert b.url == B and b.call is Call.FIND_SERVERS and not b.configured
    tracker.answered(b, 0.1, own=[server_b])
    assert tracker.settled() and [d.id for d in tracker.devices()] == [B]
    # the discovery server stops answering: B stays while it answers itself
    (lds,) = tracker.take_due(10.0)
    tracker.failed(lds, 10.0, Failure.UNREACHABLE)
    assert [d.id for d in tracker.devices()] == [B]
    # it answers again without B (unregistered): B is dropped, even while being asked
    (lds, b) = sorted(tracker.take_due(11.0), key=lambda t: t.url)
    tracker.answered(lds, 11.0, own=[], listing=[])
    assert tracker.devices() == [] and not tracker.current(b)
    tracker.answered(b, 11.1, own=[server_b])
    assert tracker.devices() == [] and B not in tracker.targets


def test_at_most_max_servers_are_tracked() -> None:
    tracker = Tracker(details(LDS, max_servers=2), now=0.0)
    (lds,) = tracker.take_due(0.0)
    listing = [Listed(f"opc.tcp://10.0.1.{i}:4840/", application=app(str(i))) for i in range(5)]
    tracker.answered(lds, 0.0, own=[], listing=listing)
    assert [item.url for item in tracker.listed] == [listing[0].url, listing[1].url]
    assert tracker.over_cap == 3


def test_multicast_offers_what_the_server_says_of_itself_through_the_filters() -> None:
    tracker = Tracker(
        details(
            LDS, method="multicast",
            application_names=FilterList(Action.EXCLUDE, ("Server C",)),
        ),
        now=0.0,
    )  # fmt: skip
    (lds,) = tracker.take_due(0.0)
    assert lds.call is Call.FIND_SERVERS_ON_NETWORK
    c_url = "opc.tcp://10.0.0.4:4840/"
    records = [Record(1, "B", B, ("DA",)), Record(2, "C", c_url, ("DA",))]
    tracker.answered(lds, 0.0, listing=[Listed(r.discovery_url, record=r) for r in records])
    for target in tracker.take_due(0.0):
        name = "Server B" if target.url == B else "Server C"
        tracker.answered(target, 0.0, own=[app(name, target.url)])
    (device,) = tracker.devices()
    assert device.id == B and device.properties["OPCUA_SERVER_CAPABILITIES"] == "DA"
    lds = app("LDS", LDS, kind=ApplicationType.DISCOVERY_SERVER)
    assert own_application(B, [lds]) == lds and not wanted(lds, None)


def test_a_discovery_servers_own_record_is_not_taken_for_a_server_it_lists() -> None:
    """node-opcua's LDS-ME lists itself (``…:4840/DiscoveryServer``, capability LDS); its
    FindServers answer describes itself as ``…:4840`` and lists the servers registered with
    it: its record is the discovery server, not the first server of the answer."""
    lds_answer = [
        app("LDS", "opc.tcp://10.0.0.1:4840", kind=ApplicationType.DISCOVERY_SERVER),
        app("Server DA", "opc.tcp://10.0.0.1:48501"),
    ]
    own = own_application("opc.tcp://10.0.0.1:4840/DiscoveryServer", lds_answer)
    assert own is not None and own.name == "LDS" and not wanted(own, None)
    assert own_application("opc.tcp://10.0.0.2:4840/", lds_answer) is None  # cannot tell
    only = [app("Server E", "opc.tcp://plc-e:4840/")]  # answers under another name
    assert own_application("opc.tcp://10.0.0.5:4840/", only) == only[0]


# -- the connection, against servers that misbehave ------------------------------------------------


@contextlib.asynccontextmanager
async def serving(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """``handle`` serving connections on a loopback port; its ``opc.tcp`` URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"opc.tcp://127.0.0.1:{port}/"
    finally:
        server.close()


def hostile(kind: str) -> contextlib.AbstractAsyncContextManager[str]:
    from tests.doubles.opcua_servers import _hostile

    return serving(functools.partial(_hostile, kind))


async def _error_of(url: str, seconds: float = 2.0) -> Any:
    from discovery_handlers.opcua import transport

    with pytest.raises(transport.CallError) as raised:
        await transport.find_servers(url, seconds)
    return raised.value


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("garbage", "answered with bytes that are not OPC UA (b'HTTP/1.1'; waiting for its Ack"),
        ("silent", "no answer within 0.5 s (waiting for its Acknowledge)"),
        ("giant-chunk", "sent a 2147483648-byte chunk, more than the 65535 bytes"),
        ("huge", "sent a FindServers response of more than 1048576 bytes"),
    ],
)
async def test_a_server_that_misbehaves_gives_one_clear_error(kind: str, message: str) -> None:
    async with hostile(kind) as url:
        error = await _error_of(url, 0.5 if kind == "silent" else 5.0)
    assert message in str(error) and not error.unreachable


async def test_refused_and_unresolvable_are_unreachable() -> None:
    with socket_nobody_listens_on() as port:
        error = await _error_of(f"opc.tcp://127.0.0.1:{port}/")
    assert error.unreachable and "Connection refused (connecting)" in str(error)
    error = await _error_of("opc.tcp://akri-no-such-host.invalid:4840/")
    assert error.unreachable and "its host does not resolve" in str(error)


@contextlib.contextmanager
def socket_nobody_listens_on() -> Any:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield probe.getsockname()[1]


async def test_an_error_message_and_a_service_fault_are_reported_with_their_status() -> None:
    from asyncua import ua
    from asyncua.ua.ua_binary import struct_to_binary

    from tests.doubles.opcua_servers import _acknowledge, _chunk, _open_response, _read_message

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_message(reader)
        error = ua.ErrorMessage(ua.StatusCode(ua.StatusCodes.BadTcpEndpointUrlInvalid), "no")
        writer.write(_chunk(b"ERR", b"F", struct_to_binary(error)))
        await writer.drain()
        writer.close()

    async def fault(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_message(reader)
        writer.write(_acknowledge())
        await _read_message(reader)
        writer.write(_open_response(1))
        await _read_message(reader)
        response = ua.ServiceFault()
        response.ResponseHeader.ServiceResult = ua.StatusCode(ua.StatusCodes.BadTooManyOperations)
        body = struct.pack("<IIII", 7, 1, 2, 2) + struct_to_binary(response)
        writer.write(_chunk(b"MSG", b"F", body))
        await writer.drain()
        await reader.read()
        writer.close()

    for handle, message in (
        (refuse, "refused with BadTcpEndpointUrlInvalid: no (waiting for its Acknowledge)"),
        (fault, "answered FindServers with a fault: BadTooManyOperations"),
    ):
        async with serving(handle) as url:
            error = await _error_of(url)
        assert message in str(error) and not error.unreachable


def test_the_handler_validates_without_importing_asyncua() -> None:
    import subprocess
    import sys

    from tests.paths import REPO

    script = (
        "import sys\n"
        "from discovery_handlers.opcua import OpcuaHandler\n"
        "OpcuaHandler().validate('opcuaDiscoveryMethod: {standard: {}}')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('asyncua', 'cryptography')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert done.stdout.strip() == "[]"


# -- issue 42: a plant floor -----------------------------------------------------------------------

BAD_HOSTS = ("opc.tcp://plc..local:4840/", f"opc.tcp://{'a' * 64}.example:4840/")


def test_a_url_whose_host_is_not_a_host_name_costs_that_url_only() -> None:
    """Issue 42.1: ``getaddrinfo`` raises UnicodeError (a ValueError) for these."""
    for url in BAD_HOSTS:
        assert host_problem(url) is not None and "not a valid host name" in str(host_problem(url))
    assert host_problem("opc.tcp://plc.local:4840/") is None
    assert host_problem("opc.tcp://[fe80::1]:4840/") is None
    answer = [app("Bad 1", BAD_HOSTS[0]), app("Good", "opc.tcp://plc-g.example:4840/"),
              app("Bad 2", BAD_HOSTS[1])]  # fmt: skip
    assert hosts_of(answer, None, 10) == ["plc-g.example"]
    assert bad_hosts(answer, None) == list(BAD_HOSTS)
    listed, skipped = listed_by_find_servers(LDS, answer, None, {"plc-g.example": True})
    assert [item.url for item in listed] == ["opc.tcp://plc-g.example:4840/"]
    assert len(skipped) == 2 and all("not a valid host name" in line for line in skipped)
    # configured: a warning naming it, and the other URLs run
    text = f"opcuaDiscoveryMethod: {{standard: {{discoveryUrls: ['{BAD_HOSTS[0]}', '{DIRECT}']}}}}"
    (warning,) = warnings(text)
    assert "discoveryUrls[0] 'opc.tcp://plc..local:4840/' has a host that is not a" in warning
    tracker = Tracker(parse_details(text), now=0.0)
    assert [t.url for t in tracker.take_due(0.0)] == [DIRECT]
    records = [Record(1, "Bad", BAD_HOSTS[0], ()), Record(2, "Good", B, ())]
    listed, skipped = listed_by_find_servers_on_network(records, [])
    assert [item.url for item in listed] == [B] and len(skipped) == 1


async def test_one_bad_host_name_costs_one_entry_and_the_good_servers_are_offered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 42.1, end to end: a discovery server listing URLs whose hosts do not encode as
    IDNA, one of them also configured. Before: the discovery task died with UnicodeError in
    ``_resolves`` on every restart and no server was ever offered."""
    listing: list[dict[str, Any]] = []  # filled once the URLs are known
    async with answering([]) as good_url, answering(listing) as lds_url:
        listing += [
            {"name": "LDS", "url": lds_url, "type": 3},
            {"name": "Good", "url": good_url},
            {"name": "Bad 1", "url": BAD_HOSTS[0]},
            {"name": "Bad 2", "url": BAD_HOSTS[1]},
        ]
        text = yaml.safe_dump(
            {"opcuaDiscoveryMethod": {"standard": {"discoveryUrls": [BAD_HOSTS[0], lds_url]}}}
        )
        with caplog.at_level("INFO", logger="discovery_handlers.opcua"):
            devices = await first_list(text)
    assert [d.id for d in devices] == [good_url]
    logged = caplog.text
    assert f"discovery URL {BAD_HOSTS[0]}: has a host that is not a valid host name" in logged
    assert f"lists {BAD_HOSTS[1]}, which has a host that is not a valid host name" in logged


def test_urls_of_one_server_are_one_target_asked_once() -> None:
    """Issue 42.4: Akri's chart renders ``opc.tcp://host:4840/``; the server lists itself as
    ``opc.tcp://host:4840`` (or without the port, or in another case)."""
    assert url_key("opc.tcp://PLC.example:4840/") == url_key("opc.tcp://plc.example")
    assert url_key("OPC.TCP://plc.example:4840") == "opc.tcp://plc.example:4840"
    assert url_key("opc.tcp://plc:4840/a/") == "opc.tcp://plc:4840/a" != url_key("opc.tcp://plc/A")
    assert url_key("opc.tcp://[FE80::1]/") == "opc.tcp://[fe80::1]:4840"
    assert url_key("opc.tcp://plc:4841/") != url_key("opc.tcp://plc/")
    urls = "['opc.tcp://10.0.0.2:4840/', 'opc.tcp://10.0.0.2', 'opc.tcp://10.0.0.3/']"
    parsed = parse_details(f"opcuaDiscoveryMethod: {{standard: {{discoveryUrls: {urls}}}}}")
    assert parsed.discovery_urls == ("opc.tcp://10.0.0.2:4840/", "opc.tcp://10.0.0.3/")
    tracker = Tracker(details("opc.tcp://10.0.0.2:4840/"), now=0.0)
    (target,) = tracker.take_due(0.0)
    itself = app("Server A", "opc.tcp://10.0.0.2:4840")  # its own URL: no slash
    listing, _ = listed_by_find_servers(target.url, [itself], None, {})
    tracker.answered(target, 0.0, own=[itself], listing=listing)
    assert tracker.take_due(0.0) == [] and len(tracker.targets) == 1  # not a second target
    assert [d.id for d in tracker.devices()] == ["opc.tcp://10.0.0.2:4840"]
    # two discovery servers listing one server under two spellings: one target, one device
    tracker = Tracker(details(LDS, B), now=0.0)
    for lds in tracker.take_due(0.0):
        spelling = "opc.tcp://10.0.0.9:4840/" if lds.url == LDS else "opc.tcp://10.0.0.9"
        tracker.answered(lds, 0.0, listing=[Listed(spelling, application=app("S", spelling))])
    assert [t.url for t in tracker.take_due(0.0)] == ["opc.tcp://10.0.0.9:4840/"]


def test_a_dead_discovery_servers_list_is_trusted_for_a_while_then_dropped() -> None:
    """Issue 42.5: the last list of a discovery server that died was kept for good."""
    tracker = Tracker(details(LDS), now=0.0)
    (lds,) = tracker.take_due(0.0)
    server_b = app("Server B", B)
    tracker.answered(lds, 0.0, listing=[Listed(B, application=server_b)])
    now = 0.0
    while now < LIST_TRUST + 60:
        for target in tracker.take_due(now):
            if target.url == B:
                tracker.answered(target, now, own=[server_b])
            else:
                tracker.failed(target, now, Failure.UNREACHABLE)
        if now < LIST_TRUST:
            assert [d.id for d in tracker.devices()] == [B], now  # B answers itself: kept
        now = min(tracker.next_due(), now + 5.0)
        tracker.expire(now)
    assert tracker.devices() == [] and B not in [t.url for t in tracker.targets.values()]
    # the discovery server answers again: its list counts again
    (lds,) = [t for t in tracker.take_due(now + 60.0) if t.configured]
    tracker.answered(lds, now + 60.0, listing=[Listed(B, application=server_b)])
    assert B in [t.url for t in tracker.targets.values()]


def test_what_is_kept_of_a_server_is_bounded_whatever_it_sends() -> None:
    """Issue 42.3: each tracked server's whole FindServers answer was kept (up to ~7.6 MB
    decoded): 20 servers pointing at one hostile server took RSS 56 → 208 MB."""
    flood = [
        Application(uri="u" * 100_000, product_uri="p" * 100_000, name=f"N{i}" * 10_000, type=0,
                    discovery_urls=tuple(f"opc.tcp://10.0.{i}.{j}:4840/" for j in range(100)))
        for i in range(50)
    ]  # fmt: skip
    tracker = Tracker(details(LDS), now=0.0)
    (lds,) = tracker.take_due(0.0)
    tracker.answered(lds, 0.0, listing=[Listed(B, application=flood[0])])
    (b,) = tracker.take_due(0.0)
    tracker.answered(b, 0.0, own=flood)  # a server answering with thousands of descriptions
    kept = [b.itself, *(item.application for item in tracker.listed)]
    for application in kept:
        assert application is not None
        texts = (application.uri, application.product_uri, application.name)
        assert all(len(text) <= 1024 for text in texts)
        assert len(application.discovery_urls) <= 1
    assert trimmed(flood[0]).discovery_urls == ("opc.tcp://10.0.0.0:4840/",)
    assert len(offered(flood, None, 10)) == 11  # maxServers + 1: "there were more"


def answering(applications: list[dict[str, Any]]) -> contextlib.AbstractAsyncContextManager[str]:
    """A light OPC UA server on loopback answering FindServers with ``applications`` (read
    at each call: the caller may fill it once it knows the URLs)."""
    from tests.doubles.opcua_servers import answer_find_servers

    return serving(functools.partial(answer_find_servers, applications))


async def first_list(text: str, deadline: float = 60.0) -> list[Any]:
    """The handler's first device list for ``text`` (bounded by a generous deadline)."""
    stream = OpcuaHandler().discover(text, {})
    try:
        async with asyncio.timeout(deadline):
            return await anext(stream)
    finally:
        await stream.aclose()


async def test_a_listed_servers_answer_is_checked_not_decoded() -> None:
    """Issue 42.3: a listed server of ``standard`` is asked whether it answers; what it lists
    is not decoded (a hostile server's ~0.9 MB answer decodes to ~8 MB, once per server that
    points at it)."""
    import json
    import sys
    import tracemalloc

    from discovery_handlers.opcua import transport
    from tests.doubles.opcua_servers import free_ports
    from tests.paths import REPO

    (port,) = free_ports(1)
    url = f"opc.tcp://127.0.0.1:{port}/"
    spec = [{"kind": "answering", "name": "Flood", "endpoint": url,
             "applications": [{"flood": 9000}]}]  # fmt: skip
    server = await asyncio.create_subprocess_exec(  # its encoding is not traced here
        sys.executable, "-m", "tests.doubles.opcua_servers", json.dumps(spec),
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        async with asyncio.timeout(120):
            assert (await server.stdout.readline()).startswith(b"ready ")
        tracemalloc.start()
        try:
            assert await transport.find_servers(url, 60.0, describe=False) == []
            _, checked = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            assert len(await transport.find_servers(url, 60.0)) == 9000
            _, decoded = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        server.kill()
        await server.wait()
    assert checked < 4 * 1024 * 1024 < decoded, (checked, decoded)
