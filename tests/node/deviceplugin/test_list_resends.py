"""What an Allocate costs the ListAndWatch streams (issue 27): kubelet needs a message only
when a device appears, goes or changes health, so a re-grant and a new IL claim that changes
no health send nothing and build no list; a health change still sends exactly one.

The manager runs in-process against an in-memory store and the kubelet double (real gRPC over
unix sockets); Allocates are sent on the test's own channel to the plugin's socket, as kubelet
sends them. Counted: the kubelet double's ListAndWatch messages per resource, the stream's
list computations, and the ``DeviceView`` objects the views build. Every wait is for an
event (a message reaching the kubelet double), with a generous bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.node.deviceplugin import views
from agent.node.deviceplugin.manager import DevicePluginManager
from agent.node.deviceplugin.service import DevicePluginService
from agent.protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from tests.doubles.kubelet_double import KubeletDouble
from tests.doubles.memory_store import MemoryStore
from tests.node.deviceplugin.support import NODE, Factory, il, instance, registered

WAIT = 60.0  # seconds; a loaded machine may be slow, an idle one returns at once


class CountedViews:
    """Counts the ``DeviceView`` objects the views build (one per slot of a list built)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.built = 0
        counter = self

        class Counted(views.DeviceView):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                counter.built += 1
                super().__init__(*args, **kwargs)

        monkeypatch.setattr(views, "DeviceView", Counted)


@asynccontextmanager
async def plugin_stub(
    kubelet: KubeletDouble, resource: str
) -> AsyncIterator[api_pb2_grpc.DevicePluginStub]:
    """A client of the plugin serving ``resource``, on the socket kubelet registered."""
    endpoint = kubelet.endpoint(resource)
    assert endpoint is not None, f"{resource} is not registered"
    async with grpc.aio.insecure_channel(
        f"unix://{kubelet.device_plugin_dir / endpoint}",
        options=[("grpc.default_authority", "localhost")],
    ) as channel:
        yield api_pb2_grpc.DevicePluginStub(channel)


async def allocate(stub: api_pb2_grpc.DevicePluginStub, device: str) -> None:
    request = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[device])]
    )
    response = await stub.Allocate(request, timeout=WAIT)
    assert len(response.container_responses) == 1


async def another_node_takes(
    store: MemoryStore, kubelet: KubeletDouble, key: ObjectKey, slot: str
) -> None:
    """A health change: another node holds ``slot``; wait until kubelet sees it Unhealthy.
    Everything the stream had to do before is done by then (it runs in order)."""
    current = store.get_cached(key)
    assert current is not None
    store.put(current.evolve(device_usage={**current.device_usage, slot: "n2"}))
    resource = f"akri.sh/{key.name}"
    await kubelet.wait_for(lambda: kubelet.devices(resource).get(slot) == "Unhealthy", WAIT)


async def settled(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory, big: Instance
) -> DevicePluginManager:
    """The manager serving ``big``, its stream past every start-up notification."""
    store.put(big)
    manager = await make_manager()
    await registered(kubelet, [il(0)])
    await kubelet.wait_list_and_watch(il(0), timeout=WAIT)
    await another_node_takes(store, kubelet, big.key, f"{big.name}-999")
    return manager


