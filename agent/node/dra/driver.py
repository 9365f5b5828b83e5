"""DRA kubelet plugin gRPC surface: translates kubelet's calls to :class:`DraState`.

* ``pluginregistration.Registration`` on ``<plugins_registry>/akri.sh-reg.sock``: ``GetInfo``
  answers type ``DRAPlugin``, name ``akri.sh``, the DRA socket as endpoint and
  ``["v1.DRAPlugin", "v1beta1.DRAPlugin"]`` (kubelet takes the first it supports);
  ``NotifyRegistrationStatus`` is recorded (a refusal is logged as an error). With a
  :class:`HealthReporter` the three ``DRAResourceHealth`` versions (``health.py``) are listed
  after them and served on the DRA socket. With a :class:`ClaimStatusWriter` each prepared
  claim's ``status.devices`` is written in the background (``claim_status.py``).
* ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` and the v1beta1 twin on
  ``<plugin dir>/dra.sock``: every claim in a request gets an entry, with ``error`` set when
  preparing it failed (kubelet retries).
* The DRA server starts before the registration socket appears; both sockets are removed on
  stop. If a socket disappears (someone cleaned the directory; inotify tells, or a poll every
  ``poll`` seconds where it cannot) both are served again so kubelet's plugin watcher
  registers us again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from agent.core import telemetry
from agent.core.aio.fswatch import DirectoryWatch
from agent.core.store.base import StoreError
from agent.node.dra.claim_status import ClaimStatusWriter
from agent.node.dra.health import HEALTH_SERVICES, HealthReporter, add_health_services
from agent.node.dra.state import ClaimRef, DraState, PrepareError
from agent.ops.streaks import FailureStreak
from agent.protos.dra.v1 import api_pb2 as v1
from agent.protos.dra.v1 import api_pb2_grpc as v1_grpc
from agent.protos.dra.v1beta1 import api_pb2 as v1beta1
from agent.protos.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent.protos.pluginregistration.v1 import api_pb2 as reg
from agent.protos.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

DRIVER_NAME = "akri.sh"
SUPPORTED_VERSIONS = ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: Path, versions: list[str] = SUPPORTED_VERSIONS) -> None:
        self.endpoint = endpoint
        self.versions = versions
        self.status: tuple[bool, str] | None = None
        self.registered = asyncio.Event()
        # kubelet retries a refused registration about every second: one error line when the
        # refusals start, one when they end, the count in a metric (issue 36)
        self.refusals = FailureStreak(
            log,
            f"registering DRA driver {DRIVER_NAME} with kubelet",
            'akri_kubelet_registration_failures_total{plugin="dra"}',
            noun="driver",
            level=logging.ERROR,
        )

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg.PluginInfo(
            type="DRAPlugin",
            name=DRIVER_NAME,
            endpoint=str(self.endpoint),
            supported_versions=self.versions,
        )

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.status = (request.plugin_registered, request.error)
        if request.plugin_registered:
            self.refusals.succeeded(DRIVER_NAME)
            log.info("kubelet registered DRA driver %s", DRIVER_NAME)
            self.registered.set()
        else:
            self.refusals.failed(DRIVER_NAME, f"kubelet refused it: {request.error}")
        return reg.RegistrationStatusResponse()


async def _prepare_all(
    state: DraState, claims: Any, pb: Any, status: ClaimStatusWriter | None = None
) -> Any:
    started = time.perf_counter()
    try:
        return await _prepare_claims(state, claims, pb, status)
    finally:
        telemetry.NODE_PREPARE.observe(time.perf_counter() - started)


async def _prepare_claims(
    state: DraState, claims: Any, pb: Any, status: ClaimStatusWriter | None
) -> Any:
    responses = {}
    for claim in claims:
        ref = ClaimRef(claim.namespace, claim.uid, claim.name)
        try:
            prepared = await state.prepare(ref)
        except PrepareError as error:
            log.warning("prepare %s/%s (%s) failed: %s", ref.namespace, ref.name, ref.uid, error)
            responses[claim.uid] = pb.NodePrepareResourceResponse(error=str(error))
            continue
        except Exception as error:  # never take the server down; kubelet retries
            log.exception("prepare %s failed", ref.uid)
            responses[claim.uid] = pb.NodePrepareResourceResponse(
                error=f"internal error: {type(error).__name__}: {error}"
            )
            continue
        devices = []
        seen: set[tuple[str, str, str | None]] = set()
        for item in prepared.devices:
            if (item.pool, item.device, item.share_id) in seen:
                continue  # the slots of one consumable-capacity allocation: one device
            seen.add((item.pool, item.device, item.share_id))
            fields: dict[str, Any] = {
                "request_names": list(item.request_names),
                "pool_name": item.pool,
                "device_name": item.device,
                "cdi_device_ids": list(item.cdi_device_ids),
            }
            if item.share_id is not None and pb is v1:
                fields["share_id"] = item.share_id
            devices.append(pb.Device(**fields))
        responses[claim.uid] = pb.NodePrepareResourceResponse(devices=devices)
        if status is not None:
            status.prepared(prepared)  # status.devices, in the background
    return pb.NodePrepareResourcesResponse(claims=responses)


async def _unprepare_all(state: DraState, claims: Any, pb: Any) -> Any:
    responses = {}
    for claim in claims:
        try:
            await state.unprepare(ClaimRef(claim.namespace, claim.uid, claim.name))
            responses[claim.uid] = pb.NodeUnprepareResourceResponse()
        except StoreError as error:
            # the API or the disk (StorageError names the file and the cause): kubelet retries
            log.warning("unprepare %s failed: %s", claim.uid, error)
            responses[claim.uid] = pb.NodeUnprepareResourceResponse(error=f"unavailable: {error}")
        except Exception as error:
            log.exception("unprepare %s failed", claim.uid)
            responses[claim.uid] = pb.NodeUnprepareResourceResponse(
                error=f"internal error: {type(error).__name__}: {error}"
            )
    return pb.NodeUnprepareResourcesResponse(claims=responses)


class _DraV1(v1_grpc.DRAPluginServicer):
    def __init__(self, state: DraState, status: ClaimStatusWriter | None = None) -> None:
        self.state = state
        self.status = status

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return await _prepare_all(self.state, request.claims, v1, self.status)

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        return await _unprepare_all(self.state, request.claims, v1)


class _DraV1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, state: DraState, status: ClaimStatusWriter | None = None) -> None:
        self.state = state
        self.status = status

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        return await _prepare_all(self.state, request.claims, v1beta1, self.status)

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        return await _unprepare_all(self.state, request.claims, v1beta1)


class DraDriver:
    """Serves the DRA and registration sockets."""

    def __init__(
        self,
        state: DraState,
        registry_dir: Path,
        plugin_dir: Path,
        *,
        poll: float = 0.5,
        health: HealthReporter | None = None,
        claim_status: ClaimStatusWriter | None = None,
    ) -> None:
        self.state = state
        self.registry_dir = registry_dir
        self.plugin_dir = plugin_dir
        self.dra_socket = plugin_dir / "dra.sock"
        self.registration_socket = registry_dir / f"{DRIVER_NAME}-reg.sock"
        self.health = health
        self.claim_status = claim_status
        # the health services after the DRAPlugin ones: kubelet takes the first DRAPlugin
        # version it knows and ignores entries it does not (validateSupportedServices)
        versions = SUPPORTED_VERSIONS + (list(HEALTH_SERVICES) if health is not None else [])
        self.registration = _Registration(self.dra_socket, versions)
        self._poll = poll
        self._dra_server: grpc.aio.Server | None = None
        self._reg_server: grpc.aio.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        self.re_registrations = 0

    @property
    def registration_failures(self) -> int:
        """Registrations kubelet refused (``akri_kubelet_registration_failures_total``)."""
        return self.registration.refusals.failures

    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        await self._serve()
        self._watch = asyncio.create_task(self._keep_registration(), name="dra-registration")

    async def _serve(self) -> None:
        """DRA service first, then the registration socket kubelet's watcher picks up."""
        with contextlib.suppress(FileNotFoundError):
            self.dra_socket.unlink()
        server = grpc.aio.server()
        v1_grpc.add_DRAPluginServicer_to_server(_DraV1(self.state, self.claim_status), server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(
            _DraV1beta1(self.state, self.claim_status), server
        )
        if self.health is not None:
            add_health_services(self.health, server)
        server.add_insecure_port(f"unix://{self.dra_socket}")
        await server.start()
        self._dra_server = server
        await self._start_registration()

    async def _start_registration(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.registration_socket.unlink()
        server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self.registration, server)
        server.add_insecure_port(f"unix://{self.registration_socket}")
        await server.start()
        self._reg_server = server
        log.info(
            "DRA driver %s: registration socket %s, service socket %s",
            DRIVER_NAME,
            self.registration_socket,
            self.dra_socket,
        )

    async def _keep_registration(self) -> None:
        names = {self.registration_socket.name, self.dra_socket.name}
        watch = DirectoryWatch(
            [self.registry_dir, self.plugin_dir],
            self._poll,
            interesting=lambda name, removed: removed and name in names,
        )
        try:
            watch.arm()
            while True:
                if not (self.registration_socket.exists() and self.dra_socket.exists()):
                    log.info("DRA sockets removed: serving them again so kubelet re-registers us")
                    self.re_registrations += 1
                    await self._stop_servers()
                    await self._serve()
                await watch.changed()
        finally:
            watch.close()

    async def _stop_servers(self) -> None:
        for server in (self._reg_server, self._dra_server):
            if server is not None:
                await server.stop(0.2)
        self._reg_server = self._dra_server = None
        for path in (self.registration_socket, self.dra_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._stop_servers()
        if self.claim_status is not None:
            await self.claim_status.stop()
