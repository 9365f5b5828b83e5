"""OPC UA servers for the opcua handler's tests: asyncua's own ``Server`` (real opc.tcp, real
discovery services), and hand-made servers that misbehave.

- ``server``: an asyncua Server (ApplicationType ClientAndServer, asyncua's default, or
  Server) that may register itself with a discovery server — RegisterServer, or RegisterServer2
  with an ``MdnsDiscoveryConfiguration`` (its mDNS name and capabilities). ``advertise`` makes
  it describe itself (and register) under another DiscoveryURL than the one it listens on: a
  server configured with a host name its clients cannot resolve (a container's host name).
- ``discovery``: an asyncua Server with ApplicationType DiscoveryServer: asyncua's own LDS
  (RegisterServer/RegisterServer2 kept, FindServers lists them) plus FindServersOnNetwork,
  which asyncua lacks (see :class:`MulticastRecords`). Where it differs from a real LDS-ME:
  it does no mDNS — its records are the RegisterServer2 registrations with an
  ``MdnsDiscoveryConfiguration`` it received (a real LDS-ME announces those with mDNS and lists
  what it hears, its own announcements included); like node-opcua's LDS it filters
  capabilities without case, pages by record id and gives one record per DiscoveryUrl.
  Registrations need no secure channel (node-opcua's needs ``allowUnsecuredRegistration``).
- ``answering``: a light server answering FindServers with the ``applications`` of its spec
  (:func:`answer_find_servers`; hundreds fit in one process: the benchmark's plant floor).
- hostile ``garbage`` (answers any connection with bytes that are not OPC UA), ``silent``
  (accepts, never answers), ``huge`` (a correct Hello/OpenSecureChannel, then a FindServers
  answer of ~1.8 MB in 65,535-byte chunks), ``giant-chunk`` (Acknowledges with a chunk header
  announcing 2 GB).

A process serves the servers its JSON spec lists and prints ``ready <name> <url>`` for each
once it listens (a registering server once registered), and ``connection <name>`` for each
connection a hostile server accepts; then it runs until killed::

    python -m tests.doubles.opcua_servers '[{"kind": "discovery", "name": "LDS",
        "endpoint": "opc.tcp://127.0.0.1:48400/"}, {"kind": "server", "name": "Server A",
        "endpoint": "opc.tcp://127.0.0.1:48401/", "register": "opc.tcp://127.0.0.1:48400/",
        "mdns": {"name": "Server A", "capabilities": ["DA"]}}]'
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import itertools
import json
import logging
import socket
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from asyncua import Client, Server, ua
from asyncua.server import binary_server_asyncio, uaprocessor
from asyncua.ua.ua_binary import struct_from_binary, struct_to_binary

log = logging.getLogger("opcua_servers")
HUGE_SERVERS = 20_000  # ~1.8 MB of ApplicationDescriptions
CHUNK = 65535


@dataclass
class MulticastRecords:
    """FindServersOnNetwork records of this process's discovery server."""

    records: dict[tuple[str, str], ua.ServerOnNetwork] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    reset: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.UTC))

    def register(self, params: ua.RegisterServer2Parameters) -> None:
        server = params.Server
        for key in [k for k in self.records if k[0] == server.ServerUri]:
            del self.records[key]
        if not server.IsOnline:
            return
        for config in params.DiscoveryConfiguration or []:
            if not isinstance(config, ua.MdnsDiscoveryConfiguration):
                continue
            name = config.MdnsServerName or (
                server.ServerNames[0].Text if server.ServerNames else server.ServerUri
            )
            for url in server.DiscoveryUrls or []:
                self.records[(server.ServerUri, url)] = ua.ServerOnNetwork(
                    RecordId=ua.UInt32(next(self.ids)),
                    ServerName=ua.String(name),
                    DiscoveryUrl=ua.String(url),
                    ServerCapabilities=list(config.ServerCapabilities or []),
                )

    def find(self, params: ua.FindServersOnNetworkParameters) -> ua.FindServersOnNetworkResult:
        wanted = {c.upper() for c in params.ServerCapabilityFilter or []}
        found: list[ua.ServerOnNetwork] = []
        for record in sorted(self.records.values(), key=lambda r: r.RecordId):
            if record.RecordId <= params.StartingRecordId:
                continue
            if not wanted <= {c.upper() for c in record.ServerCapabilities or []}:
                continue
            found.append(record)
            if params.MaxRecordsToReturn and len(found) >= params.MaxRecordsToReturn:
                break
        return ua.FindServersOnNetworkResult(LastCounterResetTime=self.reset, Servers=found)