async def test_a_burst_of_regrants_wakes_no_stream_and_sends_nothing(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    big = instance(0, capacity=1000)
    held = f"{big.name}-0"
    big = big.evolve(device_usage={**big.device_usage, held: NODE})  # this node's IL slot
    manager = await settled(store, kubelet, make_manager, big)
    service = manager.instance_plugins[big.name].service
    computations, messages = service.computations, kubelet.list_and_watch_count[il(0)]
    before = store.get_cached(big.key)
    async with plugin_stub(kubelet, il(0)) as stub:
        for _ in range(50):  # kubelet re-offering the device this node holds
            await allocate(stub, held)
    assert store.get_cached(big.key) is before  # nothing written
    await another_node_takes(store, kubelet, big.key, f"{big.name}-998")
    # only the health change: before, every re-grant woke the stream, which re-computed the
    # 1,000-slot list to find it unchanged (~1.3 ms of event loop each)
    assert service.computations == computations + 1
    assert kubelet.list_and_watch_count[il(0)] == messages + 1


async def test_new_claims_that_change_no_health_build_no_list_and_send_nothing(
    store: MemoryStore,
    kubelet: KubeletDouble,
    make_manager: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    big = instance(0, capacity=1000)
    manager = await settled(store, kubelet, make_manager, big)
    messages = kubelet.list_and_watch_count[il(0)]
    counted = CountedViews(monkeypatch)
    async with plugin_stub(kubelet, il(0)) as stub:
        for n in range(50):  # free -> this node: Healthy before and after
            await allocate(stub, f"{big.name}-{n}")
    current = store.get_cached(big.key)
    assert current is not None
    assert sum(1 for v in current.device_usage.values() if v == NODE) == 50
    await another_node_takes(store, kubelet, big.key, f"{big.name}-998")
    # one list built, for the health change; before, two per claim (51 x 2 x 1,000 views)
    assert counted.built == 1000
    assert kubelet.list_and_watch_count[il(0)] == messages + 1
    assert kubelet.allocatable(il(0)) == 998  # the 50 claimed slots are still offered
    assert all(kubelet.devices(il(0))[f"{big.name}-{n}"] == "Healthy" for n in range(50))
    del manager


async def test_a_claim_that_leaves_no_room_sends_the_free_slots_unhealthy(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    # capacity lowered to 2 while n2 still holds slot 2 (draining): one claim fills it, and
    # slot 1, still free, can no longer be given: kubelet must hear it
    lowered = instance(0, capacity=2)
    usage = {**lowered.device_usage, f"{lowered.name}-2": "n2"}
    store.put(lowered.evolve(device_usage=usage))
    await make_manager()
    await registered(kubelet, [il(0)])
    await kubelet.wait_for(lambda: kubelet.allocatable(il(0)) == 2, WAIT)
    messages = kubelet.list_and_watch_count[il(0)]
    async with plugin_stub(kubelet, il(0)) as stub:
        await allocate(stub, f"{lowered.name}-0")
    await kubelet.wait_for(lambda: kubelet.allocatable(il(0)) == 1, WAIT)
    assert kubelet.devices(il(0)) == {
        f"{lowered.name}-0": "Healthy",
        f"{lowered.name}-1": "Unhealthy",
    }
    assert kubelet.list_and_watch_count[il(0)] == messages + 1


class SameTuple:
    """Plugin logic whose list is one tuple, replaced only by :meth:`set`."""

    resource_name = "akri.sh/fake"
    preferred_allocation = False

    def __init__(self) -> None:
        self.list: tuple[views.DeviceView, ...] = (views.DeviceView("d0", True),)

    def devices(self) -> tuple[views.DeviceView, ...]:
        return self.list

    async def allocate(self, requests: Any) -> list[api_pb2.ContainerAllocateResponse]:
        return [api_pb2.ContainerAllocateResponse() for _ in requests]

    def preferred(self, available: Any, must_include: Any, size: int) -> list[str]:
        return []


async def test_the_same_tuple_is_not_sent_again_unless_a_resend_is_asked() -> None:
    logic = SameTuple()
    service = DevicePluginService(logic)
    stream = service.ListAndWatch(None, None)
    assert [d.ID for d in (await anext(stream)).devices] == ["d0"]
    following = asyncio.ensure_future(anext(stream))
    for n in range(2, 7):
        service.changed()
        for _ in range(100):  # a few loop turns: the stream looks, finds nothing to send
            if service.computations == n:
                break
            await asyncio.sleep(0)
        assert service.computations == n
    assert not following.done() and service.sends == 1
    service.resend()  # the reclaimer's nudge: kubelet must rewrite its checkpoint
    assert [d.ID for d in (await asyncio.wait_for(following, WAIT)).devices] == ["d0"]
    following = asyncio.ensure_future(anext(stream))
    logic.list = (views.DeviceView("d0", False),)  # a health change
    service.changed()
    message = await asyncio.wait_for(following, WAIT)
    assert [(d.ID, d.health) for d in message.devices] == [("d0", "Unhealthy")]
    assert service.sends == 3
    service.end_streams()
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
