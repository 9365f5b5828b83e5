"""``ExternalHandler``: a discovery handler that lives in other processes.

To the agent it is a :class:`DiscoveryHandler` like the embedded ones: ``discover()`` yields
full device lists. Behind it are the endpoints registered under its name (several are merged,
as Akri does: two udev handler processes, say). For each ``discover()`` (one per
Configuration) every endpoint gets its own ``v0.DiscoveryHandler/Discover`` stream, and each
new list of an endpoint replaces that endpoint's part of the merged list.

A failing endpoint is not an empty list (issue 11): an endpoint's last list stays in the
merged list while its stream is down — broken or ended (the process was killed, restarted,
upgraded by a rolling update of its DaemonSet), failed, cut off, or being replaced by a
re-registration — until the endpoint sends a list again. It is dialled again meanwhile (a
doubling backoff that starts over only after a stream stayed up ``stable_after``, so a handler
that ends its stream after each list is not redialled four times a second). When it has not
reported within ``reconnect_window`` of its first failure, its list goes and its devices follow
the Configuration's offline grace. Who loses it depends on the last failure:

- the endpoint cannot be reached (``UNAVAILABLE``: the socket is gone, the connection refused
  or reset): it is forgotten by the handler, for every Configuration, until it registers again
  (a restarted handler does);
- the endpoint answered this Configuration's ``Discover`` with an error status, ended the
  stream, or was cut off: only this Configuration's stream stops (other Configurations'
  streams to the endpoint may be healthy; one Configuration's details must not take the
  endpoint from the others). It is dialled again when the endpoint registers again or the
  Configuration changes.

Lists sent by a stream that is then cut off do not count as the endpoint being back unless
that stream stayed up a whole window: a handler that floods, or sends one good list and then
garbage, at every dial would otherwise keep its devices forever.

A registration of an endpoint already registered (Akri's handlers register again whenever the
agent drops one of their streams) leaves a healthy stream alone — open, and reported since its
last failure — when it names the same endpoint, type and ``shared``; only streams that are
paused, backing off, being dialled again or stopped are dialled anew. A stopped stream starts a
new window and backoff then (a cut-off pause still holds).

An endpoint that misbehaves — a message that is not a ``DiscoverResponse``, a list over the
report bounds or with duplicate ids, a message over the size limit, a flood of lists, no first
list within ``first_list_timeout`` — is cut off: that stream is closed, a log line and an Event
say why, and that Configuration's stream is not dialled again for a pause that doubles with each
of its cut-offs (a re-registration does not shorten it). What it sent before it broke the rule
is kept, as for a failed stream. Other Configurations' streams, other endpoints and other
handlers go on unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from agent.core import telemetry
from agent.node.discovery.limits import ReportRejectedError
from agent.node.external.endpoints import Endpoint, check_device_list, merge_lists
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
STABLE_AFTER = 10.0  # a stream up this long starts the backoff over when it ends
CUT_OFF_PAUSE = 30.0  # first pause after a cut-off (doubling, up to MAX_CUT_OFF_PAUSE)
MAX_CUT_OFF_PAUSE = 600.0
FLOOD_RATE = 20.0  # lists per second an endpoint may send on average...
FLOOD_BURST = 100.0  # ...after a burst of this many

ProblemReporter = Callable[[str, str, str], None]
"""(handler name, Event reason, message): shown on the Configurations using the handler."""


class CutOffError(Exception):
    """An endpoint broke a rule; it is cut off."""


class _Unreachable(Exception):
    """The endpoint cannot be reached (``UNAVAILABLE``): a problem of the endpoint, for every
    Configuration."""


class _Failed(Exception):
    """The endpoint answered this ``Discover`` with an error status: a problem of this call
    (this Configuration's details, say), not of the endpoint."""


@dataclass
class _StreamState:
    """One endpoint's stream for one ``discover()``. It outlives a re-registration of the
    endpoint: registering again neither restarts the window of a stream that is still being
    dialled nor shortens a pause (a handler that re-registers whenever its stream is dropped
    would otherwise be kept forever)."""

    endpoint: Endpoint  # the registration the stream follows (the newest equal one)
    backoff: float
    down_since: float | None = None  # the first failure since the endpoint last reported
    paused_until: float = 0.0  # end of the cut-off pause
    cut_offs: int = 0
    streaming: bool = False  # a Discover call is open (not paused, backing off or done)

    def healthy(self) -> bool:
        """The stream is open and the endpoint has reported since its last failure (or not
        failed yet): a re-registration of the same endpoint leaves it alone."""
        return self.streaming and self.down_since is None


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
        reconnect_backoff: float = RECONNECT_BACKOFF,
        max_reconnect_backoff: float = MAX_RECONNECT_BACKOFF,
        stable_after: float = STABLE_AFTER,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.name = name
        self._shared = shared
        self._report = report
        self.first_list_timeout = first_list_timeout
        self.cut_off_pause = cut_off_pause
        self.reconnect_window = reconnect_window
        self.reconnect_backoff = reconnect_backoff
        self.max_reconnect_backoff = max_reconnect_backoff
        self.stable_after = stable_after
        self._clock = clock
        self._sleep = sleep
        self.endpoints: dict[str, Endpoint] = {}
        self._changed = asyncio.Event()
        self._version = 0
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

    def forget(self, endpoint: Endpoint) -> None:
        """The endpoint cannot be reached: drop it (and its devices) until it registers
        again. Only this registration: one made since (a restarted handler's, added while an
        old stream's window ran out) stays."""
        uid = endpoint.uid
        if self.endpoints.get(uid) is endpoint:
            del self.endpoints[uid]
            telemetry.EXTERNAL_FORGOTTEN[self.name] += 1
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

    def _cut_off(self, endpoint: Endpoint, state: _StreamState, why: str) -> None:
        state.cut_offs += 1
        self.cut_off_count += 1
        telemetry.EXTERNAL_CUT_OFFS[self.name] += 1
        pause = min(MAX_CUT_OFF_PAUSE, self.cut_off_pause * 2 ** (state.cut_offs - 1))
        state.paused_until = self._clock() + pause
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
        states: dict[str, _StreamState] = {}
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
                registered = self.endpoints.get(uid)
                if registered is endpoint:
                    continue
                state = states[uid]
                if registered == endpoint and not task.done() and state.healthy():
                    # the same endpoint registered again (its process re-registers whenever
                    # one of its streams is dropped, a cut-off of another Configuration's
                    # say): a healthy stream stays; cancelling it would drop a stream in
                    # that process, which registers again, and so on
                    state.endpoint = registered
                    streams[uid] = (registered, task)
                    continue
                task.cancel()
                del streams[uid]
                if registered is None:
                    publish(uid, None)  # forgotten: its devices follow the offline grace
                    states.pop(uid, None)
                elif task.done():
                    # the stream had stopped (its window ran out): the registration starts
                    # a new window and backoff; a cut-off pause still holds
                    state.down_since = self._clock() if uid in lists else None
                    state.backoff = self.reconnect_backoff
                # else registered again while paused, backing off or being dialled (a
                # restarted handler): its last list stays until the new stream sends one
            for uid, endpoint in self.endpoints.items():
                if uid not in streams:
                    # (a stream that stopped stays in ``streams``, done, until the endpoint
                    # registers again)
                    state = states.setdefault(uid, _StreamState(endpoint, self.reconnect_backoff))
                    state.endpoint = endpoint
                    if state.down_since is None and uid in lists:
                        # registered again while its last list is kept: down until its new
                        # stream sends a list
                        state.down_since = self._clock()
                    task = asyncio.create_task(
                        self._follow(discovery_details, discovery_properties, publish, state),
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
        details: str,
        properties: DiscoveryProperties,
        publish: Callable[[str, list[Device] | None], None],
        state: _StreamState,
    ) -> None:
        """One endpoint's streams for one ``discover()``, dialled again after failures. Its
        last list stays published while it is down, until ``reconnect_window`` after the
        first failure (see the module docstring for who loses it then)."""
        while True:
            endpoint = state.endpoint
            pause = state.paused_until - self._clock()
            if pause > 0:
                await self._sleep(pause)
            dialled_at = self._clock()
            down_before = state.down_since
            unreachable = False
            state.streaming = True
            try:
                async for devices in self._stream(endpoint, details, properties):
                    if state.down_since is not None:
                        log.info(
                            "discovery handler %s at %s is back: %d device(s)",
                            self.name,
                            endpoint.endpoint,
                            len(devices),
                        )
                    state.down_since = None
                    publish(endpoint.uid, devices)
                log.warning(
                    "discovery handler %s at %s ended its stream; its last list is kept while "
                    "it is dialled again",
                    self.name,
                    endpoint.endpoint,
                )
                why = "ended its stream"
            except CutOffError as error:
                self._cut_off(endpoint, state, str(error))
                if down_before is not None and self._clock() - dialled_at < self.reconnect_window:
                    # the lists of a stream that was then cut off do not prove the endpoint
                    # is back (a flooder sends good lists before each cut-off)
                    state.down_since = down_before
                why = "cut off"
            except (_Unreachable, _Failed) as error:
                unreachable = isinstance(error, _Unreachable)
                log.warning(
                    "discovery handler %s at %s: %s; its last list is kept while it is dialled "
                    "again",
                    self.name,
                    endpoint.endpoint,
                    error,
                )
                why = str(error)
            finally:
                state.streaming = False
            now = self._clock()
            if state.down_since is None:
                state.down_since = now
            if now - state.down_since >= self.reconnect_window:
                if unreachable:
                    self.forget(state.endpoint)  # every Configuration's stream to it
                else:
                    self._stop(endpoint, publish, why)
                return
            if state.paused_until > now:
                continue  # a cut-off: its pause is the wait
            if now - dialled_at >= self.stable_after:
                state.backoff = self.reconnect_backoff  # it was up a while: start over
            window_left = state.down_since + self.reconnect_window - now
            await self._sleep(min(state.backoff, max(0.0, window_left)))
            state.backoff = min(self.max_reconnect_backoff, state.backoff * 2)

    def _stop(
        self,
        endpoint: Endpoint,
        publish: Callable[[str, list[Device] | None], None],
        why: str,
    ) -> None:
        """This ``discover()``'s stream to a reachable endpoint gives up: its list leaves this
        Configuration's merged list only; the endpoint stays for the others."""
        log.warning(
            "discovery handler %s at %s sent no list for a Configuration within %.0fs (last: "
            "%s): that Configuration drops its devices from this endpoint (offline grace) and "
            "dials it again when it registers again",
            self.name,
            endpoint.endpoint,
            self.reconnect_window,
            why,
        )
        publish(endpoint.uid, None)

    async def _stream(
        self, endpoint: Endpoint, details: str, properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        import grpc

        from agent.node.external.wire import devices_from_response, request_for
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
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise _Unreachable(f"{code.name}: {error.details()}") from None
                raise _Failed(f"answered {code.name}: {error.details()}") from None
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
