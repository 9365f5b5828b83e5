"""The ``v1beta1.DevicePlugin`` gRPC service: translates the protocol, decides nothing.

What to list and how to allocate is the :class:`PluginLogic`'s job; this class streams the
full device list on every change (kubelet rebuilds its sets from each message) and maps
allocation errors to gRPC status codes whose message says why.

* Changes are coalesced: :meth:`DevicePluginService.changed` only bumps a version, and each
  stream re-computes the list once when it next runs, however many changes came in between.
  With ``min_interval`` a stream also re-computes at most once per ``min_interval`` seconds,
  or per ``COST_FACTOR`` times what the last re-computation took if that is longer (the first
  change after a quiet period at once, a burst at the end of the window): the
  configuration-level list covers every Instance, so one re-computation per Instance event
  would make a burst of N events cost O(N²); this way it takes a bounded share of the CPU.
* A list equal to the one last sent on the stream is not sent again (kubelet keeps its own
  allocation bookkeeping: it needs a message only when a device appears, goes or changes
  health), unless :meth:`DevicePluginService.resend` asks for it. Logic that returns the
  same tuple as last time (the views keep it while the list cannot have changed) saves the
  comparison too: a new slot of a 1,000-slot Instance costs the stream O(1) Python work.
  A successful Allocate notifies no stream itself: its write's Instance event does.
* :meth:`DevicePluginService.end_streams` makes every open ``ListAndWatch`` return (status
  OK), so stopping the server does not wait for its grace on kubelet's open stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from agent.core import telemetry
from agent.protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)
COST_FACTOR = 10.0  # a rate-limited stream waits >= 10 times its last computation (<= ~10 % CPU)


class AllocationError(Exception):
    """Allocate failed; ``code`` is the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        super().__init__(message)


class Listed(Protocol):
    """A device as listed to kubelet (:class:`DeviceView`, or anything with the same two
    attributes)."""

    @property
    def id(self) -> str: ...

    @property
    def healthy(self) -> bool: ...


