"""A fake ONVIF camera (network video transmitter) for tests and for trying the handler.

- WS-Discovery on ``239.255.255.250:3702``: answers Probes for NetworkVideoTransmitter (or
  with no Types) with a unicast ProbeMatches; sends Hello when it starts (and on
  :meth:`FakeCamera.announce`) and Bye when it stops;
- SOAP 1.2 over HTTP (aiohttp) at ``/onvif/device_service``: GetDeviceInformation,
  GetNetworkInterfaces, GetScopes; other operations get a ``ter:ActionNotSupported`` Fault;
  with a username/password every call needs a WS-Security UsernameToken PasswordDigest, else
  a ``ter:NotAuthorized`` Fault.

By hand::

    python -m tests.doubles.fake_onvif --interface lo --http-host 127.0.0.1 --http-port 18900 \\
        --username admin --password secret --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import hmac
import itertools
import logging
import random
import socket
import struct
import uuid as uuid_module
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from defusedxml import ElementTree as SafeElementTree

from discovery_handlers.onvif.wsdiscovery import (
    MULTICAST_IPV4,
    MULTICAST_IPV6,
    NETWORK_WSDL,
    PORT,
    SOAP_ENV,
    WSA,
    WSD,
    Kind,
    parse_message,
)

log = logging.getLogger("fake_onvif")
DEVICE_WSDL = "http://www.onvif.org/ver10/device/wsdl"
SCHEMA = "http://www.onvif.org/ver10/schema"
TER = "http://www.onvif.org/ver10/error"
WSSE = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-secext-1.0.xsd"
WSU = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-utility-1.0.xsd"
PATH = "/onvif/device_service"


def _envelope(body: str, header: str = "") -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f'<s:Envelope xmlns:s="{SOAP_ENV}" xmlns:a="{WSA}" xmlns:d="{WSD}" '
        f'xmlns:dn="{NETWORK_WSDL}" xmlns:tds="{DEVICE_WSDL}" xmlns:tt="{SCHEMA}" '
        f'xmlns:ter="{TER}">'
        f"<s:Header>{header}</s:Header><s:Body>{body}</s:Body></s:Envelope>"
    ).encode()


def _fault(subcode: str, reason: str) -> bytes:
    return _envelope(
        "<s:Fault><s:Code><s:Value>s:Sender</s:Value>"
        f"<s:Subcode><s:Value>ter:{subcode}</s:Value></s:Subcode></s:Code>"
        f'<s:Reason><s:Text xml:lang="en">{reason}</s:Text></s:Reason></s:Fault>'
    )


@dataclass
class FakeCamera:
    """One fake camera; ``await start()`` / ``await stop()``."""

    uuid: str = field(default_factory=lambda: str(uuid_module.uuid4()))
    http_host: str = "127.0.0.1"
    http_port: int = 0  # 0: any free port
    interface: str = "127.0.0.1"  # IPv4 address of the multicast interface
    ipv6_interface: str | None = None  # also WS-Discovery on ff02::c over this interface (name)
    scopes: tuple[str, ...] = (
        "onvif://www.onvif.org/type/video_encoder",
        "onvif://www.onvif.org/name/FakeCam",
    )
    ip: str | None = None  # reported by GetNetworkInterfaces (default: http_host)
    mac: str = "02:00:00:00:00:01"
    username: str | None = None
    password: str | None = None
    answer_probes: bool = True
    xaddr_override: str | None = None  # announce this instead of the real service URL
    metadata_version: int = 1
    calls: list[str] = field(default_factory=list)
    _runner: Any = None
    _udp: Any = None
    _sender: Any = None
    _udp6: Any = None
    _sender6: Any = None
    _ids: Any = field(default_factory=itertools.count)

    @property
    def xaddr(self) -> str:
        """The device service URL announced."""
        if self.xaddr_override is not None:
            return self.xaddr_override
        host = f"[{self.http_host}]" if ":" in self.http_host else self.http_host
        return f"http://{host}:{self.http_port}{PATH}"

    # -- SOAP ----------------------------------------------------------------------------

    async def start(self, *, hello: bool = True) -> FakeCamera:
        """Serve HTTP and WS-Discovery; send Hello."""
        app = web.Application()
        app.router.add_post(PATH, self._soap)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.http_host, self.http_port)
        await site.start()
        if self.http_port == 0:
            self.http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await self._start_udp()
        if hello:
            self.announce()
        return self

    async def stop(self, *, bye: bool = True) -> None:
        """Send Bye; stop serving."""
        if bye and self._sender is not None:
            self._multicast(self._hello_or_bye(Kind.BYE))
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._udp6 is not None:
            self._udp6.close()
            self._udp6 = None
        if self._sender6 is not None:
            self._sender6.close()
            self._sender6 = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def move(self, http_port: int = 0) -> None:
        """Serve SOAP on another port and announce the new XAddr with a Hello."""
        if self._runner is not None:
            await self._runner.cleanup()
        self.http_port = http_port
        app = web.Application()
        app.router.add_post(PATH, self._soap)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.http_host, self.http_port)
        await site.start()
        if self.http_port == 0:
            self.http_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.metadata_version += 1
        self.announce()

    def _authorized(self, root: Any) -> bool:
        if self.username is None:
            return True
        token = None
        for element in root.iter(f"{{{WSSE}}}UsernameToken"):
            token = element
        if token is None:
            return False
        username = token.findtext(f"{{{WSSE}}}Username") or ""
        digest = token.findtext(f"{{{WSSE}}}Password") or ""
        nonce = token.findtext(f"{{{WSSE}}}Nonce") or ""
        created = token.findtext(f"{{{WSU}}}Created") or ""
        try:
            raw_nonce = base64.b64decode(nonce)
        except ValueError:
            return False
        expected = base64.b64encode(
            hashlib.sha1(
                raw_nonce + created.encode() + (self.password or "").encode(),
                usedforsecurity=False,
            ).digest()
        ).decode()
        return username == self.username and hmac.compare_digest(digest, expected)

    async def _soap(self, request: web.Request) -> web.Response:
        try:
            root = SafeElementTree.fromstring(await request.read(), forbid_dtd=True)
        except Exception:
            return self._reply(_fault("InvalidArgVal", "not XML"), 400)
        body = root.find(f"{{{SOAP_ENV}}}Body")
        operation = body[0].tag.rpartition("}")[2] if body is not None and len(body) else ""
        self.calls.append(operation)
        if not self._authorized(root):
            return self._reply(_fault("NotAuthorized", "Sender not Authorized"), 400)
        ip = self.ip or self.http_host
        if operation == "GetDeviceInformation":
            return self._reply(
                _envelope(
                    "<tds:GetDeviceInformationResponse><tds:Manufacturer>Fake</tds:Manufacturer>"
                    "<tds:Model>FakeCam</tds:Model><tds:FirmwareVersion>1.0</tds:FirmwareVersion>"
                    f"<tds:SerialNumber>SN-{self.uuid[:8]}</tds:SerialNumber>"
                    "<tds:HardwareId>1</tds:HardwareId></tds:GetDeviceInformationResponse>"
                )
            )
        if operation == "GetNetworkInterfaces":
            return self._reply(
                _envelope(
                    '<tds:GetNetworkInterfacesResponse><tds:NetworkInterfaces token="eth0">'
                    "<tt:Enabled>true</tt:Enabled><tt:Info><tt:Name>eth0</tt:Name>"
                    f"<tt:HwAddress>{self.mac}</tt:HwAddress><tt:MTU>1500</tt:MTU></tt:Info>"
                    "<tt:IPv4><tt:Enabled>true</tt:Enabled><tt:Config><tt:Manual>"
                    f"<tt:Address>{ip}</tt:Address><tt:PrefixLength>24</tt:PrefixLength>"
                    "</tt:Manual><tt:DHCP>false</tt:DHCP></tt:Config></tt:IPv4>"
                    "</tds:NetworkInterfaces></tds:GetNetworkInterfacesResponse>"
                )
            )
        if operation == "GetScopes":
            items = "".join(
                "<tds:Scopes><tt:ScopeDef>Fixed</tt:ScopeDef>"
                f"<tt:ScopeItem>{scope}</tt:ScopeItem></tds:Scopes>"
                for scope in self.scopes
            )
            return self._reply(_envelope(f"<tds:GetScopesResponse>{items}</tds:GetScopesResponse>"))
        return self._reply(_fault("ActionNotSupported", f"{operation} not supported"), 400)

    @staticmethod
    def _reply(payload: bytes, status: int = 200) -> web.Response:
        return web.Response(body=payload, status=status, content_type="application/soap+xml")

    # -- WS-Discovery --------------------------------------------------------------------

    def _endpoint_xml(self) -> str:
        return (
            f"<a:EndpointReference><a:Address>urn:uuid:{self.uuid}</a:Address>"
            "</a:EndpointReference>"
            "<d:Types>dn:NetworkVideoTransmitter tds:Device</d:Types>"
            f"<d:Scopes>{' '.join(self.scopes)}</d:Scopes>"
            f"<d:XAddrs>{self.xaddr}</d:XAddrs>"
            f"<d:MetadataVersion>{self.metadata_version}</d:MetadataVersion>"
        )

    def _header(self, action: str, relates_to: str = "") -> str:
        relates = f"<a:RelatesTo>{relates_to}</a:RelatesTo>" if relates_to else ""
        return (
            f"<a:MessageID>urn:uuid:{uuid_module.uuid4()}</a:MessageID>{relates}"
            f"<a:To>urn:schemas-xmlsoap-org:ws:2005:04:discovery</a:To>"
            f"<a:Action>{WSD}/{action}</a:Action>"
        )

    def _hello_or_bye(self, kind: Kind) -> bytes:
        if kind is Kind.BYE:
            body = (
                f"<d:Bye><a:EndpointReference><a:Address>urn:uuid:{self.uuid}</a:Address>"
                "</a:EndpointReference></d:Bye>"
            )
        else:
            body = f"<d:Hello>{self._endpoint_xml()}</d:Hello>"
        return _envelope(body, self._header(kind.value))

    def probe_matches(self, relates_to: str) -> bytes:
        """The ProbeMatches answering a Probe with MessageID ``relates_to``."""
        return _envelope(
            f"<d:ProbeMatches><d:ProbeMatch>{self._endpoint_xml()}</d:ProbeMatch></d:ProbeMatches>",
            self._header("ProbeMatches", relates_to),
        )

    def hello(self) -> bytes:
        """The Hello this camera would multicast (for tests that send it themselves)."""
        return self._hello_or_bye(Kind.HELLO)

    def announce(self) -> None:
        """Multicast a Hello, and once more 50 to 250 ms later, as SOAP-over-UDP 1.1 has a sender
        repeat a multicast message (MULTICAST_UDP_REPEAT 1, UDP_MIN/MAX_DELAY) and cameras do:
        a single datagram lost on a loaded host is not a camera never found."""
        hello = self._hello_or_bye(Kind.HELLO)
        self._multicast(hello)
        with contextlib.suppress(RuntimeError):  # no loop: the one send is all
            asyncio.get_running_loop().call_later(
                random.uniform(0.05, 0.25), self._multicast, hello
            )

    def _multicast(self, payload: bytes) -> None:
        if self._sender is not None:
            with contextlib.suppress(OSError):
                self._sender.sendto(payload, (MULTICAST_IPV4, PORT))
        if self._sender6 is not None and self.ipv6_interface is not None:
            index = socket.if_nametoindex(self.ipv6_interface)
            with contextlib.suppress(OSError):
                self._sender6.sendto(payload, (MULTICAST_IPV6, PORT, 0, index))

    async def _start_udp(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("0.0.0.0", PORT))
        membership = struct.pack(
            "4s4s", socket.inet_aton(MULTICAST_IPV4), socket.inet_aton(self.interface)
        )
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
        sock.setblocking(False)
        camera = self

        class Listener(asyncio.DatagramProtocol):
            transport: Any = None

            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: Any) -> None:
                message = parse_message(data)
                if message is None or message.kind is not Kind.PROBE or not camera.answer_probes:
                    return
                if message.types and not any(
                    t.rpartition(":")[2] in ("NetworkVideoTransmitter", "Device")
                    for t in message.types
                ):
                    return
                self.transport.sendto(camera.probe_matches(message.message_id), addr)

        self._udp, _ = await loop.create_datagram_endpoint(Listener, sock=sock)
        if self.ipv6_interface is not None:
            index = socket.if_nametoindex(self.ipv6_interface)
            sock6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
            sock6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock6.bind(("::", PORT))
            group = socket.inet_pton(socket.AF_INET6, MULTICAST_IPV6)
            sock6.setsockopt(
                socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, group + struct.pack("@I", index)
            )
            sock6.setblocking(False)
            self._udp6, _ = await loop.create_datagram_endpoint(Listener, sock=sock6)
            sender6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
            sender6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, index)
            sender6.setblocking(False)
            self._sender6 = sender6
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        sender.setsockopt(
            socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(self.interface)
        )
        sender.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        sender.bind((self.interface, 0))
        sender.setblocking(False)
        self._sender = sender


def _interface_address(name: str) -> str:
    """An interface's IPv4 address (``lo`` → 127.0.0.1); an address is returned as is."""
    with contextlib.suppress(OSError):
        socket.inet_aton(name)
        return name
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])  # SIOCGIFADDR


