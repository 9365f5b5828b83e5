"""A kubelet double: the device manager side of the device plugin API, plus pod-resources.

It speaks the real wire protocol over unix sockets with the generated stubs, so device
plugins are tested end to end exactly as the kubelet would drive them (reference
``k8s-device-apis.md`` §1.4, §1.5, §7.6, §8):

* ``v1beta1.Registration/Register`` on ``<dir>/kubelet.sock``: version and extended resource
  name checks, blocking dial of ``<dir>/<endpoint>`` (10 s), ``GetDevicePluginOptions`` (the
  options it returns are the ones kept), then a background ``ListAndWatch`` consumer. Every
  message replaces the resource's device set. When the stream ends the resource's devices
  all become unhealthy (allocatable 0, capacity kept) and the endpoint is stopped; after
  ``endpoint_stop_grace_period`` (5 min, like kubelet) the resource is deleted.
* Pod admission like the device manager (``devicesToAllocate`` / ``allocateContainerResources``):
  init containers first, devices of (non-restartable) init containers reusable by app
  containers, healthy devices not held by another active pod (none healthy at all: kubelet's
  ``no healthy devices present`` refusal, before anything else), ``GetPreferredAllocation``
  when advertised (answer intersected with the available set, shortfall filled by the
  double), one ``Allocate`` per container per resource with one ``ContainerAllocateRequest``,
  only ``container_responses[0]`` used, ``UnexpectedAdmissionError`` texts on failure, and
  ``PreStartContainer`` before each container start when ``pre_start_required``.
* ``v1.PodResourcesLister`` (``List``, ``GetAllocatableResources``, ``Get``) on its own socket,
  answering from the same bookkeeping: one ``ContainerDevices`` entry per device (and NUMA
  node), like the kubelet.
* ``restart()``: stop both servers, drop every plugin connection, remove every socket in the
  directory (``CleanupPluginDirectory``), forget devices and registrations but keep pods
  (the kubelet's checkpoint), and serve a fresh ``kubelet.sock``.
* The device-manager checkpoint ``<dir>/kubelet_internal_checkpoint`` in kubelet's JSON form
  (``Data.PodDeviceEntries`` with ``PodUID``, ``ContainerName``, ``ResourceName``,
  ``DeviceIDs`` per NUMA node, ``AllocResp``; ``Data.RegisteredDevices``; ``Checksum``),
  with kubelet's timing, and only then (``writeCheckpoint`` in ``manager.go``, 1.36): after
  each successful ``Allocate``, on every ``ListAndWatch`` message, and when ``GetCapacity``
  (the node status update; here every query of capacity, allocatable or devices) deletes a
  resource whose plugin stopped more than ``endpoint_stop_grace_period`` ago. A deleted pod
  stays in its in-memory ``podDevices`` (and so in the file) until ``UpdateAllocatedDevices``
  runs — at the next admission or pod-resources ``List`` — and in the file until the next
  write after that: with no plugin registered and no allocation, never (until a stopped
  plugin's resource is deleted).

All times are ``time.monotonic()`` values.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import re
import stat
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NamedTuple, TypeVar

import grpc

from agent.protos.deviceplugin.v1beta1 import api_pb2 as dp
from agent.protos.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.protos.podresources.v1 import api_pb2 as pr
from agent.protos.podresources.v1 import api_pb2_grpc as pr_grpc

KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
SUPPORTED_VERSIONS = ("v1beta1",)
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DIAL_TIMEOUT = 10.0
PRE_START_TIMEOUT = 30.0
ENDPOINT_STOP_GRACE_PERIOD = 300.0
UNEXPECTED_ADMISSION_ERROR = "UnexpectedAdmissionError"

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Resource name validation (kubernetes pkg/apis/core/v1/helper IsExtendedResourceName)
# --------------------------------------------------------------------------------------------

_QUALIFIED_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN_RE = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")


def is_qualified_name(value: str) -> bool:
    """``validation.IsQualifiedName``: optional DNS-subdomain prefix + ``/`` + name (≤63)."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN_RE.match(prefix):
            return False
    else:
        return False
    return bool(name) and len(name) <= 63 and bool(_QUALIFIED_NAME_RE.match(name))


def is_extended_resource_name(name: str) -> bool:
    """``v1helper.IsExtendedResourceName`` exactly as the kubelet applies it in ``Register``."""
    # IsNativeResource: no "/" or *contains* "kubernetes.io/" (IsPrefixedNativeResource).
    if "/" not in name or "kubernetes.io/" in name:
        return False
    if name.startswith("requests."):
        return False
    return is_qualified_name("requests." + name)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


class Registration(NamedTuple):
    """A successful ``Register`` (options = what ``GetDevicePluginOptions`` returned)."""

    resource_name: str
    endpoint: str
    options: dp.DevicePluginOptions
    time: float


@dataclass
class RegisterAttempt:
    """Every ``Register`` call, successful or not."""

    request: dp.RegisterRequest
    time: float
    error: str | None = None
    finished: float | None = None


@dataclass
class ListAndWatchEvent:
    resource_name: str
    endpoint: str
    time: float
    devices: dict[str, str]


@dataclass
class RpcCall:
    """One call the double made to a plugin (Allocate, GetPreferredAllocation, PreStart)."""

    method: str
    resource_name: str
    endpoint: str
    request: Any
    time: float
    response: Any = None
    code: grpc.StatusCode | None = None
    details: str | None = None
    pod: tuple[str, str] | None = None
    container: str | None = None


