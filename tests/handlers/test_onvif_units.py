"""The onvif handler's pure parts: discoveryDetails, Akri's filter semantics, WS-Discovery and
SOAP parsing (hostile XML included), credentials, device ids and properties."""

from __future__ import annotations

import base64
import datetime
import json
import logging
from typing import Any

import pytest

from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.onvif import soap
from discovery_handlers.onvif.credentials import Credential, CredentialStore
from discovery_handlers.onvif.details import parse_details, warnings
from discovery_handlers.onvif.device_query import QueryResult
from discovery_handlers.onvif.devices import build_device, device_id
from discovery_handlers.onvif.filters import (
    Action,
    FilterList,
    equal,
    equal_ignoring_case,
    mac_matches,
    passes,
)
from discovery_handlers.onvif.handler import OnvifHandler, offered_device
from discovery_handlers.onvif.multicast import Link
from discovery_handlers.onvif.wsdiscovery import (
    MAX_MESSAGE_BYTES,
    Kind,
    build_probe,
    device_uuid,
    parse_message,
)
from tests.doubles.fake_onvif import FakeCamera

# -- discoveryDetails -----------------------------------------------------------------------


def test_details_defaults_match_akri() -> None:
    details = parse_details("")
    assert details.discovery_timeout == 1.0
    assert details.probe_interval == 10.0
    assert details.ip_addresses is None and details.scopes is None and details.uuids is None
    assert details.interfaces == ()
    assert parse_details("{}") == details


def test_details_akri_example() -> None:
    details = parse_details(
        """
ipAddresses: {action: Exclude, items: [10.0.0.1]}
macAddresses: {action: Exclude, items: []}
scopes: {items: ["onvif://www.onvif.org/name/GreatCam"]}
uuids: {action: Include, items: ["3FA1FE68-b915-4053-a3e1-ac15a21f5f91"]}
discoveryTimeoutSeconds: 2
probeIntervalSeconds: 30
interfaces: [eth0, 192.0.2.2]
"""
    )
    assert details.ip_addresses == FilterList(Action.EXCLUDE, ("10.0.0.1",))
    assert details.mac_addresses == FilterList(Action.EXCLUDE, ())
    assert details.scopes == FilterList(Action.INCLUDE, ("onvif://www.onvif.org/name/GreatCam",))
    assert details.uuids is not None and details.uuids.action is Action.INCLUDE
    assert details.discovery_timeout == 2 and details.probe_interval == 30
    assert details.interfaces == ("eth0", "192.0.2.2")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ipAddresses: [a]", "discoveryDetails.ipAddresses must be a mapping"),
        ("scopes: {action: Maybe, items: []}", "scopes.action must be Include or Exclude"),
        ("scopes: {action: Include}", "scopes.items is required"),
        ("uuids: {items: abc}", "uuids.items must be a list"),
        ("uuids: {items: [1]}", "uuids.items[0] must be a string"),
        ("macAddresses: {items: [], acton: Include}", "unknown field(s) acton"),
        ("discoveryTimeoutSeconds: soon", "discoveryTimeoutSeconds must be a number"),
        ("discoveryTimeoutSeconds: -1", "discoveryTimeoutSeconds must be between"),
        ("discoveryTimeoutSeconds: .nan", "discoveryTimeoutSeconds must be a number"),
        ("probeIntervalSeconds: 0", "probeIntervalSeconds must be between"),
        ("probeIntervalSeconds: true", "probeIntervalSeconds must be a number"),
        ("interfaces: eth0", "interfaces must be a list"),
        ("interfaces: ['']", "interfaces[0] must be"),
        ("interfaces: ['../x']", "interfaces[0] is neither"),
        ("- a list", "must be a YAML mapping"),
        ("a: [", "not valid YAML"),
    ],
)
def test_details_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(InvalidDiscoveryDetailsError) as caught:
        parse_details(text)
    assert message in str(caught.value)
    assert str(caught.value).startswith("onvif: ")


