"""FindServers and FindServersOnNetwork over ``opc.tcp`` (OPC UA Part 6, SecurityPolicy None,
no session: the discovery services need none), bounded against servers that misbehave.

Messages are encoded and decoded by ``asyncua`` (its ``ua`` types and binary codec); the
connection is our own, because asyncua's client trusts the server it talks to: it buffers a
chunk of whatever size the header claims before checking it (re-joining the buffer on every
read), takes the limits of the server's Acknowledge as its own (0 = none), and decodes answers
on the event loop. Here:

- the whole call (connect, Hello, OpenSecureChannel, the request, the answer) has one deadline;
- a chunk header announcing more than :data:`RECEIVE_BUFFER` bytes, more than
  :data:`MAX_MESSAGE` bytes in all or more than :data:`MAX_CHUNKS` chunks ends the call before
  the bytes are read (we announce these limits in Hello; a server must keep to them);
- an answer over :data:`DECODE_ON_LOOP` bytes is decoded in a worker thread;
- every failure is a :class:`CallError` with one line saying what went wrong and whether the
  server could be reached at all (``unreachable``: the caller asks again soon; otherwise it is
  broken and asked again later).

This module imports ``asyncua``: the handler imports it in a worker thread, only when an
``opcua`` Configuration runs (asyncua's import takes about a second and 40 MB).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from asyncua import ua
from asyncua.common.utils import Buffer
from asyncua.ua.ua_binary import (
    nodeid_from_binary,
    struct_from_binary,
    struct_to_binary,
    uatcp_to_binary,
)

from discovery_handlers.opcua.details import host_and_port
from discovery_handlers.opcua.servers import Application, Record
from discovery_handlers.resolver import LookupFailed, shared_resolver

RECEIVE_BUFFER = 65535  # the largest chunk we accept (what asyncua announces too)
MAX_MESSAGE = 1024 * 1024  # the largest answer: ~6,000 servers; decoding it takes ~0.3 s
MAX_CHUNKS = MAX_MESSAGE // (RECEIVE_BUFFER - 32) + 1
DECODE_ON_LOOP = 64 * 1024  # larger answers are decoded in a worker thread
MAX_RECORDS_PER_CALL = 1000  # FindServersOnNetwork page size
SECURITY_POLICY_NONE = "http://opcfoundation.org/UA/SecurityPolicy#None"
_HEADER = struct.Struct("<3scI")
_UINT32 = struct.Struct("<I")
_KINDS = (b"ACK", b"ERR", b"OPN", b"MSG", b"CLO")

T = TypeVar("T")


class CallError(Exception):
    """A discovery call that gave no usable answer; ``str()`` is one line for the log."""

    def __init__(self, message: str, *, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


async def find_servers(
    url: str, seconds: float, quiet: float = 0.0, *, describe: bool = True
) -> list[Application]:
    """FindServers on ``url``, all within ``seconds``: the applications it knows (itself; a
    discovery server also the servers registered with it). A host name that gives no answer
    in time is not looked up again for ``quiet`` seconds. ``describe=False``: only whether it
    answers (its answer's header is checked, its applications are not decoded: [])."""
    request = ua.FindServersRequest()
    request.Parameters.EndpointUrl = url
    if not describe:
        await _call(url, seconds, request, ua.FindServersResponse, "FindServers", quiet, True)
        return []
    response = await _call(url, seconds, request, ua.FindServersResponse, "FindServers", quiet)
    return [_application(item) for item in response.Servers or ()]


async def find_servers_on_network(
    url: str, seconds: float, capabilities: Sequence[str], max_records: int, quiet: float = 0.0
) -> list[Record]:
    """FindServersOnNetwork on ``url`` (a discovery server with LDS-ME), each call within
    ``seconds``: its records of
    servers with every capability in ``capabilities``, at most ``max_records + 1`` (more
    than the caller tracks tells it there were more), read in pages by record id."""
    records: list[Record] = []
    starting = 0
    while len(records) <= max_records:
        request = ua.FindServersOnNetworkRequest()
        request.Parameters.StartingRecordId = starting
        page = min(MAX_RECORDS_PER_CALL, max_records + 1 - len(records))
        request.Parameters.MaxRecordsToReturn = page
        request.Parameters.ServerCapabilityFilter = list(capabilities)
        response = await _call(
            url, seconds, request, ua.FindServersOnNetworkResponse, "FindServersOnNetwork", quiet
        )
        servers = response.Parameters.Servers or []
        records += [_record(item) for item in servers]
        last = max((r.record_id for r in records), default=starting)
        if len(servers) < page or last <= starting:
            break  # the last page (or a server that does not page: never loop)
        starting = last
    return records


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _application(item: Any) -> Application:
    name = item.ApplicationName.Text if item.ApplicationName is not None else None
    kind = item.ApplicationType
    return Application(
        uri=_text(item.ApplicationUri),
        product_uri=_text(item.ProductUri),
        name=_text(name),
        type=int(kind) if kind is not None else -1,
        discovery_urls=tuple(u for u in item.DiscoveryUrls or () if isinstance(u, str)),
    )


def _record(item: Any) -> Record:
    return Record(
        record_id=int(item.RecordId or 0),
        server_name=_text(item.ServerName),
        discovery_url=_text(item.DiscoveryUrl),
        capabilities=tuple(c for c in item.ServerCapabilities or () if isinstance(c, str)),
    )


async def _call(
    url: str,
    seconds: float,
    request: Any,
    response_type: type[T],
    name: str,
    quiet: float,
    header_only: bool = False,
) -> T:
    session = _Exchange(url, seconds, quiet)
    try:
        async with asyncio.timeout(seconds):
            await session.connect()
            await session.hello()
            await session.open_channel()
            body = await session.request(request)
    except TimeoutError:
        raise CallError(
            f"no answer within {seconds:g} s ({session.step})", unreachable=session.reader is None
        ) from None
    except CallError:
        raise
    except OSError as error:
        message = _os_error(error, session.step)
        raise CallError(message, unreachable=session.reader is None) from None
    finally:
        session.close()
    if header_only:
        _decode_header(body, response_type, name)
        return None  # type: ignore[return-value]
    return await _decode(body, response_type, name)


def _os_error(error: OSError, step: str) -> str:
    if isinstance(error, socket.gaierror):
        return f"its host does not resolve ({error.strerror or error})"
    # asyncio's "Connect call failed (host, port)" says less than the errno's own text
    reason = os.strerror(error.errno) if error.errno else str(error) or type(error).__name__
    return f"{reason} ({step})"


class _Exchange:
    """One connection: Hello, OpenSecureChannel (None), one request, CloseSecureChannel."""

    def __init__(self, url: str, timeout: float, quiet: float = 0.0) -> None:
        self.url = url
        self.timeout = timeout
        self.quiet = quiet  # a host name that does not answer is not asked again for so long
        self.step = "connecting"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.server_receive_buffer = RECEIVE_BUFFER
        self.channel_id = 0
        self.token_id = 0
        self.sequence = 0
        self.request_id = 0

    async def connect(self) -> None:
        """Connect to the URL's host: a name is resolved on the resolver's own threads
        (never the loop's default executor, which the agent shares), then its addresses are
        tried in turn."""
        host, port = host_and_port(self.url)
        try:
            addresses = await shared_resolver().lookup(host, seconds=self.timeout, quiet=self.quiet)
        except LookupFailed as error:
            raise CallError(f"its host {error.reason}", unreachable=True) from None
        failure: OSError | None = None
        for _family, address in addresses:
            try:
                reader, writer = await asyncio.open_connection(address, port, limit=RECEIVE_BUFFER)
            except OSError as error:
                failure = failure or error
                continue
            self.reader, self.writer = reader, writer
            return
        raise failure or OSError(f"no address for {host}")

    def close(self) -> None:
        writer = self.writer
        if writer is None:
            return
        if self.channel_id:  # be polite: CloseSecureChannel needs no answer
            with contextlib.suppress(Exception):
                request = ua.CloseSecureChannelRequest()
                writer.write(self._frame(b"CLO", request))
        writer.close()

    # -- framing ---------------------------------------------------------------------------
    async def _read_chunk(self) -> tuple[bytes, bytes, bytes]:
        """(message type, chunk type, body) of the next chunk, its size checked first."""
        assert self.reader is not None
        head = await self._read(8)
        kind, chunk, size = _HEADER.unpack(head)
        if kind not in _KINDS:
            raise CallError(
                f"answered with bytes that are not OPC UA ({head[:8]!r}; {self.step})",
                unreachable=False,
            )
        if size > RECEIVE_BUFFER:
            raise CallError(
                f"sent a {size}-byte chunk, more than the {RECEIVE_BUFFER} bytes this client "
                f"accepts ({self.step})",
                unreachable=False,
            )
        if size < 8 + (4 if kind in (b"OPN", b"MSG", b"CLO") else 0):
            raise CallError(
                f"sent a malformed {kind.decode()} header ({self.step})", unreachable=False
            )
        body = await self._read(size - 8)
        if kind == b"ERR":
            raise CallError(self._error_message(body), unreachable=False)
        return kind, chunk, body

    async def _read(self, count: int) -> bytes:
        assert self.reader is not None
        try:
            return await self.reader.readexactly(count)
        except asyncio.IncompleteReadError as error:
            got = "nothing" if not error.partial else f"{len(error.partial)} of {count} bytes"
            raise CallError(
                f"closed the connection after sending {got} ({self.step})", unreachable=False
            ) from None

    def _error_message(self, body: bytes) -> str:
        try:
            error = struct_from_binary(ua.ErrorMessage, Buffer(body))
            status = ua.StatusCode(error.Error.value).name
            reason = f": {error.Reason[:200]}" if error.Reason else ""
        except Exception:
            status, reason = "an unreadable status", ""
        return f"refused with {status}{reason} ({self.step})"

    def _frame(self, kind: bytes, request: Any) -> bytes:
        self.sequence += 1
        self.request_id += 1
        if kind == b"OPN":
            security = struct_to_binary(
                ua.AsymmetricAlgorithmHeader(SecurityPolicyURI=ua.String(SECURITY_POLICY_NONE))
            )
        else:
            security = _UINT32.pack(self.token_id)
        request.RequestHeader.RequestHandle = self.request_id
        request.RequestHeader.TimeoutHint = int(self.timeout * 1000)
        payload = (
            _UINT32.pack(self.channel_id)
            + security
            + _UINT32.pack(self.sequence)
            + _UINT32.pack(self.request_id)
            + struct_to_binary(request)
        )
        if len(payload) + 8 > self.server_receive_buffer:
            raise CallError(
                f"accepts chunks of {self.server_receive_buffer} bytes only", unreachable=False
            )
        return _HEADER.pack(kind, b"F", len(payload) + 8) + payload

    # -- the steps -------------------------------------------------------------------------------
    async def hello(self) -> None:
        assert self.writer is not None
        self.step = "waiting for its Acknowledge"
        hello = ua.Hello()
        hello.ReceiveBufferSize = ua.UInt32(RECEIVE_BUFFER)
        hello.SendBufferSize = ua.UInt32(RECEIVE_BUFFER)
        hello.MaxMessageSize = ua.UInt32(MAX_MESSAGE)
        hello.MaxChunkCount = ua.UInt32(MAX_CHUNKS)
        hello.EndpointUrl = ua.String(self.url)
        self.writer.write(uatcp_to_binary(cast(Any, ua.MessageType.Hello), hello))
        kind, _chunk, body = await self._read_chunk()
        if kind != b"ACK":
            raise CallError(f"answered Hello with {kind.decode()}", unreachable=False)
        try:
            ack = struct_from_binary(ua.Acknowledge, Buffer(body))
        except Exception as error:
            raise CallError(f"sent a malformed Acknowledge ({error})", unreachable=False) from None
        # its receive buffer bounds what we send (our requests are far smaller than the
        # 8,192 bytes Part 6 requires); its other limits do not widen ours
        self.server_receive_buffer = ack.ReceiveBufferSize or RECEIVE_BUFFER

    async def open_channel(self) -> None:
        assert self.writer is not None
        self.step = "waiting for its OpenSecureChannel response"
        request = ua.OpenSecureChannelRequest()
        request.Parameters.ClientProtocolVersion = 0
        request.Parameters.RequestType = ua.SecurityTokenRequestType.Issue
        request.Parameters.SecurityMode = ua.MessageSecurityMode.None_
        request.Parameters.ClientNonce = b""
        request.Parameters.RequestedLifetime = 60_000
        self.writer.write(self._frame(b"OPN", request))
        kind, _chunk, body = await self._read_chunk()
        if kind != b"OPN":
            raise CallError(f"answered OpenSecureChannel with {kind.decode()}", unreachable=False)
        try:
            buffer = Buffer(body)
            buffer.read(4)  # its channel id, also in the token
            struct_from_binary(ua.AsymmetricAlgorithmHeader, buffer)
            buffer.read(8)  # sequence header
            payload = buffer.read(len(buffer))
        except Exception as error:
            raise CallError(
                f"sent a malformed OpenSecureChannel response ({error})", unreachable=False
            ) from None
        response = await _decode(payload, ua.OpenSecureChannelResponse, "OpenSecureChannel")
        self.channel_id = response.Parameters.SecurityToken.ChannelId
        self.token_id = response.Parameters.SecurityToken.TokenId

    async def request(self, request: Any) -> bytes:
        """Send ``request`` and return the body of its answer (all chunks joined)."""
        assert self.writer is not None
        name = type(request).__name__.removesuffix("Request")
        self.step = f"waiting for its {name} response"
        self.writer.write(self._frame(b"MSG", request))
        parts: list[bytes] = []
        total = 0
        while True:
            kind, chunk, body = await self._read_chunk()
            if kind != b"MSG" or len(body) < 16:
                raise CallError(
                    f"answered {name} with a malformed {kind.decode()}", unreachable=False
                )
            channel, _token, _sequence, request_id = struct.unpack_from("<IIII", body)
            if channel != self.channel_id or request_id != self.request_id:
                raise CallError(
                    f"answered on channel {channel} / request {request_id}, not ours",
                    unreachable=False,
                )
            part = body[16:]
            if chunk == b"A":
                raise CallError(f"aborted its {name} response", unreachable=False)
            total += len(part)
            parts.append(part)
            if total > MAX_MESSAGE or len(parts) > MAX_CHUNKS:
                raise CallError(
                    f"sent a {name} response of more than {MAX_MESSAGE} bytes or "
                    f"{MAX_CHUNKS} chunks (the limits this client announced)",
                    unreachable=False,
                )
            if chunk == b"F":
                return b"".join(parts)
            if chunk != b"C":
                raise CallError(f"sent an unknown chunk type {chunk!r}", unreachable=False)


_large_decodes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


async def _decode(body: bytes, response_type: type[T], name: str) -> T:
    """``body`` as ``response_type`` (a ServiceFault or a failed ServiceResult is a
    :class:`CallError`); large bodies are decoded in a worker thread, one at a time (a
    decoded answer takes ~8 times its size: many large answers at once would take that many
    times the memory, which the process keeps once it has grown)."""
    decode: Callable[[], T] = lambda: _decode_now(body, response_type, name)  # noqa: E731
    if len(body) > DECODE_ON_LOOP:
        loop = asyncio.get_running_loop()
        slot = _large_decodes.get(loop)
        if slot is None:
            slot = _large_decodes[loop] = asyncio.Semaphore(1)
        async with slot:
            return await asyncio.to_thread(decode)
    return decode()


def _decode_header(body: bytes, response_type: type[T], name: str) -> None:
    """Check that ``body`` is a good ``response_type`` by its type and header only."""
    try:
        buffer = Buffer(body)
        type_id = nodeid_from_binary(buffer)
        if type_id == ua.ServiceFault().TypeId:
            header = struct_from_binary(ua.ResponseHeader, buffer)
            raise CallError(
                f"answered {name} with a fault: {header.ServiceResult.name}", unreachable=False
            )
        expected = response_type().TypeId  # type: ignore[attr-defined]
        if type_id != expected:
            raise CallError(f"answered {name} with another message ({type_id})", unreachable=False)
        header = struct_from_binary(ua.ResponseHeader, buffer)
    except CallError:
        raise
    except Exception as error:
        raise CallError(
            f"sent a malformed {name} response ({type(error).__name__}: {str(error)[:200]})",
            unreachable=False,
        ) from None
    if not header.ServiceResult.is_good():
        raise CallError(f"answered {name} with {header.ServiceResult.name}", unreachable=False)


def _decode_now(body: bytes, response_type: type[T], name: str) -> T:
    try:
        type_id = nodeid_from_binary(Buffer(body))
        if type_id == ua.ServiceFault().TypeId:
            fault = struct_from_binary(ua.ServiceFault, Buffer(body))
            raise CallError(
                f"answered {name} with a fault: {fault.ResponseHeader.ServiceResult.name}",
                unreachable=False,
            )
        expected = response_type().TypeId  # type: ignore[attr-defined]
        if type_id != expected:
            raise CallError(f"answered {name} with another message ({type_id})", unreachable=False)
        response: Any = struct_from_binary(response_type, Buffer(body))
    except CallError:
        raise
    except RecursionError:
        raise CallError(f"sent a {name} response nested too deep", unreachable=False) from None
    except Exception as error:
        raise CallError(
            f"sent a malformed {name} response ({type(error).__name__}: {str(error)[:200]})",
            unreachable=False,
        ) from None
    result = response.ResponseHeader.ServiceResult
    if not result.is_good():
        raise CallError(f"answered {name} with {result.name}", unreachable=False)
    return response  # type: ignore[no-any-return]
