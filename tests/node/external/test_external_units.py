"""External handlers, the pure parts: which registrations are accepted, what a handler's list
may hold, how endpoints' lists merge, and the v0 message mapping."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from agent.node.discovery.limits import MAX_DEVICES, ReportRejectedError
from agent.node.external.endpoints import (
    NETWORK,
    UDS,
    EndpointPolicy,
    RegistrationRefusedError,
    check_device_list,
    check_registration,
    merge_lists,
    parse_networks,
)
from agent.node.external.wire import (
    devices_from_response,
    properties_of,
    request_for,
    response_from_devices,
)
from agent.node.settings import SettingsError
from discovery_handlers.base import Device, DeviceSpec, Mount

DIR = Path("/var/lib/akri")
POLICY = EndpointPolicy(DIR)
LOCAL = {ipaddress.ip_address("10.0.0.5")}


def local(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return address.is_loopback or address in LOCAL


def register(
    endpoint: str, endpoint_type: int = UDS, policy: EndpointPolicy = POLICY, name: str = "udev"
) -> str:
    return check_registration(name, endpoint, endpoint_type, False, policy, local).target


def test_a_socket_in_the_directory_is_accepted() -> None:
    assert register("/var/lib/akri/udev.sock") == "unix:///var/lib/akri/udev.sock"
    assert register("/var/lib/akri/sub/x.sock") == "unix:///var/lib/akri/sub/x.sock"


@pytest.mark.parametrize(
    "endpoint",
    ["/tmp/udev.sock", "/var/lib/akri/../kubelet/kubelet.sock", "/var/lib/akri-other/x.sock"],
)
def test_a_socket_elsewhere_is_refused_as_a_permission(endpoint: str) -> None:
    with pytest.raises(RegistrationRefusedError, match="outside the handler directory") as info:
        register(endpoint)
    assert info.value.permission


def test_sockets_anywhere_is_an_explicit_choice() -> None:
    anywhere = EndpointPolicy(DIR, sockets_anywhere=True)
    assert register("/tmp/udev.sock", policy=anywhere) == "unix:///tmp/udev.sock"


@pytest.mark.parametrize("endpoint", ["udev.sock", "", "/var/lib/akri/a\x00b"])
def test_unusable_socket_paths_are_refused(endpoint: str) -> None:
    with pytest.raises(RegistrationRefusedError):
        register(endpoint)


@pytest.mark.parametrize("name", ["", "a b", "x" * 64, "../x", "-x"])
def test_handler_names_are_identifiers(name: str) -> None:
    with pytest.raises(RegistrationRefusedError, match="handler name"):
        register("/var/lib/akri/x.sock", name=name)


def test_network_endpoints_of_this_node_are_accepted() -> None:
    assert register("http://127.0.0.1:10000", NETWORK) == "127.0.0.1:10000"
    assert register("http://10.0.0.5:10000", NETWORK) == "10.0.0.5:10000"
    assert register("http://[::1]:10000", NETWORK) == "[::1]:10000"


def test_other_network_endpoints_need_an_allowed_range() -> None:
    with pytest.raises(RegistrationRefusedError, match="not an address of this node") as info:
        register("http://10.244.1.7:10000", NETWORK)
    assert info.value.permission
    pods = EndpointPolicy(DIR, networks=parse_networks("10.244.1.0/24, fd00::/64"))
    assert register("http://10.244.1.7:10000", NETWORK, pods) == "10.244.1.7:10000"
    with pytest.raises(RegistrationRefusedError):
        register("http://10.244.2.7:10000", NETWORK, pods)


@pytest.mark.parametrize(
    "endpoint",
    [
        "10.0.0.5:10000",
        "http://camera.local:10000",
        "http://10.0.0.5",
        "http://10.0.0.5:0",
        "http://10.0.0.5:70000",
        "http://0.0.0.0:10000",
        "https://10.0.0.5:10000",
    ],
)
def test_malformed_network_endpoints_are_refused(endpoint: str) -> None:
    with pytest.raises(RegistrationRefusedError):
        register(endpoint, NETWORK)


def test_unknown_endpoint_types_are_refused() -> None:
    with pytest.raises(RegistrationRefusedError, match="unknown endpoint type 7"):
        register("/var/lib/akri/x.sock", 7)


def test_parse_networks_says_what_is_wrong() -> None:
    assert parse_networks("") == ()
    with pytest.raises(ValueError, match="must be CIDRs"):
        parse_networks("10.0.0.0/8,pods")


def test_the_networks_flag_reports_a_bad_value() -> None:
    from agent.node.settings import AGENT_OPTIONS, resolve

    class Args:
        pass

    with pytest.raises(SettingsError, match=r"AKRI_DISCOVERY_HANDLER_NETWORKS.*must be CIDRs"):
        resolve(Args(), AGENT_OPTIONS, {"AKRI_DISCOVERY_HANDLER_NETWORKS": "nope"})  # type: ignore[arg-type]


def test_a_list_with_a_duplicate_id_is_rejected() -> None:
    check_device_list([Device("a"), Device("b")])
    with pytest.raises(ReportRejectedError, match="appears twice"):
        check_device_list([Device("a"), Device("b"), Device("a")])


def test_the_report_bounds_apply_to_external_lists() -> None:
    with pytest.raises(ReportRejectedError, match="more than the limit"):
        check_device_list([Device(str(i)) for i in range(MAX_DEVICES + 1)])
    with pytest.raises(ReportRejectedError, match="1 to"):
        check_device_list([Device("")])


def test_merging_keeps_the_first_endpoint_s_device_per_id() -> None:
    merged = merge_lists(
        {
            "udev@/b.sock": [Device("y", {"FROM": "b"}), Device("z")],
            "udev@/a.sock": [Device("x"), Device("y", {"FROM": "a"})],
        }
    )
    assert [d.id for d in merged] == ["x", "y", "z"]
    assert merged[1].properties == {"FROM": "a"}


def test_devices_survive_the_wire_both_ways() -> None:
    devices = [
        Device(
            "usb-1",
            {"UDEV_DEVNODE": "/dev/video0"},
            (Mount("/data", "/host/data", True),),
            (DeviceSpec("/dev/video0", "/dev/video0", "rw"),),
        ),
        Device("usb-2"),
    ]
    assert devices_from_response(response_from_devices(devices)) == devices


def test_properties_without_a_value_stay_distinct_from_empty_ones() -> None:
    request = request_for("details: 1", {"a": b"x", "b": b"", "c": None})
    assert request.discovery_details == "details: 1"
    assert properties_of(request) == {"a": b"x", "b": b"", "c": None}
