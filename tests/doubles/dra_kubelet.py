"""A kubelet double for DRA kubelet plugins: the plugin watcher plus the DRA manager of one node.

It speaks the real wire protocol over unix sockets with the generated stubs, so a DRA plugin is
driven exactly as the kubelet would drive it (reference ``k8s-device-apis.md`` §2.3, §3.1, §3.4):

* **Plugin watcher** (``pluginmanager/pluginwatcher``): :meth:`DraKubeletDouble.start` scans
  ``registry_dir`` (recursively, names starting with ``.`` ignored, only unix sockets) and then
  polls it every ``poll_interval`` seconds. For a new socket it calls
  ``pluginregistration.Registration/GetInfo`` with a 1 s timeout, validates the answer
  (``type == "DRAPlugin"``, a non-empty name, and the **first** entry of ``supported_versions``
  that the kubelet supports - ``v1.DRAPlugin`` or ``v1beta1.DRAPlugin`` - in the plugin's
  order), takes ``PluginInfo.endpoint`` (or the registration socket itself when it is empty)
  and answers ``NotifyRegistrationStatus(plugin_registered=True)``, or ``False`` with the error
  text when validation fails. A failed attempt (GetInfo error, validation, failed notify) is
  retried from scratch with exponential backoff (0.5 s doubling, like the kubelet's nested
  pending operations). A removed socket, or one replaced by a new inode, is a deregistration.
  Several instances of a driver may be registered (rolling update); the most recently
  registered one is used.
* **DRA manager** (``cm/dra``): :meth:`DraKubeletDouble.prepare` adds the pod's references to
  its claims and calls ``NodePrepareResources`` once per driver with all of the pod's claims
  for that driver that are not prepared on this node yet (a claim shared by several pods is
  prepared once; later pods get the cached result). Every requested claim UID must have an
  entry, unknown UIDs and non-empty ``error`` fields fail the call, like the kubelet.
  ``NodeUnprepareResources`` is called only when the last pod referencing a claim is gone
  (:meth:`DraKubeletDouble.remove_pod`, :meth:`DraKubeletDouble.unprepare`).
  With an API-server double, the claim is fetched first: it must exist with the same UID, be
  allocated and (by default) list the pod in ``status.reservedFor``; the drivers to call are the
  ones in ``status.allocation.devices.results``. Without one, pass ``driver=`` or register
  exactly one driver.
* **Restart** (:meth:`DraKubeletDouble.restart`): registrations are forgotten and the registry
  directory is re-scanned (the kubelet does *not* wipe ``plugins_registry``), the prepared-claims
  checkpoint (``dra_manager_state``) and pod references are kept, and with an API-server double
  every ResourceSlice with ``spec.nodeName == node_name`` is deleted.
* **Wiping**: when the last registered instance of a driver goes away, the driver's slices on
  this node are deleted after ``wipe_delay`` seconds (30 s in the kubelet; ``None`` disables)
  unless an instance registers again.

* **Device health** (KEP-4680, ``ResourceHealthStatus`` gate; ``health=True``, the default):
  for every registration a task opens ``DRAResourceHealth/NodeWatchResources`` on the DRA
  socket and consumes the stream like ``HandleWatchResourcesStream`` (``pkg/kubelet/cm/dra/
  manager.go``): each message replaces the driver's device list (``updateHealthInfo``); a
  device whose status is older than its ``health_check_timeout_seconds`` (30 s when ≤ 0) reads
  ``Unknown`` (``getHealthInfo``); when the stream ends the driver's health is cleared
  (``clearDriver``) and it is opened again after ``health_retry`` seconds (5 s,
  ``wait.UntilWithContext``). Which version: with ``health_by_advertisement`` (newer kubelets,
  ``pickHealthService``) the first of ``v1``, ``v1alpha1`` that the plugin lists in
  ``supported_versions``, none if it lists neither; without it (kubelet 1.34-1.36) always
  ``v1alpha1``. Pods given to :meth:`track_pod` get ``status.containerStatuses[].
  allocatedResourcesStatus`` as ``UpdateAllocatedResourcesStatus`` builds it (resource name
  ``claim:<pod claim>[/<request>]``, one entry per prepared device with ``resourceID`` = its
  first CDI id, else ``<driver>/<pool>/<device>``; ``health``; ``message`` when set — the
  ``ResourceHealthStatusMessage`` field); the claim's real name comes from
  ``status.resourceClaimStatuses``, like the kubelet. With an API double the pod status is
  also written through the ``pods/status`` subresource when it changes.

* **Pods and the extended-resource claim** (KEP-5004): :meth:`DraKubeletDouble.pod_claims`
  lists what kubelet prepares for a Pod object — its ``spec.resourceClaims`` (named through
  ``status.resourceClaimStatuses``) and the special claim the scheduler created for extended
  resources backed by DRA (``status.extendedResourceClaimStatus.resourceClaimName``);
  :meth:`DraKubeletDouble.prepare_pod` prepares them; :meth:`DraKubeletDouble.
  container_cdi_devices` gives each container the CDI ids of its claims and of the requests
  ``requestMappings`` maps to it.

Not emulated: the periodic ``GetInfo`` health probing of newer plugin watchers, the gRPC
connection monitoring (a registered instance counts as connected until its socket goes away),
CDI hand-off to a runtime, and the claim tombstones.

All times are ``time.monotonic()`` values.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from agent.protos.dra.v1 import api_pb2 as dra_v1
from agent.protos.dra.v1 import api_pb2_grpc as dra_v1_grpc
from agent.protos.dra.v1beta1 import api_pb2 as dra_v1beta1
from agent.protos.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from agent.protos.dra_health.v1 import api_pb2 as health_v1
from agent.protos.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from agent.protos.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from agent.protos.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from agent.protos.pluginregistration.v1 import api_pb2 as reg
from agent.protos.pluginregistration.v1 import api_pb2_grpc as reg_grpc

if TYPE_CHECKING:
    from tests.doubles.apiserver import ApiServerDouble

DRA_PLUGIN_TYPE = "DRAPlugin"
DRA_V1 = "v1.DRAPlugin"
DRA_V1BETA1 = "v1beta1.DRAPlugin"
# servicesSupportedByKubelet in pkg/kubelet/cm/dra/plugin/dra_plugin.go (kubelet 1.34+).
SERVICES_SUPPORTED_BY_KUBELET: tuple[str, ...] = (DRA_V1, DRA_V1BETA1)
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
DEFAULT_CALL_TIMEOUT = 45.0  # defaultClientCallTimeout
WIPING_DELAY = 30.0  # defaultWipingDelay
INITIAL_BACKOFF = 0.5
MAX_BACKOFF = 122.0

RESOURCE_CLAIMS = "resourceclaims.resource.k8s.io"
RESOURCE_SLICES = "resourceslices.resource.k8s.io"
PODS = "pods"
HEALTH_V1 = "v1.DRAResourceHealth"
HEALTH_V1ALPHA1 = "v1alpha1.DRAResourceHealth"
# healthServicesSupportedByKubelet / pickHealthService (dra_plugin_manager.go), v1 preferred.
HEALTH_SERVICES_SUPPORTED_BY_KUBELET: tuple[str, ...] = (HEALTH_V1, HEALTH_V1ALPHA1)
HEALTH_RETRY = 5.0  # wait.UntilWithContext(..., 5*time.Second)
DEFAULT_HEALTH_TIMEOUT = 30.0  # DefaultHealthTimeout
_HEALTH_MODULES: dict[str, tuple[ModuleType, ModuleType]] = {
    HEALTH_V1: (health_v1, health_v1_grpc),
    HEALTH_V1ALPHA1: (health_v1alpha1, health_v1alpha1_grpc),
}

JSON = dict[str, Any]
ClaimRef = tuple[str, str, str]
"""``(namespace, uid, name)`` of a ResourceClaim, as in ``dra.v1.Claim``."""

# The generated stubs' modules per service string: (messages, grpc stubs).
_SERVICE_MODULES: dict[str, tuple[ModuleType, ModuleType]] = {
    DRA_V1: (dra_v1, dra_v1_grpc),
    DRA_V1BETA1: (dra_v1beta1, dra_v1beta1_grpc),
}


class DraKubeletError(Exception):
    """A failure the kubelet would report (pod start or teardown fails and is retried)."""


class PrepareError(DraKubeletError):
    """NodePrepareResources failed (RPC error, missing/unknown claim entries, claim errors)."""


class UnprepareError(DraKubeletError):
    """NodeUnprepareResources failed."""


@dataclass(frozen=True)
class Registration:
    """A registered DRA plugin instance."""

    driver: str
    socket: Path  # the registration socket
    endpoint: str  # the DRA service socket (PluginInfo.endpoint or the registration socket)
    service: str  # the chosen service, "v1.DRAPlugin" or "v1beta1.DRAPlugin"
    supported_versions: tuple[str, ...]
    registered_at: float


@dataclass(frozen=True)
class RegistrationAttempt:
    """One run of the registration sequence for a socket."""

    socket: Path
    at: float
    info: reg.PluginInfo | None  # None when GetInfo failed
    registered: bool  # the value sent as plugin_registered (False also when GetInfo failed)
    error: str  # the error sent in NotifyRegistrationStatus, or why the attempt failed
    notified: bool  # NotifyRegistrationStatus was delivered


@dataclass(frozen=True)
class Deregistration:
    driver: str
    socket: Path
    at: float


@dataclass(frozen=True)
class DraCall:
    """One NodePrepareResources / NodeUnprepareResources call."""

    method: str  # "NodePrepareResources" | "NodeUnprepareResources"
    driver: str
    endpoint: str
    service: str
    claims: tuple[ClaimRef, ...]
    at: float
    response: Any | None  # the response message, None on an RPC error
    error: str | None  # RPC error text


@dataclass
class ClaimInfo:
    """The kubelet's checkpointed state of one claim on this node (``dra_manager_state``)."""

    namespace: str
    uid: str
    name: str
    pods: set[str] = field(default_factory=set)
    drivers: list[str] = field(default_factory=list)
    prepared: bool = False
    response: Any | None = None  # NodePrepareResourceResponse (of the service used)
    # driver -> its prepared devices (claimInfo.DriverState), for the health status
    driver_devices: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def ref(self) -> ClaimRef:
        return (self.namespace, self.uid, self.name)


