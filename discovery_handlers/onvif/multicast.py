"""WS-Discovery sockets on the event loop (asyncio datagram endpoints, no threads).

- one *probe* socket per interface (IPv4, and IPv6 where it can be set up), bound to an
  ephemeral port: Probes go out to ``239.255.255.250:3702`` / ``[ff02::c]:3702`` and the
  unicast ProbeMatches come back to it;
- one *listener* per address family bound to port 3702 (``SO_REUSEADDR``/``SO_REUSEPORT``, so
  cameras or other discovery clients on the same host can share it) and joined to the group on
  every interface: it hears Hello and Bye, so cameras appear and vanish between Probes. The
  IPv4 one is bound to the group address, so it hears no unicast datagrams (IPv6: bound to
  ``::``, as a link-local group needs one interface per bound socket).

A listener that cannot bind or join is logged and skipped (Probes still work); IPv6 problems
are logged at debug level only (many nodes have no IPv6 multicast route).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import ipaddress
import logging
import socket
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from discovery_handlers.onvif.wsdiscovery import (
    MAX_MESSAGE_BYTES,
    MULTICAST_IPV4,
    MULTICAST_IPV6,
    PORT,
    Message,
    parse_message,
)

log = logging.getLogger("discovery_handlers.onvif")

OnMessage = Callable[[Message, Any], None]


@dataclass(frozen=True)
class Interface:
    """Where to send/listen: an interface index (0 = the kernel's choice) and/or an IPv4
    address."""

    label: str
    index: int
    ipv4: str = "0.0.0.0"


@dataclass(frozen=True)
class Link:
    """What the default choice needs to know about a network interface."""

    name: str
    index: int
    up: bool
    multicast: bool
    loopback: bool
    has_ipv4: bool
    has_routable_ipv6: bool = False  # an IPv6 address other than link-local (fe80::/10)

    @property
    def addressed(self) -> bool:
        return self.has_ipv4 or self.has_routable_ipv6


# Interfaces that container runtimes, CNI plugins and hypervisors create. Pods (or VMs)
# behind them could answer a Probe or send a Hello with a real camera's uuid and their own
# XAddr, and would then receive the WS-Security digest of that camera's credentials: they are
# never chosen by default (name them in ``interfaces`` to use them anyway).
CONTAINER_INTERFACE_PATTERNS = (
    "docker*", "br-*", "cni*", "cbr0", "flannel*", "cali*", "vxlan*", "cilium*", "lxc*",
    "veth*", "tunl*", "weave*", "vethwe*", "datapath", "kube-*", "virbr*", "vnet*", "podman*",
    "genev_sys*", "nodelocaldns", "antrea-*", "ovn-k8s-*", "ovs-system", "gke*", "eni*",
    "wireguard.cali", "nerdctl*",
)  # fmt: skip
MAX_DEFAULT_INTERFACES = 16  # group memberships are limited (net.ipv4.igmp_max_memberships)


def container_interface(name: str) -> bool:
    """Is ``name`` one of :data:`CONTAINER_INTERFACE_PATTERNS` (container/CNI/virtual)?"""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CONTAINER_INTERFACE_PATTERNS)


def default_links(links: Sequence[Link]) -> list[Link]:
    """The interfaces to use when none are configured, best first (the caller keeps at most
    :data:`MAX_DEFAULT_INTERFACES`): every interface that is up, multicast-capable, not a
    loopback and not a container/CNI/virtual one (:func:`container_interface`), those with
    an IPv4 or a routable IPv6 address (IPv4 first) ahead of address-less ones; failing that,
    multicast-capable loopbacks; ``[]`` leaves the choice to the kernel (its default route).

    Why addressed ones first: an address-less interface is rarely where cameras are (on an
    IPv6-only node the uplink has a global address), and a socket can join a group on at most
    ``net.ipv4.igmp_max_memberships`` (20) interfaces. Why not container interfaces: see
    :data:`CONTAINER_INTERFACE_PATTERNS`."""
    usable = [link for link in links if link.up and link.multicast]
    outward = [link for link in usable if not link.loopback and not container_interface(link.name)]
    addressed = [link for link in outward if link.addressed]
    if addressed:
        return sorted(addressed, key=lambda link: not link.has_ipv4)  # stable: kernel order
    if outward:
        return outward
    return [link for link in usable if link.loopback]


def routable_ipv6_interfaces(if_inet6: str) -> set[str]:
    """Names of the interfaces with an IPv6 address that is neither link-local nor loopback,
    from the text of ``/proc/net/if_inet6`` (address, index, prefix length, scope, flags,
    name per line)."""
    names = set()
    for line in if_inet6.splitlines():
        fields = line.split()
        if len(fields) != 6:
            continue
        try:
            address = ipaddress.IPv6Address(int(fields[0], 16))
        except ValueError:
            continue
        if not (address.is_link_local or address.is_loopback):
            names.add(fields[5])
    return names


# from linux/sockios.h and linux/if.h
_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_IFF_MULTICAST = 0x1000


def system_links() -> list[Link]:
    """This network namespace's interfaces (ioctl on a socket: the namespace of the caller,
    unlike /sys/class/net, which shows the one sysfs was mounted in)."""
    if not sys.platform.startswith("linux"):
        return []
    import fcntl

    try:  # /proc/net is the caller's namespace's (a link to /proc/self/net)
        with open("/proc/net/if_inet6", encoding="ascii", errors="replace") as file:
            with_ipv6 = routable_ipv6_interfaces(file.read())
    except OSError:  # IPv6 disabled
        with_ipv6 = set()
    links = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for index, name in socket.if_nameindex():
            request = struct.pack("16sH14s", name.encode()[:15], 0, b"")
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(sock, _SIOCGIFFLAGS, request), 16)[0]
            except OSError:
                continue  # gone meanwhile
            try:
                fcntl.ioctl(sock, _SIOCGIFADDR, request)
                has_ipv4 = True
            except OSError:  # EADDRNOTAVAIL: no IPv4 address
                has_ipv4 = False
            links.append(
                Link(
                    name,
                    index,
                    up=bool(flags & _IFF_UP),
                    multicast=bool(flags & _IFF_MULTICAST),
                    loopback=bool(flags & _IFF_LOOPBACK),
                    has_ipv4=has_ipv4,
                    has_routable_ipv6=name in with_ipv6,
                )
            )
    return links


def resolve_interfaces(
    names: Sequence[str], links: Callable[[], Sequence[Link]] = system_links
) -> list[Interface]:
    """Interfaces from names or IPv4 addresses; ``[]`` means the default choice
    (:func:`default_links`, at most :data:`MAX_DEFAULT_INTERFACES`), or the kernel's default
    route if nothing qualifies.
    Raises OSError for an unknown interface name."""
    if not names:
        chosen = default_links(links())
        if not chosen:
            return [Interface("default", 0)]
        if len(chosen) > MAX_DEFAULT_INTERFACES:
            log.warning(
                "onvif: %d interfaces qualify by default; using the first %d (%s), the cap "
                "MAX_DEFAULT_INTERFACES: set interfaces in discoveryDetails to choose",
                len(chosen),
                MAX_DEFAULT_INTERFACES,
                ", ".join(link.name for link in chosen[:MAX_DEFAULT_INTERFACES]),
            )
            chosen = chosen[:MAX_DEFAULT_INTERFACES]
        return [Interface(link.name, link.index) for link in chosen]
    result = []
    for name in names:
        try:
            address = ipaddress.IPv4Address(name)
        except ValueError:
            result.append(Interface(name, socket.if_nametoindex(name)))
        else:
            result.append(Interface(name, 0, str(address)))
    return result


# Linux delivers a group's datagrams arriving on *any* interface to every socket bound to the
# port, if any socket on the host joined that group on some interface (IP_MULTICAST_ALL,
# default 1): a listener for eth0 would hear Hellos from lo or a container bridge. Off, it
# hears only the groups and interfaces it joined itself. (Values from linux/in.h, in6.h.)
_IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)
_IPV6_MULTICAST_ALL = getattr(socket, "IPV6_MULTICAST_ALL", 29)


def _only_own_groups(sock: socket.socket, family: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):  # a kernel without it: as before (filters still apply)
        if family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_IP, _IP_MULTICAST_ALL, 0)
        else:
            sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_MULTICAST_ALL, 0)


def _mreqn(group: str, interface: Interface) -> bytes:
    return struct.pack(
        "4s4si", socket.inet_aton(group), socket.inet_aton(interface.ipv4), interface.index
    )


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, on_message: OnMessage, label: str) -> None:
        self.on_message = on_message
        self.label = label

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if len(data) > MAX_MESSAGE_BYTES:
            return
        message = parse_message(data)
        if message is not None:
            self.on_message(message, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("onvif: WS-Discovery socket %s: %s", self.label, exc)


class WsDiscoverySockets:
    """Probe senders and Hello/Bye listeners for a set of interfaces."""

    def __init__(
        self,
        interfaces: Sequence[str],
        on_message: OnMessage,
        *,
        port: int = PORT,
        ipv6: bool = True,
    ) -> None:
        self.interface_names = tuple(interfaces)
        self.on_message = on_message
        self.port = port
        self.ipv6 = ipv6
        self._probers: list[tuple[asyncio.DatagramTransport, Any, str]] = []
        self._listeners: list[asyncio.DatagramTransport] = []
        self._warned: set[str] = set()
        self.interfaces: list[str] = []  # labels of the interfaces in use, after start()

    async def start(self) -> None:
        """Open the sockets (raises OSError if no Probe socket at all can be opened)."""
        interfaces = resolve_interfaces(self.interface_names)
        self.interfaces = [interface.label for interface in interfaces]
        loop = asyncio.get_running_loop()
        for interface in interfaces:
            with contextlib.suppress(OSError):
                await self._add_prober(loop, interface, socket.AF_INET)
            if self.ipv6 and socket.has_ipv6:
                try:
                    await self._add_prober(loop, interface, socket.AF_INET6)
                except OSError as error:
                    log.debug("onvif: no IPv6 probe socket on %s: %s", interface.label, error)
        if not self._probers:
            # the IPv4 failure again, this time raised: the handler cannot work at all
            await self._add_prober(loop, interfaces[0], socket.AF_INET)
        try:
            await self._add_listener(loop, interfaces, socket.AF_INET)
        except OSError as error:
            log.warning(
                "onvif: cannot listen for Hello/Bye on port %d (%s); cameras are found by "
                "Probes only",
                self.port,
                error,
            )
        if self.ipv6 and socket.has_ipv6:
            try:
                await self._add_listener(loop, interfaces, socket.AF_INET6)
            except OSError as error:
                log.debug("onvif: no IPv6 Hello/Bye listener: %s", error)

    async def _add_prober(
        self, loop: asyncio.AbstractEventLoop, interface: Interface, family: int
    ) -> None:
        sock = socket.socket(family, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        try:
            sock.setblocking(False)
            if family == socket.AF_INET:
                sock.setsockopt(
                    socket.IPPROTO_IP, socket.IP_MULTICAST_IF, _mreqn(MULTICAST_IPV4, interface)
                )
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
                sock.bind(("0.0.0.0", 0))
                destination: Any = (MULTICAST_IPV4, self.port)
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, interface.index)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_LOOP, 1)
                sock.bind(("::", 0))
                destination = (MULTICAST_IPV6, self.port, 0, interface.index)
            label = f"{interface.label}/{'v4' if family == socket.AF_INET else 'v6'}"
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Protocol(self.on_message, label), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        self._probers.append((transport, destination, label))

    async def _add_listener(
        self, loop: asyncio.AbstractEventLoop, interfaces: Sequence[Interface], family: int
    ) -> None:
        sock = socket.socket(family, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            joined = 0
            _only_own_groups(sock, family)
            if family == socket.AF_INET:
                # bound to the group, not 0.0.0.0: Linux then delivers only datagrams sent to
                # the group, so a host (or a pod, through the node's address) cannot slip a
                # unicast Hello or Bye past the interface choice
                sock.bind((MULTICAST_IPV4 if sys.platform.startswith("linux") else "", self.port))
                for interface in interfaces:
                    try:
                        sock.setsockopt(
                            socket.IPPROTO_IP,
                            socket.IP_ADD_MEMBERSHIP,
                            _mreqn(MULTICAST_IPV4, interface),
                        )
                        joined += 1
                    except OSError as error:
                        if error.errno == errno.EADDRINUSE:  # already joined: fine
                            joined += 1
                        elif len(interfaces) == 1:
                            raise
                        else:  # e.g. over net.ipv4.igmp_max_memberships: the others still
                            log.warning(
                                "onvif: cannot hear Hello/Bye on %s: %s", interface.label, error
                            )
                if not joined:
                    raise OSError(errno.EADDRNOTAVAIL, "no interface could join the group")
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(("::", self.port))
                group = socket.inet_pton(socket.AF_INET6, MULTICAST_IPV6)
                for interface in interfaces:
                    try:
                        sock.setsockopt(
                            socket.IPPROTO_IPV6,
                            socket.IPV6_JOIN_GROUP,
                            group + struct.pack("@I", interface.index),
                        )
                        joined += 1
                    except OSError as error:
                        if len(interfaces) == 1:
                            raise
                        log.debug("onvif: no IPv6 Hello/Bye on %s: %s", interface.label, error)
                if not joined:
                    raise OSError(errno.EADDRNOTAVAIL, "no interface could join the group")
            label = f"listener/{'v4' if family == socket.AF_INET else 'v6'}"
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Protocol(self.on_message, label), sock=sock
            )
        except BaseException:
            sock.close()
            raise
        self._listeners.append(transport)

    def probe(self, payload: bytes) -> int:
        """Send ``payload`` (a Probe) from every probe socket; returns how many were sent."""
        sent = 0
        for transport, destination, label in self._probers:
            try:
                transport.sendto(payload, destination)
                sent += 1
            except OSError as error:
                level = logging.DEBUG if label in self._warned or "v6" in label else logging.WARNING
                self._warned.add(label)
                log.log(level, "onvif: cannot send a Probe on %s: %s", label, error)
        return sent

    def close(self) -> None:
        """Close every socket."""
        for transport, _, _ in self._probers:
            transport.close()
        for transport in self._listeners:
            transport.close()
        self._probers.clear()
        self._listeners.clear()
