"""DevicePluginManager and PluginEndpoint at scale: concurrency, stopping, coalescing, polling.

The manager runs in-process against an in-memory store and the kubelet double (real gRPC over
unix sockets). Nothing here asserts wall-clock durations: concurrency is observed by counting
restarts in flight, blocking is shown by holding a stop open, coalescing by counting
re-computations, and socket polling by counting ``stat`` calls.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.node.deviceplugin.endpoint import PluginEndpoint
from agent.node.deviceplugin.registration import KubeletRegistrar
from agent.node.deviceplugin.service import DevicePluginService
from agent.node.deviceplugin.views import DeviceView
from agent.protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from tests.doubles.kubelet_double import KubeletDouble
from tests.doubles.memory_store import MemoryStore
from tests.node.deviceplugin.support import CL, Factory, Source, il, instance, registered


class InFlight:
    """Counts concurrent calls of an async method (patched on the class)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> None:
        self.now = 0
        self.max = 0
        self.calls = 0
        original = getattr(cls, method)

        async def wrapper(this: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.now += 1
            self.max = max(self.max, self.now)
            try:
                return await original(this, *args, **kwargs)
            finally:
                self.now -= 1

        monkeypatch.setattr(cls, method, wrapper)


# --------------------------------------------------------------------------- kubelet restart


async def test_kubelet_restart_restarts_plugins_concurrently_with_a_bound(
    store: MemoryStore,
    kubelet: KubeletDouble,
    make_manager: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for i in range(24):
        store.put(instance(i))
    manager = await make_manager(concurrency=8)
    resources = [il(i) for i in range(24)] + [CL]
    await registered(kubelet, resources)
    for endpoint in manager.endpoints():
        await asyncio.wait_for(endpoint.registered.wait(), 10)
    before = {e.resource_name: (e.socket_path, e.registrations) for e in manager.endpoints()}
    restarts = InFlight(monkeypatch, PluginEndpoint, "restart")

    restarted = await kubelet.restart()
    await manager.check_sockets()
    await registered(kubelet, resources, after=restarted)

    assert manager.kubelet_restarts == 1
    assert restarts.calls == 25
    assert 1 < restarts.max <= 8, restarts.max  # concurrent, and bounded
    for endpoint in manager.endpoints():
        old_socket, old_registrations = before[endpoint.resource_name]
        # each as before: a new server on a new socket, registered once more
        assert endpoint.socket_path != old_socket and endpoint.socket_path is not None
        assert endpoint.socket_path.exists() and not old_socket.exists()  # type: ignore[union-attr]
        await asyncio.wait_for(endpoint.registered.wait(), 10)
        assert endpoint.registrations == old_registrations + 1
    for resource in resources:
        await kubelet.wait_list_and_watch(resource)  # streaming again
    ends = [end for end in kubelet.stream_ends if end[2] > restarted]
    assert ends == []  # the double closed the old streams itself; no new stream ended


async def test_new_plugins_start_concurrently_with_a_bound(
    store: MemoryStore,
    kubelet: KubeletDouble,
    make_manager: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    starts = InFlight(monkeypatch, PluginEndpoint, "start")
    for i in range(20):
        store.put(instance(i))
    await make_manager(concurrency=6)
    await registered(kubelet, [il(i) for i in range(20)] + [CL])
    assert starts.calls == 21
    assert 1 < starts.max <= 6, starts.max


# --------------------------------------------------------------------------- stopping


async def test_sync_is_not_blocked_by_a_stopping_plugin_and_close_awaits_it(
    store: MemoryStore,
    kubelet: KubeletDouble,
    make_manager: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store.put(instance(0))
    manager = await make_manager()
    await registered(kubelet, [il(0), CL])
    release = asyncio.Event()
    held: list[str] = []
    stopped: list[str] = []
    original_stop = PluginEndpoint.stop

    async def slow_stop(endpoint: PluginEndpoint) -> None:
        if endpoint.resource_name == il(0):
            held.append(endpoint.resource_name)
            await release.wait()
        await original_stop(endpoint)
        stopped.append(endpoint.resource_name)

    monkeypatch.setattr(PluginEndpoint, "stop", slow_stop)
    store.remove(instance(0).name)
    await kubelet.wait_for(lambda: held, 10, "the removed plugin did not start stopping")
    store.put(instance(1))  # a new plugin while the old one is still stopping
    await registered(kubelet, [il(1)])
    assert il(0) not in stopped and il(0) not in {e.resource_name for e in manager.endpoints()}
    await kubelet.wait_list_and_watch(il(1))

    closing = asyncio.create_task(manager.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # close() waits for the background stop too
    release.set()
    await closing
    assert set(stopped) == {il(0), il(1), CL}
    assert not list(kubelet.device_plugin_dir.glob("akri.sh-*.sock"))


async def test_list_and_watch_stream_ends_on_stop_without_waiting_the_grace(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    store.put(instance(0))
    manager = await make_manager()
    await registered(kubelet, [il(0), CL])
    await kubelet.wait_list_and_watch(il(0))
    endpoint = manager.instance_plugins[instance(0).name]
    assert endpoint.service.open_streams == 1
    endpoint.stop_grace = 3600  # only streams still open could make stop() wait this long
    await asyncio.wait_for(endpoint.stop(), 30)
    assert endpoint.service.open_streams == 0
    await kubelet.wait_for(lambda: any(e[0] == il(0) for e in kubelet.stream_ends), 5)
    ends = [e for e in kubelet.stream_ends if e[0] == il(0)]
    assert ends[0][3] is None, ends  # ended by the plugin with status OK, not cancelled
    # kubelet marks the resource unhealthy
    await kubelet.wait_for(lambda: kubelet.allocatable(il(0)) == 0, 5)
    await endpoint.restart()  # a stopped endpoint stays stopped
    assert endpoint.socket_path is not None and not endpoint.socket_path.exists()


class Logic:
    resource_name = "akri.sh/fake"
    preferred_allocation = False

    def __init__(self) -> None:
        self.devices_list = [DeviceView("d0", True)]
        self.computed = 0

    def devices(self) -> Sequence[DeviceView]:
        self.computed += 1
        return list(self.devices_list)

    async def allocate(
        self, container_requests: Sequence[Sequence[str]]
    ) -> list[api_pb2.ContainerAllocateResponse]:
        return [api_pb2.ContainerAllocateResponse() for _ in container_requests]

    def preferred(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        return list(available)[:size]


async def test_a_stream_ended_on_stop_finishes_with_ok_for_a_plain_client(base: Path) -> None:
    endpoint = PluginEndpoint(DevicePluginService(Logic()), base / "dp", stop_grace=3600)
    await endpoint.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{endpoint.socket_path}") as channel:
            call = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
            first = await call.read()
            assert [d.ID for d in first.devices] == ["d0"]
            await asyncio.wait_for(endpoint.stop(), 30)
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
    finally:
        await endpoint.stop()


async def test_endpoints_share_one_registration_channel_that_recovers_from_failures(
    base: Path, kubelet: KubeletDouble
) -> None:
    """Every plugin registers over one kubelet channel; a refused Register is retried on a
    fresh channel, and so is one sent while kubelet was down (never stuck on the dead one)."""
    registrar = KubeletRegistrar(base / "dp")
    kubelet.register_error = "injected refusal"
    first = PluginEndpoint(DevicePluginService(Logic()), base / "dp", registrar=registrar)
    await first.start()
    try:
        await kubelet.wait_for(lambda: len(kubelet.register_attempts) >= 2, 10)
        assert not first.registered.is_set()
        kubelet.register_error = None
        await asyncio.wait_for(first.registered.wait(), 10)
        channel = registrar.channel
        assert channel is not None
        await kubelet.stop()  # kubelet down: the next Register fails
        logic = Logic()
        logic.resource_name = "akri.sh/other"
        second = PluginEndpoint(DevicePluginService(logic), base / "dp", registrar=registrar)
        await second.start()
        try:
            await asyncio.sleep(0.3)
            assert not second.registered.is_set()
            # the failed calls dropped the dead kubelet's channel: no retry waits on it
            assert registrar.channel is not channel
            await kubelet.start()  # wipes the directory, like kubelet: both serve anew
            await second.restart()
            await first.restart()
            await asyncio.wait_for(second.registered.wait(), 10)
            await asyncio.wait_for(first.registered.wait(), 10)
            assert {r.resource_name for r in kubelet.registrations} >= {
                "akri.sh/fake",
                "akri.sh/other",
            }
        finally:
            await second.stop()
    finally:
        await first.stop()
        await registrar.close()


async def test_a_register_call_cancelled_under_the_endpoint_is_retried(
    base: Path, kubelet: KubeletDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc.aio raises CancelledError in the caller when the call's channel is closed: that is
    a failed attempt, not the endpoint being stopped — it must not end the registering."""
    registrar = KubeletRegistrar(base / "dp")
    real_register = registrar.register
    cancelled = [1]

    async def register(request: api_pb2.RegisterRequest, *, rpc_timeout: float) -> None:
        if cancelled:
            cancelled.pop()
            raise asyncio.CancelledError()
        await real_register(request, rpc_timeout=rpc_timeout)

    monkeypatch.setattr(registrar, "register", register)
    endpoint = PluginEndpoint(DevicePluginService(Logic()), base / "dp", registrar=registrar)
    await endpoint.start()
    try:
        await asyncio.wait_for(endpoint.registered.wait(), 10)
        assert not cancelled and endpoint.registrations == 1
    finally:
        await endpoint.stop()
        await registrar.close()


# --------------------------------------------------------------------------- coalescing


async def test_cl_list_is_recomputed_once_for_a_burst_of_instance_events(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    store.put(instance(0))
    manager = await make_manager(cl_update_interval=3600)
    await registered(kubelet, [il(0), CL])
    await kubelet.wait_list_and_watch(CL)
    cl = manager.configuration_plugins["cam"].service
    assert cl.computations == 1
    lists = store.full_lists  # the subscription's initial list and the first sync
    burst = 40
    for i in range(1, burst + 1):
        syncs = manager.syncs
        store.put(instance(i))
        await kubelet.wait_for(lambda s=syncs: manager.syncs > s, 10)  # one sync per event
    await registered(kubelet, [il(i) for i in range(burst + 1)])
    # the old code re-computed the CL list (over every Instance) once per event: 41 times
    assert cl.computations == 1
    assert manager.syncs > burst
    assert store.full_lists == lists  # syncs after the first cost O(changed), not O(Instances)
    await asyncio.wait_for(manager.close(), 30)  # a stream waiting out the window still ends
    assert cl.open_streams == 0


async def test_stream_recomputes_once_per_window_and_sends_the_latest_list(base: Path) -> None:
    window = asyncio.Event()
    sleeps: list[float] = []

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await window.wait()

    logic = Logic()
    service = DevicePluginService(logic, min_interval=10.0, clock=lambda: 0.0, sleep=sleep)
    stream = service.ListAndWatch(None, None)
    first = await anext(stream)
    assert [d.ID for d in first.devices] == ["d0"]
    following = asyncio.ensure_future(anext(stream))
    for n in range(1, 31):  # a burst of changes, each seen by the stream on its own
        logic.devices_list = [DeviceView(f"d{k}", True) for k in range(n + 1)]
        service.changed()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert logic.computed == 1 and sleeps == [10.0]  # waiting out the window
    window.set()
    second = await following
    assert [d.ID for d in second.devices] == [f"d{k}" for k in range(31)]
    assert logic.computed == 2  # one re-computation for the whole burst
    service.end_streams()
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert service.open_streams == 0


async def test_a_costly_list_waits_longer_between_recomputations() -> None:
    now = [0.0]
    sleeps: list[float] = []

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await asyncio.Event().wait()

    class Slow(Logic):
        def devices(self) -> Sequence[DeviceView]:
            now[0] += 1.0  # each computation "takes" one second
            return super().devices()

    service = DevicePluginService(Slow(), min_interval=0.01, clock=lambda: now[0], sleep=sleep)
    stream = service.ListAndWatch(None, None)
    await anext(stream)
    following = asyncio.ensure_future(anext(stream))
    service.changed()
    for _ in range(3):
        await asyncio.sleep(0)
    # at most one computation per COST_FACTOR x its cost: 10 s after the last one started
    assert sleeps == [9.0]
    service.end_streams()
    with pytest.raises(StopAsyncIteration):
        await following


async def test_il_streams_are_not_rate_limited(base: Path) -> None:
    logic = Logic()
    service = DevicePluginService(logic)  # min_interval 0
    stream = service.ListAndWatch(None, None)
    await anext(stream)
    for n in range(1, 4):
        logic.devices_list = [DeviceView(f"d{k}", True) for k in range(n + 1)]
        service.changed()
        message = await anext(stream)
        assert len(message.devices) == n + 1
    service.end_streams()
    with pytest.raises(StopAsyncIteration):
        await anext(stream)


# --------------------------------------------------------------------------- socket polling


def age_directory(directory: Path) -> None:
    """Set the directory's mtime an hour back (a change that old is surely visible)."""
    old = os.stat(directory).st_mtime_ns - 3600 * 10**9
    os.utime(directory, ns=(old, old))


class StatCounter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = PluginEndpoint.socket_missing

        def counted(endpoint: PluginEndpoint) -> bool:
            self.calls += 1
            return original(endpoint)

        monkeypatch.setattr(PluginEndpoint, "socket_missing", counted)


async def test_idle_polls_do_not_stat_our_sockets(
    store: MemoryStore,
    kubelet: KubeletDouble,
    make_manager: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for i in range(10):
        store.put(instance(i))
    manager = await make_manager()
    await registered(kubelet, [il(i) for i in range(10)] + [CL])
    age_directory(kubelet.device_plugin_dir)
    await manager.check_sockets()  # sees the (aged) change once
    stats = StatCounter(monkeypatch)
    for _ in range(50):  # the old code stat'ed all 11 sockets on every 10th poll
        await manager.check_sockets()
    assert stats.calls == 0


async def test_a_deleted_plugin_socket_is_detected_and_only_that_plugin_restarts(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    for i in range(5):
        store.put(instance(i))
    manager = await make_manager()
    await registered(kubelet, [il(i) for i in range(5)] + [CL])
    age_directory(kubelet.device_plugin_dir)
    await manager.check_sockets()
    victim = manager.instance_plugins[instance(2).name]
    others = {e.resource_name: e.socket_path for e in manager.endpoints() if e is not victim}
    assert victim.socket_path is not None
    old = victim.socket_path
    since = time.monotonic()
    old.unlink()
    await manager.check_sockets()
    assert victim.socket_path != old and victim.socket_path.exists()
    await kubelet.wait_registered(il(2), 10, after=since)
    assert {e.resource_name: e.socket_path for e in manager.endpoints() if e is not victim} == (
        others
    )
    assert manager.kubelet_restarts == 0


async def test_a_removal_within_the_same_mtime_tick_is_still_detected(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    """A removal right after a poll may leave the directory's mtime unchanged (coarse
    timestamps): a recent mtime keeps the next poll checking."""
    store.put(instance(0))
    manager = await make_manager()
    await registered(kubelet, [il(0), CL])
    directory = kubelet.device_plugin_dir
    now = time.time_ns()
    os.utime(directory, ns=(now, now))
    await manager.check_sockets()  # sees an mtime close to now
    endpoint = manager.instance_plugins[instance(0).name]
    assert endpoint.socket_path is not None
    old = endpoint.socket_path
    old.unlink()
    os.utime(directory, ns=(now, now))  # as if within the same tick
    await manager.check_sockets()
    assert endpoint.socket_path != old and endpoint.socket_path.exists()


async def test_a_wiped_and_recreated_directory_is_detected(
    store: MemoryStore,
    kubelet: KubeletDouble,
    make_manager: Factory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for i in range(3):
        store.put(instance(i))
    manager = await make_manager()
    resources = [il(i) for i in range(3)] + [CL]
    await registered(kubelet, resources)
    directory = kubelet.device_plugin_dir
    await kubelet.stop()
    shutil.rmtree(directory)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            await manager.check_sockets()  # nothing to serve into: wait, warn once
    assert len([r for r in caplog.records if "is gone" in r.getMessage()]) == 1
    directory.mkdir()
    age_directory(directory)  # the new inode alone must be enough
    await manager.check_sockets()
    for endpoint in manager.endpoints():
        assert endpoint.socket_path is not None and endpoint.socket_path.exists()
    assert manager.kubelet_restarts == 0
    since = time.monotonic()
    await kubelet.start()  # a fresh kubelet.sock: everything registers again
    await manager.check_sockets()
    assert manager.kubelet_restarts == 1
    await registered(kubelet, resources, after=since)


async def test_a_failed_restart_is_retried_on_the_next_poll(
    store: MemoryStore,
    kubelet: KubeletDouble,
    make_manager: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store.put(instance(0))
    manager = await make_manager()
    await registered(kubelet, [il(0), CL])
    endpoint = manager.instance_plugins[instance(0).name]
    original = PluginEndpoint._confirm_serving
    failures = [1]

    def flaky_confirmation(this: PluginEndpoint) -> None:
        if failures:
            failures.pop()
            raise ConnectionError("injected")
        original(this)

    monkeypatch.setattr(PluginEndpoint, "_confirm_serving", flaky_confirmation)
    assert endpoint.socket_path is not None
    endpoint.socket_path.unlink()
    directory = kubelet.device_plugin_dir
    age_directory(directory)
    aged = os.stat(directory).st_mtime_ns
    await manager.check_sockets()  # the restart fails: nothing half-started is left
    assert endpoint.socket_path is not None and not endpoint.socket_path.exists()
    os.utime(directory, ns=(aged, aged))  # as if the directory had not changed since
    await manager.check_sockets()
    assert endpoint.socket_path.exists()
    await kubelet.wait_registered(il(0), 10)


# --------------------------------------------------------------------------- plugin set


async def test_plugins_follow_instances_and_offline_changes(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    store.put(instance(0))
    store.put(instance(1, configuration="other"))
    manager = await make_manager()
    await registered(kubelet, [il(0), "akri.sh/other-000001", CL, "akri.sh/other"])
    assert set(manager.configuration_plugins) == {"cam", "other"}
    store.put(instance(1, configuration="other").evolve(nodes=("n2",)))  # leaves this node
    await kubelet.wait_for(lambda: "other" not in manager.configuration_plugins, 10)
    assert set(manager.instance_plugins) == {instance(0).name}
    # an offline change re-lists: the IL slots turn Unhealthy
    await kubelet.wait_for(lambda: kubelet.allocatable(il(0)) == 2, 10)
    source = manager.source
    assert isinstance(source, Source)
    source.offline.add(instance(0).name)
    manager.offline_changed()
    await kubelet.wait_for(lambda: kubelet.allocatable(il(0)) == 0, 10)
    store.remove(instance(0).name)
    await kubelet.wait_for(lambda: not manager.endpoints(), 10)