@dataclass(frozen=True)
class DeviceHealthState:
    """The kubelet's cached health of one device (``state.DeviceHealth``)."""

    health: str  # "Healthy" | "Unhealthy" | "Unknown"
    message: str
    received: float  # monotonic time of the message that carried it
    timeout: float


@dataclass(frozen=True)
class HealthUpdate:
    """One message received on a NodeWatchResources stream."""

    driver: str
    service: str
    at: float
    devices: dict[tuple[str, str], DeviceHealthState]
    changed: tuple[tuple[str, str], ...]  # (pool, device) whose health changed


@dataclass
class _SocketState:
    path: Path
    inode: int
    registered: bool = False
    next_attempt: float = 0.0
    backoff: float = INITIAL_BACKOFF


def _rpc_error_text(exc: grpc.aio.AioRpcError) -> str:
    return f"rpc error: code = {exc.code().name} desc = {exc.details()}"


def _target(path: str | Path) -> str:
    text = str(path)
    return f"unix://{text}" if text.startswith("/") else f"unix:{text}"


class DraKubeletDouble:
    """The plugin watcher and DRA manager of the kubelet on node ``node_name``.

    Use as ``async with DraKubeletDouble(registry_dir, "node-a", api) as kubelet: ...`` or call
    :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        registry_dir: Path,
        node_name: str,
        api: ApiServerDouble | None = None,
        *,
        poll_interval: float = 0.1,
        get_info_timeout: float = GET_INFO_TIMEOUT,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        wipe_delay: float | None = WIPING_DELAY,
        check_reserved_for: bool = True,
        initial_backoff: float = INITIAL_BACKOFF,
        health: bool = True,
        health_by_advertisement: bool = True,
        health_retry: float = HEALTH_RETRY,
    ) -> None:
        self.registry_dir = Path(registry_dir)
        self.node_name = node_name
        self.api = api
        self.poll_interval = poll_interval
        self.get_info_timeout = get_info_timeout
        self.call_timeout = call_timeout
        self.wipe_delay = wipe_delay
        self.check_reserved_for = check_reserved_for
        self.initial_backoff = initial_backoff
        self.health_enabled = health
        self.health_by_advertisement = health_by_advertisement
        self.health_retry = health_retry
        # History, kept across restarts.
        self.attempts: list[RegistrationAttempt] = []
        self.deregistrations: list[Deregistration] = []
        self.calls: list[DraCall] = []
        self.wiped: list[tuple[str | None, list[str]]] = []  # (driver or None = all, names)
        self.restarts = 0
        self.health_updates: list[HealthUpdate] = []
        self.health_streams_opened: list[tuple[str, str]] = []  # (driver, service)
        self.pod_status_writes: list[tuple[str, JSON]] = []  # (pod uid, containerStatuses)
        # Live state.
        self._registrations: dict[Path, Registration] = {}
        self._sockets: dict[Path, _SocketState] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._wipe_tasks: dict[str, asyncio.Task[None]] = {}
        self._poll_task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Future[None]] = set()
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()
        self._health_tasks: dict[Path, asyncio.Task[None]] = {}
        self.device_health: dict[str, dict[tuple[str, str], DeviceHealthState]] = {}
        self.pod_objects: dict[str, JSON] = {}  # pod uid -> Pod object (track_pod)
        self._pod_statuses: dict[str, JSON] = {}
        # Checkpoint (survives restart()).
        self.claims: dict[str, ClaimInfo] = {}

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, *, wipe_slices: bool = False) -> None:
        """Scan the registry directory once (registering what is there), then keep polling.

        ``wipe_slices`` deletes this node's ResourceSlices first, like a kubelet start."""
        if self._poll_task is not None:
            return
        if wipe_slices:
            self.wipe_node_slices()
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        await self._poll_once()
        self._poll_task = asyncio.create_task(self._poll_loop(), name="dra-kubelet-watcher")

    async def stop(self) -> None:
        """Stop watching and close all plugin connections. Registrations are forgotten."""
        task, self._poll_task = self._poll_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for wipe in self._wipe_tasks.values():
            wipe.cancel()
        for wipe in self._wipe_tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await wipe
        self._wipe_tasks.clear()
        for path in list(self._health_tasks):
            await self._stop_health(path)
        self.device_health.clear()
        self._registrations.clear()
        self._sockets.clear()
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close(None)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def restart(self) -> None:
        """A kubelet restart: forget registrations, keep the claim checkpoint and pods, delete
        this node's ResourceSlices (when an API double is given), re-scan the sockets."""
        await self.stop()
        self.restarts += 1
        await self.start(wipe_slices=True)

    async def __aenter__(self) -> DraKubeletDouble:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- registrations -------------------------------------------------------------------

    @property
    def registrations(self) -> list[Registration]:
        """Current registrations, oldest first."""
        return sorted(self._registrations.values(), key=lambda r: r.registered_at)

    def registration(self, driver: str) -> Registration | None:
        """The instance of ``driver`` the kubelet would use (the most recently registered)."""
        found = [r for r in self._registrations.values() if r.driver == driver]
        return max(found, key=lambda r: r.registered_at) if found else None

    def drivers(self) -> list[str]:
        return sorted({r.driver for r in self._registrations.values()})

    def attempts_for(self, socket: Path | str) -> list[RegistrationAttempt]:
        return [a for a in self.attempts if a.socket == Path(socket)]

    async def wait_for(
        self,
        predicate: Callable[[], bool],
        timeout: float = 5.0,  # noqa: ASYNC109
        what: str = "condition",
    ) -> None:
        """Wait until ``predicate()`` is true (re-checked after every watcher pass)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, self.poll_interval))

    async def wait_for_registration(
        self,
        driver: str,
        timeout: float = 5.0,  # noqa: ASYNC109
    ) -> Registration:
        await self.wait_for(
            lambda: self.registration(driver) is not None, timeout, f"{driver} to register"
        )
        registration = self.registration(driver)
        assert registration is not None
        return registration

    async def wait_for_deregistration(
        self,
        driver: str,
        timeout: float = 5.0,  # noqa: ASYNC109
    ) -> None:
        await self.wait_for(
            lambda: self.registration(driver) is None, timeout, f"{driver} to deregister"
        )

    async def wait_for_attempts(
        self,
        socket: Path | str,
        count: int = 1,
        timeout: float = 5.0,  # noqa: ASYNC109
    ) -> list[RegistrationAttempt]:
        await self.wait_for(
            lambda: len(self.attempts_for(socket)) >= count,
            timeout,
            f"{count} registration attempt(s) on {socket}",
        )
        return self.attempts_for(socket)

    @staticmethod
    def choose_service(supported_versions: Sequence[str]) -> str | None:
        """``validateSupportedServices``: the first plugin-listed service the kubelet supports."""
        for service in supported_versions:
            if service in SERVICES_SUPPORTED_BY_KUBELET:
                return service
        return None

    # --- the watcher ---------------------------------------------------------------------

    def _scan(self) -> dict[Path, int]:
        found: dict[Path, int] = {}

        def walk(directory: str) -> None:
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                return
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    walk(entry.path)
                elif stat.S_ISSOCK(st.st_mode):
                    found[Path(entry.path)] = st.st_ino

        walk(str(self.registry_dir))
        return found

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            await self._poll_once()

    async def _poll_once(self) -> None:
        current = self._scan()
        for path, state in list(self._sockets.items()):
            if current.get(path) != state.inode:
                self._forget_socket(path)
        for path, inode in current.items():
            if path not in self._sockets:
                self._sockets[path] = _SocketState(path, inode, backoff=self.initial_backoff)
        now = time.monotonic()
        due = [s for s in self._sockets.values() if not s.registered and s.next_attempt <= now]
        if due:
            await asyncio.gather(*(self._register(s) for s in due))
        self._changed.set()

    def _forget_socket(self, path: Path) -> None:
        self._sockets.pop(path, None)
        registration = self._registrations.pop(path, None)
        if registration is None:
            return
        self.deregistrations.append(Deregistration(registration.driver, path, time.monotonic()))
        task = self._health_tasks.pop(path, None)
        if task is not None:
            task.cancel()
        self._close_unused_channels()
        if self.registration(registration.driver) is None:
            self._schedule_wipe(registration.driver)

    def _validate(self, path: Path, info: reg.PluginInfo) -> tuple[str | None, str]:
        """Returns (chosen service, error text); the error is what the kubelet notifies."""
        if info.type != DRA_PLUGIN_TYPE:
            return None, (
                f"RegisterPlugin error -- no handler registered for plugin type: {info.type} "
                f"at socket {path}"
            )
        if not info.name:
            return None, "RegisterPlugin error -- plugin validation failed with err: empty name"
        versions = list(info.supported_versions)
        if not versions:
            return None, (
                "RegisterPlugin error -- plugin validation failed with err: "
                "empty list of supported versions"
            )
        service = self.choose_service(versions)
        if service is None:
            return None, (
                "RegisterPlugin error -- plugin validation failed with err: none of the "
                f"services supported by the plugin ({', '.join(versions)}) are supported by "
                f"the kubelet ({', '.join(SERVICES_SUPPORTED_BY_KUBELET)})"
            )
        return service, ""

    async def _register(self, state: _SocketState) -> None:
        path = state.path
        info: reg.PluginInfo | None = None
        service: str | None = None
        error = ""
        notified = False
        async with grpc.aio.insecure_channel(_target(path)) as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = await stub.GetInfo(reg.InfoRequest(), timeout=self.get_info_timeout)
            except grpc.aio.AioRpcError as exc:
                error = f"failed to get plugin info using RPC GetInfo at socket {path}: " + (
                    _rpc_error_text(exc)
                )
            if info is not None:
                service, error = self._validate(path, info)
                if service is not None and self._sockets.get(path) is state:
                    self._registrations[path] = Registration(
                        driver=info.name,
                        socket=path,
                        endpoint=info.endpoint or str(path),
                        service=service,
                        supported_versions=tuple(info.supported_versions),
                        registered_at=time.monotonic(),
                    )
                    wipe = self._wipe_tasks.pop(info.name, None)
                    if wipe is not None:
                        wipe.cancel()
                    self._start_health(self._registrations[path])
                try:
                    await stub.NotifyRegistrationStatus(
                        reg.RegistrationStatus(plugin_registered=service is not None, error=error),
                        timeout=NOTIFY_TIMEOUT,
                    )
                    notified = True
                except grpc.aio.AioRpcError as exc:
                    error = (
                        error
                        or f"RegisterPlugin error -- failed to send registration status at "
                        f"socket {path}, err: {_rpc_error_text(exc)}"
                    )
        ok = service is not None and notified
        self.attempts.append(
            RegistrationAttempt(path, time.monotonic(), info, service is not None, error, notified)
        )
        if self._sockets.get(path) is not state:
            return  # removed meanwhile
        state.registered = ok
        if not ok:
            state.next_attempt = time.monotonic() + state.backoff
            state.backoff = min(state.backoff * 2, MAX_BACKOFF)
        self._changed.set()

    # --- slices wiping -------------------------------------------------------------------

    def _node_slices(self, driver: str | None = None) -> list[dict[str, Any]]:
        if self.api is None:
            return []
        return [
            s
            for s in self.api.list(RESOURCE_SLICES)
            if (s.get("spec") or {}).get("nodeName") == self.node_name
            and (driver is None or s["spec"].get("driver") == driver)
        ]

    def wipe_node_slices(self, driver: str | None = None) -> list[str]:
        """Delete this node's ResourceSlices (of ``driver``, or all). Returns their names."""
        if self.api is None:
            return []
        names = []
        for item in self._node_slices(driver):
            name = item["metadata"]["name"]
            if self.api.get(RESOURCE_SLICES, name) is not None:
                self.api.delete(RESOURCE_SLICES, name)
                names.append(name)
        self.wiped.append((driver, names))
        return names

    def _schedule_wipe(self, driver: str) -> None:
        if self.wipe_delay is None or self.api is None or driver in self._wipe_tasks:
            return
        delay = self.wipe_delay

        async def wipe_later() -> None:
            await asyncio.sleep(delay)
            self._wipe_tasks.pop(driver, None)
            if self.registration(driver) is None:
                self.wipe_node_slices(driver)
                self._changed.set()

        self._wipe_tasks[driver] = asyncio.create_task(wipe_later(), name=f"wipe-{driver}")

    # --- pods and claims -----------------------------------------------------------------

    @property
    def pods(self) -> dict[str, list[ClaimRef]]:
        """Pod UID -> the claims it references on this node."""
        result: dict[str, list[ClaimRef]] = {}
        for info in self.claims.values():
            for pod in info.pods:
                result.setdefault(pod, []).append(info.ref)
        return result

    @property
    def prepared(self) -> set[str]:
        """UIDs of the claims prepared on this node."""
        return {uid for uid, info in self.claims.items() if info.prepared}

    def add_pod(self, pod_uid: str, claims: Iterable[ClaimRef]) -> None:
        """Record that ``pod_uid`` references ``claims`` (no RPC)."""
        for namespace, uid, name in claims:
            info = self.claims.setdefault(uid, ClaimInfo(namespace, uid, name))
            info.pods.add(pod_uid)

    async def remove_pod(self, pod_uid: str, *, service: str | None = None) -> dict[str, Any]:
        """The pod is gone: drop its references and unprepare the claims nobody references
        any more. Returns the unprepare results by claim UID."""
        released: list[ClaimRef] = []
        for info in list(self.claims.values()):
            if pod_uid in info.pods:
                info.pods.discard(pod_uid)
                if not info.pods:
                    released.append(info.ref)
        if not released:
            return {}
        return await self.unprepare(released, service=service)

    def _registration_for(self, driver: str) -> Registration:
        registration = self.registration(driver)
        if registration is None:
            raise DraKubeletError(f"DRA driver {driver} is not registered")
        return registration

    def _default_driver(self) -> str:
        drivers = self.drivers()
        if len(drivers) != 1:
            raise DraKubeletError(
                "cannot tell which driver to call without an API double: pass driver= "
                f"(registered: {drivers})"
            )
        return drivers[0]

    def _claim_drivers(self, pod_uid: str, claim: ClaimRef, driver: str | None) -> list[str]:
        """The drivers to call for ``claim``, after the kubelet's checks on the claim."""
        if driver is not None:
            return [driver]
        if self.api is None:
            return [self._default_driver()]
        namespace, uid, name = claim
        obj = self.api.get(RESOURCE_CLAIMS, name, namespace)
        if obj is None:
            raise PrepareError(
                f"failed to fetch ResourceClaim {namespace}/{name}: "
                f'{RESOURCE_CLAIMS} "{name}" not found'
            )
        if obj["metadata"].get("uid") != uid:
            raise PrepareError(
                f"ResourceClaim {namespace}/{name}: UID {obj['metadata'].get('uid')} does not "
                f"match the requested UID {uid}"
            )
        status = obj.get("status") or {}
        allocation = status.get("allocation")
        if not allocation:
            raise PrepareError(f"ResourceClaim {namespace}/{name} is not allocated")
        if self.check_reserved_for:
            reserved = [r.get("uid") for r in status.get("reservedFor") or []]
            if pod_uid not in reserved:
                raise PrepareError(
                    f"pod {pod_uid} is not allowed to use ResourceClaim {namespace}/{name} "
                    f"(reservedFor: {reserved})"
                )
        drivers: list[str] = []
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("driver") and result["driver"] not in drivers:
                drivers.append(result["driver"])
        return drivers

    async def prepare(
        self,
        pod_uid: str,
        claims: Sequence[ClaimRef],
        *,
        driver: str | None = None,
        service: str | None = None,
    ) -> dict[str, Any]:
        """What the kubelet does before starting ``pod_uid``'s containers.

        Adds the pod's references, then calls ``NodePrepareResources`` once per driver with all
        of the pod's not yet prepared claims. Returns ``{claim uid: NodePrepareResourceResponse}``
        for every claim (cached for claims already prepared on this node). Raises
        :class:`PrepareError` like a failing pod start; successfully prepared claims stay
        prepared. ``service`` forces ``"v1beta1.DRAPlugin"`` / ``"v1.DRAPlugin"`` instead of the
        one chosen at registration. Calls are serialized (like the DRA manager's claim-info
        lock), so concurrent pods sharing a claim still prepare it once."""
        async with self._lock:
            return await self._prepare(pod_uid, claims, driver, service)

    async def _prepare(
        self,
        pod_uid: str,
        claims: Sequence[ClaimRef],
        driver: str | None,
        service: str | None,
    ) -> dict[str, Any]:
        self.add_pod(pod_uid, claims)
        results: dict[str, Any] = {}
        batches: dict[str, list[ClaimInfo]] = {}
        for claim in claims:
            info = self.claims[claim[1]]
            if info.prepared:
                results[info.uid] = info.response
                continue
            drivers = self._claim_drivers(pod_uid, claim, driver)
            info.drivers = drivers
            if not drivers:  # nothing allocated from any driver: nothing to prepare
                info.prepared = True
                info.response = dra_v1.NodePrepareResourceResponse()
                results[info.uid] = info.response
            for name in drivers:
                batches.setdefault(name, []).append(info)
        errors: list[str] = []
        per_claim: dict[str, list[tuple[str, Any]]] = {}
        failed: set[str] = set()
        for name, infos in batches.items():
            refs = [i.ref for i in infos]
            try:
                registration = self._registration_for(name)
                chosen = service or registration.service
                response = await self._call(registration, chosen, "NodePrepareResources", refs)
            except DraKubeletError as exc:
                errors.append(str(exc))
                failed.update(i.uid for i in infos)
                continue
            requested = {i.uid: i for i in infos}
            for uid, entry in response.claims.items():
                if uid not in requested:
                    errors.append(
                        f"NodePrepareResources returned result for unknown claim UID {uid}"
                    )
                    continue
                if entry.error:
                    info = requested[uid]
                    errors.append(
                        f"NodePrepareResources failed for claim {info.namespace}/{info.name}: "
                        f"{entry.error}"
                    )
                    failed.add(uid)
                    continue
                per_claim.setdefault(uid, []).append((name, entry))
            missing = [uid for uid in requested if uid not in response.claims]
            if missing:
                errors.append(
                    f"NodePrepareResources left out {len(missing)} claims: {', '.join(missing)}"
                )
                failed.update(missing)
        for info in {i.uid: i for infos in batches.values() for i in infos}.values():
            entries = per_claim.get(info.uid, [])
            if info.uid in failed or len(entries) != len(info.drivers):
                continue
            info.prepared = True
            responses = [entry for _, entry in entries]
            info.response = responses[0] if len(responses) == 1 else _merge(responses)
            info.driver_devices = {name: list(entry.devices) for name, entry in entries}
            results[info.uid] = info.response
        if errors:
            raise PrepareError("; ".join(errors))
        return results

    async def unprepare(
        self,
        claims: Sequence[ClaimRef],
        *,
        driver: str | None = None,
        service: str | None = None,
    ) -> dict[str, Any]:
        """Call ``NodeUnprepareResources`` for those ``claims`` that no pod references any more
        (claims still referenced are skipped, like the kubelet). Claims unknown on this node are
        skipped unless ``driver`` is given. Returns ``{claim uid: NodeUnprepareResourceResponse}``
        for the claims actually unprepared; they are removed from the checkpoint."""
        async with self._lock:
            return await self._unprepare(claims, driver, service)

    async def _unprepare(
        self,
        claims: Sequence[ClaimRef],
        driver: str | None,
        service: str | None,
    ) -> dict[str, Any]:
        batches: dict[str, list[ClaimInfo]] = {}
        todo: dict[str, ClaimInfo] = {}
        for namespace, uid, name in claims:
            info = self.claims.get(uid)
            if info is None:
                if driver is None:
                    continue
                info = ClaimInfo(namespace, uid, name, drivers=[driver])
            if info.pods:
                continue
            drivers = [driver] if driver is not None else info.drivers
            if not drivers:
                self.claims.pop(uid, None)
                continue
            todo[uid] = info
            for name_ in drivers:
                batches.setdefault(name_, []).append(info)
        errors: list[str] = []
        results: dict[str, Any] = {}
        failed: set[str] = set()
        for name, infos in batches.items():
            try:
                registration = self._registration_for(name)
                chosen = service or registration.service
                response = await self._call(
                    registration, chosen, "NodeUnprepareResources", [i.ref for i in infos]
                )
            except DraKubeletError as exc:
                errors.append(str(exc))
                failed.update(i.uid for i in infos)
                continue
            requested = {i.uid: i for i in infos}
            for uid, entry in response.claims.items():
                if uid not in requested:
                    errors.append(
                        f"NodeUnprepareResources returned result for unknown claim UID {uid}"
                    )
                    continue
                if entry.error:
                    info = requested[uid]
                    errors.append(
                        f"NodeUnprepareResources failed for claim {info.namespace}/{info.name}: "
                        f"{entry.error}"
                    )
                    failed.add(uid)
                    continue
                results.setdefault(uid, entry)
            missing = [uid for uid in requested if uid not in response.claims]
            if missing:
                errors.append(
                    f"NodeUnprepareResources left out {len(missing)} claims: {', '.join(missing)}"
                )
                failed.update(missing)
        for uid in todo:
            if uid in failed or uid not in results:
                results.pop(uid, None)
                continue
            self.claims.pop(uid, None)
        if errors:
            raise UnprepareError("; ".join(errors))
        return results

    async def prepare_v1beta1(
        self, pod_uid: str, claims: Sequence[ClaimRef], *, driver: str | None = None
    ) -> dict[str, Any]:
        """:meth:`prepare` through the ``v1beta1.DRAPlugin`` service."""
        return await self.prepare(pod_uid, claims, driver=driver, service=DRA_V1BETA1)

    async def unprepare_v1beta1(
        self, claims: Sequence[ClaimRef], *, driver: str | None = None
    ) -> dict[str, Any]:
        """:meth:`unprepare` through the ``v1beta1.DRAPlugin`` service."""
        return await self.unprepare(claims, driver=driver, service=DRA_V1BETA1)

    async def node_prepare_resources(
        self,
        claims: Sequence[ClaimRef],
        *,
        driver: str | None = None,
        service: str | None = None,
    ) -> Any:
        """A raw ``NodePrepareResources`` call (no bookkeeping, no checks); returns the
        response message. Raises :class:`DraKubeletError` on RPC errors."""
        registration = self._registration_for(driver or self._default_driver())
        return await self._call(
            registration, service or registration.service, "NodePrepareResources", claims
        )

    async def node_unprepare_resources(
        self,
        claims: Sequence[ClaimRef],
        *,
        driver: str | None = None,
        service: str | None = None,
    ) -> Any:
        """A raw ``NodeUnprepareResources`` call (no bookkeeping, no checks)."""
        registration = self._registration_for(driver or self._default_driver())
        return await self._call(
            registration, service or registration.service, "NodeUnprepareResources", claims
        )

    # --- pods: their claims, including the extended-resource claim (KEP-5004) ----------

    def pod_claims(self, pod: JSON) -> list[ClaimRef]:
        """The claims kubelet prepares for ``pod`` (needs the API double): every
        ``spec.resourceClaims`` entry by its name in ``status.resourceClaimStatuses`` (or
        ``resourceClaimName``), and the special claim named in
        ``status.extendedResourceClaimStatus`` (the scheduler created it for extended
        resources backed by DRA)."""
        if self.api is None:
            raise DraKubeletError("pod_claims needs the API double")
        namespace = pod["metadata"].get("namespace", "default")
        status = pod.get("status") or {}
        generated = {
            s.get("name"): s.get("resourceClaimName")
            for s in status.get("resourceClaimStatuses") or []
        }
        names: list[str] = []
        for claim in pod["spec"].get("resourceClaims") or []:
            name = claim.get("resourceClaimName") or generated.get(claim.get("name"))
            if name:
                names.append(name)
        extended = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
        if extended:
            names.append(extended)
        refs: list[ClaimRef] = []
        for name in names:
            obj = self.api.get(RESOURCE_CLAIMS, name, namespace)
            if obj is None:
                raise PrepareError(f"failed to fetch ResourceClaim {namespace}/{name}: not found")
            refs.append((namespace, obj["metadata"]["uid"], name))
        return refs

    async def prepare_pod(self, pod: JSON) -> dict[str, Any]:
        """:meth:`prepare` for all of ``pod``'s claims (:meth:`pod_claims`); the pod is
        tracked for its status (:meth:`track_pod`)."""
        refs = self.pod_claims(pod)
        results = await self.prepare(pod["metadata"]["uid"], refs)
        self.track_pod(pod)
        return results

    def container_cdi_devices(self, pod: JSON, container: str) -> list[str]:
        """The CDI device ids kubelet hands the runtime for ``container``: of the claims in its
        ``resources.claims`` (filtered by ``request`` when set), and of the extended-resource
        claim the devices of the requests ``requestMappings`` maps to this container."""
        namespace = pod["metadata"].get("namespace", "default")
        status = pod.get("status") or {}
        generated = {
            s.get("name"): s.get("resourceClaimName")
            for s in status.get("resourceClaimStatuses") or []
        }
        by_pod_name = {
            c.get("name"): c.get("resourceClaimName") or generated.get(c.get("name"))
            for c in pod["spec"].get("resourceClaims") or []
        }
        by_name = {(i.namespace, i.name): i for i in self.claims.values()}
        wanted: list[tuple[str | None, str | None]] = []  # (claim name, request or None)
        spec = next(c for c in pod["spec"]["containers"] if c["name"] == container)
        for claim in (spec.get("resources") or {}).get("claims") or []:
            wanted.append((by_pod_name.get(claim["name"]), claim.get("request")))
        extended = status.get("extendedResourceClaimStatus") or {}
        for mapping in extended.get("requestMappings") or []:
            if mapping.get("containerName") == container:
                wanted.append((extended.get("resourceClaimName"), mapping.get("requestName")))
        ids: list[str] = []
        for claim_name, request in wanted:
            info = by_name.get((namespace, claim_name)) if claim_name else None
            if info is None or info.response is None:
                continue
            for device in info.response.devices:
                names = list(device.request_names)
                if request is None or not names or request in names:
                    ids.extend(i for i in device.cdi_device_ids if i not in ids)
        return ids

    # --- device health (KEP-4680) ----------------------------------------------------------

    def choose_health_service(self, supported_versions: Sequence[str]) -> str | None:
        """``pickHealthService``: the kubelet's preferred health version the plugin lists; a
        kubelet without it (1.34-1.36) always uses v1alpha1."""
        if not self.health_by_advertisement:
            return HEALTH_V1ALPHA1
        for service in HEALTH_SERVICES_SUPPORTED_BY_KUBELET:
            if service in supported_versions:
                return service
        return None

    def _start_health(self, registration: Registration) -> None:
        if not self.health_enabled:
            return
        service = self.choose_health_service(registration.supported_versions)
        if service is None:
            return
        old = self._health_tasks.pop(registration.socket, None)
        if old is not None:
            old.cancel()
        self._health_tasks[registration.socket] = asyncio.create_task(
            self._health_loop(registration, service), name=f"dra-health-{registration.driver}"
        )

    async def _stop_health(self, path: Path) -> None:
        task = self._health_tasks.pop(path, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _health_loop(self, registration: Registration, service: str) -> None:
        messages, stubs = _HEALTH_MODULES[service]
        while True:
            self.health_streams_opened.append((registration.driver, service))
            try:
                stub = stubs.DRAResourceHealthStub(self._channel(registration.endpoint))
                call = stub.NodeWatchResources(messages.NodeWatchResourcesRequest())
                async for response in call:
                    self._health_received(registration.driver, service, messages, response)
            except grpc.aio.AioRpcError:
                pass  # logged by the kubelet; the stream is opened again below
            finally:
                # HandleWatchResourcesStream: clearDriver when the stream exits
                if self.device_health.pop(registration.driver, None):
                    self._health_changed(registration.driver, None)
            await asyncio.sleep(self.health_retry)

    def _health_received(self, driver: str, service: str, messages: Any, response: Any) -> None:
        now = time.monotonic()
        names = {
            messages.HEALTHY: "Healthy",
            messages.UNHEALTHY: "Unhealthy",
        }
        devices: dict[tuple[str, str], DeviceHealthState] = {}
        for item in response.devices:
            timeout = float(item.health_check_timeout_seconds)
            devices[(item.device.pool_name, item.device.device_name)] = DeviceHealthState(
                names.get(item.health, "Unknown"),
                item.message if len(item.message) <= 1024 else item.message[:1021] + "...",
                now,
                timeout if timeout > 0 else DEFAULT_HEALTH_TIMEOUT,
            )
        before = self.device_health.get(driver, {})
        changed = tuple(
            sorted(
                key
                for key in set(before) | set(devices)
                if (before.get(key) and (before[key].health, before[key].message))
                != (devices.get(key) and (devices[key].health, devices[key].message))
            )
        )
        self.device_health[driver] = devices
        self.health_updates.append(HealthUpdate(driver, service, now, devices, changed))
        if changed:
            self._health_changed(driver, changed)
        self._changed.set()

    def health_of(self, driver: str, pool: str, device: str) -> str:
        """``getHealthInfo``: the device's health, ``Unknown`` once its status is too old."""
        state = self.device_health.get(driver, {}).get((pool, device))
        if state is None or time.monotonic() - state.received > state.timeout:
            return "Unknown"
        return state.health

    def _health_changed(self, driver: str, changed: Sequence[tuple[str, str]] | None) -> None:
        """Refresh the status of the tracked pods using a changed device (all of the driver's
        when ``changed`` is None)."""
        for info in self.claims.values():
            devices = info.driver_devices.get(driver, [])
            if not any(changed is None or (d.pool_name, d.device_name) in changed for d in devices):
                continue
            for pod_uid in info.pods:
                if pod_uid in self.pod_objects:
                    self._publish_pod_status(pod_uid)

    def track_pod(self, pod: JSON) -> None:
        """Give the double the Pod object of a pod it prepares (``metadata.uid``,
        ``spec.containers[].resources.claims``, ``status.resourceClaimStatuses``), so that its
        ``allocatedResourcesStatus`` is kept (:meth:`pod_status`)."""
        self.pod_objects[pod["metadata"]["uid"]] = pod
        self._publish_pod_status(pod["metadata"]["uid"])

    def container_statuses(self, pod: JSON) -> list[JSON]:
        """``UpdateAllocatedResourcesStatus`` for ``pod``: one entry per container, with
        ``allocatedResourcesStatus`` when one of its claims has prepared devices."""
        namespace = pod["metadata"].get("namespace", "default")
        claim_names = {
            s.get("name"): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
        }
        by_name = {(i.namespace, i.name): i for i in self.claims.values()}
        statuses: list[JSON] = []
        for container in pod["spec"].get("containers") or []:
            entry: JSON = {"name": container["name"]}
            resources: list[JSON] = []
            for claim in (container.get("resources") or {}).get("claims") or []:
                actual = claim_names.get(claim["name"])
                info = by_name.get((namespace, actual)) if actual else None
                if info is None:
                    continue
                name = f"claim:{claim['name']}"
                if claim.get("request"):
                    name += f"/{claim['request']}"
                health: list[JSON] = []
                for driver, devices in sorted(info.driver_devices.items()):
                    for device in devices:
                        resource_id = (
                            device.cdi_device_ids[0]
                            if device.cdi_device_ids
                            else f"{driver}/{device.pool_name}/{device.device_name}"
                        )
                        item: JSON = {
                            "resourceID": resource_id,
                            "health": self.health_of(driver, device.pool_name, device.device_name),
                        }
                        state = self.device_health.get(driver, {}).get(
                            (device.pool_name, device.device_name)
                        )
                        if state is not None and state.message and item["health"] != "Unknown":
                            item["message"] = state.message
                        health.append(item)
                if health:
                    resources.append({"name": name, "resources": health})
            if resources:
                entry["allocatedResourcesStatus"] = resources
            statuses.append(entry)
        return statuses

    def pod_status(self, pod_uid: str) -> JSON:
        """The tracked pod's last computed ``status`` (``containerStatuses``)."""
        return self._pod_statuses.get(pod_uid, {})

    def _publish_pod_status(self, pod_uid: str) -> None:
        pod = self.pod_objects[pod_uid]
        status = {"containerStatuses": self.container_statuses(pod)}
        if status == self._pod_statuses.get(pod_uid):
            return
        self._pod_statuses[pod_uid] = status
        self.pod_status_writes.append((pod_uid, status))
        if self.api is None:
            return
        meta = pod["metadata"]
        stored = self.api.get(PODS, meta["name"], meta.get("namespace", "default"))
        if stored is None or stored["metadata"].get("uid") != pod_uid:
            return
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": meta["name"],
                "namespace": stored["metadata"]["namespace"],
                "resourceVersion": stored["metadata"]["resourceVersion"],
            },
            "status": {**(stored.get("status") or {}), **status},
        }
        self.api.store.update(
            self.api.resource(PODS),
            "v1",
            stored["metadata"]["namespace"],
            meta["name"],
            body,
            subresource="status",
        )

    async def wait_for_health(
        self,
        driver: str,
        pool: str,
        device: str,
        health: str,
        timeout: float = 10.0,  # noqa: ASYNC109
    ) -> None:
        """Wait until the kubelet's cache shows ``health`` for the device."""
        await self.wait_for(
            lambda: self.health_of(driver, pool, device) == health,
            timeout,
            f"{driver}/{pool}/{device} to be {health}",
        )

    # --- gRPC ----------------------------------------------------------------------------

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = grpc.aio.insecure_channel(_target(endpoint))
            self._channels[endpoint] = channel
        return channel

    def _close_unused_channels(self) -> None:
        used = {r.endpoint for r in self._registrations.values()}
        for endpoint in [e for e in self._channels if e not in used]:
            channel = self._channels.pop(endpoint)
            task = asyncio.ensure_future(channel.close(None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _call(
        self, registration: Registration, service: str, method: str, claims: Sequence[ClaimRef]
    ) -> Any:
        if service not in _SERVICE_MODULES:
            raise DraKubeletError(f"unsupported DRA service {service!r}")
        messages, stubs = _SERVICE_MODULES[service]
        stub = stubs.DRAPluginStub(self._channel(registration.endpoint))
        pb_claims = [messages.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
        if method == "NodePrepareResources":
            request: Any = messages.NodePrepareResourcesRequest(claims=pb_claims)
            rpc = stub.NodePrepareResources
        else:
            request = messages.NodeUnprepareResourcesRequest(claims=pb_claims)
            rpc = stub.NodeUnprepareResources
        error: str | None = None
        response: Any | None = None
        try:
            response = await rpc(request, timeout=self.call_timeout)
        except grpc.aio.AioRpcError as exc:
            error = f"{method} on {registration.driver} ({service}): {_rpc_error_text(exc)}"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller itself was cancelled
            # grpc.aio raises CancelledError in the caller when its channel is closed under
            # the call (the plugin deregistered meanwhile, _close_unused_channels): kubelet's
            # client sees codes.Canceled, a failed call, not a crash
            error = (
                f"{method} on {registration.driver} ({service}): rpc error: code = Canceled "
                "desc = the connection to the plugin was closed"
            )
        self.calls.append(
            DraCall(
                method,
                registration.driver,
                registration.endpoint,
                service,
                tuple(claims),
                time.monotonic(),
                response,
                error,
            )
        )
        if error is not None:
            raise (PrepareError if method == "NodePrepareResources" else UnprepareError)(error)
        return response

    def calls_for(self, method: str, driver: str | None = None) -> list[DraCall]:
        return [
            c for c in self.calls if c.method == method and (driver is None or c.driver == driver)
        ]


def _merge(entries: Sequence[Any]) -> Any:
    """Merge the NodePrepareResourceResponses of several drivers for one claim."""
    merged = type(entries[0])()
    for entry in entries:
        merged.MergeFromString(entry.SerializeToString())
    return merged
