"""One plugin's socket: serve, confirm it is up, register with kubelet, re-register on demand.

Follows what kubelet expects (reference §1.4): serve first, then ``Register`` on
``kubelet.sock`` with the socket *file name* as endpoint and the same options that
``GetDevicePluginOptions`` returns. The Go plugins dial their own socket before registering
because their server starts in a goroutine; ``grpc.aio``'s ``start()`` returns with the socket
bound and listening, so the socket file existing is the confirmation (a self-dial cost 0.35 ms
a plugin, a quarter of re-registering 67 plugins). Each start uses a fresh socket name
(``<resource>-<ms>.sock``, unique within the process), so a restarted plugin never collides
with a stale socket. A failed registration is retried with capped backoff while the socket
keeps being served; the socket is removed on stop.

A restart (kubelet wiped the directory) ends the old streams, serves the new socket and
registers it first, then stops the old server in the background: only RPCs in flight on the
old socket wait for its grace, never the new registration.

Stopping first ends the ListAndWatch streams (kubelet keeps its stream open for as long as
the plugin serves), so the server's stop grace is only waited for by RPCs really in flight.
``start``/``stop``/``restart`` of one endpoint never overlap (a lock), and a ``restart``
after ``stop`` does nothing: the manager and the socket watcher can act on the same endpoint
without reviving a removed plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Container
from pathlib import Path

import grpc

from agent.node.deviceplugin.registration import KubeletRegistrar
from agent.node.deviceplugin.service import DevicePluginService
from agent.protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
MAX_REGISTER_BACKOFF = 5.0
STOP_GRACE = 0.2  # for RPCs in flight (Allocate); open ListAndWatch streams are ended first


UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


_last_stamp = 0


def _unique_stamp() -> int:
    """Milliseconds since the epoch, strictly increasing within the process (two starts of one
    plugin in the same millisecond still get different sockets)."""
    global _last_stamp
    _last_stamp = max(time.time_ns() // 1_000_000, _last_stamp + 1)
    return _last_stamp


def socket_file_name(resource_name: str, directory: Path) -> str:
    """A unique socket name for this start (``akri.sh/x`` → ``akri.sh-x-<ms>.sock``), shortened
    (prefix + hash) so the full path fits the 108-byte unix socket limit."""
    base = resource_name.replace("/", "-")
    suffix = f"-{_unique_stamp()}.sock"
    budget = UNIX_PATH_MAX - len(str(directory)) - 1 - len(suffix)
    if budget < 8:
        raise ValueError(
            f"device plugin directory {directory} is too long for unix socket paths "
            f"({UNIX_PATH_MAX} bytes)"
        )
    if len(base) > budget:
        digest = hashlib.sha256(base.encode()).hexdigest()[:8]
        head = base[: max(0, budget - 9)]
        base = f"{head}-{digest}" if head else digest[: max(1, budget)]
    return base + suffix


class PluginEndpoint:
    """Serves one :class:`DevicePluginService` on a unix socket and keeps it registered."""

    def __init__(
        self,
        service: DevicePluginService,
        directory: Path,
        *,
        stop_grace: float = STOP_GRACE,
        registrar: KubeletRegistrar | None = None,
    ) -> None:
        self.service = service
        self.directory = directory
        self.stop_grace = stop_grace
        self._registrar = registrar or KubeletRegistrar(directory)
        self.socket_path: Path | None = None
        self.registered = asyncio.Event()
        self.registrations = 0
        self.starts = 0
        self._server: grpc.aio.Server | None = None
        self._register_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._stopped = False  # stop() was called (and no start() since)
        self._retiring: set[asyncio.Task[None]] = set()  # old servers stopping after a restart

    @property
    def resource_name(self) -> str:
        return self.service.logic.resource_name

    @property
    def busy(self) -> bool:
        """Starting, stopping or restarting right now."""
        return self._lock.locked()

    @property
    def stopped(self) -> bool:
        return self._stopped

    async def start(self) -> None:
        """Serve on a new socket and start registering."""
        async with self._lock:
            self._stopped = False
            await self._start()

    async def _start(self) -> None:
        self.registered.clear()
        self.socket_path = self.directory / socket_file_name(self.resource_name, self.directory)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        try:
            server = grpc.aio.server()
            api_pb2_grpc.add_DevicePluginServicer_to_server(self.service, server)
            server.add_insecure_port(f"unix://{self.socket_path}")
            self._server = server
            await server.start()
            self._confirm_serving()
        except BaseException:
            # leave nothing half-started: no server, no socket (so a retry starts afresh and
            # the socket watcher sees this plugin's socket as missing)
            await self._stop()
            raise
        self.starts += 1
        self._register_task = asyncio.create_task(
            self._register_until_done(), name=f"register-{self.resource_name}"
        )

    def _confirm_serving(self) -> None:
        if self.socket_path is None or not self.socket_path.exists():
            raise RuntimeError(f"the server started but its socket {self.socket_path} is missing")

    async def _register_until_done(self) -> None:
        backoff = 0.1
        while True:
            failure: Exception
            try:
                await self._register_once()
                self._registrar.failures.succeeded(self.resource_name)
                self.registrations += 1
                self.registered.set()
                log.info(
                    "registered %s with kubelet (%s)",
                    self.resource_name,
                    self.socket_path.name if self.socket_path else "?",
                )
                return
            except asyncio.CancelledError as cancelled:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # we were stopped or restarted
                # grpc.aio raises CancelledError when the call (not this task) was cancelled,
                # e.g. its channel closed under it: a failed attempt like any other
                failure = RuntimeError(f"the Register call was cancelled {cancelled}".strip())
            except Exception as error:
                failure = error
            # one warning per streak of failures of any plugin, not one per retry (50 agents
            # started before kubelet wrote ~9,300 of them in 5 minutes: issue 36)
            self._registrar.failures.failed(
                self.resource_name, f"{_describe(failure)}; next attempt in {backoff:.1f}s"
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_REGISTER_BACKOFF)

    async def _register_once(self) -> None:
        assert self.socket_path is not None
        await self._registrar.register(
            api_pb2.RegisterRequest(
                version=API_VERSION,
                endpoint=self.socket_path.name,
                resource_name=self.resource_name,
                options=self.service.options(),
            ),
            rpc_timeout=15,
        )

    async def stop(self) -> None:
        """Stop serving and remove our socket (only ours). A later :meth:`restart` does
        nothing; :meth:`start` serves again."""
        async with self._lock:
            self._stopped = True
            await self._stop()
        self._registrar.failures.forget(self.resource_name)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def _stop(self) -> None:
        await self._shut_down(*await self._detach())

    async def _detach(self) -> tuple[grpc.aio.Server | None, Path | None]:
        """Stop registering and end the streams; the server and socket to shut down."""
        if self._register_task is not None:
            self._register_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._register_task
            self._register_task = None
        # kubelet never closes its ListAndWatch stream: end it here, or stopping the server
        # would always wait the whole grace
        self.service.end_streams()
        self.registered.clear()
        server, self._server = self._server, None
        return server, self.socket_path

    async def _shut_down(self, server: grpc.aio.Server | None, socket_path: Path | None) -> None:
        if server is not None:
            await server.stop(self.stop_grace)
        if socket_path is not None:
            _remove_socket(socket_path)

    async def restart(self) -> None:
        """New socket + re-registration (after a kubelet restart wiped the directory); does
        nothing once :meth:`stop` was called. The old server stops in the background."""
        async with self._lock:
            if self._stopped:
                return
            old_server, old_socket = await self._detach()
            try:
                await self._start()
            finally:
                task = asyncio.create_task(
                    self._shut_down(old_server, old_socket),
                    name=f"retire-{self.resource_name}",
                )
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    def socket_missing(self, present: Container[str] | None = None) -> bool:
        """True if kubelet (or anyone) removed our socket; False while we are (re)starting
        or stopping it ourselves, or after :meth:`stop`. ``present``: the names in the
        directory, if the caller listed it (saves a ``stat``)."""
        if self._stopped or self.busy or self.socket_path is None:
            return False
        if present is not None:
            return self.socket_path.name not in present
        return not self.socket_path.exists()


def _remove_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