def test_unknown_fields_are_warnings_not_errors() -> None:
    handler = OnvifHandler()
    assert handler.validate("discoveryTimeoutSeconds: 1") == []
    (warning,) = handler.validate("colour: red\ndiscoveryTimeoutSeconds: 1")
    assert "colour" in warning
    assert warnings("") == []


# -- filters (Akri's execute_filter) ------------------------------------------------------

INCLUDE_A = FilterList(Action.INCLUDE, ("a",))
EXCLUDE_A = FilterList(Action.EXCLUDE, ("a",))
EXCLUDE_NONE = FilterList(Action.EXCLUDE, ())
INCLUDE_NONE = FilterList(Action.INCLUDE, ())


@pytest.mark.parametrize(
    ("filter_list", "values", "kept"),
    [
        (None, ["a"], True),
        (None, None, True),  # no filter: kept even when the lookup failed (Akri PR #640)
        (EXCLUDE_NONE, None, True),  # empty Exclude: kept even when unknown
        (EXCLUDE_NONE, ["a"], True),
        (INCLUDE_A, None, False),  # unknown value + Include: out
        (EXCLUDE_A, None, False),  # unknown value + non-empty Exclude: out
        (INCLUDE_A, ["a"], True),
        (INCLUDE_A, ["b"], False),
        (INCLUDE_A, ["b", "a"], True),
        (INCLUDE_NONE, ["a"], False),  # Include [] keeps nothing
        (EXCLUDE_A, ["a"], False),
        (EXCLUDE_A, ["b"], True),
        (INCLUDE_A, [], False),
        (EXCLUDE_A, [], True),
    ],
)
def test_filter_semantics(
    filter_list: FilterList | None, values: list[str] | None, kept: bool
) -> None:
    assert passes(filter_list, values) is kept


def test_filter_comparisons() -> None:
    mac = FilterList(Action.INCLUDE, ("AA:BB:CC:DD:EE:FF",))
    assert passes(mac, ["aa:bb:cc:dd:ee:ff"], mac_matches)
    assert passes(mac, ["aa-bb-cc-dd-ee-ff"], mac_matches)
    assert not passes(mac, ["aa:bb:cc:dd:ee:00"], mac_matches)
    uuids = FilterList(Action.EXCLUDE, ("3FA1FE68-B915-4053-A3E1-AC15A21F5F91",))
    assert not passes(uuids, ["3fa1fe68-b915-4053-a3e1-ac15a21f5f91"], equal_ignoring_case)
    scopes = FilterList(Action.INCLUDE, ("onvif://www.onvif.org/name/Lobby",))
    assert passes(scopes, ["onvif://x", "onvif://www.onvif.org/name/Lobby"], equal)
    assert not passes(scopes, ["onvif://www.onvif.org/name/lobby"], equal)  # exact, as Akri


def test_ip_and_mac_filters_on_query_results() -> None:
    details = parse_details(
        "ipAddresses: {action: Exclude, items: [10.0.0.1]}\n"
        "macAddresses: {action: Include, items: ['02:00:00:00:00:01']}"
    )
    url, uuid = "http://10.0.0.2/onvif/device_service", "u-1"
    good = QueryResult(offered=True, ip="10.0.0.2", mac="02:00:00:00:00:01")
    assert offered_device(details, url, uuid, good) == build_device(url, uuid, "10.0.0.2", good.mac)
    assert (
        offered_device(details, url, uuid, QueryResult(True, ip="10.0.0.1", mac=good.mac)) is None
    )
    assert offered_device(details, url, uuid, QueryResult(True, ip="10.0.0.2", mac="x")) is None
    # MAC unknown and an Include filter on it: out (Akri); without filters: offered, no IP/MAC
    assert offered_device(details, url, uuid, QueryResult(True, ip="10.0.0.2")) is None
    bare = offered_device(parse_details(""), url, uuid, QueryResult(True))
    assert bare is not None and "ONVIF_DEVICE_IP_ADDRESS" not in bare.properties
    # never offered: no answer / credentials rejected
    assert offered_device(parse_details(""), url, uuid, QueryResult(False, "no answer")) is None


# -- ids and properties ------------------------------------------------------------------


