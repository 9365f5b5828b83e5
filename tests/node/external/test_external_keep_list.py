"""A failing external handler is not an empty list (issue 11 case 4, issue 16).

``ExternalHandler.discover()`` in the test's event loop against a real gRPC server on a unix
socket (also in the test's loop, so the test decides exactly what the endpoint sends and when
it goes away). Each test drives the endpoint through a failure and checks the next merged
list the handler yields: the last list must stay until the endpoint reports again, and go only
when the endpoint does not come back within its reconnect window.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.node.external.endpoints import Endpoint
from agent.node.external.handler import ExternalHandler
from agent.node.external.wire import response_from_devices
from agent.protos.akri.discovery.v0 import discovery_pb2 as pb
from discovery_handlers.base import Device, InvalidDiscoveryDetailsError

END = object()  # ends the current stream
GARBAGE = object()  # one message that is no DiscoverResponse


def exported(family: str, handler: str) -> float:
    """The value /metrics shows for ``family`` and this handler name (0 when absent)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from agent.ops.metrics import registry_for

    text = generate_latest(registry_for()).decode()
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            if sample.name == family and sample.labels["discovery_handler_name"] == handler:
                return float(sample.value)
    return 0.0


class ScriptedEndpoint:
    """A ``v0.DiscoveryHandler`` whose newest stream for some ``discoveryDetails`` sends what
    the test puts in ``queues[details]`` (``queue`` for details ``""``); each stream has its
    own queue: a stream the agent dropped cannot take the next item. ``script(details, n)``
    says how the n-th stream for those details starts: items put on its queue first, or a
    status it is refused with."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.queues: dict[str, asyncio.Queue[Any]] = {"": asyncio.Queue()}
        self.script: Callable[[str, int], Sequence[Any] | grpc.StatusCode] = lambda _d, _n: ()
        self.discovers = 0
        self.dials: dict[str, int] = {}
        self.discovered = asyncio.Event()
        self._server: grpc.aio.Server | None = None

    @property
    def queue(self) -> asyncio.Queue[Any]:
        return self.queues[""]

    async def start(self) -> None:
        async def discover(request: bytes, context: Any) -> AsyncIterator[bytes]:
            details = pb.DiscoverRequest.FromString(request).discovery_details
            self.discovers += 1
            n = self.dials[details] = self.dials.get(details, 0) + 1
            self.discovered.set()
            script = self.script(details, n)
            if isinstance(script, grpc.StatusCode):
                await context.abort(script, f"refused for details {details!r}")
                return  # (abort raises)
            first = n == 1 and details in self.queues
            queue = self.queues[details] if first else asyncio.Queue()
            self.queues[details] = queue
            for item in script:
                queue.put_nowait(item)
            while True:
                item = await queue.get()
                if item is END:
                    return
                if item is GARBAGE:
                    yield b"\x0a\x7f\x0a"  # a length-delimited field running past the end
                    continue
                yield response_from_devices(item).SerializeToString()

        method = grpc.unary_stream_rpc_method_handler(discover)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v0.DiscoveryHandler", {"Discover": method}),)
        )
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
            self._server = None


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[ScriptedEndpoint]:
    scripted = ScriptedEndpoint(tmp_path / "h.sock")
    await scripted.start()
    yield scripted
    await scripted.stop()


def registration(socket: Path) -> Endpoint:
    return Endpoint("scripted", str(socket), network=False, shared=False)


class Lists:
    """The merged lists one ``discover()`` yields, read one by one with a bound."""

    def __init__(self, handler: ExternalHandler, details: str = "") -> None:
        self._lists = handler.discover(details, {})

    async def next(self, within: float = 10.0) -> list[str]:
        async with asyncio.timeout(within):
            devices = await anext(self._lists)
        return [device.id for device in devices]

    async def close(self) -> None:
        close = getattr(self._lists, "aclose", None)  # an async generator's
        if close is not None:
            with contextlib.suppress(Exception):
                await close()


async def dialled(endpoint: ScriptedEndpoint) -> None:
    async with asyncio.timeout(10):
        await endpoint.discovered.wait()


async def dials(endpoint: ScriptedEndpoint, count: int, details: str = "") -> None:
    """Until the endpoint has had ``count`` streams for ``details``."""
    async with asyncio.timeout(10):
        while endpoint.dials.get(details, 0) < count:
            endpoint.discovered.clear()
            await endpoint.discovered.wait()


def devices(*ids: str) -> list[Device]:
    return [Device(i) for i in ids]


async def test_a_broken_stream_keeps_the_list_until_the_endpoint_reports_again(
    endpoint: ScriptedEndpoint,
) -> None:
    handler = ExternalHandler("scripted", False, reconnect_window=30)
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    await endpoint.queue.put(devices("a", "b"))
    assert await lists.next() == ["a", "b"]
    endpoint.discovered.clear()
    await endpoint.stop()  # the handler process is killed (a rolling update)
    await endpoint.start()
    await dialled(endpoint)  # dialled again
    await endpoint.queue.put(devices("b", "c"))
    # the next list is the endpoint's new report, not an empty list in between
    assert await lists.next() == ["b", "c"]
    assert "scripted@" + str(endpoint.socket) in handler.endpoints
    await lists.close()


async def test_an_ended_stream_keeps_the_list_too(endpoint: ScriptedEndpoint) -> None:
    handler = ExternalHandler("scripted", False, reconnect_window=30)
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    await endpoint.queue.put(devices("a"))
    assert await lists.next() == ["a"]
    endpoint.discovered.clear()
    await endpoint.queue.put(END)
    await dialled(endpoint)  # the agent dialled again after the end
    await endpoint.queue.put(devices("a", "z"))
    assert await lists.next() == ["a", "z"]
    await lists.close()


async def test_an_endpoint_that_does_not_come_back_within_its_window_is_forgotten(
    endpoint: ScriptedEndpoint,
) -> None:
    handler = ExternalHandler("scripted", False, reconnect_window=0.5)
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    await endpoint.queue.put(devices("a"))
    assert await lists.next() == ["a"]
    forgotten = exported("akri_discovery_handler_endpoints_forgotten_total", "scripted")
    await endpoint.stop()
    # gone for good: only now do its devices leave (and follow the offline grace)
    assert await lists.next() == []
    assert handler.endpoints == {}
    # an operator sees it on /metrics (an alert follows it: deploy/components/monitoring)
    assert exported("akri_discovery_handler_endpoints_forgotten_total", "scripted") == forgotten + 1
    await lists.close()


async def test_registering_again_keeps_the_list_until_the_new_stream_reports(
    endpoint: ScriptedEndpoint,
) -> None:
    backing_off = asyncio.Event()

    async def sleep(seconds: float) -> None:
        backing_off.set()
        await asyncio.sleep(seconds)

    handler = ExternalHandler(
        "scripted", False, reconnect_window=60, reconnect_backoff=30, sleep=sleep
    )
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    await endpoint.queue.put(devices("a"))
    assert await lists.next() == ["a"]
    endpoint.discovered.clear()
    await endpoint.queue.put(END)  # its stream broke; it waits 30 s to dial again...
    async with asyncio.timeout(10):
        await backing_off.wait()
    # ...but a restarted handler registers again: dialled at once (a healthy stream would
    # be left alone)
    handler.add(registration(endpoint.socket))
    following = asyncio.create_task(lists.next())  # the runner always waits for the next list
    await dialled(endpoint)
    await endpoint.queue.put(devices("a", "b"))
    assert await following == ["a", "b"]
    await lists.close()


@pytest.mark.parametrize("bad", ["duplicate", "garbage"])
async def test_a_cut_off_endpoint_keeps_its_last_good_list(
    endpoint: ScriptedEndpoint, bad: str
) -> None:
    reports: list[tuple[str, str, str]] = []
    handler = ExternalHandler(
        "scripted",
        False,
        lambda *report: reports.append(report),
        cut_off_pause=0.2,
        reconnect_window=30,
    )
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    await endpoint.queue.put(devices("a"))
    assert await lists.next() == ["a"]
    endpoint.discovered.clear()
    cut_offs = exported("akri_discovery_handler_cut_offs_total", "scripted")
    await endpoint.queue.put(devices("b", "b") if bad == "duplicate" else GARBAGE)
    await dialled(endpoint)  # cut off, paused, dialled again
    assert [reason for _name, reason, _message in reports] == ["DiscoveryHandlerCutOff"]
    assert exported("akri_discovery_handler_cut_offs_total", "scripted") == cut_offs + 1
    if bad == "garbage":
        assert "not a DiscoverResponse" in reports[0][2]
    await endpoint.queue.put(devices("c"))
    assert await lists.next() == ["c"]  # no empty list in between
    await lists.close()


# -- review of 3b02c53: every failure counts towards the window, per Configuration -----------


@pytest.mark.parametrize("bad", ["hung", "garbage", "flood"])
async def test_an_endpoint_cut_off_at_every_dial_loses_its_list_after_the_window(
    endpoint: ScriptedEndpoint, bad: str
) -> None:
    # a hung handler accepts Discover and never answers (a cut-off at the first-list timeout);
    # a flooder sends good lists before each cut-off: neither may keep its devices forever
    handler = ExternalHandler(
        "scripted", False, first_list_timeout=0.1, cut_off_pause=0.05, reconnect_window=0.6
    )
    later: dict[str, Sequence[Any]] = {
        "hung": (),
        "garbage": (GARBAGE,),
        "flood": [devices("a")] * 150,  # over the burst of 100
    }
    endpoint.script = lambda _details, n: later[bad] if n > 1 else ()
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    await endpoint.queue.put(devices("a"))
    assert await lists.next() == ["a"]
    await endpoint.queue.put(END)  # the first failure: the window starts
    assert await lists.next(within=20) == []  # old code: kept forever
    assert handler.cut_off_count >= 2  # it was dialled and cut off again meanwhile
    # the endpoint answered: only this Configuration's stream stopped
    assert "scripted@" + str(endpoint.socket) in handler.endpoints
    await lists.close()


@pytest.mark.parametrize(
    "status",
    [grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT],
)
async def test_one_configuration_the_handler_rejects_leaves_the_others_streams_alone(
    endpoint: ScriptedEndpoint, status: grpc.StatusCode
) -> None:
    handler = ExternalHandler("scripted", False, reconnect_window=0.5)
    uid = "scripted@" + str(endpoint.socket)
    # the handler serves details "bad" once, then refuses them (a raise in its Discover is
    # UNKNOWN); details "" are served all along
    endpoint.script = lambda details, n: status if details == "bad" and n > 1 else ()
    handler.add(registration(endpoint.socket))
    good = Lists(handler)
    await endpoint.queue.put(devices("a"))
    assert await good.next() == ["a"]
    endpoint.queues["bad"] = asyncio.Queue()
    bad = Lists(handler, "bad")
    await endpoint.queues["bad"].put(devices("x"))
    assert await bad.next() == ["x"]
    await endpoint.queues["bad"].put(END)
    if status == grpc.StatusCode.INVALID_ARGUMENT:
        with pytest.raises(InvalidDiscoveryDetailsError):
            await bad.next()  # the Configuration waits for an edit
    else:
        assert await bad.next(within=20) == []  # past the window: gone for "bad" only
        assert endpoint.dials["bad"] >= 2
    assert uid in handler.endpoints  # old code: forgotten, for every Configuration
    await endpoint.queue.put(devices("a", "b"))
    assert await good.next() == ["a", "b"]  # the same stream, no empty list in between
    assert endpoint.dials[""] == 1
    if status != grpc.StatusCode.INVALID_ARGUMENT:
        # a registration (the handler restarted, fixed) dials the stopped stream again
        endpoint.script = lambda _details, _n: ()
        following = asyncio.create_task(bad.next())
        handler.add(registration(endpoint.socket))
        await dials(endpoint, endpoint.dials["bad"] + 1, "bad")
        await endpoint.queues["bad"].put(devices("y"))
        assert await following == ["y"]
    await bad.close()
    await good.close()


async def test_a_handler_ending_its_stream_after_each_list_is_redialled_with_a_growing_backoff(
    endpoint: ScriptedEndpoint,
) -> None:
    # the handler's waits are recorded instead of slept, on a clock the test moves: the
    # backoff is read exactly, without timing anything
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)

    now = [0.0]
    handler = ExternalHandler(
        "scripted",
        False,
        reconnect_window=30,
        reconnect_backoff=0.25,
        max_reconnect_backoff=5,
        stable_after=10,
        clock=lambda: now[0],
        sleep=record,
    )
    # streams 1-7 send one list and end; stream 8 stays
    endpoint.script = lambda _details, n: [devices("a"), END] if n < 8 else ()
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    assert await lists.next() == ["a"]
    await dials(endpoint, 8)
    # each list used to start the backoff over: 0.25 s between dials, forever
    assert waits == [0.25, 0.5, 1, 2, 4, 5, 5]
    # a stream that stayed up stable_after starts it over
    now[0] += 10
    await endpoint.queue.put(END)
    await dials(endpoint, 9)
    assert waits[7:] == [0.25]
    assert "scripted@" + str(endpoint.socket) in handler.endpoints
    await lists.close()
