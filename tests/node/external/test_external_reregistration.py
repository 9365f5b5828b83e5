"""Registering again (review of the external handlers, issue 16).

Akri's handler processes register again whenever the agent drops one of their streams. A
registration must not tear down the healthy streams of the same endpoint (each would be a
dropped stream in that process: another registration, and so on), and a stream that stopped
or an old stream's window must not turn a new registration into a forgotten endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from agent.node.external.endpoints import EndpointPolicy
from agent.node.external.handler import ExternalHandler, ProblemReporter
from agent.node.external.registration import RegistrationServer, RegistrationService
from agent.node.external.serve import ExternalHandlerProcess
from discovery_handlers.base import Device, DiscoveryHandler, DiscoveryProperties
from discovery_handlers.registry import HandlerRegistry
from tests.node.external.test_external_keep_list import (
    END,
    Lists,
    ScriptedEndpoint,
    devices,
    dials,
    registration,
)


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[ScriptedEndpoint]:
    scripted = ScriptedEndpoint(tmp_path / "h.sock")
    await scripted.start()
    yield scripted
    await scripted.stop()


class TwoConfigurations(DiscoveryHandler):
    """Details "flood" send 150 lists at once on their first stream (over the agent's burst
    of 100: cut off), one list later; any other details send one list and stay."""

    name = "twoconfigs"

    def __init__(self) -> None:
        self.streams: dict[str, int] = {}
        self.flood_again = asyncio.Event()

    @property
    def shared(self) -> bool:
        return False

    def validate(self, discovery_details: str) -> Sequence[str] | None:
        return None

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        n = self.streams[discovery_details] = self.streams.get(discovery_details, 0) + 1
        if discovery_details == "flood" and n == 1:
            for _ in range(150):
                yield [Device("f")]
        else:
            if discovery_details == "flood":
                self.flood_again.set()
            yield [Device(discovery_details or "calm")]
        await asyncio.Event().wait()


async def test_one_cut_off_stream_does_not_set_off_registrations_that_drop_the_others(
    tmp_path: Path,
) -> None:
    def make_handler(name: str, shared: bool, report: ProblemReporter) -> ExternalHandler:
        return ExternalHandler(name, shared, report, cut_off_pause=0.5)

    cut_off = asyncio.Event()
    registered = asyncio.Event()
    service = RegistrationService(
        EndpointPolicy(tmp_path),
        HandlerRegistry(),
        lambda _name: registered.set(),
        lambda _name, _reason, _message: cut_off.set(),
        make_handler,
    )
    agent = RegistrationServer(tmp_path, service)
    assert await agent.start()
    handler = TwoConfigurations()
    process = ExternalHandlerProcess(handler, tmp_path)
    await process.start()
    keeper = asyncio.create_task(process.keep_registered())
    calm: Lists | None = None
    flood: Lists | None = None
    try:
        async with asyncio.timeout(10):
            await registered.wait()
        external = service.external["twoconfigs"]
        calm = Lists(external, "calm")
        assert await calm.next() == ["calm"]
        flood = Lists(external, "flood")
        assert await flood.next() == ["f"]  # its first list; the rest is a flood
        async with asyncio.timeout(10):
            await cut_off.wait()
            # the flood's Configuration is dialled again after its pause: by then any
            # registrations the cut-off set off have happened
            await handler.flood_again.wait()
        # old code: 13-316 registrations, each dropping the calm Configuration's stream
        assert process.registrations == 1
        assert handler.streams["calm"] == 1
        assert await flood.next() == ["flood"]
    finally:
        for lists in (calm, flood):
            if lists is not None:
                await lists.close()
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await process.stop()
        await agent.stop()


async def test_the_handler_registers_again_when_the_agent_drops_its_last_stream(
    tmp_path: Path,
) -> None:
    registered = asyncio.Event()
    service = RegistrationService(
        EndpointPolicy(tmp_path), HandlerRegistry(), lambda _name: registered.set(), lambda *_: None
    )
    agent = RegistrationServer(tmp_path, service)
    assert await agent.start()
    process = ExternalHandlerProcess(TwoConfigurations(), tmp_path)
    await process.start()
    keeper = asyncio.create_task(process.keep_registered())
    try:
        async with asyncio.timeout(10):
            await registered.wait()
        external = service.external["twoconfigs"]
        lists = Lists(external, "one")
        assert await lists.next() == ["one"]
        await lists.close()  # the agent drops its only stream (Akri's handlers register again)
        registered.clear()
        async with asyncio.timeout(10):
            await registered.wait()
        # (the agent accepted a second registration)
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        await process.stop()
        await agent.stop()


async def test_registering_again_keeps_a_healthy_stream_and_redials_a_cut_off_one(
    endpoint: ScriptedEndpoint,
) -> None:
    cut_off = asyncio.Event()
    handler = ExternalHandler(
        "scripted", False, lambda *_: cut_off.set(), cut_off_pause=0.2, reconnect_window=30
    )
    handler.add(registration(endpoint.socket))
    endpoint.queues["calm"] = asyncio.Queue()
    endpoint.queues["bad"] = asyncio.Queue()
    calm = Lists(handler, "calm")
    bad = Lists(handler, "bad")
    await endpoint.queues["calm"].put(devices("a"))
    assert await calm.next() == ["a"]
    await endpoint.queues["bad"].put(devices("x"))
    assert await bad.next() == ["x"]
    calm_stream = endpoint.queues["calm"]
    await endpoint.queues["bad"].put(devices("x", "x"))  # a duplicate id: cut off
    async with asyncio.timeout(10):
        await cut_off.wait()
    # the handler process registers again (the same endpoint, a new request)
    handler.add(registration(endpoint.socket))
    await calm_stream.put(devices("a", "b"))
    # old code: the calm stream was cancelled and dialled again; the list sent on the old
    # stream never arrived
    assert await calm.next() == ["a", "b"]
    assert endpoint.dials["calm"] == 1
    # the cut-off stream is dialled again (after its pause)
    following = asyncio.create_task(bad.next())
    await dials(endpoint, 2, "bad")
    await endpoint.queues["bad"].put(devices("y"))
    assert await following == ["y"]
    await calm.close()
    await bad.close()


class FakeTime:
    """A clock the handler's waits move; ``gate`` holds the waits while cleared."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []
        self.waiting = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.waiting.set()
        await self.gate.wait()
        self.now += seconds
        await asyncio.sleep(0)