def test_device_id_and_properties_as_akri() -> None:
    url = "http://10.0.0.5:80/onvif/device_service"
    uuid = "3fa1fe68-b915-4053-a3e1-ac15a21f5f91"
    assert device_id(url, uuid) == f"{url}-{uuid}"
    device = build_device(url, uuid, "10.0.0.5", "02:00:00:00:00:01")
    assert (
        device.id == "http://10.0.0.5:80/onvif/device_service-3fa1fe68-b915-4053-a3e1-ac15a21f5f91"
    )
    assert dict(device.properties) == {
        "ONVIF_DEVICE_SERVICE_URL": url,
        "ONVIF_DEVICE_UUID": uuid,
        "ONVIF_DEVICE_IP_ADDRESS": "10.0.0.5",
        "ONVIF_DEVICE_MAC_ADDRESS": "02:00:00:00:00:01",
    }
    assert device.mounts == () and device.device_specs == ()
    assert OnvifHandler().shared is True


def test_instance_name_is_akris_for_the_same_camera() -> None:
    """Shared device: the Instance name is ``<config>-<blake2b-3 of the id>`` on every node."""
    import hashlib

    from agent.core.model.naming import akri_digest, device_key, instance_name

    device = build_device("http://10.0.0.5:80/onvif/device_service", "abc", None, None)
    expected = hashlib.blake2b(device.id.encode(), digest_size=3).hexdigest()
    for node in ("node-a", "node-b"):
        key = device_key(device.id, node, True)
        assert instance_name("cams", akri_digest(key)) == f"cams-{expected}"


@pytest.mark.parametrize(
    ("address", "uuid"),
    [
        ("urn:uuid:3FA1FE68-B915-4053-A3E1-AC15A21F5F91", "3fa1fe68-b915-4053-a3e1-ac15a21f5f91"),
        ("uuid:abc", "abc"),
        ("urn:abc", "abc"),
        ("Device-1", "device-1"),
    ],
)
def test_device_uuid(address: str, uuid: str) -> None:
    assert device_uuid(address) == uuid


# -- WS-Discovery parsing --------------------------------------------------------------------


def test_probe_round_trips() -> None:
    probe = build_probe("uuid:1234")
    message = parse_message(probe)
    assert message is not None and message.kind is Kind.PROBE
    assert message.message_id == "uuid:1234"
    assert message.types == ("tdn:NetworkVideoTransmitter",)
    assert b'xmlns:tdn="http://www.onvif.org/ver10/network/wsdl"' in probe


def test_probe_matches_hello_bye_from_the_fake_camera() -> None:
    camera = FakeCamera(uuid="AbC-1", http_port=8080, scopes=("onvif://a", "onvif://b"))
    matches = parse_message(camera.probe_matches("uuid:probe-1"))
    assert matches is not None and matches.kind is Kind.PROBE_MATCHES
    assert matches.relates_to == "uuid:probe-1"
    (endpoint,) = matches.endpoints
    assert endpoint.uuid == "abc-1" and endpoint.address == "urn:uuid:AbC-1"
    assert endpoint.xaddrs == ("http://127.0.0.1:8080/onvif/device_service",)
    assert endpoint.scopes == ("onvif://a", "onvif://b")
    assert endpoint.is_video_transmitter and endpoint.metadata_version == "1"
    hello = parse_message(camera._hello_or_bye(Kind.HELLO))
    assert hello is not None and hello.kind is Kind.HELLO and hello.endpoints == (endpoint,)
    bye = parse_message(camera._hello_or_bye(Kind.BYE))
    assert bye is not None and bye.kind is Kind.BYE
    assert bye.endpoints[0].uuid == "abc-1" and bye.endpoints[0].xaddrs == ()