RECORDS = MulticastRecords()
_FIND_ON_NETWORK = ua.NodeId(ua.ObjectIds.FindServersOnNetworkRequest_Encoding_DefaultBinary)
_REGISTER2 = ua.NodeId(ua.ObjectIds.RegisterServer2Request_Encoding_DefaultBinary)


class MulticastProcessor(uaprocessor.UaProcessor):
    """asyncua's request processor plus FindServersOnNetwork (and RegisterServer2 noted as
    records). Installed for the whole process by :func:`_serve_discovery`."""

    async def _process_message(self, typeid: Any, requesthdr: Any, seqhdr: Any, body: Any) -> Any:
        if typeid == _FIND_ON_NETWORK:
            params = struct_from_binary(ua.FindServersOnNetworkParameters, body)
            response = ua.FindServersOnNetworkResponse()
            response.Parameters = RECORDS.find(params)
            self.send_response(requesthdr.RequestHandle, seqhdr, response)
            return True
        if typeid == _REGISTER2:
            RECORDS.register(struct_from_binary(ua.RegisterServer2Parameters, body.copy()))
        return await super()._process_message(typeid, requesthdr, seqhdr, body)


def _quiet() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("asyncua").setLevel(logging.ERROR)


async def _asyncua_server(spec: dict[str, Any]) -> Server:
    server = Server()
    if spec["kind"] == "discovery":
        server.application_type = ua.ApplicationType.DiscoveryServer
    elif spec.get("type") == "server":
        server.application_type = ua.ApplicationType.Server
    await server.init()
    server.set_endpoint(spec["endpoint"])
    server.set_server_name(spec["name"])
    server.product_uri = spec.get("product", "urn:akri-py:tests:opcua")
    await server.set_application_uri(spec.get("uri", f"urn:akri-py:tests:{spec['name']}"))
    await server.start()
    advertise = spec.get("advertise")
    if advertise:
        # what it tells FindServers (and a discovery server) about itself
        for description in server.iserver._known_servers.values():
            description.Server.DiscoveryUrls = [advertise]
        for endpoint in server.iserver.endpoints:
            endpoint.Server.DiscoveryUrls = [advertise]
    return server


async def _register(server: Server, spec: dict[str, Any]) -> None:
    """RegisterServer (and RegisterServer2 with an mDNS configuration, if ``mdns``) with the
    discovery server ``spec["register"]``, retried until it answers."""
    registered = ua.RegisteredServer()
    registered.ServerUri = ua.String(server.get_application_uri())
    registered.ProductUri = ua.String(server.product_uri)
    registered.DiscoveryUrls = [spec.get("advertise") or spec["endpoint"]]
    registered.ServerType = server.application_type
    registered.ServerNames = [ua.LocalizedText(spec["name"])]
    registered.IsOnline = True
    mdns = spec.get("mdns")
    while True:
        client = Client(spec["register"], timeout=2)
        try:
            await client.connect_sessionless()
            try:
                if mdns is not None:
                    params = ua.RegisterServer2Parameters()
                    params.Server = registered
                    params.DiscoveryConfiguration = [
                        ua.MdnsDiscoveryConfiguration(
                            MdnsServerName=mdns.get("name", spec["name"]),
                            ServerCapabilities=list(mdns.get("capabilities", [])),
                        )
                    ]
                    await client.uaclient.register_server2(params)
                else:
                    await client.uaclient.register_server(registered)
            finally:
                await client.disconnect_sessionless()
            return
        except (OSError, TimeoutError, ua.UaError):
            await asyncio.sleep(0.2)