async def test_a_stopped_stream_gets_a_new_window_when_the_endpoint_registers_again(
    endpoint: ScriptedEndpoint,
) -> None:
    time = FakeTime()
    handler = ExternalHandler(
        "scripted", False, reconnect_window=10, clock=time.clock, sleep=time.sleep
    )
    uid = "scripted@" + str(endpoint.socket)
    # the first stream sends a list and ends; the handler then refuses the details
    endpoint.script = lambda _d, n: [devices("a"), END] if n == 1 else grpc.StatusCode.UNKNOWN
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    assert await lists.next() == ["a"]
    assert await lists.next() == []  # the window ran out: this Configuration's stream stopped
    assert uid in handler.endpoints
    dialled = endpoint.dials[""]
    # registered again; the new stream's first failure says the endpoint cannot be reached
    statuses = iter([grpc.StatusCode.UNAVAILABLE])
    endpoint.script = lambda _d, _n: next(statuses, ())
    following = asyncio.create_task(lists.next())
    handler.add(registration(endpoint.socket))
    # old code: the stopped stream's old failure time was reused, so that one failure was
    # past the window and the endpoint was forgotten for every Configuration
    await dials(endpoint, dialled + 2)
    assert uid in handler.endpoints
    await endpoint.queue.put(devices("b"))
    assert await following == ["b"]
    await lists.close()


async def test_an_old_stream_s_window_running_out_does_not_forget_a_new_registration(
    endpoint: ScriptedEndpoint,
) -> None:
    time = FakeTime()
    handler = ExternalHandler(
        "scripted",
        False,
        reconnect_window=1,
        reconnect_backoff=5,
        clock=time.clock,
        sleep=time.sleep,
    )
    uid = "scripted@" + str(endpoint.socket)
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    await endpoint.queue.put(devices("a"))
    assert await lists.next() == ["a"]
    (old,) = [task for task in asyncio.all_tasks() if task.get_name() == f"external-{uid}"]
    time.gate.clear()
    await endpoint.stop()  # the handler process goes away
    async with asyncio.timeout(10):
        await time.waiting.wait()  # the old stream waits to dial again
    await endpoint.start()  # it restarted and registers again...
    endpoint.script = lambda _d, _n: grpc.StatusCode.UNAVAILABLE  # (not serving yet)
    new = registration(endpoint.socket)
    handler.add(new)
    time.gate.set()  # ...while the old stream's window runs out, before the next sync
    async with asyncio.timeout(10):
        await asyncio.wait([old])
    # old code: the old stream forgot the endpoint by its uid, the new registration with it
    assert handler.endpoints.get(uid) is new
    endpoint.script = lambda _d, _n: ()
    dialled = endpoint.dials[""]
    following = asyncio.create_task(lists.next())
    await dials(endpoint, dialled + 1)
    await endpoint.queue.put(devices("b"))
    assert await following == ["b"]
    await lists.close()
