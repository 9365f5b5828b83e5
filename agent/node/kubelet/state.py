"""What kubelet says is assigned to containers: pod-resources ``List`` plus its checkpoint.

``List`` alone is not enough: kubelet leaves non-restartable init containers out of it
(``server_v1.go``: only ``pod.Spec.Containers`` and restartable init containers are listed),
yet keeps their devices assigned to the pod until the pod ends. Its device-manager checkpoint
(``<device-plugin-dir>/kubelet_internal_checkpoint``, JSON
``{"Data": {"PodDeviceEntries": [{"PodUID", "ContainerName", "ResourceName", "DeviceIDs",
"AllocResp"}], "RegisteredDevices": {...}}, "Checksum": N}``) has every container's devices,
init containers included; it is written right after each allocation and on every
``ListAndWatch`` message kubelet receives.

The rule (docs/slot-model.md, "Reclaim"): a device is **in use** when ``List`` shows it *or*
the checkpoint, read after that ``List``, shows it. The checkpoint never misses a device kubelet
counts as assigned; it can only be late in dropping a pod that is gone: ``List`` itself makes
kubelet forget inactive pods (``UpdateAllocatedDevices``), but the file is only rewritten on
kubelet's next write. So when a held device is in the checkpoint but not in ``List``, the
reclaimer asks one of our plugins to re-send its (unchanged) device list: kubelet then
rewrites the checkpoint, and a pod that is really gone drops out of it by the next pass,
while a running init container stays.

``DeviceIDs`` is ``{"<numa node>": [ids]}`` since Kubernetes 1.20 (``-1`` without topology)
and a plain list before; both are read.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import time
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.core.ledger.ledger import EvidenceReadError

CHECKPOINT_FILE = "kubelet_internal_checkpoint"
MAX_CHECKPOINT_BYTES = 16 * 1024 * 1024
MAX_POD_RESOURCES_BYTES = 64 * 1024 * 1024

InUse = Mapping[str, frozenset[str]]  # resource name -> device ids
# after a failed look (List hung or failed, checkpoint unreadable), how long evidence
# requests fail at once rather than each asking kubelet again
FAILED_LOOK_RETRY = 2.0


class KubeletStateError(EvidenceReadError):
    """kubelet's answer or checkpoint cannot be used (nothing may be freed on it)."""


def parse_kubelet_checkpoint(raw: bytes) -> dict[str, frozenset[str]]:
    """Device ids per resource in a device-manager checkpoint (every container, init ones
    included). Raises :class:`KubeletStateError` when it is not one."""
    found: defaultdict[str, set[str]] = defaultdict(set)
    for entry in _checkpoint_entries(raw):
        found[entry["ResourceName"]].update(_device_ids(entry.get("DeviceIDs")))
    return {resource: frozenset(ids) for resource, ids in found.items()}


def _checkpoint_entries(raw: bytes) -> list[dict[str, Any]]:
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise KubeletStateError(f"kubelet checkpoint is not JSON: {error}") from error
    data = document.get("Data") if isinstance(document, dict) else None
    if not isinstance(data, dict):
        raise KubeletStateError("kubelet checkpoint has no Data object")
    entries = data.get("PodDeviceEntries") or []
    if not isinstance(entries, list):
        raise KubeletStateError("kubelet checkpoint: Data.PodDeviceEntries is not a list")
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("ResourceName"), str):
            raise KubeletStateError("kubelet checkpoint: malformed PodDeviceEntries item")
    return entries


_DIGEST_SUFFIX = re.compile(r"_([0-9A-F]{6})$")


@dataclass(frozen=True)
class CheckpointAllocation:
    """One ``PodDeviceEntries`` item: the devices of one resource given to one container, and
    the Instance digests its ``AllocResp`` env var names end in (``K_<DIGEST>`` next to ``K``,
    see :mod:`agent.node.deviceplugin.container_env` and :func:`instance_digests`): for a
    configuration-level resource, the Instances behind its virtual devices."""

    resource: str
    device_ids: frozenset[str]
    digests: frozenset[str]


