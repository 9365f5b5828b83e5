"""``ExternalHandler``: a discovery handler that lives in other processes.

To the agent it is a :class:`DiscoveryHandler` like the embedded ones: ``discover()`` yields
full device lists. Behind it are the endpoints registered under its name (several are merged,
as Akri does: two udev handler processes, say). For each ``discover()`` (one per
Configuration) every endpoint gets its own ``v0.DiscoveryHandler/Discover`` stream, and each
new list of an endpoint replaces that endpoint's part of the merged list.

When an endpoint goes away (its stream breaks: the process was killed or restarted) its
devices leave the merged list, so they follow the Configuration's offline grace, and the
agent dials it again a few times; if it cannot connect, the endpoint is forgotten until the
handler registers again (it does so when it restarts). An endpoint that misbehaves — a list
over the report bounds or with duplicate ids, a message over the size limit, a flood of
lists, no first list within ``first_list_timeout`` — is cut off: its stream is closed, its
devices leave the list, a log line and an Event say why, and it is not dialled again for a
pause that doubles with each cut-off. Other endpoints and other handlers go on unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from agent.discovery.limits import ReportRejectedError
from agent.external.endpoints import Endpoint, check_device_list, merge_lists
from discovery_handlers.base import (
    Device,
    DiscoveryHandler,
    DiscoveryProperties,
    InvalidDiscoveryDetailsError,
)

log = logging.getLogger("agent.external")

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
FIRST_LIST_TIMEOUT = 30.0  # seconds from Discover to the first list (Akri's send at once)
SETTLE = 1.0  # seconds the first merged list waits for every endpoint's first list
RECONNECTS = 4  # dials after a broken stream before the endpoint is forgotten
RECONNECT_BACKOFF = 0.25  # first wait between those dials (doubling)
CUT_OFF_PAUSE = 30.0  # first pause after a cut-off (doubling, up to MAX_CUT_OFF_PAUSE)
MAX_CUT_OFF_PAUSE = 600.0
FLOOD_RATE = 20.0  # lists per second an endpoint may send on average...
FLOOD_BURST = 100.0  # ...after a burst of this many

ProblemReporter = Callable[[str, str, str], None]
"""(handler name, Event reason, message): shown on the Configurations using the handler."""


class CutOffError(Exception):
    """An endpoint broke a rule; it is cut off."""


class _Gone(Exception):
    """An endpoint cannot be reached any more."""


@dataclass
class _Bucket:
    """Token bucket for the flood rule."""

    tokens: float
    stamp: float

    def take(self, now: float) -> bool:
        self.tokens = min(FLOOD_BURST, self.tokens + (now - self.stamp) * FLOOD_RATE)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ExternalHandler(DiscoveryHandler):
    """The registered endpoints of one handler name."""

    def __init__(
        self,
        name: str,
        shared: bool,
        report: ProblemReporter = lambda _name, _reason, _message: None,
        *,
        first_list_timeout: float = FIRST_LIST_TIMEOUT,
        cut_off_pause: float = CUT_OFF_PAUSE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._shared = shared
        self._report = report
        self.first_list_timeout = first_list_timeout
        self.cut_off_pause = cut_off_pause
        self._clock = clock
        self.endpoints: dict[str, Endpoint] = {}
        self._changed = asyncio.Event()
        self._version = 0
        self._paused_until: dict[str, float] = {}  # uid -> end of its cut-off pause
        self._cut_offs: dict[str, int] = {}
        self.cut_off_count = 0

    @property
    def shared(self) -> bool:
        return self._shared

    def validate(self, discovery_details: str) -> Sequence[str] | None:
        # the handler process checks them (Discover answers InvalidArgument)
        return None

    # -- endpoints ---------------------------------------------------------------------------
    def add(self, endpoint: Endpoint) -> None:
        """A (re-)registration: dial it now (a registration ends a cut-off pause only once
        the pause is over)."""
        self.endpoints[endpoint.uid] = endpoint
        self._bump()

    def forget(self, uid: str) -> None:
        """The endpoint cannot be reached: drop it until it registers again."""
        if self.endpoints.pop(uid, None) is not None:
            log.warning("discovery handler %s: endpoint %s forgotten (unreachable)", self.name, uid)
            self._bump()

    def _bump(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _cut_off(self, endpoint: Endpoint, why: str) -> None:
        count = self._cut_offs.get(endpoint.uid, 0) + 1
        self._cut_offs[endpoint.uid] = count
        self.cut_off_count += 1
        pause = min(MAX_CUT_OFF_PAUSE, self.cut_off_pause * 2 ** (count - 1))
        self._paused_until[endpoint.uid] = self._clock() + pause
        message = (
            f"discovery handler {self.name} at {endpoint.endpoint} cut off: {why}; its devices "
            f"are dropped and it is not dialled again for {pause:.0f}s"
        )
        log.error("%s", message)
        self._report(self.name, "DiscoveryHandlerCutOff", message)

    # -- discovery ---------------------------------------------------------------------------
    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        lists: dict[str, list[Device]] = {}
        streams: dict[str, tuple[Endpoint, asyncio.Task[None]]] = {}
        news = asyncio.Event()
        failures: list[BaseException] = []

        def publish(uid: str, devices: list[Device] | None) -> None:
            if devices is None:
                if lists.pop(uid, None) is None:
                    return
            else:
                lists[uid] = devices
            news.set()

        def sync() -> None:
            for uid, (endpoint, task) in list(streams.items()):
                if self.endpoints.get(uid) is not endpoint:
                    task.cancel()
                    del streams[uid]
                    publish(uid, None)
            for uid, endpoint in self.endpoints.items():
                if uid not in streams:
                    task = asyncio.create_task(
                        self._follow(endpoint, discovery_details, discovery_properties, publish),
                        name=f"external-{uid}",
                    )
                    task.add_done_callback(lambda t: _collect(t, failures, news))
                    streams[uid] = (endpoint, task)

        last: list[Device] | None = None
        try:
            sync()
            # the first list waits briefly for every endpoint's first list (a partial first
            # list would start the grace of the other endpoints' devices)
            settle_until = self._clock() + SETTLE
            while len(lists) < len(streams) and self._clock() < settle_until and not failures:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, settle_until - self._clock())):
                        await _first(news.wait(), self._changed.wait())
                news.clear()
                sync()
            while True:
                if failures:
                    raise failures[0]
                merged = merge_lists(lists)
                if merged != last:
                    last = merged
                    yield merged
                changed = self._changed
                await _first(news.wait(), changed.wait())
                news.clear()
                sync()
        finally:
            for _endpoint, task in streams.values():
                task.cancel()
            for _endpoint, task in streams.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _follow(
        self,
        endpoint: Endpoint,
        details: str,
        properties: DiscoveryProperties,
        publish: Callable[[str, list[Device] | None], None],
    ) -> None:
        """One endpoint's streams for one ``discover()``, dialled again after breaks."""
        backoff = RECONNECT_BACKOFF
        attempts = 0
        while True:
            pause = self._paused_until.get(endpoint.uid, 0.0) - self._clock()
            if pause > 0:
                await asyncio.sleep(pause)
            try:
                async for devices in self._stream(endpoint, details, properties):
                    attempts, backoff = 0, RECONNECT_BACKOFF
                    publish(endpoint.uid, devices)
                log.warning(
                    "discovery handler %s at %s ended its stream", self.name, endpoint.endpoint
                )
            except CutOffError as error:
                publish(endpoint.uid, None)
                self._cut_off(endpoint, str(error))
                continue
            except _Gone as error:
                log.warning("discovery handler %s at %s: %s", self.name, endpoint.endpoint, error)
            publish(endpoint.uid, None)
            attempts += 1
            if attempts > RECONNECTS:
                self.forget(endpoint.uid)
                return
            await asyncio.sleep(backoff)
            backoff *= 2

    async def _stream(
        self, endpoint: Endpoint, details: str, properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        import grpc

        from agent.external.wire import devices_from_response, request_for
        from agent.protos.akri.discovery.v0 import discovery_pb2_grpc

        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
        ]
        bucket = _Bucket(FLOOD_BURST, self._clock())
        async with grpc.aio.insecure_channel(endpoint.target, options=options) as channel:
            stub = discovery_pb2_grpc.DiscoveryHandlerStub(channel)
            call = stub.Discover(request_for(details, properties))
            responses = call.__aiter__()
            first = True
            try:
                while True:
                    try:
                        if first:
                            async with asyncio.timeout(self.first_list_timeout):
                                response = await anext(responses)
                        else:
                            response = await anext(responses)
                    except StopAsyncIteration:
                        return
                    except TimeoutError:
                        raise CutOffError(
                            f"sent no device list within {self.first_list_timeout:.0f}s of Discover"
                        ) from None
                    first = False
                    if not bucket.take(self._clock()):
                        raise CutOffError(
                            f"sent more than {FLOOD_RATE:.0f} device lists per second"
                        )
                    devices = devices_from_response(response)
                    try:
                        check_device_list(devices)
                    except ReportRejectedError as error:
                        raise CutOffError(str(error)) from None
                    yield devices
            except grpc.aio.AioRpcError as error:
                code = error.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidDiscoveryDetailsError(error.details() or "invalid") from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise CutOffError(
                        f"sent a message over {MAX_MESSAGE_BYTES // (1024 * 1024)} MiB"
                    ) from None
                raise _Gone(f"{code.name}: {error.details()}") from None
            finally:
                call.cancel()


def _collect(task: asyncio.Task[None], failures: list[BaseException], news: asyncio.Event) -> None:
    """A stream task that ended with an error the Configuration must see (invalid details)."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None:
        failures.append(error)
        news.set()


async def _first(*waits: object) -> None:
    """Wait until the first of the awaitables finishes."""
    tasks = [asyncio.ensure_future(w) for w in waits]  # type: ignore[call-overload]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
