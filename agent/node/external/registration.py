"""The agent's ``v0.Registration`` service on ``<dir>/agent-registration.sock``.

Only this unix socket is served (never a network port), so only processes that can write the
handler directory can register. A registration names a handler; its endpoint joins that
name's :class:`ExternalHandler` (created on first registration and put in the agent's handler
registry, where it takes precedence over an embedded handler of the same name: an operator
who deploys an external udev handler wants that one). Then ``on_registered(name)`` lets the
discovery manager start the Configurations that were waiting for the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from agent.node.external.endpoints import (
    REGISTRATION_SOCKET,
    EndpointPolicy,
    RegistrationRefusedError,
    check_registration,
)
from agent.node.external.handler import ExternalHandler, ProblemReporter
from agent.protos.akri.discovery.v0 import discovery_pb2 as pb
from agent.protos.akri.discovery.v0 import discovery_pb2_grpc
from discovery_handlers.registry import HandlerRegistry

log = logging.getLogger("agent.external")


def is_local_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Is ``address`` one of this host's (the kernel lets us bind only to those)?"""
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


class RegistrationService(discovery_pb2_grpc.RegistrationServicer):
    """Accepts or refuses registrations (the protocol part only)."""

    def __init__(
        self,
        policy: EndpointPolicy,
        handlers: HandlerRegistry,
        on_registered: Callable[[str], None],
        report: ProblemReporter,
        make_handler: Callable[[str, bool, ProblemReporter], ExternalHandler] = ExternalHandler,
    ) -> None:
        self.policy = policy
        self.handlers = handlers
        self.on_registered = on_registered
        self.report = report
        self.make_handler = make_handler
        self.external: dict[str, ExternalHandler] = {}
        self.refused = 0

    async def RegisterDiscoveryHandler(
        self, request: pb.RegisterDiscoveryHandlerRequest, context: Any
    ) -> pb.Empty:
        try:
            endpoint = check_registration(
                request.name,
                request.endpoint,
                request.endpoint_type,
                request.shared,
                self.policy,
                is_local_address,
            )
            handler = self.external.get(endpoint.name)
            embedded = self.handlers.get(endpoint.name)
            current = handler if handler is not None else embedded
            if current is not None and current.shared != endpoint.shared:
                raise RegistrationRefusedError(
                    f"handler {endpoint.name}: registered as shared={endpoint.shared}, but "
                    f"{endpoint.name} is already shared={current.shared}"
                )
        except RegistrationRefusedError as error:
            self.refused += 1
            log.warning("discovery handler registration refused: %s", error)
            code = (
                grpc.StatusCode.PERMISSION_DENIED
                if error.permission
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(error))
            raise AssertionError("unreachable") from error  # abort raises
        if handler is None:
            handler = self.make_handler(endpoint.name, endpoint.shared, self.report)
            self.external[endpoint.name] = handler
            if embedded is not None:
                log.info(
                    "discovery handler %s registered externally: it replaces the embedded one",
                    endpoint.name,
                )
            self.handlers.register(handler)
        known = endpoint.uid in handler.endpoints
        handler.add(endpoint)
        log.info(
            "discovery handler %s %s at %s (shared: %s)",
            endpoint.name,
            "registered again" if known else "registered",
            endpoint.endpoint,
            endpoint.shared,
        )
        self.on_registered(endpoint.name)
        return pb.Empty()


class RegistrationServer:
    """Serves :class:`RegistrationService` on the registration socket."""

    def __init__(self, directory: Path, service: RegistrationService) -> None:
        self.directory = directory
        self.socket_path = directory / REGISTRATION_SOCKET
        self.service = service
        self._server: grpc.aio.Server | None = None
        self._inode: int | None = None

    async def start(self) -> bool:
        """Serve; False (with a log line) when the socket cannot be served: another live
        agent serves it, or the directory is not writable. The agent goes on without
        external handlers then."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            log.warning(
                "external discovery handlers off: cannot create %s (%s); set "
                "--discovery-handlers-dir",
                self.directory,
                error.strerror or error,
            )
            return False
        if await _answers(self.socket_path):
            log.warning(
                "external discovery handlers off: another agent serves %s", self.socket_path
            )
            return False
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # a stale socket of an earlier run
        server = grpc.aio.server()
        discovery_pb2_grpc.add_RegistrationServicer_to_server(self.service, server)
        try:
            server.add_insecure_port(f"unix://{self.socket_path}")
            await server.start()
        except Exception as error:  # grpc raises RuntimeError for an unusable address
            log.warning(
                "external discovery handlers off: cannot serve %s (%s)", self.socket_path, error
            )
            await server.stop(None)
            return False
        self._server = server
        with contextlib.suppress(OSError):
            self._inode = os.stat(self.socket_path).st_ino
        log.info("discovery handler registration served on %s", self.socket_path)
        return True

    async def stop(self) -> None:
        """Stop serving and remove the socket (if it is still ours), so handlers notice a
        restarted agent by its new socket."""
        if self._server is None:
            return
        await self._server.stop(0.2)
        self._server = None
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == self._inode:
                self.socket_path.unlink()


async def _answers(path: Path) -> bool:
    """Does a process accept connections on the unix socket ``path``?"""
    try:
        _reader, writer = await asyncio.open_unix_connection(str(path))
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
