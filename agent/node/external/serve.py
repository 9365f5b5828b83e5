"""``akri handler NAME``: one of our handlers as an external handler process.

It serves ``v0.DiscoveryHandler/Discover`` on ``<dir>/<name>.sock`` (or, when ``POD_IP`` is
set, on ``POD_IP:<port>``, as Akri's handlers do) and registers with the agent's
``agent-registration.sock`` in the same directory — again whenever that socket is re-created
(the agent restarted) or the agent drops the last open stream, and every few seconds until an
agent accepts it.

A handler that fails inside a stream is retried there, with backoff, without ending the
stream: the agent keeps the last list it got (an error is not an empty list), as it does for
its embedded handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from agent.core.aio.fswatch import DirectoryWatch
from agent.node.external.endpoints import NETWORK, REGISTRATION_SOCKET, UDS
from agent.node.external.wire import properties_of, response_from_devices
from agent.protos.akri.discovery.v0 import discovery_pb2 as pb
from agent.protos.akri.discovery.v0 import discovery_pb2_grpc
from discovery_handlers.base import DiscoveryHandler, InvalidDiscoveryDetailsError

log = logging.getLogger("agent.handler")

REGISTER_RETRY = 2.0  # seconds between registration attempts while no agent answers
MAX_DISCOVER_BACKOFF = 60.0


class DiscoverService(discovery_pb2_grpc.DiscoveryHandlerServicer):
    """``Discover`` backed by an embedded handler."""

    def __init__(self, handler: DiscoveryHandler, dropped: asyncio.Event) -> None:
        self.handler = handler
        self.dropped = dropped  # set when the agent drops the last open stream
        self.streams = 0

    async def Discover(
        self, request: pb.DiscoverRequest, context: Any
    ) -> AsyncIterator[pb.DiscoverResponse]:
        details = request.discovery_details
        try:
            warnings = self.handler.validate(details)
        except InvalidDiscoveryDetailsError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            return
        for warning in warnings or ():
            log.warning("discoveryDetails: %s", warning)
        properties = properties_of(request)
        self.streams += 1
        backoff = 1.0
        try:
            while True:
                try:
                    async for devices in self.handler.discover(details, properties):
                        backoff = 1.0
                        yield response_from_devices(devices)
                    log.warning("handler %s ended its stream; restarting", self.handler.name)
                except InvalidDiscoveryDetailsError as error:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as error:
                    log.error(
                        "handler %s failed: %s: %s (the agent keeps its last list; retrying "
                        "in %.0fs)",
                        self.handler.name,
                        type(error).__name__,
                        error,
                        backoff,
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_DISCOVER_BACKOFF)
        finally:
            self.streams -= 1
            if self.streams == 0:
                # the agent dropped its last stream: it may have restarted (Akri's handlers
                # register again then). Not on every drop: the agent drops one
                # Configuration's stream when it cuts it off, and a registration for that
                # would make it redial the others' streams for nothing
                self.dropped.set()


class ExternalHandlerProcess:
    """Serve one handler and keep it registered with the agent."""

    def __init__(self, handler: DiscoveryHandler, directory: Path, port: int = 10000) -> None:
        self.handler = handler
        self.directory = directory
        self.port = port
        self.dropped = asyncio.Event()
        self.service = DiscoverService(handler, self.dropped)
        self.registrations = 0
        self._server: grpc.aio.Server | None = None
        self.endpoint = ""
        self.endpoint_type = UDS
        self.socket_path: Path | None = None

    async def start(self) -> None:
        """Serve ``Discover`` (UDS in the directory, or POD_IP:port)."""
        server = grpc.aio.server()
        discovery_pb2_grpc.add_DiscoveryHandlerServicer_to_server(self.service, server)
        pod_ip = os.environ.get("POD_IP")
        if pod_ip:
            host = str(ipaddress.ip_address(pod_ip))
            bracketed = f"[{host}]" if ":" in host else host
            server.add_insecure_port(f"{bracketed}:{self.port}")
            self.endpoint = f"http://{bracketed}:{self.port}"
            self.endpoint_type = NETWORK
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.socket_path = self.directory / f"{self.handler.name}.sock"
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            server.add_insecure_port(f"unix://{self.socket_path}")
            self.endpoint = str(self.socket_path)
        await server.start()
        self._server = server
        log.info("handler %s serves Discover at %s", self.handler.name, self.endpoint)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0.5)
            self._server = None
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                self.socket_path.unlink()

    async def register(self) -> None:
        """One registration (raises when no agent accepts it)."""
        target = f"unix://{self.directory / REGISTRATION_SOCKET}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = discovery_pb2_grpc.RegistrationStub(channel)
            await stub.RegisterDiscoveryHandler(
                pb.RegisterDiscoveryHandlerRequest(
                    name=self.handler.name,
                    endpoint=self.endpoint,
                    endpoint_type=self.endpoint_type,  # type: ignore[arg-type]
                    shared=self.handler.shared,
                ),
                timeout=5,
            )
        self.registrations += 1

    async def keep_registered(self) -> None:
        """Register, and again when the agent's socket is re-created or its last open stream
        is dropped; retry every :data:`REGISTER_RETRY` seconds while no agent accepts."""
        socket_path = self.directory / REGISTRATION_SOCKET
        watch = DirectoryWatch(
            [self.directory], REGISTER_RETRY, interesting=lambda n, _r: n == REGISTRATION_SOCKET
        )
        watch.arm()
        registered_inode: int | None = None
        refused_logged = ""
        try:
            while True:
                inode = _inode(socket_path)
                if inode is not None and inode != registered_inode:
                    try:
                        await self.register()
                        registered_inode = inode
                        refused_logged = ""
                        log.info(
                            "registered %s with the agent at %s", self.handler.name, socket_path
                        )
                    except grpc.aio.AioRpcError as error:
                        message = f"{error.code().name}: {error.details()}"
                        if message != refused_logged:
                            refused_logged = message
                            log.warning("registration not accepted (%s); retrying", message)
                # registered: wait for a new agent socket or a dropped stream; not yet:
                # try again within REGISTER_RETRY seconds
                within = None if registered_inode is not None else REGISTER_RETRY
                dropped = asyncio.ensure_future(self.dropped.wait())
                changed = asyncio.ensure_future(watch.changed(within=within))
                try:
                    await asyncio.wait({dropped, changed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    dropped.cancel()
                    changed.cancel()
                if self.dropped.is_set():
                    self.dropped.clear()
                    registered_inode = None  # the agent may be new: register again
        finally:
            watch.close()


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


async def run_handler_process(
    handler: DiscoveryHandler, directory: Path, port: int, stop: asyncio.Event
) -> None:
    """Serve and stay registered until ``stop``."""
    process = ExternalHandlerProcess(handler, directory, port)
    await process.start()
    keeper = asyncio.create_task(process.keep_registered(), name="register")
    try:
        await stop.wait()
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await process.stop()