async def _main(args: argparse.Namespace) -> None:
    camera = FakeCamera(
        uuid=args.uuid or str(uuid_module.uuid4()),
        http_host=args.http_host,
        http_port=args.http_port,
        interface=_interface_address(args.interface),
        ipv6_interface=args.ipv6_interface,
        scopes=tuple(args.scope) or FakeCamera.scopes,
        ip=args.ip,
        mac=args.mac,
        username=args.username,
        password=args.password,
    )
    await camera.start()
    print(f"fake camera {camera.uuid} at {camera.xaddr}", flush=True)
    try:
        await asyncio.sleep(args.seconds)
    finally:
        await camera.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.doubles.fake_onvif",
        description="A fake ONVIF camera (WS-Discovery + SOAP).",
    )
    parser.add_argument("--uuid", help="endpoint uuid (default: random)")
    parser.add_argument("--interface", default="127.0.0.1", help="multicast interface (name/IPv4)")
    parser.add_argument(
        "--ipv6-interface", help="also answer and announce on ff02::c over this interface"
    )
    parser.add_argument("--http-host", default="127.0.0.1", help="address to serve SOAP on")
    parser.add_argument("--http-port", type=int, default=0, help="port (default: any free)")
    parser.add_argument("--scope", action="append", default=[], help="a scope (repeatable)")
    parser.add_argument("--ip", help="IPv4 address GetNetworkInterfaces reports")
    parser.add_argument("--mac", default="02:00:00:00:00:01", help="MAC address reported")
    parser.add_argument("--username", help="require WS-Security credentials")
    parser.add_argument("--password", help="password for --username")
    parser.add_argument("--seconds", type=float, default=3600.0, help="run this long")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
