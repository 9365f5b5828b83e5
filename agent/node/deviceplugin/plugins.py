"""Instance-level and configuration-level plugin logic, on top of the slot ledger."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import grpc

from agent.core.ledger.decisions import Owner, slots_held_by
from agent.core.ledger.ledger import SlotLedger, SlotRefusedError
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import configuration_resource_name, parse_slot_id
from agent.core.store.base import StoreError
from agent.node.deviceplugin.container_env import container_edits
from agent.node.deviceplugin.service import AllocationError, Listed
from agent.node.deviceplugin.views import (
    ConfigurationDevices,
    DeviceView,
    InstanceDevices,
    InsufficientInstancesError,
    VirtualDevice,
    configuration_resource,
    instance_resource,
    plan_configuration_allocation,
    preferred_configuration_devices,
)
from agent.protos.deviceplugin.v1beta1 import api_pb2
from discovery_handlers.base import Device

log = logging.getLogger(__name__)


class DeviceSource(Protocol):
    """What discovery tells the plugins: devices in grace and the devices themselves."""

    def offline_instances(self) -> frozenset[str]: ...

    def device_for(self, instance: str) -> Device | None: ...


def _response(
    instances: Sequence[Instance], source: DeviceSource
) -> api_pb2.ContainerAllocateResponse:
    edits = container_edits(instances, {i.name: source.device_for(i.name) for i in instances})
    return api_pb2.ContainerAllocateResponse(
        envs=edits.envs,
        devices=[
            api_pb2.DeviceSpec(
                container_path=s.container_path, host_path=s.host_path, permissions=s.permissions
            )
            for s in edits.device_specs
        ],
        mounts=[
            api_pb2.Mount(
                container_path=m.container_path, host_path=m.host_path, read_only=m.read_only
            )
            for m in edits.mounts
        ],
    )


def _refusal_code(error: SlotRefusedError) -> grpc.StatusCode:
    if error.reason in ("UnknownSlot", "UnknownInstance"):
        return grpc.StatusCode.INVALID_ARGUMENT
    if error.reason in (
        "SlotInUse",
        "CapacityReached",
        "Deleting",
        "NotOnNode",
        "Draining",
        "Reserved",
    ):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.UNAVAILABLE


class InstancePlugin:
    """``akri.sh/<instance>``: one device per slot. ``store_lookup`` finds the served
    Instance by its (node-global) name."""

    preferred_allocation = False

    def __init__(
        self,
        instance: str,
        store_lookup: Callable[[str], Instance | None],
        ledger: SlotLedger,
        source: DeviceSource,
    ) -> None:
        self.instance = instance
        self.resource_name = instance_resource(instance)
        self._lookup = store_lookup
        self._ledger = ledger
        self._source = source
        self._view = InstanceDevices(ledger.node)

    def devices(self) -> Sequence[DeviceView]:
        # the same tuple while the list cannot have changed (InstanceDevices): a stream
        # recognises it without comparing every slot
        offline = self.instance in self._source.offline_instances()
        return self._view(self._lookup(self.instance), offline)

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        return (
            list(must_include)[:size]
            + [d for d in available if d not in must_include][: max(0, size - len(must_include))]
        )

    async def allocate(
        self, container_requests: Sequence[Sequence[str]]
    ) -> list[api_pb2.ContainerAllocateResponse]:
        owner = Owner.instance_level(self._ledger.node)
        for ids in container_requests:
            for device_id in ids:
                if parse_slot_id(self.instance, device_id) is None:
                    raise AllocationError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{self.resource_name}: unknown device {device_id!r}",
                    )
        responses = []
        # every slot this request newly claimed, across its containers: a request that fails
        # part-way gives them all back (kubelet admits all of it or nothing)
        claimed: list[tuple[ObjectKey, str]] = []
        try:
            for ids in container_requests:
                responses.append(await self._allocate_container(ids, owner, claimed))
        except Exception:
            for key, device_id in reversed(claimed):
                await self._roll_back(key, [device_id], owner)
            raise
        return responses

    async def _allocate_container(
        self, ids: Sequence[str], owner: Owner, claimed: list[tuple[ObjectKey, str]]
    ) -> api_pb2.ContainerAllocateResponse:
        if self.instance in self._source.offline_instances():
            raise AllocationError(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.resource_name}: device is offline on {self._ledger.node}",
            )
        served = self._lookup(self.instance)
        if served is None:
            raise AllocationError(
                grpc.StatusCode.NOT_FOUND, f"{self.resource_name}: instance is gone"
            )
        key = served.key
        try:
            for device_id in ids:
                result = await self._ledger.claim(key, device_id, owner)
                if result.changed:
                    claimed.append((key, device_id))
        except (SlotRefusedError, StoreError) as error:
            code = (
                _refusal_code(error)
                if isinstance(error, SlotRefusedError)
                else grpc.StatusCode.UNAVAILABLE
            )
            raise AllocationError(code, f"{self.resource_name}: {error}") from error
        current = self._lookup(self.instance)
        if current is None:
            raise AllocationError(grpc.StatusCode.NOT_FOUND, f"{self.instance} vanished")
        return _response([current], self._source)

    async def _roll_back(self, key: ObjectKey, claimed: Collection[str], owner: Owner) -> None:
        for device_id in claimed:
            try:
                await self._ledger.release(key, device_id, owner)
            except Exception as error:  # the reclaimer will free it later
                log.warning("could not roll back %s: %s", device_id, error)


class ConfigurationPlugin:
    """``akri.sh/<configuration>``: virtual devices, each a distinct Instance per container.
    ``list_instances`` gives the served Instances of a Configuration name."""

    preferred_allocation = True

    def __init__(
        self,
        configuration: str,
        list_instances: Callable[[str], list[Instance]],
        ledger: SlotLedger,
        source: DeviceSource,
    ) -> None:
        self.configuration = configuration
        self.resource_name = configuration_resource(configuration)
        self._list = list_instances
        self._ledger = ledger
        self._source = source
        self._lock = asyncio.Lock()
        self._view = ConfigurationDevices(configuration, ledger.node)

    def _virtual_devices(self) -> Sequence[VirtualDevice]:
        return self._view(self._list(self.configuration), self._source.offline_instances())

    def devices(self) -> Sequence[VirtualDevice]:
        return self._virtual_devices()  # each has the ``id`` and ``healthy`` kubelet sees

    def _usable_instances(self) -> dict[str, Instance]:
        offline = self._source.offline_instances()
        return {
            i.name: i
            for i in self._list(self.configuration)
            # a draining node takes no new slot (the stored mark: another node may have
            # re-created the Instance and this node adopted it draining)
            if self._ledger.node in i.nodes
            and i.name not in offline
            and self._ledger.node not in i.draining_nodes
        }

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        return preferred_configuration_devices(
            available, must_include, size, self._virtual_devices(), self._usable_instances()
        )

    async def allocate(
        self, container_requests: Sequence[Sequence[str]]
    ) -> list[api_pb2.ContainerAllocateResponse]:
        prefix = configuration_resource_name(self.configuration) + "-"
        for ids in container_requests:
            for vdev in ids:
                tail = vdev[len(prefix) :] if vdev.startswith(prefix) else ""
                if not tail.isdigit():
                    raise AllocationError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{self.resource_name}: unknown device {vdev!r}",
                    )
        responses = []
        # what this request claimed, across its containers: all given back if any part fails
        granted: list[tuple[ObjectKey, Owner, str, bool]] = []
        async with self._lock:
            try:
                for ids in container_requests:
                    responses.append(await self._allocate_container(ids, granted))
            except Exception:
                await self._roll_back(granted)
                raise
        return responses

    async def _allocate_container(
        self, ids: Sequence[str], granted: list[tuple[ObjectKey, Owner, str, bool]]
    ) -> api_pb2.ContainerAllocateResponse:
        node = self._ledger.node
        try:
            choices = plan_configuration_allocation(
                ids, self._virtual_devices(), self._usable_instances()
            )
        except InsufficientInstancesError as error:
            raise AllocationError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.resource_name}: {error}"
            ) from error
        known = {i.name: i for i in self._list(self.configuration)}
        used: list[str] = []
        for choice in choices:
            owner = Owner.configuration_level(choice.vdev, node)
            placed = False
            for candidate in choice.candidates:
                if candidate in used or candidate not in known:
                    continue
                key = known[candidate].key
                try:
                    result = await self._ledger.claim_any(key, owner)
                except SlotRefusedError:
                    continue  # taken meanwhile (another node): next Instance
                except StoreError as error:
                    raise AllocationError(
                        grpc.StatusCode.UNAVAILABLE, f"{self.resource_name}: {error}"
                    ) from error
                granted.append((key, owner, result.slot, result.changed))
                used.append(candidate)
                placed = True
                if choice.moved_from is not None and choice.moved_from in known:
                    await self._release_moved(known[choice.moved_from].key, owner)
                break
            if not placed:
                raise AllocationError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.resource_name}: no instance has a free slot for {choice.vdev}",
                )
        instances = [i for name in used if (i := self._lookup(name)) is not None]
        return _response(instances, self._source)

    def _lookup(self, name: str) -> Instance | None:
        return next((i for i in self._list(self.configuration) if i.name == name), None)

    async def _release_moved(self, old: ObjectKey, owner: Owner) -> None:
        """Free the stale slot a moved vdev left behind (see ``ClChoice.moved_from``); a
        failure leaves it to the reclaimer, which frees it once kubelet's assignment of the
        vdev ends."""
        instance = self._ledger.store.get_cached(old)
        for slot in slots_held_by(instance, owner) if instance is not None else ():
            try:
                await self._ledger.release(old, slot, owner)
            except StoreError as error:
                log.warning("could not release %s of moved %s: %s", slot, owner.value, error)

    async def _roll_back(self, granted: Sequence[tuple[ObjectKey, Owner, str, bool]]) -> None:
        """(instance, owner, slot, newly claimed) of a failed request: free the new ones."""
        for instance, owner, slot, new in reversed(granted):
            if not new:
                continue
            try:
                await self._ledger.release(instance, slot, owner)
            except Exception as error:
                log.warning("could not roll back %s: %s", slot, error)


class HoldingPlugin:
    """``akri.sh/<name>`` kept registered, offering no device, while this node holds slots
    under the name through a device plugin that no longer serves it (the name went to DRA on
    this node, or its Instance or Configuration left the node) — until those slots are
    freed. docs/device-plugins.md, "A name nobody serves any more".

    kubelet rewrites its device-manager checkpoint only after an allocation or when a plugin
    sends it a list; the reclaimer counts a device in use while that file lists it, so without
    a registered plugin whose list it can have re-sent (``nudge_kubelet``) a pod that ended
    would stay in the file, and its slot held, for good. An empty list, not the held devices
    marked Unhealthy: kubelet's allocatable for the name is 0 either way — so the scheduler
    keeps taking DRA for it (KEP-5004: a name with allocatable 0 and a DeviceClass goes
    through DRA) and kubelet admits no pod through it — but a device listed Unhealthy would
    show as Unhealthy in its running pod's ``allocatedResourcesStatus``."""

    preferred_allocation = False

    def __init__(self, resource_name: str, node: str) -> None:
        self.resource_name = resource_name
        self.node = node

    def devices(self) -> Sequence[Listed]:
        return ()  # the one empty tuple: a stream sees it unchanged without comparing

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        return []

    async def allocate(
        self, container_requests: Sequence[Sequence[str]]
    ) -> list[api_pb2.ContainerAllocateResponse]:
        # kubelet asks no plugin without a healthy device (devicesToAllocate); something
        # that bypasses that check gets a clear answer
        raise AllocationError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{self.resource_name}: no device is offered through this device plugin on node "
            f"{self.node}: it stays registered only until the pods that got its slots through "
            "a device plugin end",
        )
