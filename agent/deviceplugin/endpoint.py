"""One plugin's socket: serve, confirm it is up, register with kubelet, re-register on demand.

Follows what kubelet expects (reference §1.4): serve first, self-dial, then ``Register`` on
``kubelet.sock`` with the socket *file name* as endpoint and the same options that
``GetDevicePluginOptions`` returns. Each start uses a fresh socket name
(``<resource>-<ms>.sock``), so a restarted plugin never collides with a stale socket. A
failed registration is retried with capped backoff while the socket keeps being served;
the socket is removed on stop.

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

from agent.deviceplugin.service import DevicePluginService
from agent.protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
API_VERSION = "v1beta1"
MAX_REGISTER_BACKOFF = 5.0
STOP_GRACE = 0.2  # for RPCs in flight (Allocate); open ListAndWatch streams are ended first


UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


def socket_file_name(resource_name: str, directory: Path) -> str:
    """A unique socket name for this start (``akri.sh/x`` → ``akri.sh-x-<ms>.sock``), shortened
    (prefix + hash) so the full path fits the 108-byte unix socket limit."""
    base = resource_name.replace("/", "-")
    suffix = f"-{time.time_ns() // 1_000_000}.sock"
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
        self, service: DevicePluginService, directory: Path, *, stop_grace: float = STOP_GRACE
    ) -> None:
        self.service = service
        self.directory = directory
        self.stop_grace = stop_grace
        self._kubelet_target = f"unix://{directory / KUBELET_SOCKET}"
        self.socket_path: Path | None = None
        self.registered = asyncio.Event()
        self.registrations = 0
        self.starts = 0
        self._server: grpc.aio.Server | None = None
        self._register_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._stopped = False  # stop() was called (and no start() since)

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
            await self._self_dial()
        except BaseException:
            # leave nothing half-started: no server, no socket (so a retry starts afresh and
            # the socket watcher sees this plugin's socket as missing)
            await self._stop()
            raise
        self.starts += 1
        self._register_task = asyncio.create_task(
            self._register_until_done(), name=f"register-{self.resource_name}"
        )

    async def _self_dial(self) -> None:
        async with grpc.aio.insecure_channel(f"unix://{self.socket_path}") as channel:
            async with asyncio.timeout(5):
                await channel.channel_ready()

    async def _register_until_done(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._register_once()
                self.registrations += 1
                self.registered.set()
                log.info(
                    "registered %s with kubelet (%s)",
                    self.resource_name,
                    self.socket_path.name if self.socket_path else "?",
                )
                return
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning(
                    "registering %s failed (%s); retrying in %.1fs",
                    self.resource_name,
                    _describe(error),
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_REGISTER_BACKOFF)

    async def _register_once(self) -> None:
        assert self.socket_path is not None
        async with grpc.aio.insecure_channel(self._kubelet_target) as channel:
            stub = api_pb2_grpc.RegistrationStub(channel)
            await stub.Register(
                api_pb2.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket_path.name,
                    resource_name=self.resource_name,
                    options=self.service.options(),
                ),
                timeout=15,
            )

    async def stop(self) -> None:
        """Stop serving and remove our socket (only ours). A later :meth:`restart` does
        nothing; :meth:`start` serves again."""
        async with self._lock:
            self._stopped = True
            await self._stop()

    async def _stop(self) -> None:
        if self._register_task is not None:
            self._register_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._register_task
            self._register_task = None
        # kubelet never closes its ListAndWatch stream: end it here, or stop() would always
        # wait the whole grace
        self.service.end_streams()
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(self.stop_grace)
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.registered.clear()

    async def restart(self) -> None:
        """New socket + re-registration (after a kubelet restart wiped the directory); does
        nothing once :meth:`stop` was called."""
        async with self._lock:
            if self._stopped:
                return
            await self._stop()
            await self._start()

    def socket_missing(self, present: Container[str] | None = None) -> bool:
        """True if kubelet (or anyone) removed our socket; False while we are (re)starting
        or stopping it ourselves, or after :meth:`stop`. ``present``: the names in the
        directory, if the caller listed it (saves a ``stat``)."""
        if self._stopped or self.busy or self.socket_path is None:
            return False
        if present is not None:
            return self.socket_path.name not in present
        return not self.socket_path.exists()


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
