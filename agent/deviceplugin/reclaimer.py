"""Frees slots this node holds for containers that no longer exist.

Every ``interval`` seconds the reclaimer asks kubelet's pod-resources API (``List``) which
device IDs are assigned to live containers, per resource. A slot this node holds through a
device plugin is *in use* if its device ID is listed under its resource:

* IL value ``<node>`` in Instance I, slot S → ``S`` listed under ``akri.sh/I``;
* CL value ``C:<vdev>:<node>`` in an Instance of configuration C → ``vdev`` listed under
  ``akri.sh/C``.

(Both are compared in kubelet's own format, so unlike Akri 0.13 IL slots are really freed.)
A slot seen unused continuously for ``grace`` seconds is released through the ledger. DRA
slots (``D:…``) belong to the DRA driver and are never touched here. If the pod-resources
socket is missing, reclaim is off and the log says so once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.deviceplugin.views import configuration_resource, instance_resource
from agent.ledger.ledger import SlotLedger
from agent.model.device_usage import ConfigurationUsage, NodeUsage, parse_usage
from agent.model.instance import Instance
from agent.protos.podresources.v1 import api_pb2 as pr_pb2
from agent.protos.podresources.v1 import api_pb2_grpc as pr_grpc

log = logging.getLogger(__name__)

InUse = Mapping[str, frozenset[str]]  # resource name -> device ids assigned to live containers


@dataclass(frozen=True)
class HeldSlot:
    """A slot this node holds through a device plugin, and the kubelet ID that proves use."""

    instance: str
    slot: str
    value: str
    resource: str
    device_id: str


def held_by_plugins(instances: Iterable[Instance], node: str) -> list[HeldSlot]:
    """Every IL/CL slot ``node`` holds (DRA and other nodes' slots excluded)."""
    result = []
    for instance in instances:
        for slot, value in sorted(instance.device_usage.items()):
            if not value:
                continue  # free: most slots, and this runs every reclaim pass
            usage = parse_usage(value)
            if usage == NodeUsage(node):
                result.append(
                    HeldSlot(instance.name, slot, value, instance_resource(instance.name), slot)
                )
            elif isinstance(usage, ConfigurationUsage) and usage.node == node:
                resource = configuration_resource(instance.configuration_name)
                result.append(HeldSlot(instance.name, slot, value, resource, usage.vdev))
    return result


def stale_slots(
    held: Iterable[HeldSlot],
    in_use: InUse,
    unused_since: dict[tuple[str, str], float],
    now: float,
    grace: float,
) -> list[HeldSlot]:
    """Slots unused for at least ``grace`` seconds; updates ``unused_since`` in place."""
    due = []
    current: set[tuple[str, str]] = set()
    for slot in held:
        key = (slot.instance, slot.slot)
        current.add(key)
        if slot.device_id in in_use.get(slot.resource, frozenset()):
            unused_since.pop(key, None)
            continue
        since = unused_since.setdefault(key, now)
        if now - since >= grace:
            due.append(slot)
    for key in list(unused_since):
        if key not in current:
            del unused_since[key]
    return due


async def list_pod_resources(socket: Path, rpc_timeout: float = 5.0) -> dict[str, frozenset[str]]:
    """kubelet's pod-resources ``List``: device ids per resource over all live containers."""
    in_use: defaultdict[str, set[str]] = defaultdict(set)
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        response = await stub.List(pr_pb2.ListPodResourcesRequest(), timeout=rpc_timeout)
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                in_use[devices.resource_name].update(devices.device_ids)
    return {resource: frozenset(ids) for resource, ids in in_use.items()}


class SlotReclaimer:
    """Periodically frees this node's stale IL/CL slots."""

    def __init__(
        self,
        ledger: SlotLedger,
        list_instances: Callable[[], list[Instance]],
        socket: Path,
        *,
        interval: float = 1.0,
        grace: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self._list = list_instances
        self.socket = socket
        self.interval = interval
        self.grace = grace
        self._clock = clock
        self._unused_since: dict[tuple[str, str], float] = {}
        self._warned = False
        self.freed = 0

    async def run(self) -> None:
        """Reclaim forever."""
        while True:
            try:
                await self.reclaim_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("slot reclaim pass failed")
            await asyncio.sleep(self.interval)

    async def reclaim_once(self) -> list[HeldSlot]:
        """One pass; returns the slots freed."""
        if not self.socket.exists():
            if not self._warned:
                log.warning(
                    "pod-resources socket %s not found: slot reclaim is off until it appears",
                    self.socket,
                )
                self._warned = True
            return []
        # taken before asking kubelet: anything granted after this is not covered by the answer
        snapshot = self._clock()
        try:
            in_use = await list_pod_resources(self.socket)
        except grpc.aio.AioRpcError as error:
            if not self._warned:
                log.warning(
                    "pod-resources List failed (%s): slot reclaim paused", error.code().name
                )
                self._warned = True
            return []
        if self._warned:
            log.info("pod-resources API available: slot reclaim is on")
            self._warned = False
        instances = [i for i in self._list() if self.ledger.node in i.nodes or i.device_usage]
        held = held_by_plugins(instances, self.ledger.node)
        due = stale_slots(held, in_use, self._unused_since, snapshot, self.grace)
        freed = []
        for slot in due:
            key = (slot.instance, slot.slot)
            since = self._unused_since.get(key, snapshot)
            released = await self.ledger.release_slots(
                slot.instance, {slot.slot: slot.value}, unless_granted_since=since
            )
            if slot.slot in released:
                log.info(
                    "reclaimed slot %s (%s): no container uses %s any more",
                    slot.slot,
                    slot.value,
                    slot.device_id,
                )
                self._unused_since.pop(key, None)
                self.freed += 1
                freed.append(slot)
            else:
                # granted again (kubelet re-offered it) since we saw it unused: start over
                self._unused_since.pop(key, None)
        return freed
