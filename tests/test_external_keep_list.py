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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.external.endpoints import Endpoint
from agent.external.handler import ExternalHandler
from agent.external.wire import response_from_devices
from discovery_handlers.base import Device

END = object()  # ends the current stream
GARBAGE = object()  # one message that is no DiscoverResponse


class ScriptedEndpoint:
    """A ``v0.DiscoveryHandler`` whose newest stream sends what the test puts in ``queue``
    (each stream has its own queue: a stream the agent dropped cannot take the next item)."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.discovers = 0
        self.discovered = asyncio.Event()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        async def discover(request: bytes, context: Any) -> AsyncIterator[bytes]:
            self.discovers += 1
            queue = self.queue if self.discovers == 1 else asyncio.Queue()
            self.queue = queue
            self.discovered.set()
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

    def __init__(self, handler: ExternalHandler) -> None:
        self._lists = handler.discover("", {})

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
    await endpoint.stop()
    # gone for good: only now do its devices leave (and follow the offline grace)
    assert await lists.next() == []
    assert handler.endpoints == {}
    await lists.close()


async def test_registering_again_keeps_the_list_until_the_new_stream_reports(
    endpoint: ScriptedEndpoint,
) -> None:
    handler = ExternalHandler("scripted", False, reconnect_window=30)
    handler.add(registration(endpoint.socket))
    lists = Lists(handler)
    await endpoint.queue.put(devices("a"))
    assert await lists.next() == ["a"]
    endpoint.discovered.clear()
    handler.add(registration(endpoint.socket))  # a restarted handler registers again
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
    await endpoint.queue.put(devices("b", "b") if bad == "duplicate" else GARBAGE)
    await dialled(endpoint)  # cut off, paused, dialled again
    assert [reason for _name, reason, _message in reports] == ["DiscoveryHandlerCutOff"]
    if bad == "garbage":
        assert "not a DiscoverResponse" in reports[0][2]
    await endpoint.queue.put(devices("c"))
    assert await lists.next() == ["c"]  # no empty list in between
    await lists.close()
