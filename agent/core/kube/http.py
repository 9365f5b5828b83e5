"""HTTP/1.1 on one asyncio stream: write a request, read the status and headers, then the body
(``Content-Length``, ``chunked`` or until EOF). Keep-alive is decided here; pooling is not."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from agent.core.kube.proxy import Proxy, open_tunnel

CHUNK = 65536
MAX_HEAD = 64 * 1024
# a whole answer (one list page of 500 objects; etcd stores at most 1.5 MiB per object by
# default) is far below this: more is a broken or hostile server, refused before it is read
MAX_BODY = 64 * 1024 * 1024


class ProtocolError(Exception):
    """The server's answer is not valid HTTP/1.1."""


class BodyTooLargeError(ProtocolError):
    """The answer's body (or one chunk of it) is over the limit: refused before it is read."""


@dataclass
class Response:
    """Status line and headers (names lower-case; a repeated header keeps the last value)."""

    status: int
    reason: str
    headers: dict[str, str]


KEEPALIVE_IDLE = 30  # seconds of silence before the first probe
KEEPALIVE_INTERVAL = 10  # seconds between probes
KEEPALIVE_PROBES = 3  # unanswered probes before the kernel drops the connection


def enable_keepalive(sock: socket.socket) -> None:
    """TCP keepalive, so a peer that vanished (node rebooted, NAT dropped the flow) is noticed
    within about a minute instead of never."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Connection:
    """One HTTP/1.1 connection. Not safe for concurrent requests: the pool hands it out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._keep_alive = False
        self._framing: str | int | None = 0
        self.idle_since = time.monotonic()

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        server_name: str | None,
        proxy: Proxy | None = None,
    ) -> Connection:
        if proxy is None:
            reader, writer = await asyncio.open_connection(
                host,
                port,
                ssl=ssl_context,
                server_hostname=(server_name or host) if ssl_context is not None else None,
                limit=MAX_HEAD,
            )
        else:
            reader, writer = await open_tunnel(proxy, host, port, limit=MAX_HEAD)
            if ssl_context is not None:
                try:
                    await writer.start_tls(ssl_context, server_hostname=server_name or host)
                except BaseException:
                    writer.close()
                    raise
        sock = writer.get_extra_info("socket")
        if sock is not None:
            enable_keepalive(sock)
        return cls(reader, writer)

    @property
    def usable(self) -> bool:
        """Keep-alive was agreed, and neither side has closed the connection since."""
        return self._keep_alive and not self._writer.is_closing() and not self._reader.at_eof()

    def close(self) -> None:
        self._keep_alive = False
        self._writer.close()

    async def send(
        self,
        method: str,
        target: str,
        headers: Sequence[tuple[str, str]],
        body: bytes | None,
    ) -> None:
        """``headers`` as pairs: a name may repeat (``Impersonate-Group``)."""
        lines = [f"{method} {target} HTTP/1.1"]
        lines.extend(f"{name}: {value}" for name, value in headers)
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self._writer.write(head + body if body else head)
        await self._writer.drain()

    async def read_head(self, method: str) -> Response:
        """Status line and headers of the next final (non-1xx) response."""
        while True:
            try:
                raw = await self._reader.readuntil(b"\r\n\r\n")
            except asyncio.LimitOverrunError as error:
                raise ProtocolError("response headers too long") from error
            lines = raw.decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise ProtocolError(f"bad status line {lines[0][:100]!r}")
            status = int(parts[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if not line:
                    continue
                name, sep, value = line.partition(":")
                if not sep:
                    raise ProtocolError(f"bad header line {line[:100]!r}")
                headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:
                continue  # 100 Continue and friends: the real answer follows
            response = Response(status, parts[2] if len(parts) > 2 else "", headers)
            self._keep_alive = (
                parts[0] == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
            )
            self._framing = self._framing_of(response, method)
            return response

    def _framing_of(self, response: Response, method: str) -> str | int | None:
        """``"chunked"``, a Content-Length, or None (read until the server closes)."""
        if method == "HEAD" or response.status in (204, 304):
            return 0
        if "chunked" in response.headers.get("transfer-encoding", "").lower():
            return "chunked"
        length = response.headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                raise ProtocolError(f"bad Content-Length {length!r}")
            return int(length)
        self._keep_alive = False
        return None

    async def read_body(self, limit: int | None = None) -> bytes:
        """The whole body; :class:`ProtocolError` if it is longer than ``limit`` bytes
        (default :data:`MAX_BODY`), said by its Content-Length before reading, or found
        while reading."""
        limit = MAX_BODY if limit is None else limit
        if isinstance(self._framing, int) and self._framing > limit:
            raise BodyTooLargeError(
                f"response body of {self._framing} bytes is over the limit of {limit} bytes"
            )
        pieces: list[bytes] = []
        size = 0
        async for chunk in self.iter_body():
            size += len(chunk)
            if size > limit:
                raise BodyTooLargeError(f"response body is over the limit of {limit} bytes")
            pieces.append(chunk)
        return b"".join(pieces)

    async def iter_body(self) -> AsyncGenerator[bytes, None]:
        """The body in pieces as they arrive (chunked transfer coding removed). A chunk may
        not announce more than :data:`MAX_BODY` bytes (it would be buffered whole)."""
        framing = self._framing
        if framing == "chunked":
            while True:
                size_line = await self._reader.readuntil(b"\r\n")
                size_text = size_line.split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError as error:
                    raise ProtocolError(f"bad chunk size {size_text[:20]!r}") from error
                if size > MAX_BODY:
                    raise BodyTooLargeError(
                        f"chunk of {size} bytes is over the limit of {MAX_BODY} bytes"
                    )
                if size == 0:
                    while await self._reader.readuntil(b"\r\n") != b"\r\n":
                        pass  # trailer fields: ignored
                    return
                data = await self._reader.readexactly(size)
                if await self._reader.readexactly(2) != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                yield data
        elif isinstance(framing, int):
            remaining = framing
            while remaining:
                data = await self._reader.read(min(remaining, CHUNK))
                if not data:
                    raise asyncio.IncompleteReadError(b"", remaining)
                remaining -= len(data)
                yield data
        else:
            while data := await self._reader.read(CHUNK):
                yield data

    def finished(self) -> None:
        """The whole body was read: the connection may serve the next request."""
        self.idle_since = time.monotonic()