def instance_digests(env_names: Collection[str]) -> set[str]:
    """The Instance digests a container's env var names stand for. Our Allocate sets every
    broker property ``K`` twice, as ``K`` and ``K_<DIGEST>``; a name merely *ending* in ``_``
    and six hex digits (``SERIAL_123456``) is a property of its own, so a suffix counts only
    when the name without it is set too."""
    names = set(env_names)
    digests: set[str] = set()
    for name in names:
        match = _DIGEST_SUFFIX.search(name)
        if match is not None and name[: match.start()] in names:
            digests.add(match.group(1))
    return digests


def parse_checkpoint_allocations(raw: bytes) -> list[CheckpointAllocation]:
    """The entries of a device-manager checkpoint with the digests of their ``AllocResp``
    (base64 of a ``ContainerAllocateResponse``, as kubelet's JSON encodes ``[]byte``). An
    ``AllocResp`` that cannot be decoded names no digest. Raises :class:`KubeletStateError`
    when the file is not a checkpoint."""
    # here: a local agent never reads a kubelet checkpoint, nor needs protobuf
    from google.protobuf.message import DecodeError

    from agent.protos.deviceplugin.v1beta1 import api_pb2

    entries = _checkpoint_entries(raw)
    result = []
    for entry in entries:
        digests: set[str] = set()
        encoded = entry.get("AllocResp")
        if isinstance(encoded, str) and encoded:
            try:
                response = api_pb2.ContainerAllocateResponse.FromString(
                    base64.b64decode(encoded, validate=True)
                )
            except (binascii.Error, ValueError, DecodeError):
                response = None
            if response is not None:
                digests = instance_digests(response.envs)
        result.append(
            CheckpointAllocation(
                entry["ResourceName"],
                frozenset(_device_ids(entry.get("DeviceIDs"))),
                frozenset(digests),
            )
        )
    return result


def _device_ids(value: Any) -> set[str]:
    if value is None:
        return set()
    if isinstance(value, list):
        groups: list[Any] = [value]
    elif isinstance(value, dict):
        groups = list(value.values())
    else:
        raise KubeletStateError("kubelet checkpoint: DeviceIDs is neither a list nor a map")
    ids: set[str] = set()
    for group in groups:
        if not isinstance(group, list) or not all(isinstance(i, str) for i in group):
            raise KubeletStateError("kubelet checkpoint: DeviceIDs holds a non-string")
        ids.update(group)
    return ids


def read_kubelet_checkpoint(path: Path) -> dict[str, frozenset[str]]:
    """:func:`parse_kubelet_checkpoint` of ``path``; no file = nothing assigned yet."""
    raw = read_checkpoint_bytes(path)
    return parse_kubelet_checkpoint(raw) if raw is not None else {}


