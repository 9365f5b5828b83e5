"""DRA device health for kubelet (KEP-4680): the ``DRAResourceHealth`` service.

kubelet opens ``NodeWatchResources`` on the DRA service socket and publishes what it receives in
``pod.status.containerStatuses[].allocatedResourcesStatus`` of the pods using the devices.
Every message is the **complete** list of the driver's devices on this node; a device left out,
or not sent again within its ``health_check_timeout_seconds``, becomes ``Unknown``.

* :func:`device_health` (pure) says what to report: every slot device of every Instance this
  node is in (local ones in the node's pool, shared ones in the Instance's pool — the pools of
  ``slices.py``), ``UNHEALTHY`` with a message while the Instance is offline here (its handler
  no longer reports the device: the grace period) or draining, ``HEALTHY`` otherwise; and the
  devices of claims prepared here whose Instance no longer exists, ``UNHEALTHY``.
* :class:`HealthReporter` keeps the current list and wakes every open stream when it changes:
  :meth:`HealthReporter.changed` is called by the discovery manager's offline listener (so a
  device going offline is sent at once, not at the next poll) and on Instance events. The list
  is also re-sent every ``resend`` seconds (less than the timeout it announces) so kubelet
  never lets a live device go ``Unknown``.
* One servicer per upstream version (``v1alpha1``, ``v1beta1``, ``v1``: identical messages,
  different proto packages). kubelet 1.34-1.36 open ``v1alpha1`` whenever their
  ``ResourceHealthStatus`` gate is on; newer ones pick from the advertised
  ``supported_versions`` (``v1`` first), so the driver lists all three.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from agent.core.model.instance import Instance
from agent.core.model.naming import slot_id
from agent.node.dra.slices import device_name
from agent.protos.dra_health.v1 import api_pb2 as health_v1
from agent.protos.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from agent.protos.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from agent.protos.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from agent.protos.dra_health.v1beta1 import api_pb2 as health_v1beta1
from agent.protos.dra_health.v1beta1 import api_pb2_grpc as health_v1beta1_grpc

log = logging.getLogger(__name__)

# "<proto package>.<service>" strings for PluginInfo.supported_versions, newest first
# (k8s.io/kubelet/pkg/apis/dra-health/*/types.go DRAResourceHealthService).
HEALTH_SERVICES = (
    "v1.DRAResourceHealth",
    "v1beta1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)
HEALTH_TIMEOUT_SECONDS = 30  # announced per device; kubelet's own default is also 30 s
RESEND_SECONDS = 10.0  # well inside the timeout, so a loaded node does not flap to Unknown
MAX_MESSAGE = 1024  # kubelet truncates longer messages to 1021 characters + "..."

PreparedDevices = Callable[[], Iterable[tuple[str, str, str]]]
"""``(pool, device, instance)`` of every device of a claim prepared on this node."""


@dataclass(frozen=True)
class DeviceHealthEntry:
    """What one ``DeviceHealth`` says (without the timestamps)."""

    pool: str
    device: str
    healthy: bool
    message: str = ""


@functools.lru_cache(maxsize=16384)
def _slot_devices(name: str, capacity: int) -> tuple[str, ...]:
    # every Instance event recomputes the list: 1000 Instances' device names cost ~2 ms.
    # The Instance's own name is its device with consumable capacity (slices.py).
    return (
        *(device_name(slot_id(name, index)) for index in range(capacity)),
        device_name(name),
    )


def _truncate(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def offline_message(instance: Instance, node: str) -> str:
    """Why an offline Instance's devices are unhealthy (shown in the pod's status)."""
    return _truncate(
        f"akri.sh: device {instance.name} (Configuration {instance.configuration_name}) is "
        f"offline on node {node}: its discovery handler no longer reports it"
    )


def device_health(
    instances: Iterable[Instance],
    node: str,
    offline: Collection[str],
    prepared: Iterable[tuple[str, str, str]] = (),
) -> tuple[DeviceHealthEntry, ...]:
    """The complete health list of this node's devices, sorted by (pool, device).

    ``offline`` holds the names of the Instances this node keeps in their grace period or is
    draining (``DiscoveryManager.offline_instances``); an Instance carrying this node's
    draining mark counts too. ``prepared`` adds the devices of claims prepared here whose
    Instance is gone (a pod may still run with them)."""
    entries: dict[tuple[str, str], DeviceHealthEntry] = {}
    for instance in instances:
        if node not in instance.nodes:
            continue
        pool = instance.name if instance.shared else node
        unhealthy = instance.name in offline or node in instance.draining_nodes
        message = offline_message(instance, node) if unhealthy else ""
        for name in _slot_devices(instance.name, instance.capacity):
            entries[(pool, name)] = DeviceHealthEntry(pool, name, not unhealthy, message)
    for pool, device, instance_name in prepared:
        if (pool, device) not in entries:
            entries[(pool, device)] = DeviceHealthEntry(
                pool,
                device,
                False,
                _truncate(f"akri.sh: Instance {instance_name} of this device no longer exists"),
            )
    return tuple(entries[key] for key in sorted(entries))


def response(
    pb: ModuleType,
    entries: Iterable[DeviceHealthEntry],
    now: float,
    timeout: int = HEALTH_TIMEOUT_SECONDS,
) -> Any:
    """A ``NodeWatchResourcesResponse`` of the proto module ``pb`` (any health version)."""
    stamp = int(now)
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=e.pool, device_name=e.device),
                health=pb.HEALTHY if e.healthy else pb.UNHEALTHY,
                last_updated_time=stamp,
                health_check_timeout_seconds=timeout,
                message=e.message,
            )
            for e in entries
        ]
    )


class HealthReporter:
    """The current device health list, and the streams that send it to kubelet."""

    def __init__(
        self,
        node: str,
        instances: Callable[[], Iterable[Instance]],
        offline: Callable[[], Collection[str]],
        prepared: PreparedDevices = lambda: (),
        *,
        resend: float = RESEND_SECONDS,
    ) -> None:
        self.node = node
        self._instances = instances
        self._offline = offline
        self._prepared = prepared
        self.resend = resend
        self.entries: tuple[DeviceHealthEntry, ...] = ()
        self.version = 0
        self._wake = asyncio.Condition()
        self._pending: asyncio.Handle | None = None
        self.streams = 0  # open NodeWatchResources streams
        self.sent = 0  # messages sent on all streams
        self.on_sent: Callable[[tuple[DeviceHealthEntry, ...]], None] | None = None

    def _compute(self) -> tuple[DeviceHealthEntry, ...]:
        return device_health(self._instances(), self.node, self._offline(), self._prepared())

    def changed(self) -> None:
        """Something the list depends on changed: recompute at the next loop turn (a burst of
        Instance events costs one recompute) and wake the streams if the list differs."""
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_soon(self._recompute)

    def _recompute(self) -> None:
        self._pending = None
        entries = self._compute()
        if entries == self.entries:
            return
        went_bad = {(e.pool, e.device) for e in entries if not e.healthy} - {
            (e.pool, e.device) for e in self.entries if not e.healthy
        }
        if went_bad:
            log.info(
                "DRA health: %d device(s) now unhealthy on %s (sent to kubelet)",
                len(went_bad),
                self.node,
            )
        self.entries = entries
        self.version += 1
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._wake:
            self._wake.notify_all()

    async def watch(self, pb: ModuleType) -> AsyncIterator[Any]:
        """The messages of one stream: the list at once, then on every change and every
        ``resend`` seconds."""
        self.streams += 1
        try:
            if self.version == 0:
                self.entries = self._compute()
                self.version = 1
            while True:
                seen = self.version
                entries = self.entries
                yield response(pb, entries, time.time())
                self.sent += 1
                if self.on_sent is not None:
                    self.on_sent(entries)
                async with self._wake:
                    if self.version == seen:
                        try:  # not wait_for: on 3.11 a wake with a cancel loses the cancel
                            async with asyncio.timeout(self.resend):
                                await self._wake.wait()
                        except TimeoutError:
                            # the re-send; also catches what no event announces (a claim
                            # unprepared whose Instance is gone)
                            self._recompute()
        finally:
            self.streams -= 1


class _HealthServicer:
    def __init__(self, reporter: HealthReporter, pb: ModuleType) -> None:
        self.reporter = reporter
        self.pb = pb

    async def NodeWatchResources(self, request: Any, context: Any) -> AsyncIterator[Any]:
        log.info("kubelet opened a %s NodeWatchResources stream", self.pb.DESCRIPTOR.package)
        async for message in self.reporter.watch(self.pb):
            yield message


class _V1(_HealthServicer, health_v1_grpc.DRAResourceHealthServicer):
    pass


class _V1beta1(_HealthServicer, health_v1beta1_grpc.DRAResourceHealthServicer):
    pass


class _V1alpha1(_HealthServicer, health_v1alpha1_grpc.DRAResourceHealthServicer):
    pass


def add_health_services(reporter: HealthReporter, server: Any) -> None:
    """Serve every health version on ``server`` (the DRA service socket)."""
    health_v1_grpc.add_DRAResourceHealthServicer_to_server(_V1(reporter, health_v1), server)
    health_v1beta1_grpc.add_DRAResourceHealthServicer_to_server(
        _V1beta1(reporter, health_v1beta1), server
    )
    health_v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
        _V1alpha1(reporter, health_v1alpha1), server
    )
