"""``ExternalHandler``: a discovery handler that lives in other processes.

To the agent it is a :class:`DiscoveryHandler` like the embedded ones: ``discover()`` yields
full device lists. Behind it are the endpoints registered under its name (several are merged,
as Akri does: two udev handler processes, say). For each ``discover()`` (one per
Configuration) every endpoint gets its own ``v0.DiscoveryHandler/Discover`` stream, and each
new list of an endpoint replaces that endpoint's part of the merged list.

A failing endpoint is not an empty list (issue 11): an endpoint's last list stays in the
merged list while its stream is down — broken or ended (the process was killed, restarted,
upgraded by a rolling update of its DaemonSet), cut off, or being replaced by a
re-registration — until the endpoint sends a list again. Only an endpoint that does not come
back within ``reconnect_window`` of its stream breaking (it is dialled again meanwhile, with a
doubling backoff) is forgotten: then, and only then, its devices leave the list and follow the
Configuration's offline grace. A forgotten endpoint is dialled again when it registers again
(a restarted handler does).

An endpoint that misbehaves — a message that is not a ``DiscoverResponse``, a list over the
report bounds or with duplicate ids, a message over the size limit, a flood of lists, no first
list within ``first_list_timeout`` — is cut off: its stream is closed, a log line and an Event
say why, and it is not dialled again for a pause that doubles with each cut-off (a
re-registration does not shorten it). What it sent before it broke the rule is kept, as for a
broken stream. Other endpoints and other handlers go on unaffected.
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
RECONNECT_WINDOW = 60.0  # seconds a broken endpoint keeps its list while it is dialled again
RECONNECT_BACKOFF = 0.25  # first wait between those dials (doubling...)
MAX_RECONNECT_BACKOFF = 5.0  # ...up to this)
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
        reconnect_window: float = RECONNECT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._shared = shared
        self._report = report
        self.first_list_timeout = first_list_timeout
        self.cut_off_pause = cut_off_pause
        self.reconnect_window = reconnect_window
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
        """The endpoint cannot be reached: drop it (and its devices) until it registers
        again."""
        if self.endpoints.pop(uid, None) is not None:
            log.warning(
                "discovery handler %s: endpoint %s forgotten (unreachable for %.0fs): its "
                "devices follow the offline grace",
                self.name,
                uid,
                self.reconnect_window,
            )
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
            f"discovery handler {self.name} at {endpoint.endpoint} cut off: {why}; it is not "
            f"dialled again for {pause:.0f}s (its last good list, if any, is kept meanwhile)"
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

        synced = [self._version]  # the endpoints version the streams follow

        def sync() -> None:
            synced[0] = self._version
            for uid, (endpoint, task) in list(streams.items()):
                if self.endpoints.get(uid) is not endpoint:
                    task.cancel()
                    del streams[uid]
                    if uid not in self.endpoints:
                        publish(uid, None)  # forgotten: its devices follow the offline grace
                    # else registered again (a restarted handler): its last list stays
                    # until the new stream sends one
            for uid, endpoint in self.endpoints.items():
                if uid not in streams:
                    # an endpoint registered again while its last list is kept is down until
                    # its new stream sends a list
                    down = self._clock() if uid in lists else None
                    task = asyncio.create_task(
                        self._follow(
                            endpoint, discovery_details, discovery_properties, publish, down
                        ),
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
                if self._version == synced[0]:
                    # (a registration while the caller held the last list bumped the
                    # version already: sync at once, or it would wait for the next list)
                    await _first(news.wait(), self._changed.wait())
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
        down_since: float | None = None,
    ) -> None:
        """One endpoint's streams for one ``discover()``, dialled again after breaks. Its last
        list stays published while it is down; it is forgotten (and its list dropped by
        ``discover``) only when no stream sends a list within ``reconnect_window`` of the
        break."""
        backoff = RECONNECT_BACKOFF
        while True:
            pause = self._paused_until.get(endpoint.uid, 0.0) - self._clock()
            if pause > 0:
                await asyncio.sleep(pause)
            try:
                async for devices in self._stream(endpoint, details, properties):
                    if down_since is not None:
                        log.info(
                            "discovery handler %s at %s is back: %d device(s)",
                            self.name,
                            endpoint.endpoint,
                            len(devices),
                        )
                    down_since, backoff = None, RECONNECT_BACKOFF
                    publish(endpoint.uid, devices)
                log.warning(
                    "discovery handler %s at %s ended its stream; its last list is kept while "
                    "it is dialled again",
                    self.name,
                    endpoint.endpoint,
                )
            except CutOffError as error:
                if down_since is None:
                    down_since = self._clock()
                self._cut_off(endpoint, str(error))
                continue
            except _Gone as error:
                log.warning(
                    "discovery handler %s at %s: %s; its last list is kept while it is dialled "
                    "again",
                    self.name,
                    endpoint.endpoint,
                    error,
                )
            now = self._clock()
            if down_since is None:
                down_since = now
            if now - down_since >= self.reconnect_window:
                self.forget(endpoint.uid)
                return
            await asyncio.sleep(min(backoff, max(0.0, down_since + self.reconnect_window - now)))
            backoff = min(MAX_RECONNECT_BACKOFF, backoff * 2)

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
                    if response is None:
                        # grpc logs "Exception deserializing message!" and hands over None
                        raise CutOffError("sent a message that is not a DiscoverResponse")
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
                if code == grpc.StatusCode.INTERNAL and "serializ" in (error.details() or ""):
                    raise CutOffError(
                        f"sent a message that is not a DiscoverResponse ({error.details()})"
                    ) from None
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
