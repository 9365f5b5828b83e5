"""``/healthz``, ``/readyz`` and ``/metrics`` on one HTTP port (``--health-port``).

The server runs on the agent's event loop on purpose: ``/healthz`` is answered only while the
loop turns, so a blocked loop fails the liveness probe by its timeout (kubelet's default 1 s),
which is the failure it exists to catch. ``/readyz`` says whether the agent does its job yet:
store synced, device plugins registered with kubelet, the DRA driver registered (when on).
``/metrics`` is Prometheus text (``agent/ops/metrics.py``), built per scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger("agent.health")

MAX_REQUEST_HEAD = 8192
READ_TIMEOUT = 5.0

Page = tuple[int, str, bytes]  # status, content type, body


class HealthServer:
    """A minimal HTTP/1.1 server: GET of three paths, one request per connection."""

    def __init__(
        self,
        host: str,
        port: int,
        readiness: Callable[[], list[str]],
        metrics: Callable[[], bytes] | None,
    ) -> None:
        self.host = host
        self.port = port
        self.readiness = readiness
        self.metrics = metrics
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        sockets = self._server.sockets or ()
        if sockets:
            self.port = sockets[0].getsockname()[1]  # the real port when 0 was asked
        log.info(
            "health and metrics on http://%s:%d (/healthz /readyz /metrics)", self.host, self.port
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    def page(self, method: str, path: str) -> Page:
        """The answer for one request (pure apart from the callbacks)."""
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET\n"
        path = path.split("?", 1)[0]
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            problems = self.readiness()
            if problems:
                return 503, "text/plain", ("".join(f"not ready: {p}\n" for p in problems)).encode()
            return 200, "text/plain", b"ready\n"
        if path == "/metrics" and self.metrics is not None:
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics()
        return 404, "text/plain", b"not found: /healthz, /readyz, /metrics\n"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > MAX_REQUEST_HEAD:
                raise ValueError("request head too large")
            method, path, _version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            status, content_type, body = self.page(method, path)
        except (TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status, content_type, body = 400, "text/plain", b"bad request\n"
            method = "GET"
        except Exception as error:  # a bug in a callback: answer 500, keep serving
            log.exception("health endpoint failed")
            status, content_type, body = 500, "text/plain", f"{error}\n".encode()
            method = "GET"
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  500: "Internal Server Error", 503: "Service Unavailable"}[status]  # fmt: skip
        head_out = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(ConnectionError):
            writer.write(head_out + (body if method != "HEAD" else b""))
            await writer.drain()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
