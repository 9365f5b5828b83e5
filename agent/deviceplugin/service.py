"""The ``v1beta1.DevicePlugin`` gRPC service: translates the protocol, decides nothing.

What to list and how to allocate is the :class:`PluginLogic`'s job; this class streams the
full device list on every change (kubelet rebuilds its sets from each message) and maps
allocation errors to gRPC status codes whose message says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import grpc

from agent.deviceplugin.views import DeviceView
from agent.protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)


class AllocationError(Exception):
    """Allocate failed; ``code`` is the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        super().__init__(message)


class PluginLogic(Protocol):
    """What a device plugin decides."""

    resource_name: str
    preferred_allocation: bool

    def devices(self) -> Sequence[DeviceView]:
        """The full device list with health, from the current cache."""

    async def allocate(
        self, container_requests: Sequence[Sequence[str]]
    ) -> list[api_pb2.ContainerAllocateResponse]:
        """One response per container request; raises :class:`AllocationError`."""

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        """GetPreferredAllocation for one container."""


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    """Serves one resource."""

    def __init__(self, logic: PluginLogic) -> None:
        self.logic = logic
        self._version = 0
        self._changed = asyncio.Condition()
        self.sends = 0
        self.allocations = 0

    def options(self) -> api_pb2.DevicePluginOptions:
        """The options registered with kubelet and returned by GetDevicePluginOptions."""
        return api_pb2.DevicePluginOptions(
            pre_start_required=False,
            get_preferred_allocation_available=self.logic.preferred_allocation,
        )

    async def notify(self) -> None:
        """The devices may have changed: let every ListAndWatch stream re-check."""
        async with self._changed:
            self._version += 1
            self._changed.notify_all()

    def notify_soon(self) -> None:
        """:meth:`notify` from synchronous code."""
        asyncio.get_running_loop().create_task(self.notify())

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self.options()

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        last: tuple[tuple[str, bool], ...] | None = None
        while True:
            seen = self._version
            devices = list(self.logic.devices())
            key = tuple((d.id, d.healthy) for d in devices)
            if key != last:
                last = key
                self.sends += 1
                yield api_pb2.ListAndWatchResponse(
                    devices=[
                        api_pb2.Device(ID=d.id, health="Healthy" if d.healthy else "Unhealthy")
                        for d in devices
                    ]
                )
            await self._wait_for_change(seen)

    async def _wait_for_change(self, seen: int) -> None:
        async with self._changed:
            while self._version == seen:
                await self._changed.wait()

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        responses = [
            api_pb2.ContainerPreferredAllocationResponse(
                deviceIDs=self.logic.preferred(
                    list(req.available_deviceIDs),
                    list(req.must_include_deviceIDs),
                    req.allocation_size,
                )
            )
            for req in request.container_requests
        ]
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: Any, context: Any) -> Any:
        requests = [list(req.devices_ids) for req in request.container_requests]
        try:
            responses = await self.logic.allocate(requests)
        except AllocationError as error:
            log.warning("%s: Allocate %s refused: %s", self.logic.resource_name, requests, error)
            await self.notify()
            await context.abort(error.code, str(error))
            raise  # unreachable: abort raises
        self.allocations += 1
        await self.notify()
        return api_pb2.AllocateResponse(container_responses=responses)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        return api_pb2.PreStartContainerResponse()