# -- servers that misbehave ----------------------------------------------------------------------


def _chunk(kind: bytes, chunk: bytes, payload: bytes) -> bytes:
    return kind + chunk + struct.pack("<I", len(payload) + 8) + payload


def _acknowledge() -> bytes:
    ack = ua.Acknowledge(ReceiveBufferSize=CHUNK, SendBufferSize=CHUNK)
    return _chunk(b"ACK", b"F", struct_to_binary(ack))


def _open_response(request_id: int) -> bytes:
    response = ua.OpenSecureChannelResponse()
    response.Parameters.SecurityToken.ChannelId = 7
    response.Parameters.SecurityToken.TokenId = 1
    response.Parameters.SecurityToken.RevisedLifetime = 60_000
    header = struct_to_binary(ua.AsymmetricAlgorithmHeader())
    payload = (
        struct.pack("<I", 7) + header + struct.pack("<II", 1, request_id)
        + struct_to_binary(response)
    )  # fmt: skip
    return _chunk(b"OPN", b"F", payload)


@functools.cache
def _huge_body() -> bytes:
    response = ua.FindServersResponse()
    for index in range(HUGE_SERVERS):
        response.Servers.append(
            ua.ApplicationDescription(
                ApplicationUri=ua.String(f"urn:flood:{index}"),
                ApplicationName=ua.LocalizedText(f"Flood {index}"),
                ApplicationType=ua.ApplicationType.Server,
                DiscoveryUrls=[f"opc.tcp://10.0.{index // 250}.{index % 250}:4840/"],
            )
        )
    return struct_to_binary(response)


def _huge_answer(request_id: int) -> list[bytes]:
    return _message_chunks(request_id, _huge_body())  # encoded once: ~1 s of CPU


def _message_chunks(request_id: int, body: bytes) -> list[bytes]:
    """``body`` as MSG chunks of at most 65,535 bytes (the last one final)."""
    size = CHUNK - 8 - 16
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    return [
        _chunk(
            b"MSG",
            b"F" if index == len(parts) - 1 else b"C",
            struct.pack("<IIII", 7, 1, index + 2, request_id) + part,
        )
        for index, part in enumerate(parts)
    ]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (the probes are held open together)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


async def _read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readexactly(8)
    kind, _chunk_type, size = struct.unpack("<3scI", head)
    return kind, await reader.readexactly(size - 8)


def _request_id(body: bytes, kind: bytes) -> int:
    # channel id, then the security header (OPN: policy URI + 2 byte strings; MSG: token id)
    if kind == b"OPN":
        offset = 4
        for _ in range(3):
            (length,) = struct.unpack_from("<i", body, offset)
            offset += 4 + max(length, 0)
    else:
        offset = 8
    (request_id,) = struct.unpack_from("<I", body, offset + 4)
    return int(request_id)


def find_servers_answer(request_id: int, applications: list[dict[str, Any]]) -> list[bytes]:
    """A FindServers response listing ``applications`` (``name``, ``url``, optional
    ``type``: 0 Server, 2 ClientAndServer, 3 DiscoveryServer; or ``flood``: that many
    generated Server descriptions, ~100 bytes each), in chunks of at most 65,535 bytes."""
    response = ua.FindServersResponse()
    for item in applications:
        if "flood" in item:
            response.Servers += [
                ua.ApplicationDescription(
                    ApplicationUri=ua.String(f"urn:flood:{index}"),
                    ApplicationName=ua.LocalizedText(f"Flood {index}"),
                    ApplicationType=ua.ApplicationType.Server,
                    DiscoveryUrls=[f"opc.tcp://10.1.{index // 250 % 250}.{index % 250}:4840/"],
                )
                for index in range(item["flood"])
            ]
            continue
        response.Servers.append(
            ua.ApplicationDescription(
                ApplicationUri=ua.String(item.get("uri", f"urn:akri-py:tests:{item['name']}")),
                ApplicationName=ua.LocalizedText(item["name"]),
                ApplicationType=ua.ApplicationType(item.get("type", 0)),
                DiscoveryUrls=[item["url"]],
            )
        )
    return _message_chunks(request_id, struct_to_binary(response))