@dataclass
class ContainerAllocation:
    """What the device manager holds for one container (the checkpoint entry)."""

    name: str
    init: bool
    requests: dict[str, int]
    devices: dict[str, list[str]] = field(default_factory=dict)
    responses: dict[str, dp.ContainerAllocateResponse] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[dp.Mount] = field(default_factory=list)
    device_specs: list[dp.DeviceSpec] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)
    skipped_resources: list[str] = field(default_factory=list)
    prestart_error: str | None = None
    # resource -> device id -> NUMA nodes at allocation time (for pod-resources topology)
    topology: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def all_devices(self) -> list[str]:
        return [d for ids in self.devices.values() for d in ids]


@dataclass
class PodAdmission:
    """Result of :meth:`KubeletDouble.admit_pod`; also the double's record of an active pod."""

    namespace: str
    name: str
    uid: str
    containers: list[ContainerAllocation] = field(default_factory=list)
    admitted: bool = False
    pending: bool = True
    reason: str | None = None
    message: str | None = None
    grpc_code: grpc.StatusCode | None = None
    grpc_details: str | None = None
    started: float = 0.0
    finished: float | None = None

    @property
    def error(self) -> str | None:
        return self.message

    def container(self, name: str) -> ContainerAllocation:
        for c in self.containers:
            if c.name == name:
                return c
        raise KeyError(name)

    def devices(self, resource_name: str | None = None) -> list[str]:
        """Device ids allocated to any container (optionally of one resource), no duplicates."""
        seen: list[str] = []
        for c in self.containers:
            for res, ids in c.devices.items():
                if resource_name is None or res == resource_name:
                    seen.extend(d for d in ids if d not in seen)
        return seen


class _AdmissionError(Exception):
    def __init__(
        self, text: str, code: grpc.StatusCode | None = None, details: str | None = None
    ) -> None:
        super().__init__(text)
        self.text = text
        self.code = code
        self.details = details


