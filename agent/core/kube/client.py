"""The Kubernetes REST client: JSON requests over a small keep-alive pool, and watch streams.

Every failure is an :class:`ApiError`: the server's status (``.status``, ``.reason``,
``.body``), or a :class:`TransportError` (status 0) when there was no HTTP answer at all
(refused, dropped, TLS, timeout, credentials).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from agent.core import telemetry
from agent.core.kube.credentials import Auth
from agent.core.kube.errors import ApiError, ResponseTooLargeError, TransportError
from agent.core.kube.http import BodyTooLargeError, Connection, ProtocolError, Response
from agent.core.kube.kubeconfig import ClusterConfig, load_config
from agent.core.kube.tls import make_ssl_context

log = logging.getLogger(__name__)

JSON = dict[str, Any]
Params = Mapping[str, str | int | bool | None]

DEFAULT_TIMEOUT = 30.0
LIST_PAGE_SIZE = 500  # like client-go's reflector
LIST_RESTARTS = 5
# no byte at all on a watch (events or bookmarks, which the server sends about every minute)
# for this long: the connection is presumed dead (a half-open TCP connection never errors)
WATCH_IDLE_TIMEOUT = 150.0
USER_AGENT = "akri-py-agent"
# one watch event is one object (etcd stores at most 1.5 MiB per object by default): a line
# longer than this is a broken or hostile stream, refused before it fills the memory
MAX_WATCH_LINE = 16 * 1024 * 1024
MAX_THROTTLE_RETRIES = 10  # client-go's default
MAX_RETRY_AFTER = 10.0  # seconds: a longer Retry-After is shortened to this
_TRANSPORT_ERRORS = (OSError, EOFError, ProtocolError, asyncio.LimitOverrunError, ValueError)
_RETRY_ON_STALE = frozenset({"GET", "HEAD"})  # writes are never sent twice


APPLY_PATCH = "application/apply-patch+yaml"


def resource_path(
    group: str, version: str, plural: str, namespace: str | None = None, name: str | None = None
) -> str:
    """``/api/v1/...`` for the core group (``group=""``), else ``/apis/{group}/{version}/...``;
    namespaced when ``namespace`` is given."""
    path = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespace is not None:
        path += f"/namespaces/{quote(namespace, safe='')}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{quote(name, safe='')}"
    return path


def make_kube_client(
    kubeconfig: str | None = None, *, timeout: float = DEFAULT_TIMEOUT
) -> KubeClient:
    """A client from a kubeconfig file, else in-cluster settings, else ``$KUBECONFIG`` /
    ``~/.kube/config``. Raises :class:`~agent.core.kube.errors.ConfigError`."""
    return KubeClient(load_config(kubeconfig), timeout=timeout)


class KubeClient:
    """An asyncio client for one API server.

    ``timeout`` bounds each request (connect, send, whole answer, waiting for a free
    connection) unless a call gives its own. At most ``max_connections`` requests are in
    flight (watch streams not counted), and as many connections are kept for reuse, each for
    at most ``idle_ttl`` seconds (load balancers drop idle connections silently).
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 8,
        idle_ttl: float = 30.0,
    ) -> None:
        self.config = config
        self.timeout = timeout
        self._max_idle = max_connections
        self._slots = asyncio.Semaphore(max_connections)
        self._idle_ttl = idle_ttl
        self._idle: list[Connection] = []
        self._busy: set[Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._ssl_pair: tuple[bytes, bytes] | None = None
        self._closed = False
        self.connections_opened = 0
        self.throttled = 0  # requests sent again after a 429 / Retry-After

    @property
    def namespace(self) -> str:
        """The namespace of the kubeconfig context or the pod."""
        return self.config.namespace

    # -- JSON requests ---------------------------------------------------------------------
    async def get(
        self, path: str, *, params: Params | None = None, request_timeout: float | None = None
    ) -> JSON:
        return await self.request("GET", path, params=params, request_timeout=request_timeout)

    async def create(self, path: str, body: JSON, *, request_timeout: float | None = None) -> JSON:
        return await self.request("POST", path, body=body, request_timeout=request_timeout)

    async def replace(self, path: str, body: JSON, *, request_timeout: float | None = None) -> JSON:
        return await self.request("PUT", path, body=body, request_timeout=request_timeout)

    async def delete(
        self, path: str, body: JSON | None = None, *, request_timeout: float | None = None
    ) -> JSON:
        return await self.request("DELETE", path, body=body, request_timeout=request_timeout)

    async def apply(
        self,
        path: str,
        body: JSON,
        *,
        field_manager: str,
        force: bool = False,
        request_timeout: float | None = None,
    ) -> JSON:
        """Server-side apply (``PATCH`` ``application/apply-patch+yaml``; JSON is YAML) of
        ``body`` as ``field_manager``: the fields it lists become (co-)owned by that manager,
        and fields it applied before and omits now are removed unless another manager owns
        them."""
        params = {"fieldManager": field_manager}
        if force:
            params["force"] = "true"
        return await self.request(
            "PATCH",
            path,
            params=params,
            body=body,
            request_timeout=request_timeout,
            content_type=APPLY_PATCH,
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Params | None = None,
        body: JSON | None = None,
        request_timeout: float | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        """Send ``body`` as JSON (as ``content_type``: a patch type for ``PATCH``); the answer's
        JSON object (``{}`` if empty). Raises :class:`ApiError` for status >= 400 and
        :class:`TransportError` without an answer."""
        limit = request_timeout or self.timeout
        target = self._target(path, params)
        payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        waits = 0
        try:
            async with asyncio.timeout(limit):
                while True:
                    async with self._slots:
                        for attempt in (1, 2):
                            auth = await self.config.credentials.get(deadline)
                            conn, response = await self._exchange(
                                method, target, payload, auth, content_type
                            )
                            data = await self._read_all(conn, method, target, response)
                            if self._retry_unauthorized(response, attempt):
                                continue
                            break
                    wait = retry_wait(method, response, data, waits, deadline - loop.time())
                    if wait is None:
                        break
                    waits += 1
                    self._throttled(method, target, response.status, wait)
                    await asyncio.sleep(wait)  # outside the connection slot
        except TimeoutError as error:
            telemetry.API_ERRORS["transport"] += 1
            raise TransportError(f"{method} {target}: no answer within {limit:g}s") from error
        if response.status >= 400:
            telemetry.API_ERRORS[str(response.status)] += 1
            refused = ApiError.from_response(response.status, response.reason, data)
            raise _refusal(method, target, refused)
        return _json_object(data, method, target)

    async def list_all(
        self,
        path: str,
        *,
        params: Params | None = None,
        page_size: int = LIST_PAGE_SIZE,
        request_timeout: float | None = None,
        keep: Callable[[JSON], JSON | None] | None = None,
    ) -> tuple[list[JSON], str]:
        """Every item of a collection, ``page_size`` at a time (``limit``/``continue``, so a
        large collection never arrives as one huge answer), and the list's resourceVersion.
        A continue token the server no longer honours (410 Expired: the snapshot was
        compacted while paging) restarts the list from the beginning. A page over the body
        limit is asked again at half the size (the same continue token: ``limit`` may change
        from page to page); one object over the limit raises :class:`ResponseTooLargeError`.
        ``keep`` sees each item as its page arrives and returns what to keep of it (None: drop
        it), so that only one page of whole objects is ever held."""
        for _ in range(LIST_RESTARTS):
            items: list[JSON] = []
            token: str | None = None
            try:
                while True:
                    try:
                        page = await self.get(
                            path,
                            params={**(params or {}), "limit": page_size, "continue": token},
                            request_timeout=request_timeout,
                        )
                    except ResponseTooLargeError:
                        if page_size <= 1:
                            raise
                        page_size //= 2
                        log.warning(
                            "GET %s: a list page was over the size limit; asking for %d "
                            "items a page",
                            path,
                            page_size,
                        )
                        continue
                    found = page.get("items") or []
                    if keep is None:
                        items.extend(found)
                    else:
                        items.extend(k for k in map(keep, found) if k is not None)
                    meta = page.get("metadata") or {}
                    token = meta.get("continue") or None
                    if not token:
                        return items, str(meta.get("resourceVersion") or "")
            except ApiError as error:
                if error.status == 410 and token:
                    continue  # the snapshot expired while paging: start over
                raise
        raise TransportError(f"GET {path}: the list kept expiring while paging")

    # -- streams ---------------------------------------------------------------------------
    async def stream_lines(
        self,
        path: str,
        *,
        params: Params | None = None,
        request_timeout: float | None = None,
        idle_timeout: float | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """GET a streaming answer (a watch) and yield its lines as they arrive.

        The status and headers must arrive within the client's timeout; ``request_timeout``
        bounds the whole stream, ``idle_timeout`` the silence between two chunks (a dead
        connection raises :class:`TransportError` instead of hanging). A 429 (or a 5xx with
        ``Retry-After``) is sent again after the wait the server asks for, as :meth:`request`
        does, within the same timeout; any other error status raises :class:`ApiError`
        before any line. Closing the generator early closes the connection."""
        loop = asyncio.get_running_loop()
        target = self._target(path, params)
        deadline = loop.time() + (request_timeout or self.timeout)
        head_deadline = loop.time() + self.timeout
        waits = 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    for attempt in (1, 2):
                        auth = await self.config.credentials.get(head_deadline)
                        conn, response = await self._exchange("GET", target, None, auth)
                        if response.status < 400:
                            break
                        data = await self._read_all(conn, "GET", target, response)
                        if not self._retry_unauthorized(response, attempt):
                            break
                    if response.status < 400:
                        break
                    wait = retry_wait("GET", response, data, waits, head_deadline - loop.time())
                    if wait is None:
                        refused = ApiError.from_response(response.status, response.reason, data)
                        raise _refusal("GET", target, refused)
                    waits += 1
                    self._throttled("GET", target, response.status, wait)
                    await asyncio.sleep(wait)
        except TimeoutError as error:
            raise TransportError(f"GET {target}: no answer within {self.timeout:g}s") from error
        complete = False
        try:
            async with contextlib.aclosing(conn.iter_body()) as body:
                pending = bytearray()
                while True:
                    now = loop.time()
                    silent_until = now + idle_timeout if idle_timeout else deadline
                    try:
                        async with asyncio.timeout_at(min(deadline, silent_until)):
                            chunk = await anext(body, None)
                    except TimeoutError as error:
                        if loop.time() < deadline:
                            raise TransportError(
                                f"GET {target}: no data for {idle_timeout:g}s "
                                "(connection presumed dead)"
                            ) from error
                        raise TransportError(
                            f"GET {target}: stream outlived its timeout"
                        ) from error
                    except _TRANSPORT_ERRORS as error:
                        raise _transport_error("GET", target, error) from error
                    if chunk is None:
                        break
                    pending += chunk
                    if b"\n" in chunk:
                        *lines, rest = bytes(pending).split(b"\n")
                        pending = bytearray(rest)
                        for line in lines:
                            if len(line) > MAX_WATCH_LINE:
                                raise _line_too_long(target)
                            yield line
                    if len(pending) > MAX_WATCH_LINE:
                        raise _line_too_long(target)
                if pending:
                    yield bytes(pending)
                complete = True
        finally:
            if complete:
                self._release(conn)
            else:
                self._discard(conn)

    def watch(
        self,
        path: str,
        resource_version: str,
        *,
        timeout_seconds: int,
        field_selector: str | None = None,
        idle_timeout: float = WATCH_IDLE_TIMEOUT,
        label_selector: str | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """A watch from ``resource_version`` with bookmarks, as lines of JSON events. The server
        ends it after ``timeout_seconds``; the client gives up 30 s later, or after
        ``idle_timeout`` seconds without a byte (the server sends a bookmark about every
        minute, so more than twice that means the connection died)."""
        params = {
            "fieldSelector": field_selector,
            "labelSelector": label_selector,
            "watch": True,
            "resourceVersion": resource_version,
            "timeoutSeconds": timeout_seconds,
            "allowWatchBookmarks": True,
        }
        return self.stream_lines(
            path, params=params, request_timeout=timeout_seconds + 30, idle_timeout=idle_timeout
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def close(self) -> None:
        """Close every connection; later requests fail with :class:`TransportError`."""
        self._closed = True
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
        await asyncio.sleep(0)  # let the transports finish closing

    # -- plumbing --------------------------------------------------------------------------
    def _target(self, path: str, params: Params | None) -> str:
        target = self.config.path_prefix + path
        if params:
            query = {
                key: ("true" if value else "false") if isinstance(value, bool) else str(value)
                for key, value in params.items()
                if value is not None
            }
            if query:
                target += "?" + urlencode(query)
        return target

    def _throttled(self, method: str, target: str, status: int, wait: float) -> None:
        self.throttled += 1
        log.info(
            "%s %s: HTTP %d, the server asks to wait %.1fs; retrying", method, target, status, wait
        )

    def _retry_unauthorized(self, response: Response, attempt: int) -> bool:
        return response.status == 401 and attempt == 1 and self.config.credentials.invalidate()

    def _headers(
        self, auth: Auth, body: bytes | None, content_type: str = "application/json"
    ) -> list[tuple[str, str]]:
        config = self.config
        host = f"[{config.host}]" if ":" in config.host else config.host
        headers = [
            ("Host", f"{host}:{config.port}"),
            ("User-Agent", USER_AGENT),
            ("Accept", "application/json"),
        ]
        if body is not None:
            headers.append(("Content-Type", content_type))
        if auth.authorization:
            headers.append(("Authorization", auth.authorization))
        headers.extend(config.impersonation)
        return headers

    async def _exchange(
        self,
        method: str,
        target: str,
        body: bytes | None,
        auth: Auth,
        content_type: str = "application/json",
    ) -> tuple[Connection, Response]:
        """Send the request and read the answer's head. A read sent on a pooled connection
        that the server closed meanwhile is sent again on another one."""
        headers = self._headers(auth, body, content_type)
        while True:
            conn, reused = await self._connection(method, target, auth)
            try:
                await conn.send(method, target, headers, body)
                return conn, await conn.read_head(method)
            except _TRANSPORT_ERRORS as error:
                self._discard(conn)
                if reused and method in _RETRY_ON_STALE:
                    continue
                raise _transport_error(method, target, error) from error
            except BaseException:
                self._discard(conn)
                raise

    async def _read_all(
        self, conn: Connection, method: str, target: str, response: Response
    ) -> bytes:
        try:
            data = await conn.read_body()
        except BodyTooLargeError as error:
            self._discard(conn)
            raise ResponseTooLargeError(response.status, f"{method} {target}: {error}") from error
        except _TRANSPORT_ERRORS as error:
            self._discard(conn)
            raise _transport_error(method, target, error) from error
        except BaseException:
            self._discard(conn)
            raise
        self._release(conn)
        return data

    async def _connection(self, method: str, target: str, auth: Auth) -> tuple[Connection, bool]:
        """A pooled connection (reused=True) or a new one."""
        if self._closed:
            raise TransportError(f"{method} {target}: the client is closed")
        context = self._ssl_context(auth, method, target)
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable and now - conn.idle_since < self._idle_ttl:
                self._busy.add(conn)
                return conn, True
            conn.close()
        try:
            conn = await Connection.open(
                self.config.host,
                self.config.port,
                context,
                self.config.tls.server_name,
                self.config.proxy,
            )
        except _TRANSPORT_ERRORS as error:
            raise _transport_error(method, target, error) from error
        self.connections_opened += 1
        self._busy.add(conn)
        return conn, False

    def _ssl_context(self, auth: Auth, method: str, target: str) -> ssl.SSLContext | None:
        if self.config.scheme != "https":
            return None
        if self._ssl is None or auth.client_pair != self._ssl_pair:
            try:
                self._ssl = make_ssl_context(self.config.tls, auth.client_pair)
            except (ssl.SSLError, ValueError) as error:
                raise TransportError(f"{method} {target}: TLS settings: {error}") from error
            self._ssl_pair = auth.client_pair
            for conn in self._idle:  # connections made with the old client certificate
                conn.close()
            self._idle.clear()
        return self._ssl

    def _release(self, conn: Connection) -> None:
        self._busy.discard(conn)
        if self._closed or not conn.usable or len(self._idle) >= self._max_idle:
            conn.close()
            return
        conn.finished()
        self._idle.append(conn)

    def _discard(self, conn: Connection) -> None:
        self._busy.discard(conn)
        conn.close()


def retry_wait(
    method: str, response: Response, body: bytes, waits: int, remaining: float
) -> float | None:
    """How long to wait before sending the request again, or None to answer now.

    As client-go: a 429 (the server's priority-and-fairness limits, or storage still
    initialising) was not acted on, so any verb is sent again; a 5xx with ``Retry-After``
    only for reads (a write may have been applied). The wait is the server's
    ``Retry-After`` (or ``details.retryAfterSeconds``), 1 s when it names none, at most
    :data:`MAX_RETRY_AFTER`; at most :data:`MAX_THROTTLE_RETRIES` times, and never past
    the request's own deadline."""
    status = response.status
    header = response.headers.get("retry-after", "").strip()
    if status != 429 and not (status >= 500 and header and method in _RETRY_ON_STALE):
        return None
    if waits >= MAX_THROTTLE_RETRIES:
        return None
    wait: float | None = float(header) if header.isdigit() else None
    if wait is None:
        wait = ApiError.from_response(status, response.reason, body).retry_after
    wait = min(MAX_RETRY_AFTER, wait if wait is not None and wait > 0 else 1.0)
    return wait if wait < remaining else None


def _refusal(method: str, target: str, error: ApiError) -> ApiError:
    """``error``, logged: a 4xx that names refused fields (``details.causes``: a 422, never
    routine) at INFO, any other answer >= 400 at DEBUG. Callers log again with their context;
    ``str(error)`` names the causes too."""
    if 400 <= error.status < 500 and error.causes:
        log.info("%s %s: %s", method, target, error)
    else:
        log.debug("%s %s: %s", method, target, error)
    return error


def _line_too_long(target: str) -> TransportError:
    return TransportError(
        f"GET {target}: a line of the stream is over the limit of {MAX_WATCH_LINE} bytes"
    )


def _transport_error(method: str, target: str, error: BaseException) -> TransportError:
    return TransportError(f"{method} {target}: {type(error).__name__}: {error}")


def _json_object(data: bytes, method: str, target: str) -> JSON:
    if not data.strip():
        return {}
    try:
        value = json.loads(data)
    except ValueError as error:
        raise TransportError(f"{method} {target}: answer is not JSON: {error}") from error
    if not isinstance(value, dict):
        raise TransportError(f"{method} {target}: answer is not a JSON object")
    return value