async def answer_find_servers(
    applications: list[dict[str, Any]],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    """Serve one connection as a plain, light OPC UA server: Acknowledge, OpenSecureChannel
    (None), then a FindServers answer listing ``applications`` (a server lists itself; a
    discovery server, the servers registered with it). Thousands of these fit in one
    process (asyncua's ``Server`` costs ~30 MB each): the benchmark's 200 servers."""
    try:
        await _answer(lambda request: find_servers_answer(request, applications), reader, writer)
        await reader.read()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _answer(
    chunks: Callable[[int], list[bytes]],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    """Acknowledge the Hello, open the channel (None), and answer the next request with the
    ``chunks`` made for its request id."""
    await _read_message(reader)
    writer.write(_acknowledge())
    kind, body = await _read_message(reader)
    writer.write(_open_response(_request_id(body, kind)))
    kind, body = await _read_message(reader)
    for chunk in chunks(_request_id(body, kind)):
        writer.write(chunk)
        await writer.drain()


async def _hostile(kind: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        if kind == "garbage":
            await reader.read(1)  # its Hello
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 20)
            await writer.drain()
        elif kind == "silent":
            await reader.read()  # until the client gives up
        elif kind == "giant-chunk":
            await _read_message(reader)
            writer.write(b"ACKF" + struct.pack("<I", 2**31) + b"\0" * 1024)
            await writer.drain()
            await reader.read()
        elif kind == "huge":
            await _answer(_huge_answer, reader, writer)
            await reader.read()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _serve_hostile(spec: dict[str, Any]) -> asyncio.Server:
    parts = urlsplit(spec["endpoint"])
    kind = spec["kind"]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if kind == "answering":
            await answer_find_servers(spec["applications"], reader, writer)
            return
        print(f"connection {spec['name']}", flush=True)  # tests count the handler's calls
        await _hostile(kind, reader, writer)

    return await asyncio.start_server(handle, parts.hostname, parts.port or 4840)


# -- the process ---------------------------------------------------------------------------------


async def serve(specs: list[dict[str, Any]]) -> None:
    """Start every server of ``specs`` (discovery servers first, then the others in parallel),
    print ``ready <name> <endpoint>`` for each, and run until cancelled."""
    if any(spec["kind"] == "discovery" for spec in specs):
        binary_server_asyncio.UaProcessor = MulticastProcessor  # type: ignore[misc]
    if any(spec["kind"] == "huge" for spec in specs):
        _huge_body()
    running: list[Any] = []

    async def start(spec: dict[str, Any]) -> None:
        if spec["kind"] in ("server", "discovery"):
            server = await _asyncua_server(spec)
            running.append(server)
            if spec.get("register"):
                await _register(server, spec)
        else:
            running.append(await _serve_hostile(spec))
        print(f"ready {spec['name']} {spec['endpoint']}", flush=True)

    await asyncio.gather(*(start(s) for s in specs if s["kind"] == "discovery"))
    await asyncio.gather(*(start(s) for s in specs if s["kind"] != "discovery"))
    try:
        await asyncio.Event().wait()
    finally:
        for item in running:
            with contextlib.suppress(Exception):
                if isinstance(item, Server):
                    await item.stop()
                else:
                    item.close()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    _quiet()
    specs = json.loads(args[0])
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(specs))


if __name__ == "__main__":
    main()
