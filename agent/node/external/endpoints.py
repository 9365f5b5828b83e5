"""External discovery handlers, the pure part: which registrations are accepted, and what a
``DiscoverResponse`` may contain.

A registration (Akri's ``v0.RegisterDiscoveryHandlerRequest``) names a handler, an endpoint
(a unix socket path, or ``http://<ip>:<port>``) and whether its devices are shared. It reaches
the agent only through the registration socket in the handler directory, so whoever registers
can already write there; the endpoint must still be one this node would trust:

- a unix socket inside the handler directory (a socket elsewhere could be any process's);
- a network address of this host (the handler runs with ``hostNetwork``) or inside a range the
  operator allowed (``--discovery-handler-networks``, e.g. the pod network of this node).

The checks are pure (``is_local_address`` is passed in) so they are tested without sockets.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.core.bounded_yaml import brief
from agent.node.discovery.limits import ReportRejectedError, check_report
from discovery_handlers.base import Device, DeviceSpec, Mount

REGISTRATION_SOCKET = "agent-registration.sock"
"""Akri's file name for the agent's registration socket, in the handler directory."""

UDS = 0
NETWORK = 1
"""``RegisterDiscoveryHandlerRequest.EndpointType`` values (the enum of the .proto)."""

# Akri's handler names are short identifiers (udev, onvif, opcua, debugEcho, http)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_NETWORK_ENDPOINT = re.compile(r"^http://(\[[0-9A-Fa-f:.]+\]|[0-9.]+):([0-9]{1,5})/?$")
MAX_ENDPOINT = 4096

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class RegistrationRefusedError(ValueError):
    """A registration the agent does not accept (gRPC: InvalidArgument/PermissionDenied)."""

    def __init__(self, message: str, *, permission: bool = False) -> None:
        super().__init__(message)
        self.permission = permission


@dataclass(frozen=True)
class EndpointPolicy:
    """Which endpoints registrations may name."""

    directory: Path
    networks: tuple[Network, ...] = ()
    sockets_anywhere: bool = False


@dataclass(frozen=True)
class Endpoint:
    """One registered endpoint of a handler."""

    name: str
    endpoint: str  # as registered: a socket path or http://ip:port
    network: bool
    shared: bool

    @property
    def uid(self) -> str:
        """Akri's endpoint identity: ``<name>@<endpoint>``."""
        return f"{self.name}@{self.endpoint}"

    @property
    def target(self) -> str:
        """The gRPC target to dial."""
        if not self.network:
            return f"unix://{self.endpoint}"
        match = _NETWORK_ENDPOINT.match(self.endpoint)
        assert match is not None  # checked at registration
        return f"{match.group(1)}:{match.group(2)}"


def check_registration(
    name: str,
    endpoint: str,
    endpoint_type: int,
    shared: bool,
    policy: EndpointPolicy,
    is_local_address: Callable[[ipaddress.IPv4Address | ipaddress.IPv6Address], bool],
) -> Endpoint:
    """The accepted :class:`Endpoint`, or :class:`RegistrationRefusedError` saying why not."""
    if not _NAME.match(name):
        raise RegistrationRefusedError(
            f"handler name {brief(name)} must be 1 to 63 letters, digits, '.', '_' or '-'"
        )
    if not endpoint or len(endpoint) > MAX_ENDPOINT or "\x00" in endpoint:
        raise RegistrationRefusedError(f"handler {name}: endpoint {brief(endpoint)} is not usable")
    if endpoint_type == UDS:
        return Endpoint(name, _check_socket_path(name, endpoint, policy), False, shared)
    if endpoint_type == NETWORK:
        _check_network(name, endpoint, policy, is_local_address)
        return Endpoint(name, endpoint.rstrip("/"), True, shared)
    raise RegistrationRefusedError(
        f"handler {name}: unknown endpoint type {endpoint_type} (0: UDS, 1: NETWORK)"
    )


def _check_socket_path(name: str, endpoint: str, policy: EndpointPolicy) -> str:
    path = endpoint.removeprefix("unix://")
    if not os.path.isabs(path):
        raise RegistrationRefusedError(
            f"handler {name}: socket {brief(endpoint)} must be an absolute path"
        )
    # normpath, not realpath: the socket is dialled by this path, and '..' must not escape
    normal = os.path.normpath(path)
    directory = os.path.normpath(str(policy.directory))
    inside = os.path.dirname(normal) == directory or normal.startswith(directory + os.sep)
    if not inside and not policy.sockets_anywhere:
        raise RegistrationRefusedError(
            f"handler {name}: socket {brief(path)} is outside the handler directory "
            f"{directory} (allow with --discovery-handler-sockets-anywhere)",
            permission=True,
        )
    return normal


def _check_network(
    name: str,
    endpoint: str,
    policy: EndpointPolicy,
    is_local_address: Callable[[ipaddress.IPv4Address | ipaddress.IPv6Address], bool],
) -> None:
    match = _NETWORK_ENDPOINT.match(endpoint)
    if match is None:
        raise RegistrationRefusedError(
            f"handler {name}: network endpoint {brief(endpoint)} must be http://<ip>:<port>"
        )
    try:
        address = ipaddress.ip_address(match.group(1).strip("[]"))
    except ValueError:
        raise RegistrationRefusedError(
            f"handler {name}: {brief(match.group(1))} is not an IP address"
        ) from None
    port = int(match.group(2))
    if not 0 < port < 65536:
        raise RegistrationRefusedError(f"handler {name}: port {port} is out of range")
    if address.is_unspecified or address.is_multicast:
        raise RegistrationRefusedError(f"handler {name}: {address} cannot be dialled")
    if is_local_address(address):
        return
    if any(address in network for network in policy.networks):
        return
    raise RegistrationRefusedError(
        f"handler {name}: {address} is not an address of this node; allow a range with "
        "--discovery-handler-networks (e.g. this node's pod CIDR)",
        permission=True,
    )


def parse_networks(text: str) -> tuple[Network, ...]:
    """``--discovery-handler-networks``: comma-separated CIDRs."""
    networks = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"must be CIDRs like 10.244.0.0/16, got {part[:60]!r}") from None
    return tuple(networks)


def check_device_list(devices: Sequence[Device]) -> None:
    """The bounds every handler report has (:func:`check_report`), and, from an external
    handler, unique ids: two devices with one id from one process is a broken handler."""
    check_report(devices)
    seen: set[str] = set()
    for device in devices:
        if device.id in seen:
            raise ReportRejectedError(f"device id {brief(device.id)} appears twice in one list")
        seen.add(device.id)


def merge_lists(lists: dict[str, list[Device]]) -> list[Device]:
    """One list from several endpoints' lists: in endpoint order, the first of each id."""
    merged: list[Device] = []
    seen: set[str] = set()
    for uid in sorted(lists):
        for device in lists[uid]:
            if device.id not in seen:
                seen.add(device.id)
                merged.append(device)
    return merged


def device_from_fields(
    device_id: str,
    properties: dict[str, str],
    mounts: Sequence[tuple[str, str, bool]],
    device_specs: Sequence[tuple[str, str, str]],
) -> Device:
    """A :class:`Device` from the fields of a ``v0.Device`` message."""
    return Device(
        id=device_id,
        properties=properties,
        mounts=tuple(Mount(c, h, r) for c, h, r in mounts),
        device_specs=tuple(DeviceSpec(c, h, p) for c, h, p in device_specs),
    )