def test_akri_probe_match_fixture() -> None:
    """The ProbeMatch shape of Akri's own parser test (prefixes SOAP-ENV/wsa/d, several
    XAddrs, trailing space in Scopes)."""
    data = b"""<?xml version="1.0" encoding="UTF-8"?>
<SOAP-ENV:Envelope xmlns:SOAP-ENV="http://www.w3.org/2003/05/soap-envelope"
  xmlns:wsa="http://schemas.xmlsoap.org/ws/2004/08/addressing"
  xmlns:d="http://schemas.xmlsoap.org/ws/2005/04/discovery" xmlns:dn="http://www.onvif.org/ver10/network/wsdl">
 <SOAP-ENV:Header><wsa:MessageID>urn:uuid:2bc6f06c</wsa:MessageID>
  <wsa:RelatesTo>uuid:7b1d26aa</wsa:RelatesTo></SOAP-ENV:Header>
 <SOAP-ENV:Body><d:ProbeMatches><d:ProbeMatch>
  <wsa:EndpointReference><wsa:Address>urn:uuid:device_uuid</wsa:Address></wsa:EndpointReference>
  <d:Types>dn:NetworkVideoTransmitter</d:Types>
  <d:Scopes>onvif://www.onvif.org/type/video_encoder onvif://www.onvif.org/name/NVT </d:Scopes>
  <d:XAddrs>uri_one uri_two</d:XAddrs><d:MetadataVersion>10</d:MetadataVersion>
 </d:ProbeMatch></d:ProbeMatches></SOAP-ENV:Body></SOAP-ENV:Envelope>"""
    message = parse_message(data)
    assert message is not None
    (endpoint,) = message.endpoints
    assert endpoint.uuid == "device_uuid"
    assert endpoint.xaddrs == ("uri_one", "uri_two")
    assert endpoint.scopes == (
        "onvif://www.onvif.org/type/video_encoder",
        "onvif://www.onvif.org/name/NVT",
    )