def read_checkpoint_bytes(path: Path) -> bytes | None:
    """The checkpoint file (None: none yet). Raises :class:`KubeletStateError`."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CHECKPOINT_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise KubeletStateError(f"cannot read {path}: {error.strerror}") from error
    if len(raw) > MAX_CHECKPOINT_BYTES:
        raise KubeletStateError(f"{path} is larger than {MAX_CHECKPOINT_BYTES} bytes")
    return raw


PodName = tuple[str, str]  # (namespace, name)


async def list_pod_resources(
    socket: Path, rpc_timeout: float = 5.0
) -> tuple[dict[str, frozenset[str]], frozenset[PodName]]:
    """kubelet's pod-resources ``List``: device ids per resource over all listed containers,
    and the pods listed."""
    import grpc  # here: a local agent without device plugins never needs gRPC

    from agent.protos.podresources.v1 import api_pb2 as pr_pb2
    from agent.protos.podresources.v1 import api_pb2_grpc as pr_grpc

    in_use: defaultdict[str, set[str]] = defaultdict(set)
    options = [("grpc.max_receive_message_length", MAX_POD_RESOURCES_BYTES)]
    async with grpc.aio.insecure_channel(f"unix://{socket}", options=options) as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        response = await stub.List(pr_pb2.ListPodResourcesRequest(), timeout=rpc_timeout)
    pods = set()
    for pod in response.pod_resources:
        pods.add((pod.namespace, pod.name))
        for container in pod.containers:
            for devices in container.devices:
                in_use[devices.resource_name].update(devices.device_ids)
    return {resource: frozenset(ids) for resource, ids in in_use.items()}, frozenset(pods)


@dataclass(frozen=True)
class KubeletView:
    """One look at kubelet: ``listed`` by ``List``, ``checkpointed`` in its checkpoint (read
    after the ``List``), taken after the clock read ``taken`` (monotonic); ``pods`` are the
    pods ``List`` showed."""

    listed: InUse
    checkpointed: InUse
    taken: float
    pods: frozenset[PodName] = frozenset()
    in_use: InUse = field(init=False)

    def __post_init__(self) -> None:
        merged = {
            resource: self.listed.get(resource, frozenset())
            | self.checkpointed.get(resource, frozenset())
            for resource in set(self.listed) | set(self.checkpointed)
        }
        object.__setattr__(self, "in_use", merged)

    def only_checkpointed(self, resource: str, device_id: str) -> bool:
        """In the checkpoint but not listed: an init container, or a pod kubelet has already
        forgotten but not yet written out."""
        return device_id in self.checkpointed.get(resource, frozenset()) and device_id not in (
            self.listed.get(resource, frozenset())
        )


class KubeletState:
    """Reads :class:`KubeletView` s from a pod-resources socket and a checkpoint file."""

    def __init__(
        self,
        socket: Path,
        checkpoint: Path,
        *,
        rpc_timeout: float = 5.0,
        failure_retry: float = FAILED_LOOK_RETRY,
        clock: Any = time.monotonic,
    ) -> None:
        self.socket = socket
        self.checkpoint = checkpoint
        self.rpc_timeout = rpc_timeout
        self.failure_retry = failure_retry
        self._clock = clock
        self.last: KubeletView | None = None
        self._inflight: asyncio.Future[KubeletView] | None = None
        self._inflight_started = 0.0
        # the last look's failure and until when it stands (monotonic); a success clears it
        self._failed: tuple[Exception, float] | None = None
        self.looks = 0  # looks started (tests)

    def available(self) -> bool:
        """Whether the pod-resources socket exists (kubelet serves it)."""
        return self.socket.exists()

    def socket_identity(self) -> tuple[int, int] | None:
        """(inode, ctime) of the socket: a new one means kubelet restarted."""
        try:
            stat = self.socket.stat()
        except OSError:
            return None
        return (stat.st_ino, stat.st_ctime_ns)

    async def view(self) -> KubeletView:
        """``List``, then the checkpoint. Raises ``grpc.aio.AioRpcError`` or
        :class:`KubeletStateError`. Concurrent callers share one look."""
        started = self._clock()
        if self._inflight is not None and self._inflight_started >= started:
            return await asyncio.shield(self._inflight)
        self._inflight_started = started
        self._inflight = asyncio.ensure_future(self._look(started))
        try:
            return await asyncio.shield(self._inflight)
        finally:
            if self._inflight is not None and self._inflight.done():
                self._inflight = None

    async def _look(self, taken: float) -> KubeletView:
        self.looks += 1
        try:
            listed, pods = await list_pod_resources(self.socket, self.rpc_timeout)
            checkpointed = read_kubelet_checkpoint(self.checkpoint)
        except Exception as error:
            self._failed = (error, self._clock() + self.failure_retry)
            raise
        self._failed = None
        self.last = KubeletView(listed, checkpointed, taken, pods)
        return self.last

    async def view_after(self, not_before: float) -> KubeletView:
        """A look taken at or after ``not_before`` (monotonic): the last one if it is recent
        enough, else a new one. For ``failure_retry`` seconds after a look failed, raises
        :class:`KubeletStateError` at once instead of asking again: when ``List`` hangs, the
        Instances of one discovery pass (each waiting under its own lock) then fail fast and
        are retried by the runner's backoff, instead of waiting ``rpc_timeout`` one after
        another (1000 Instances x 5 s)."""
        if self.last is not None and self.last.taken >= not_before:
            return self.last
        if self._failed is not None:
            error, until = self._failed
            if self._clock() < until:
                raise KubeletStateError(
                    f"kubelet's pod-resources answer failed moments ago "
                    f"({type(error).__name__}: {error}); asking again after "
                    f"{self.failure_retry:.0f}s"
                ) from error
        return await self.view()