class _RegisterError(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Plugin clients / endpoints
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Client:
    resource_name: str
    endpoint: str
    socket_path: Path
    channel: grpc.aio.Channel | None = None
    stub: dp_grpc.DevicePluginStub | None = None
    task: asyncio.Task[None] | None = None
    closed: bool = False  # closed by the double itself (replaced, restart, stop)
    stream_error: str | None = None
    stream_ended: float | None = None


@dataclass(eq=False)
class _Endpoint:
    """``endpointInfo{e, opts}``: client is None for a stopped endpoint read from checkpoint."""

    resource_name: str
    client: _Client | None
    options: dp.DevicePluginOptions | None
    stop_time: float | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_time is not None


_GO_CODE_NAMES = {grpc.StatusCode.CANCELLED: "Canceled"}


def go_status_error(error: grpc.aio.AioRpcError) -> str:
    """How Go prints a gRPC status error (``rpc error: code = X desc = Y``)."""
    code = error.code()
    name = _GO_CODE_NAMES.get(code) or "".join(p.capitalize() for p in code.name.split("_"))
    return f"rpc error: code = {name} desc = {error.details()}"


def _copy(message: T) -> T:
    new = type(message)()  # type: ignore[call-arg]
    new.CopyFrom(message)  # type: ignore[attr-defined]
    return new


# --------------------------------------------------------------------------------------------
# Servicers
# --------------------------------------------------------------------------------------------


class _RegistrationServicer(dp_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, double: KubeletDouble) -> None:
        self._double = double

    async def Register(
        self, request: dp.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> dp.Empty:
        return await self._double._handle_register(request, context)


class _PodResourcesServicer(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    def __init__(self, double: KubeletDouble) -> None:
        self._double = double

    async def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        await self._double._pod_resources_gate("List", context)
        return self._double.pod_resources_list()

    async def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        await self._double._pod_resources_gate("GetAllocatableResources", context)
        return self._double.pod_resources_allocatable()

    async def Get(
        self, request: pr.GetPodResourcesRequest, context: grpc.aio.ServicerContext
    ) -> pr.GetPodResourcesResponse:
        await self._double._pod_resources_gate("Get", context)
        if not self._double.get_enabled:
            await context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        pod = self._double._pods.get((request.pod_namespace, request.pod_name))
        if pod is None:
            await context.abort(
                grpc.StatusCode.UNKNOWN,
                f"pod {request.pod_name} not found in {request.pod_namespace}",
            )
        assert pod is not None
        return pr.GetPodResourcesResponse(pod_resources=self._double._pod_resources_of(pod))


# --------------------------------------------------------------------------------------------
# The double
# --------------------------------------------------------------------------------------------

ContainerSpec = tuple[str, Mapping[str, int]]


class KubeletDouble:
    """Kubelet device manager + pod-resources server over real unix-socket gRPC.

    ``reregistration``:
      * ``"replace"`` (default): a new successful ``Register`` for a resource closes the old
        client's channel and stream; the old stream's end has no effect.
      * ``"kubelet"``: the real kubelet's client handling (``server.go``): the old client is
        *not* closed, its ListAndWatch messages still overwrite the resource's devices, and
        when its stream ends ``runClient`` disconnects whichever client is *current* for that
        resource name (marking the resource unhealthy); a failed ``Register`` deregisters the
        name's client altogether.
    """

    def __init__(
        self,
        device_plugin_dir: Path | str,
        pod_resources_socket: Path | str,
        *,
        dial_timeout: float = DIAL_TIMEOUT,
        options_timeout: float | None = None,
        rpc_timeout: float | None = None,
        endpoint_stop_grace_period: float = ENDPOINT_STOP_GRACE_PERIOD,
        reregistration: Literal["replace", "kubelet"] = "replace",
        serve_pod_resources: bool = True,
        random_order: bool = False,
        seed: int | None = None,
    ) -> None:
        self.device_plugin_dir = Path(device_plugin_dir).absolute()
        self.pod_resources_socket = Path(pod_resources_socket).absolute()
        self.kubelet_socket = self.device_plugin_dir / KUBELET_SOCKET
        self.dial_timeout = dial_timeout
        self.options_timeout = options_timeout  # kubelet: none (context.Background())
        self.rpc_timeout = rpc_timeout  # Allocate / GetPreferredAllocation: none in kubelet
        self.endpoint_stop_grace_period = endpoint_stop_grace_period
        self.reregistration = reregistration
        self.serve_pod_resources = serve_pod_resources
        self._rng = random.Random(seed) if random_order else None

        # Fault injection / feature switches
        self.register_error: str | None = None  # every Register fails with this text
        self.pod_resources_error: tuple[grpc.StatusCode, str] | None = None
        self.get_enabled = True  # KubeletPodResourcesGet

        # Logs
        self.registrations: list[Registration] = []  # since the last (re)start
        self.all_registrations: list[Registration] = []
        self.register_attempts: list[RegisterAttempt] = []
        self.list_and_watch_count: Counter[str] = Counter()
        self.list_and_watch_last: dict[str, float] = {}
        self.list_and_watch_log: list[ListAndWatchEvent] = []
        self.rpc_calls: list[RpcCall] = []
        self.admissions: list[PodAdmission] = []
        self.pod_resources_calls: Counter[str] = Counter()
        self.started_at: float | None = None
        self.start_count = 0
        self.restart_times: list[float] = []
        self.stream_ends: list[tuple[str, str, float, str | None]] = []
        self.cleanups: list[list[str]] = []  # socket names removed at each start

        # Device manager state (names follow the kubelet's ManagerImpl)
        self._healthy: dict[str, set[str]] = {}
        self._unhealthy: dict[str, set[str]] = {}
        self._all_devices: dict[str, dict[str, dp.Device]] = {}
        self._endpoints: dict[str, _Endpoint] = {}
        self._earliest_stop: float | None = None  # bound for _gc_stopped (see there)
        self._clients: dict[str, _Client] = {}  # server.clients, by resource name
        self._live_clients: set[_Client] = set()
        self._pods: dict[tuple[str, str], PodAdmission] = {}  # active pods
        self._pod_devices: dict[str, PodAdmission] = {}  # podDevices, by pod uid
        self.checkpoint_writes = 0

        self._registration_server: grpc.aio.Server | None = None
        self._pod_resources_server: grpc.aio.Server | None = None
        self._running = False
        self._admit_lock = asyncio.Lock()
        self._changed = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> KubeletDouble:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def restart_time(self) -> float | None:
        return self.restart_times[-1] if self.restart_times else None

    async def start(self) -> None:
        """MkdirAll, CleanupPluginDirectory, serve kubelet.sock and the pod-resources socket."""
        if self._running:
            raise RuntimeError("kubelet double already running")
        self.device_plugin_dir.mkdir(parents=True, exist_ok=True)
        self.cleanups.append(self.cleanup_plugin_directory())
        self.registrations = []
        server = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
        server.add_insecure_port(f"unix://{self.kubelet_socket}")
        await server.start()
        self._registration_server = server
        if self.serve_pod_resources:
            self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self.pod_resources_socket.unlink()
            prs = grpc.aio.server()
            pr_grpc.add_PodResourcesListerServicer_to_server(_PodResourcesServicer(self), prs)
            prs.add_insecure_port(f"unix://{self.pod_resources_socket}")
            await prs.start()
            self._pod_resources_server = prs
        self._running = True
        self.started_at = time.monotonic()
        self.start_count += 1
        self._notify()

    async def stop(self) -> None:
        """Stop serving and drop all plugin connections (bookkeeping is kept)."""
        await self._shutdown()
        self._notify()

    async def restart(self, downtime: float = 0.0) -> float:
        """Kubelet restart. Returns the restart time (also in ``restart_times``)."""
        await self._shutdown()
        now = time.monotonic()
        self.restart_times.append(now)
        # readCheckpoint: registered resources come back with no devices and a stopped
        # endpoint (capacity 0 until the plugin re-registers); pod devices are kept.
        known = set(self._healthy) | set(self._unhealthy) | set(self._endpoints)
        self._healthy = {r: set() for r in known}
        self._unhealthy = {r: set() for r in known}
        self._all_devices = {r: {} for r in known}
        self._endpoints = {
            r: _Endpoint(resource_name=r, client=None, options=None, stop_time=now) for r in known
        }
        if known and (self._earliest_stop is None or now < self._earliest_stop):
            self._earliest_stop = now
        self._clients = {}
        self._notify()
        if downtime > 0:
            await asyncio.sleep(downtime)
        await self.start()
        return now

    async def _shutdown(self) -> None:
        self._running = False
        now = time.monotonic()
        await asyncio.gather(*(self._close_client(c) for c in list(self._live_clients)))
        for ep in self._endpoints.values():
            if ep.client is not None and ep.stop_time is None:
                self._stopped_at(ep, now)  # the connection is gone with the kubelet
        for attr in ("_registration_server", "_pod_resources_server"):
            server: grpc.aio.Server | None = getattr(self, attr)
            if server is not None:
                await server.stop(None)
                setattr(self, attr, None)

    def cleanup_plugin_directory(self) -> list[str]:
        """``CleanupPluginDirectory``: remove every socket (lstat), keep everything else."""
        removed: list[str] = []
        for name in sorted(os.listdir(self.device_plugin_dir)):
            if name == CHECKPOINT_FILE:
                continue
            path = self.device_plugin_dir / name
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(mode) or not stat.S_ISSOCK(mode):
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(name)
        return removed

    # ---------------------------------------------------------------- waiting

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float = 5.0,  # noqa: ASYNC109
        message: str | None = None,
        poll: float = 0.05,
    ) -> T:
        """Wait until ``predicate()`` is truthy (re-checked on every change and every ``poll`` s).

        Returns the truthy value; raises ``TimeoutError`` after ``timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = predicate()
            if value:
                return value
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(message or f"condition not met within {timeout}s")
            event = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(remaining, poll))

    async def wait_registered(
        self,
        resource_name: str,
        timeout: float = 10.0,  # noqa: ASYNC109
        *,
        after: float | None = None,
    ) -> Registration:
        """Wait for a successful registration of ``resource_name`` since the last (re)start
        (and after ``after``, if given). Returns the newest matching :class:`Registration`."""

        def found() -> Registration | None:
            for reg in reversed(self.registrations):
                if reg.resource_name == resource_name and (after is None or reg.time > after):
                    return reg
            return None

        return await self.wait_for(
            found, timeout, f"{resource_name} did not register within {timeout}s"
        )

    async def wait_list_and_watch(
        self,
        resource_name: str,
        count: int = 1,
        timeout: float = 5.0,  # noqa: ASYNC109
    ) -> ListAndWatchEvent:
        """Wait until ``count`` ListAndWatch messages (in total) arrived for the resource."""
        await self.wait_for(
            lambda: self.list_and_watch_count[resource_name] >= count,
            timeout,
            f"{resource_name}: fewer than {count} ListAndWatch messages within {timeout}s",
        )
        return [e for e in self.list_and_watch_log if e.resource_name == resource_name][-1]

    # ---------------------------------------------------------------- queries

    def resources(self) -> list[str]:
        self._gc_stopped()
        return sorted(set(self._healthy) | set(self._unhealthy))

    def capacity(self, resource_name: str) -> int:
        self._gc_stopped()
        return len(self._healthy.get(resource_name, ())) + len(
            self._unhealthy.get(resource_name, ())
        )

    def allocatable(self, resource_name: str) -> int:
        self._gc_stopped()
        return len(self._healthy.get(resource_name, ()))

    def node_capacity(self) -> dict[str, int]:
        return {r: self.capacity(r) for r in self.resources()}

    def node_allocatable(self) -> dict[str, int]:
        return {r: self.allocatable(r) for r in self.resources()}

    def devices(self, resource_name: str) -> dict[str, str]:
        """Device id -> ``Healthy``/``Unhealthy`` as the device manager sees it now."""
        self._gc_stopped()
        out = {d: UNHEALTHY for d in self._unhealthy.get(resource_name, ())}
        out.update({d: HEALTHY for d in self._healthy.get(resource_name, ())})
        return dict(sorted(out.items()))

    def healthy_devices(self, resource_name: str) -> set[str]:
        self._gc_stopped()
        return set(self._healthy.get(resource_name, ()))

    def device(self, resource_name: str, device_id: str) -> dp.Device | None:
        """The last ``Device`` message for this id (topology etc.)."""
        return self._all_devices.get(resource_name, {}).get(device_id)

    def options(self, resource_name: str) -> dp.DevicePluginOptions | None:
        ep = self._endpoints.get(resource_name)
        return ep.options if ep else None

    def endpoint(self, resource_name: str) -> str | None:
        """Endpoint (socket name) of the current connection for the resource, if any."""
        ep = self._endpoints.get(resource_name)
        return ep.client.endpoint if ep and ep.client else None

    def endpoint_stopped(self, resource_name: str) -> bool:
        ep = self._endpoints.get(resource_name)
        return ep is not None and ep.stopped

    def endpoint_stop_time(self, resource_name: str) -> float | None:
        ep = self._endpoints.get(resource_name)
        return ep.stop_time if ep else None

    def connected(self, resource_name: str) -> bool:
        ep = self._endpoints.get(resource_name)
        return ep is not None and not ep.stopped and ep.client is not None

    def pods(self) -> list[PodAdmission]:
        """Active pods (admitted, or pending admission), in admission order."""
        return list(self._pods.values())

    def pod(self, namespace: str, name: str) -> PodAdmission | None:
        return self._pods.get((namespace, name))

    def allocated_devices(self, resource_name: str) -> set[str]:
        """Devices held by active pods (``allocatedDevices`` after ``UpdateAllocatedDevices``)."""
        out: set[str] = set()
        for pod in self._pods.values():
            for c in pod.containers:
                out.update(c.devices.get(resource_name, ()))
        return out

    def calls(self, method: str, resource_name: str | None = None) -> list[RpcCall]:
        return [
            c
            for c in self.rpc_calls
            if c.method == method and (resource_name is None or c.resource_name == resource_name)
        ]

    def _gc_stopped(self) -> None:
        """``GetCapacity``: delete resources whose endpoint stopped more than the grace ago.

        Runs on every ListAndWatch message, so it only scans the endpoints when the earliest
        stop time it knows of is past the grace (a bound: it may be older than any endpoint
        still stopped, which only costs a scan). With 1000 plugins a scan per message made
        the double, not the plugins, the bottleneck of re-registration."""
        now = time.monotonic()
        if self._earliest_stop is None or now - self._earliest_stop <= (
            self.endpoint_stop_grace_period
        ):
            return
        earliest: float | None = None
        deleted = False
        for name, ep in list(self._endpoints.items()):
            if ep.stop_time is None:
                continue
            if now - ep.stop_time > self.endpoint_stop_grace_period:
                for table in (self._healthy, self._unhealthy, self._all_devices, self._endpoints):
                    table.pop(name, None)  # type: ignore[attr-defined]
                deleted = True
            elif earliest is None or ep.stop_time < earliest:
                earliest = ep.stop_time
        self._earliest_stop = earliest
        if deleted:
            self.write_checkpoint()  # GetCapacity: "if deletedResources.Len() > 0"

    def _stopped_at(self, ep: _Endpoint, now: float) -> None:
        ep.stop_time = now
        if self._earliest_stop is None or now < self._earliest_stop:
            self._earliest_stop = now

    # ---------------------------------------------------------------- registration

    async def _handle_register(
        self, request: dp.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> dp.Empty:
        attempt = RegisterAttempt(request=_copy(request), time=time.monotonic())
        self.register_attempts.append(attempt)
        error: str | None = None
        if request.version not in SUPPORTED_VERSIONS:
            supported = "[" + " ".join(f'"{v}"' for v in SUPPORTED_VERSIONS) + "]"
            error = (
                f'requested API version "{request.version}" is not supported by kubelet. '
                f"Supported versions are {supported}"
            )
        elif not is_extended_resource_name(request.resource_name):
            error = f'the ResourceName "{request.resource_name}" is invalid'
        elif self.register_error is not None:
            error = self.register_error
        else:
            try:
                await self._connect_client(request.resource_name, request.endpoint)
            except _RegisterError as exc:
                error = str(exc)
        attempt.error = error
        attempt.finished = time.monotonic()
        self._notify()
        if error is not None:
            # A Go error without a status: the client sees code Unknown.
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        return dp.Empty()

    async def _connect_client(self, name: str, endpoint: str) -> None:
        client = _Client(
            resource_name=name, endpoint=endpoint, socket_path=self.device_plugin_dir / endpoint
        )
        kubelet_mode = self.reregistration == "kubelet"
        if kubelet_mode:
            self._clients[name] = client  # registerClient happens before Connect
        try:
            channel = grpc.aio.insecure_channel(
                f"unix://{client.socket_path}",
                options=[("grpc.default_authority", "localhost")],
            )
            try:
                await asyncio.wait_for(channel.channel_ready(), self.dial_timeout)
            except TimeoutError:
                await channel.close()
                raise _RegisterError(
                    "failed to dial device plugin: context deadline exceeded"
                ) from None
            stub = dp_grpc.DevicePluginStub(channel)
            try:
                options = await stub.GetDevicePluginOptions(
                    dp.Empty(), timeout=self.options_timeout
                )
            except grpc.aio.AioRpcError as exc:
                await channel.close()
                raise _RegisterError(
                    f"failed to get device plugin options: {go_status_error(exc)}"
                ) from None
        except _RegisterError:
            if kubelet_mode and self._clients.get(name) is client:
                del self._clients[name]  # deregisterClient(name)
            raise
        client.channel = channel
        client.stub = stub
        self._live_clients.add(client)
        if not kubelet_mode:
            old = self._clients.get(name)
            self._clients[name] = client
            if old is not None and old is not client:
                await self._close_client(old)
        # PluginConnected: endpoints[name] = endpointInfo{e, options}; devices untouched.
        self._endpoints[name] = _Endpoint(resource_name=name, client=client, options=options)
        self._healthy.setdefault(name, set())
        self._unhealthy.setdefault(name, set())
        self._all_devices.setdefault(name, {})
        reg = Registration(name, endpoint, options, time.monotonic())
        self.registrations.append(reg)
        self.all_registrations.append(reg)
        client.task = asyncio.create_task(self._run_client(client), name=f"law-{name}")
        self._notify()

    async def _run_client(self, client: _Client) -> None:
        assert client.stub is not None
        error: str | None = None
        try:
            call = client.stub.ListAndWatch(dp.Empty())
            async for response in call:
                if client.closed:
                    return
                self._on_list_and_watch(client, response)
        except asyncio.CancelledError:
            if client.closed:
                return
            raise
        except grpc.aio.AioRpcError as exc:
            error = go_status_error(exc)
        except Exception as exc:
            error = repr(exc)
        if client.closed:
            return
        now = time.monotonic()
        client.stream_error = error
        client.stream_ended = now
        self.stream_ends.append((client.resource_name, client.endpoint, now, error))
        # runClient: disconnect whichever client is registered for the name now.
        current = self._clients.get(client.resource_name)
        if current is None:
            await self._close_channel(client)
            self._notify()
            return
        if self.reregistration == "replace" and current is not client:
            await self._close_channel(client)
            self._notify()
            return
        del self._clients[client.resource_name]
        await self._close_channel(current)
        if current is not client:
            await self._close_channel(client)
        self._plugin_disconnected(client.resource_name, now)
        self._notify()

    def _on_list_and_watch(self, client: _Client, response: dp.ListAndWatchResponse) -> None:
        # genericDeviceUpdateCallback: rebuild healthy/unhealthy from scratch.
        name = client.resource_name
        healthy: set[str] = set()
        unhealthy: set[str] = set()
        all_devices: dict[str, dp.Device] = {}
        for dev in response.devices:
            all_devices[dev.ID] = _copy(dev)
            if dev.health == HEALTHY:
                healthy.add(dev.ID)
            else:
                unhealthy.add(dev.ID)
        self._healthy[name] = healthy
        self._unhealthy[name] = unhealthy
        self._all_devices[name] = all_devices
        now = time.monotonic()
        self.list_and_watch_count[name] += 1
        self.list_and_watch_last[name] = now
        self.list_and_watch_log.append(
            ListAndWatchEvent(name, client.endpoint, now, self.devices(name))
        )
        self.write_checkpoint()  # genericDeviceUpdateCallback ends with writeCheckpoint
        self._notify()

    def _plugin_disconnected(self, name: str, now: float) -> None:
        ep = self._endpoints.get(name)
        if ep is None:
            return
        # markResourceUnhealthy
        healthy = self._healthy.get(name, set())
        self._healthy[name] = set()
        self._unhealthy[name] = self._unhealthy.get(name, set()) | healthy
        self._stopped_at(ep, now)

    async def _close_channel(self, client: _Client) -> None:
        self._live_clients.discard(client)
        if client.channel is not None:
            channel, client.channel = client.channel, None
            await channel.close()

    async def _close_client(self, client: _Client) -> None:
        """Close a client on the double's own initiative (no disconnect handling)."""
        client.closed = True
        task = client.task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._close_channel(client)

    # ---------------------------------------------------------------- pods

    async def admit_pod(
        self,
        namespace: str,
        name: str,
        containers: Sequence[ContainerSpec],
        init_containers: Sequence[ContainerSpec] = (),
        *,
        choose: Mapping[str, Sequence[str]] | None = None,
        start_containers: bool = True,
    ) -> PodAdmission:
        """Admit a pod like the kubelet's device manager (see module docstring).

        ``containers`` / ``init_containers``: ``(container name, {resource: count})``.
        ``choose``: ``{resource: [ids]}`` forces those ids, used verbatim (no health or in-use
        check, no GetPreferredAllocation), consumed in container order, ``count`` per container;
        any shortfall is chosen normally. ``start_containers``: call ``PreStartContainer`` for
        resources with ``pre_start_required`` after admission (errors only fail that
        container's start: ``ContainerAllocation.prestart_error``).
        """
        async with self._admit_lock:
            key = (namespace, name)
            if key in self._pods:
                raise ValueError(f"pod {namespace}/{name} is already active; delete it first")
            self._gc_stopped()
            self.update_allocated_devices()
            pod = PodAdmission(
                namespace=namespace, name=name, uid=str(uuid.uuid4()), started=time.monotonic()
            )
            self.admissions.append(pod)
            self._pods[key] = pod  # setPodPendingAdmission: its devices count as in use
            self._notify()
            forced = {r: list(ids) for r, ids in (choose or {}).items()}
            reusable: dict[str, set[str]] = {}
            specs = [(c, True) for c in init_containers] + [(c, False) for c in containers]
            try:
                for (cname, requests), is_init in specs:
                    alloc = ContainerAllocation(name=cname, init=is_init, requests=dict(requests))
                    pod.containers.append(alloc)
                    for resource, count in requests.items():
                        await self._allocate_container_resource(
                            pod, alloc, resource, count, reusable.get(resource, set()), forced
                        )
                    for resource, ids in alloc.devices.items():
                        if is_init:  # addContainerAllocatedResources
                            reusable.setdefault(resource, set()).update(ids)
                        else:  # removeContainerAllocatedResources
                            reusable.setdefault(resource, set()).difference_update(ids)
            except _AdmissionError as exc:
                pod.admitted = False
                pod.pending = False
                pod.reason = UNEXPECTED_ADMISSION_ERROR
                pod.message = f"Allocate failed due to {exc.text}, which is unexpected"
                pod.grpc_code = exc.code
                pod.grpc_details = exc.details
                pod.finished = time.monotonic()
                self._pods.pop(key, None)  # rejected pods are not active: devices freed
                self._notify()
                return pod
            except BaseException:
                self._pods.pop(key, None)
                raise
            pod.admitted = True
            pod.pending = False
            pod.finished = time.monotonic()
            self._pod_devices[pod.uid] = pod
            self._notify()
        if start_containers:
            await self._pre_start(pod)
        return pod

    async def delete_pod(self, namespace: str, name: str) -> bool:
        """The pod terminated and was removed: its devices are free, List stops reporting it."""
        pod = self._pods.pop((namespace, name), None)
        self._notify()
        return pod is not None

    def _is_device_plugin_resource(self, resource: str) -> bool:
        return resource in self._healthy or bool(self.allocated_devices(resource))

    async def _allocate_container_resource(
        self,
        pod: PodAdmission,
        alloc: ContainerAllocation,
        resource: str,
        count: int,
        reusable: set[str],
        forced: dict[str, list[str]],
    ) -> None:
        if count <= 0:
            return
        if not self._is_device_plugin_resource(resource):
            alloc.skipped_resources.append(resource)  # not a device-plugin resource: ignored
            return
        ids = await self._devices_to_allocate(pod, alloc, resource, count, reusable, forced)
        # Reserve before the RPC (allocatedDevices), commit for pod-resources after success.
        alloc.devices[resource] = list(ids)
        alloc.topology[resource] = {
            d: [n.ID for n in dev.topology.nodes]
            for d in ids
            if (dev := self.device(resource, d)) is not None
        }
        try:
            response = await self._call_allocate(pod, alloc, resource, ids)
        except _AdmissionError:
            del alloc.devices[resource]
            raise
        alloc.responses[resource] = response
        _merge_run_options(alloc, response)
        self._pod_devices[pod.uid] = pod  # podDevices.insert, then writeCheckpoint
        self.write_checkpoint()
        self._notify()

    async def _devices_to_allocate(
        self,
        pod: PodAdmission,
        alloc: ContainerAllocation,
        resource: str,
        required: int,
        reusable: set[str],
        forced: dict[str, list[str]],
    ) -> list[str]:
        if resource not in self._healthy:
            raise _AdmissionError(f"cannot allocate unregistered device {resource}")
        allocated: list[str] = []

        def take_from(candidates: Iterable[str]) -> bool:
            pool = sorted(set(candidates) - set(allocated))
            if self._rng is not None:
                self._rng.shuffle(pool)
            for device in pool:
                if len(allocated) >= required:
                    break
                allocated.append(device)
            return len(allocated) >= required

        queue = forced.get(resource)
        if queue:
            while queue and len(allocated) < required:
                allocated.append(queue.pop(0))
            if len(allocated) >= required:
                return allocated
        if not self._healthy[resource]:  # kubelet checks it first; forced ids skip it here
            raise _AdmissionError(
                f"no healthy devices present; cannot allocate unhealthy devices {resource}"
            )
        if take_from(reusable):
            return allocated
        in_use = self.allocated_devices(resource)
        available = self._healthy[resource] - in_use - set(allocated)
        needed = required - len(allocated)
        if len(available) < needed:
            raise _AdmissionError(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {needed}, Available: {len(available)}"
            )
        # No topology manager hint: everything is "noAffinity". Ask the plugin first.
        preferred = await self._call_preferred(
            pod, alloc, resource, available | set(allocated), list(allocated), required
        )
        if preferred is not None:
            for device in preferred:  # keep the plugin's order
                if len(allocated) >= required:
                    break
                if device in available and device not in allocated:
                    allocated.append(device)
            if len(allocated) >= required:
                return allocated
        if take_from(available):
            return allocated
        raise _AdmissionError(
            f"unexpectedly allocated less resources than required. "
            f"Requested: {required}, Got: {len(allocated)}"
        )

    def _live_endpoint(self, resource: str, *, missing: str) -> _Client:
        ep = self._endpoints.get(resource)
        if ep is None:
            raise _AdmissionError(missing)
        if ep.stopped or ep.client is None or ep.client.stub is None:
            raise _AdmissionError(f"endpoint {resource} has been stopped")
        return ep.client

    async def _call_preferred(
        self,
        pod: PodAdmission,
        alloc: ContainerAllocation,
        resource: str,
        available: set[str],
        must_include: list[str],
        size: int,
    ) -> list[str] | None:
        ep = self._endpoints.get(resource)
        if ep is None:
            raise _AdmissionError(
                f"endpoint not found in cache for a registered resource: {resource}"
            )
        if ep.options is None or not ep.options.get_preferred_allocation_available:
            return None
        client = self._live_endpoint(resource, missing="")
        assert client.stub is not None
        request = dp.PreferredAllocationRequest(
            container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=sorted(available),
                    must_include_deviceIDs=must_include,
                    allocation_size=size,
                )
            ]
        )
        record = self._record("GetPreferredAllocation", resource, client, request, pod, alloc)
        try:
            response = await client.stub.GetPreferredAllocation(request, timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            record.code, record.details = exc.code(), exc.details()
            raise _AdmissionError(
                f"device plugin GetPreferredAllocation rpc failed with err: {go_status_error(exc)}",
                exc.code(),
                exc.details(),
            ) from None
        record.response = response
        if response.container_responses:
            return list(response.container_responses[0].deviceIDs)
        return None

    async def _call_allocate(
        self, pod: PodAdmission, alloc: ContainerAllocation, resource: str, ids: list[str]
    ) -> dp.ContainerAllocateResponse:
        client = self._live_endpoint(resource, missing=f"unknown Device Plugin {resource}")
        assert client.stub is not None
        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=list(ids))]
        )
        record = self._record("Allocate", resource, client, request, pod, alloc)
        try:
            response = await client.stub.Allocate(request, timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            record.code, record.details = exc.code(), exc.details()
            raise _AdmissionError(go_status_error(exc), exc.code(), exc.details()) from None
        record.response = response
        if not response.container_responses:
            raise _AdmissionError(f"no containers return in allocation response {response}")
        return _copy(response.container_responses[0])

    async def _pre_start(self, pod: PodAdmission) -> None:
        for alloc in pod.containers:
            for resource, ids in alloc.devices.items():
                ep = self._endpoints.get(resource)
                if ep is None:
                    alloc.prestart_error = (
                        f"endpoint not found in cache for a registered resource: {resource}"
                    )
                    break
                if ep.options is None or not ep.options.pre_start_required:
                    continue
                try:
                    client = self._live_endpoint(resource, missing="")
                except _AdmissionError as exc:
                    alloc.prestart_error = exc.text
                    break
                assert client.stub is not None
                request = dp.PreStartContainerRequest(devices_ids=list(ids))
                record = self._record("PreStartContainer", resource, client, request, pod, alloc)
                try:
                    record.response = await client.stub.PreStartContainer(
                        request, timeout=PRE_START_TIMEOUT
                    )
                except grpc.aio.AioRpcError as exc:
                    record.code, record.details = exc.code(), exc.details()
                    alloc.prestart_error = (
                        "device plugin PreStartContainer rpc failed with err: "
                        + go_status_error(exc)
                    )
                    break
        self._notify()

    def _record(
        self,
        method: str,
        resource: str,
        client: _Client,
        request: Any,
        pod: PodAdmission,
        alloc: ContainerAllocation,
    ) -> RpcCall:
        record = RpcCall(
            method=method,
            resource_name=resource,
            endpoint=client.endpoint,
            request=_copy(request),
            time=time.monotonic(),
            pod=(pod.namespace, pod.name),
            container=alloc.name,
        )
        self.rpc_calls.append(record)
        return record

    # ---------------------------------------------------------------- pod-resources

    @property
    def list_enabled(self) -> bool:
        return self.pod_resources_error is None

    @list_enabled.setter
    def list_enabled(self, value: bool) -> None:
        self.pod_resources_error = (
            None
            if value
            else (grpc.StatusCode.UNAVAILABLE, "pod resources API unavailable (simulated)")
        )

    async def _pod_resources_gate(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.pod_resources_calls[method] += 1
        self._notify()
        if self.pod_resources_error is not None:
            code, details = self.pod_resources_error
            await context.abort(code, details)

    def _pod_resources_of(self, pod: PodAdmission) -> pr.PodResources:
        containers = []
        for c in pod.containers:
            if c.init:  # only restartable init containers are listed; none here
                continue
            devices: list[pr.ContainerDevices] = []
            for resource, ids in c.devices.items():
                if resource not in c.responses:  # Allocate still in flight
                    continue
                topo = c.topology.get(resource, {})
                devices.extend(_container_devices(resource, sorted(ids), topo))
            containers.append(pr.ContainerResources(name=c.name, devices=devices))
        return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)

    def update_allocated_devices(self) -> None:
        """``UpdateAllocatedDevices``: forget the devices of pods that are no longer active
        (in memory only: the checkpoint file keeps them until the next write)."""
        active = {pod.uid for pod in self._pods.values()}
        for uid in [uid for uid in self._pod_devices if uid not in active]:
            del self._pod_devices[uid]

    def checkpoint_data(self) -> dict[str, Any]:
        """The device-manager checkpoint as kubelet writes it (``checkpoint.Data``)."""
        entries = []
        for uid, pod in self._pod_devices.items():
            for container in pod.containers:
                for resource, ids in container.devices.items():
                    response = container.responses.get(resource)
                    if response is None:
                        continue  # Allocate in flight: inserted once it succeeded
                    per_numa: dict[str, list[str]] = {}
                    for device in ids:
                        nodes = container.topology.get(resource, {}).get(device) or [-1]
                        for node in nodes:
                            per_numa.setdefault(str(node), []).append(device)
                    entries.append(
                        {
                            "PodUID": uid,
                            "ContainerName": container.name,
                            "ResourceName": resource,
                            "DeviceIDs": per_numa,
                            "AllocResp": base64.b64encode(response.SerializeToString()).decode(),
                        }
                    )
        registered = {resource: sorted(devices) for resource, devices in self._all_devices.items()}
        data = {"PodDeviceEntries": entries, "RegisteredDevices": registered}
        checksum = sum(json.dumps(data, sort_keys=True).encode()) & 0xFFFFFFFF
        return {"Data": data, "Checksum": checksum}

    def write_checkpoint(self) -> None:
        """``writeCheckpoint``: atomically replace the checkpoint file."""
        path = self.device_plugin_dir / CHECKPOINT_FILE
        tmp = path.with_name(f".{CHECKPOINT_FILE}.tmp")
        tmp.write_text(json.dumps(self.checkpoint_data()))
        tmp.replace(path)
        self.checkpoint_writes += 1

    def pod_resources_list(self) -> pr.ListPodResourcesResponse:
        """What ``List`` returns now (it runs ``UpdateAllocatedDevices`` first, like
        ``server_v1.go``)."""
        self.update_allocated_devices()
        return pr.ListPodResourcesResponse(
            pod_resources=[self._pod_resources_of(p) for p in self._pods.values()]
        )

    def pod_resources_allocatable(self) -> pr.AllocatableResourcesResponse:
        """What ``GetAllocatableResources`` returns now (healthy devices)."""
        self._gc_stopped()
        devices: list[pr.ContainerDevices] = []
        for resource in sorted(self._healthy):
            known = self._all_devices.get(resource, {})
            for dev_id in sorted(self._healthy[resource]):
                dev = known.get(dev_id)
                nodes = [n.ID for n in dev.topology.nodes] if dev is not None else []
                devices.extend(_container_devices(resource, [dev_id], {dev_id: nodes}))
        return pr.AllocatableResourcesResponse(devices=devices)


def _container_devices(
    resource: str, ids: Sequence[str], topology: Mapping[str, Sequence[int]]
) -> list[pr.ContainerDevices]:
    """``containerDevicesFromResourceDeviceInstances``: one entry per device and NUMA node."""
    out: list[pr.ContainerDevices] = []
    for dev_id in ids:
        nodes = topology.get(dev_id) or []
        if not nodes:
            out.append(pr.ContainerDevices(resource_name=resource, device_ids=[dev_id]))
            continue
        for node in nodes:
            out.append(
                pr.ContainerDevices(
                    resource_name=resource,
                    device_ids=[dev_id],
                    topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=node)]),
                )
            )
    return out


def _merge_run_options(alloc: ContainerAllocation, response: dp.ContainerAllocateResponse) -> None:
    """``deviceRunContainerOptions``: the first setting of an env/annotation/path wins."""
    for k, v in response.envs.items():
        alloc.envs.setdefault(k, v)
    for k, v in response.annotations.items():
        alloc.annotations.setdefault(k, v)
    mount_paths = {m.container_path for m in alloc.mounts}
    for m in response.mounts:
        if m.container_path not in mount_paths:
            alloc.mounts.append(_copy(m))
            mount_paths.add(m.container_path)
    dev_paths = {d.container_path for d in alloc.device_specs}
    for d in response.devices:
        if d.container_path not in dev_paths:
            alloc.device_specs.append(_copy(d))
            dev_paths.add(d.container_path)
    for cdi in response.cdi_devices:
        if cdi.name not in alloc.cdi_devices:
            alloc.cdi_devices.append(cdi.name)