class PluginLogic(Protocol):
    """What a device plugin decides."""

    resource_name: str
    preferred_allocation: bool

    def devices(self) -> Sequence[Listed]:
        """The full device list with health, from the current cache. Returning the same
        tuple as the last call says "unchanged" at no cost (never a list changed in place)."""

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

    def __init__(
        self,
        logic: PluginLogic,
        *,
        min_interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.logic = logic
        # the Allocate histogram's label: instance- or configuration-level plugin
        self.kind = (
            "configuration" if type(logic).__name__.startswith("Configuration") else "instance"
        )
        self.min_interval = min_interval
        self._clock = clock
        self._sleep = sleep
        self._version = 0
        self._resends = 0
        self._changed = asyncio.Event()  # replaced (after being set) on every change
        self._closing = asyncio.Event()  # replaced (after being set) by end_streams()
        self.sends = 0
        self.allocations = 0
        self.computations = 0  # device lists computed by ListAndWatch streams
        self.open_streams = 0

    def options(self) -> api_pb2.DevicePluginOptions:
        """The options registered with kubelet and returned by GetDevicePluginOptions."""
        return api_pb2.DevicePluginOptions(
            pre_start_required=False,
            get_preferred_allocation_available=self.logic.preferred_allocation,
        )

    def changed(self) -> None:
        """The devices may have changed: every ListAndWatch stream re-checks (once, however
        often this is called before the stream runs again). O(1)."""
        self._version += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def resend(self) -> None:
        """Make every ListAndWatch stream send its list again even if unchanged: kubelet
        rewrites its device-manager checkpoint on every message it receives (the reclaimer
        uses this to have a gone pod dropped from it)."""
        self._resends += 1
        self.changed()

    def end_streams(self) -> None:
        """Make every open ListAndWatch stream return; streams opened later are not affected."""
        closing, self._closing = self._closing, asyncio.Event()
        closing.set()
        self.changed()

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self.options()

    async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
        closing = self._closing
        self.open_streams += 1
        try:
            last: tuple[tuple[str, bool], ...] | None = None
            last_list: Sequence[Listed] | None = None
            resent = self._resends
            while not closing.is_set():
                seen = self._version
                computed_at = self._clock()
                devices = self.logic.devices()
                self.computations += 1
                message = None
                # the very tuple computed last time (logic that keeps its list while nothing
                # changed) is unchanged without comparing its 1,000 devices; a list may have
                # been changed in place, so it is compared
                unchanged = isinstance(devices, tuple) and devices is last_list
                if not unchanged:
                    key = tuple((d.id, d.healthy) for d in devices)
                    unchanged = key == last
                    last, last_list = key, devices
                if not unchanged or resent != self._resends:
                    resent = self._resends
                    self.sends += 1
                    message = api_pb2.ListAndWatchResponse(
                        devices=[
                            api_pb2.Device(ID=d.id, health="Healthy" if d.healthy else "Unhealthy")
                            for d in devices
                        ]
                    )
                interval = self.min_interval
                if interval > 0:
                    interval = max(interval, COST_FACTOR * (self._clock() - computed_at))
                if message is not None:
                    yield message
                await self._wait_for_change(seen, closing)
                delay = computed_at + interval - self._clock()
                if delay > 0 and not closing.is_set():
                    await self._pause(delay, closing)
        finally:
            self.open_streams -= 1

    async def _wait_for_change(self, seen: int, closing: asyncio.Event) -> None:
        while self._version == seen and not closing.is_set():
            await self._changed.wait()

    async def _pause(self, delay: float, closing: asyncio.Event) -> None:
        """Sleep ``delay`` seconds, or less if the streams are ended meanwhile."""
        sleeper = asyncio.ensure_future(self._sleep(delay))
        closer = asyncio.ensure_future(closing.wait())
        try:
            await asyncio.wait({sleeper, closer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            closer.cancel()

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
        started = time.perf_counter()
        try:
            responses = await self.logic.allocate(requests)
        except AllocationError as error:
            code, message = error.code, str(error)
            log.warning("%s: Allocate %s refused: %s", self.logic.resource_name, requests, error)
        except Exception as error:
            code, message = refusal_for(self.logic.resource_name, error)
            log.error(
                "%s: Allocate %s failed: %s",
                self.logic.resource_name,
                requests,
                message,
                exc_info=not isinstance(error, OSError),  # a bug: its traceback helps
            )
        else:
            telemetry.ALLOCATE.observe(self.kind, time.perf_counter() - started)
            self.allocations += 1
            # no changed() here: a claim changes the Instance, and the store's event makes
            # the manager notify exactly the plugins whose lists may change; a re-grant
            # changed nothing, so it wakes no stream (it sends nothing either way)
            return api_pb2.AllocateResponse(container_responses=responses)
        telemetry.ALLOCATE.observe(self.kind, time.perf_counter() - started)
        # kubelet counted the devices as allocated before it asked; what it should see may
        # have changed too (a roll-back, a slot taken meanwhile): send the whole list again,
        # even when it looks unchanged, so kubelet re-syncs with it
        self.resend()
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        # nothing to do (pre_start_required is false): no I/O, so nothing that can fail
        return api_pb2.PreStartContainerResponse()


def refusal_for(resource: str, error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status for an error the plugin logic did not translate itself: a file-system
    error is ``UNAVAILABLE`` naming its cause (retrying later may work), anything else
    ``INTERNAL`` (never the UNKNOWN a raw exception gives kubelet)."""
    if isinstance(error, OSError):
        where = f" ({error.filename})" if error.filename else ""
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"{resource}: I/O error{where}: {error.strerror or error}",
        )
    return grpc.StatusCode.INTERNAL, f"{resource}: internal error: {type(error).__name__}: {error}"