BILLION_LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>
<s:Envelope xmlns:s="http://www.w3.org/2003/05/soap-envelope"><s:Body>&lol3;</s:Body></s:Envelope>"""
EXTERNAL_ENTITY = b"""<?xml version="1.0"?>
<!DOCTYPE x [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>
<s:Envelope xmlns:s="http://www.w3.org/2003/05/soap-envelope"><s:Body>&xxe;</s:Body></s:Envelope>"""


@pytest.mark.parametrize(
    "data",
    [
        BILLION_LAUGHS,
        EXTERNAL_ENTITY,
        b"",
        b"not xml",
        b"<a>",
        b"<x/>",  # not an envelope
        b'<s:Envelope xmlns:s="http://www.w3.org/2003/05/soap-envelope"/>',  # no body
        b'<s:Envelope xmlns:s="urn:other"><s:Body/></s:Envelope>',
        b"\xff\xfe\x00garbage",
        b'<s:Envelope xmlns:s="http://www.w3.org/2003/05/soap-envelope"><s:Body>'
        + b"<x>" * 100
        + b" " * MAX_MESSAGE_BYTES,  # over the size cap
    ],
)
def test_hostile_or_malformed_datagrams_are_ignored(data: bytes) -> None:
    assert parse_message(data) is None


def test_limits_on_matches_and_endpoints_without_address() -> None:
    camera = FakeCamera(uuid="x")
    one = camera.probe_matches("r").decode()
    start = one.index("<d:ProbeMatch>")
    end = one.index("</d:ProbeMatches>")
    many = one[:start] + one[start:end] * 100 + one[end:]
    message = parse_message(many.encode())
    assert message is not None and len(message.endpoints) == 64
    no_address = one.replace("urn:uuid:x", "")
    message = parse_message(no_address.encode())
    assert message is not None and message.endpoints == ()


# -- SOAP ---------------------------------------------------------------------------------


def test_password_digest_matches_akri_vector() -> None:
    # Akri username_token.rs: nonce "nonce", created "2000-01-01T12:34:56:789Z", password "1234567"
    assert soap.password_digest(b"nonce", "2000-01-01T12:34:56:789Z", "1234567") == (
        "AGsoQQ+qNJu6Ha7h/QAPoQvYcV0="
    )
    token = soap.make_token(
        "user",
        "1234567",
        nonce=b"nonce",
        now=datetime.datetime(2000, 1, 1, 12, 34, 56, 789000, tzinfo=datetime.UTC),
    )
    assert token.nonce == base64.b64encode(b"nonce").decode()
    assert token.created == "2000-01-01T12:34:56.789Z"
    assert "1234567" not in repr(token) and "user" not in repr(token)


def test_request_with_token_is_checked_by_the_fake_camera() -> None:
    from defusedxml import ElementTree

    camera = FakeCamera(username="admin", password="pa<ss")
    good = soap.request("GetScopes", soap.make_token("admin", "pa<ss"))
    bad = soap.request("GetScopes", soap.make_token("admin", "wrong"))
    assert camera._authorized(ElementTree.fromstring(good))
    assert not camera._authorized(ElementTree.fromstring(bad))
    assert not camera._authorized(ElementTree.fromstring(soap.request("GetScopes")))


def test_parse_answers() -> None:
    from tests.doubles.fake_onvif import _envelope, _fault

    body = soap.parse_envelope(
        _envelope(
            "<tds:GetNetworkInterfacesResponse><tds:NetworkInterfaces><tt:Info>"
            "<tt:HwAddress>02:AB:00:00:00:01</tt:HwAddress></tt:Info><tt:IPv4><tt:Config>"
            "<tt:FromDHCP><tt:Address>10.1.2.3</tt:Address></tt:FromDHCP>"
            "</tt:Config></tt:IPv4></tds:NetworkInterfaces></tds:GetNetworkInterfacesResponse>"
        )
    )
    assert soap.parse_network_interfaces(body) == ("10.1.2.3", "02:AB:00:00:00:01")
    empty = soap.parse_envelope(_envelope("<tds:GetNetworkInterfacesResponse/>"))
    assert soap.parse_network_interfaces(empty) == (None, None)
    with pytest.raises(soap.SoapError):
        soap.parse_scopes(empty)
    fault = soap.find_fault(soap.parse_envelope(_fault("NotAuthorized", "Sender not Authorized")))
    assert fault is not None and fault.not_authorized
    assert fault.code == "Sender" and fault.reason == "Sender not Authorized"
    other = soap.find_fault(soap.parse_envelope(_fault("ActionNotSupported", "no")))
    assert other is not None and not other.not_authorized
    for hostile in (BILLION_LAUGHS, EXTERNAL_ENTITY, b"<x/>", b"x" * (soap.MAX_RESPONSE_BYTES + 1)):
        with pytest.raises(soap.SoapError):
            soap.parse_envelope(hostile)


# -- credentials -------------------------------------------------------------------------

UUID = "3fa1fe68-b915-4053-a3e1-ac15a21f5f91"
OTHER = "5f5a69c2-e0ae-504f-829b-00fcdab169cc"


def test_credentials_direct_and_default() -> None:
    store = CredentialStore.from_properties(
        {
            f"username_{UUID.replace('-', '_')}": b"cam-user",
            f"password_{UUID.replace('-', '_')}": b"cam-pass",
            "username_default": b"admin",
            "password_default": b"secret",
        }
    )
    assert store.get(UUID) == Credential("cam-user", "cam-pass")
    assert store.get(UUID.upper()) == Credential("cam-user", "cam-pass")
    assert store.get(OTHER) == Credential("admin", "secret")
    assert "secret" not in repr(store) and "secret" not in repr(store.get(OTHER))
    assert CredentialStore.from_properties({}).get(UUID) is None
    only_user = CredentialStore.from_properties({"username_default": b"admin"})
    assert only_user.get(UUID) == Credential("admin", None)
    assert CredentialStore.from_properties({"password_default": b"x"}).get(UUID) is None


def test_credentials_json_list_forms_and_order() -> None:
    secret_list = json.dumps(
        {
            UUID: {
                "username": "list-user",
                "password": base64.b64encode(b"pw").decode(),
                "base64encoded": True,
            },
            OTHER: {"username": "other", "password": "plain"},
            "bad": {"password": "no username"},
        }
    ).encode()
    ref_list = json.dumps({OTHER: {"username_ref": "u_ref", "password_ref": "p_ref"}}).encode()
    store = CredentialStore.from_properties(
        {
            "device_credential_list": b'["camera_secrets", "missing", 3]',
            "camera_secrets": secret_list,
            "device_credential_ref_list": b'["refs"]',
            "refs": ref_list,
            "u_ref": b"ref-user",
            "p_ref": b"ref-pass",
        }
    )
    assert store.get(UUID) == Credential("list-user", "pw")
    assert store.get(OTHER) == Credential("ref-user", "ref-pass")  # ref list overrides the list
    assert store.get("bad") is None
    # direct username_<uuid> overrides both lists
    direct = CredentialStore.from_properties(
        {
            "device_credential_list": b'["camera_secrets"]',
            "camera_secrets": secret_list,
            f"username_{UUID.replace('-', '_')}": b"direct",
        }
    )
    assert direct.get(UUID) == Credential("direct", None)


@pytest.mark.parametrize(
    "properties",
    [
        {"device_credential_list": b"not json"},
        {"device_credential_list": b'{"a": 1}'},
        {"device_credential_list": b'["x"]', "x": b"[1, 2]"},
        {"device_credential_list": b'["x"]', "x": b'{"u": "not a map"}'},
        {"device_credential_list": None},
        {"device_credential_ref_list": b'["r"]', "r": b'{"u": {"username_ref": "nope"}}'},
        {"username_": b"x"},
        {"username_x": b"\xff\xfe"},
    ],
)
def test_malformed_credentials_are_skipped(properties: dict[str, bytes | None]) -> None:
    assert len(CredentialStore.from_properties(properties)) == 0


def test_default_interfaces_are_the_multicast_capable_ones() -> None:
    from discovery_handlers.onvif.multicast import Link, default_links, resolve_interfaces

    lo = Link("lo", 1, up=True, multicast=False, loopback=True, has_ipv4=True)
    eth0 = Link("eth0", 2, up=True, multicast=True, loopback=False, has_ipv4=True)
    eth1 = Link("eth1", 3, up=True, multicast=True, loopback=False, has_ipv4=True)
    down = Link("eth2", 4, up=False, multicast=True, loopback=False, has_ipv4=True)
    nomc = Link("tun0", 5, up=True, multicast=False, loopback=False, has_ipv4=True)
    veth = Link("veth1", 6, up=True, multicast=True, loopback=False, has_ipv4=False)
    mclo = Link("lo", 1, up=True, multicast=True, loopback=True, has_ipv4=True)
    assert default_links([lo, eth0, eth1, down, nomc, veth]) == [eth0, eth1]
    bare = Link("ens4", 7, up=True, multicast=True, loopback=False, has_ipv4=False)
    assert default_links([lo, bare, veth, down]) == [bare]  # address-less, if nothing better
    assert default_links([lo, veth, down]) == []  # never a pod's veth
    assert default_links([mclo, down]) == [mclo]  # a loopback only when nothing else
    assert default_links([lo, down, nomc]) == []
    labels = [i.label for i in resolve_interfaces([], lambda: [lo, eth0, eth1, veth])]
    assert labels == ["eth0", "eth1"]
    assert [(i.label, i.index) for i in resolve_interfaces([], lambda: [lo])] == [("default", 0)]


async def test_problem_reporter_budget_and_summary() -> None:
    """Many distinct devices: BUDGET reports (log at warning + Event) a window, the rest
    at debug only; when the window ends, one summary Event with how many were held back;
    the per-device limit still holds; after close() no more Events."""
    import asyncio
    import logging

    from discovery_handlers.base import ProblemReporter, report_problems_to

    events: list[tuple[str, str]] = []
    summary = asyncio.Event()

    async def record(reason: str, message: str) -> None:
        events.append((reason, message))
        if reason == "DeviceProblemsSuppressed":
            summary.set()

    report_problems_to(record)
    now = [1000.0]
    logger = logging.getLogger("discovery_handlers.onvif")
    reporter = ProblemReporter(logger, budget=3, window=0.2, every=300, clock=lambda: now[0])
    reported = [reporter.report(f"cam-{i}", "R", f"cam-{i} fails") for i in range(25)]
    assert reported == [True] * 3 + [False] * 22
    reporter.report("cam-9", "R", "cam-9 fails")  # held back twice: counted once
    await asyncio.wait_for(summary.wait(), 10)  # the window's timer (real time)
    assert [reason for reason, _ in events] == ["R"] * 3 + ["DeviceProblemsSuppressed"]
    assert "22 more device(s) not offered" in events[-1][1]
    assert events[-1][1].startswith("onvif: ")
    # a new window: held-back devices get their own report; reported ones stay quiet
    now[0] += 1
    assert reporter.report("cam-10", "R", "cam-10 fails")
    assert not reporter.report("cam-0", "R", "cam-0 fails")  # per device: every 300 s
    await asyncio.sleep(0)  # its Event is sent
    reporter.close()
    assert not reporter.report("cam-11", "R", "cam-11 fails")
    for _ in range(3):
        await asyncio.sleep(0)
    assert [reason for reason, _ in events] == ["R"] * 3 + ["DeviceProblemsSuppressed", "R"]


def _link(name: str, index: int, *, v4: bool = False, v6: bool = False, **flags: bool) -> Link:
    return Link(
        name,
        index,
        up=flags.get("up", True),
        multicast=flags.get("multicast", True),
        loopback=name == "lo",
        has_ipv4=v4,
        has_routable_ipv6=v6,
    )


def test_default_interfaces_on_a_typical_node_leave_out_container_interfaces() -> None:
    """A Kubernetes node: the uplink, a camera VLAN, a bond, and the interfaces docker and
    the CNI plugins made (bridges with IPv4 addresses among them): only the node's own
    interfaces are chosen, so no pod can answer a Probe and get the credentials' digest."""
    from discovery_handlers.onvif.multicast import container_interface, default_links

    node = [
        _link("lo", 1, v4=True, multicast=False),
        _link("eth0", 2, v4=True),
        _link("eth0.20", 3, v4=True),  # the camera VLAN
        _link("bond0", 4, v4=True),
        _link("docker0", 5, v4=True),
        _link("br-5f2c1a9e0b3d", 6, v4=True),
        _link("cni0", 7, v4=True),
        _link("cbr0", 8, v4=True),
        _link("flannel.1", 9, v4=True),
        _link("cali3f1a2b4c5d6", 10),
        _link("vxlan.calico", 11, v4=True),
        _link("cilium_host", 12, v4=True),
        _link("lxc1234abcd", 13),
        _link("veth9a8b7c6", 14),
        _link("tunl0", 15, v4=True),
        _link("weave", 16, v4=True),
        _link("kube-ipvs0", 17, v4=True),
        _link("kube-bridge", 18, v4=True),
        _link("virbr0", 19, v4=True),
        _link("podman0", 20, v4=True),
        _link("genev_sys_6081", 21),
        _link("nodelocaldns", 22, v4=True),
    ]
    chosen = [link.name for link in default_links(node)]
    assert chosen == ["eth0", "eth0.20", "bond0"]
    for link in node[4:]:
        assert container_interface(link.name), link.name
    for name in ("eth0", "ens192", "enp3s0", "eno1", "wlan0", "bond0", "br0", "eth0.20"):
        assert not container_interface(name), name


def test_default_interfaces_on_an_ipv6_only_node(caplog: pytest.LogCaptureFixture) -> None:
    """IPv6 only: interfaces with a routable IPv6 address come before (and instead of)
    address-less ones; IPv4 ones first when both exist; container interfaces never; and
    no more than MAX_DEFAULT_INTERFACES are used, with a warning naming the cap."""
    from discovery_handlers.onvif.multicast import (
        MAX_DEFAULT_INTERFACES,
        default_links,
        resolve_interfaces,
        routable_ipv6_interfaces,
    )

    proc = (
        "00000000000000000000000000000001 01 80 10 80       lo\n"
        "20010db8000000000000000000000002 02 40 00 80     eth0\n"
        "fe800000000000000000000000000002 02 40 20 80     eth0\n"
        "fe800000000000000000000000000003 03 40 20 80     ens5\n"
        "fd000000000000000000000000000004 04 40 00 80  cni0\n"
        "garbage\n"
    )
    assert routable_ipv6_interfaces(proc) == {"eth0", "cni0"}
    pods = [_link(f"veth{i:04x}", 100 + i) for i in range(200)]
    node = [_link("lo", 1), _link("eth0", 2, v6=True), _link("ens5", 3), *pods]
    assert [link.name for link in default_links(node)] == ["eth0"]
    both = [_link("eth1", 5, v6=True), _link("eth2", 6, v4=True), _link("ens5", 3)]
    assert [link.name for link in default_links(both)] == ["eth2", "eth1"]
    # many address-less, non-container interfaces (no better choice): capped
    many = [_link(f"ens{i}", 10 + i) for i in range(40)]
    caplog.set_level("WARNING", logger="discovery_handlers.onvif")
    chosen = resolve_interfaces([], lambda: many)
    assert [i.label for i in chosen] == [f"ens{i}" for i in range(MAX_DEFAULT_INTERFACES)]
    assert any(
        "MAX_DEFAULT_INTERFACES" in r.getMessage() and "40 interfaces" in r.getMessage()
        for r in caplog.records
    )


def test_probe_matches_count_only_when_they_answer_our_probes() -> None:
    """A ProbeMatches whose RelatesTo is not one of our recent Probes' MessageIDs (sent by
    someone who never saw a Probe, e.g. a pod guessing the probe socket's port) is
    dropped; one answering a recent Probe is taken, in any urn:/uuid: spelling."""
    from discovery_handlers.base import ProblemReporter
    from discovery_handlers.onvif.handler import RECENT_PROBES, _Session

    session = _Session(parse_details(""), ProblemReporter(logging.getLogger("t")))
    camera = FakeCamera(uuid="00000000-0000-4000-8000-000000000001")
    ours = "uuid:6d7a0f3e-2c55-4b7e-9a0e-1f2d3c4b5a69"

    def matches(relates_to: str) -> Any:
        message = parse_message(camera.probe_matches(relates_to))
        assert message is not None
        return message

    session.receive(matches(ours), None)  # before our Probe: not ours yet
    assert not session.pending
    session.probed(ours)
    session.receive(matches("uuid:" + "1" * 32), None)
    session.receive(matches(""), None)
    assert not session.pending
    session.receive(matches("urn:" + ours.upper()), None)
    assert len(session.pending) == 1
    for index in range(RECENT_PROBES):  # later Probes push ours out
        session.probed(f"uuid:00000000-0000-4000-8000-{index:012d}")
    session.receive(matches(ours), None)
    assert len(session.pending) == 1
    hello = parse_message(camera.hello())  # Hello/Bye relate to no Probe
    assert hello is not None
    session.receive(hello, None)
    assert len(session.pending) == 2


# -- stopping ---------------------------------------------------------------------------------


class _NoSockets:
    def probe(self, data: bytes) -> None:
        pass


@pytest.mark.parametrize("turns", range(6))
async def test_a_cancel_that_comes_with_a_wake_stops_the_discovery(turns: int) -> None:
    """A wake (a datagram, a query done) and the cancel of a stopped discovery in the same
    turn of the loop: on Python 3.11 ``asyncio.wait_for`` returned and dropped the cancel, and
    the discovery went on for ever (a test here hung until its 120 s timeout). Each
    ``turns`` cancels at another step of the wake's way to the waiting loop."""
    import asyncio

    from discovery_handlers.base import ProblemReporter
    from discovery_handlers.onvif.handler import _Session

    session = _Session(
        parse_details("discoveryTimeoutSeconds: 1\nprobeIntervalSeconds: 3600"),
        ProblemReporter(logging.getLogger("test")),
    )

    async def consume() -> None:
        async for _ in session.run(_NoSockets(), querier=None):  # no camera: never queried
            pass

    task = asyncio.create_task(consume())
    for _ in range(3):
        await asyncio.sleep(0)  # the loop probed and waits
    session.wake.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10)  # bound of a failure, not a timing
    assert done, "the discovery went on after its cancel"
    assert task.cancelled()
