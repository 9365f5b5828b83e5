"""The kubelet double against a tiny fake device plugin, over real unix-socket gRPC."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from agent.protos.deviceplugin.v1beta1 import api_pb2 as dp
from agent.protos.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.protos.podresources.v1 import api_pb2 as pr
from agent.protos.podresources.v1 import api_pb2_grpc as pr_grpc
from tests.doubles.kubelet_double import (
    HEALTHY,
    UNHEALTHY,
    KubeletDouble,
    is_extended_resource_name,
)

RESOURCE = "akri.sh/foo"
H, U = HEALTHY, UNHEALTHY


class FakePlugin(dp_grpc.DevicePluginServicer):  # type: ignore[misc]
    """A minimal device plugin: configurable devices, Allocate echoes the ids as an env."""

    def __init__(
        self,
        directory: Path,
        name: str,
        devices: Sequence[tuple[str, str]],
        *,
        options: dp.DevicePluginOptions | None = None,
        preference: Callable[[list[str], list[str], int], list[str]] | None = None,
        allocate_error: tuple[grpc.StatusCode, str] | None = None,
        extra_response: bool = False,
    ) -> None:
        self.directory = directory
        self.socket = directory / name
        self.devices = [dp.Device(ID=i, health=h) for i, h in devices]
        self.served_options = options or dp.DevicePluginOptions()
        self.preference = preference
        self.allocate_error = allocate_error
        self.extra_response = extra_response
        self.allocate_requests: list[dp.AllocateRequest] = []
        self.preferred_requests: list[dp.PreferredAllocationRequest] = []
        self.prestart_requests: list[dp.PreStartContainerRequest] = []
        self.streams_cancelled = 0
        self._queues: list[asyncio.Queue[list[dp.Device] | None]] = []
        self._server: grpc.aio.Server | None = None

    async def start(self) -> FakePlugin:
        server = grpc.aio.server()
        dp_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    async def register(
        self,
        *,
        version: str = "v1beta1",
        resource: str = RESOURCE,
        options: dp.DevicePluginOptions | None = None,
        endpoint: str | None = None,
    ) -> None:
        target = f"unix://{self.directory / 'kubelet.sock'}"
        async with grpc.aio.insecure_channel(target) as channel:
            await dp_grpc.RegistrationStub(channel).Register(
                dp.RegisterRequest(
                    version=version,
                    endpoint=endpoint if endpoint is not None else self.socket.name,
                    resource_name=resource,
                    options=options if options is not None else self.served_options,
                ),
                timeout=5,
            )

    def update(self, devices: Sequence[tuple[str, str]]) -> None:
        self.devices = [dp.Device(ID=i, health=h) for i, h in devices]
        for q in self._queues:
            q.put_nowait(list(self.devices))

    def end_streams(self) -> None:
        for q in self._queues:
            q.put_nowait(None)

    @property
    def open_streams(self) -> int:
        return len(self._queues)

    async def GetDevicePluginOptions(
        self, request: dp.Empty, context: grpc.aio.ServicerContext
    ) -> dp.DevicePluginOptions:
        return self.served_options

    async def ListAndWatch(
        self, request: dp.Empty, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        q: asyncio.Queue[list[dp.Device] | None] = asyncio.Queue()
        self._queues.append(q)
        try:
            yield dp.ListAndWatchResponse(devices=self.devices)
            while (devices := await q.get()) is not None:
                yield dp.ListAndWatchResponse(devices=devices)
        except asyncio.CancelledError:
            self.streams_cancelled += 1
            raise
        finally:
            self._queues.remove(q)

    async def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> dp.PreferredAllocationResponse:
        self.preferred_requests.append(request)
        out = []
        for creq in request.container_requests:
            available = list(creq.available_deviceIDs)
            must = list(creq.must_include_deviceIDs)
            size = creq.allocation_size
            ids = (
                self.preference(available, must, size)
                if self.preference
                else sorted(available, reverse=True)[:size]
            )
            out.append(dp.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return dp.PreferredAllocationResponse(container_responses=out)

    async def Allocate(
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext
    ) -> dp.AllocateResponse:
        self.allocate_requests.append(request)
        if self.allocate_error is not None:
            await context.abort(*self.allocate_error)
        responses = [
            dp.ContainerAllocateResponse(
                envs={"FAKE_DEVICES": ",".join(creq.devices_ids)},
                annotations={"fake/devices": ",".join(creq.devices_ids)},
                cdi_devices=[dp.CDIDevice(name=f"akri.sh/foo={d}") for d in creq.devices_ids],
            )
            for creq in request.container_requests
        ]
        if self.extra_response:
            responses.append(dp.ContainerAllocateResponse(envs={"FAKE_DEVICES": "BOGUS"}))
        return dp.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> dp.PreStartContainerResponse:
        self.prestart_requests.append(request)
        return dp.PreStartContainerResponse()


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Short path: unix socket paths are limited to 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="kd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(workdir: Path) -> AsyncIterator[KubeletDouble]:
    double = KubeletDouble(
        workdir / "device-plugins", workdir / "pod-resources" / "kubelet.sock", dial_timeout=1.0
    )
    async with double:
        yield double


@pytest.fixture
async def plugins() -> AsyncIterator[list[FakePlugin]]:
    started: list[FakePlugin] = []
    yield started
    for p in started:
        await p.stop()


async def serve(
    plugins: list[FakePlugin],
    kubelet: KubeletDouble,
    devices: Sequence[tuple[str, str]],
    name: str = "foo.sock",
    register: bool = True,
    **kwargs: object,
) -> FakePlugin:
    plugin = await FakePlugin(kubelet.device_plugin_dir, name, devices, **kwargs).start()  # type: ignore[arg-type]
    plugins.append(plugin)
    if register:
        await plugin.register()
        await kubelet.wait_list_and_watch(RESOURCE, kubelet.list_and_watch_count[RESOURCE] + 1)
    return plugin


async def pod_resources(kubelet: KubeletDouble, method: str, request: object) -> object:
    async with grpc.aio.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        return await getattr(stub, method)(request, timeout=5)


def listed(response: pr.ListPodResourcesResponse) -> dict[str, dict[str, list[str]]]:
    """{ns/pod: {container: [resource:id, ...]}}"""
    out: dict[str, dict[str, list[str]]] = {}
    for p in response.pod_resources:
        out[f"{p.namespace}/{p.name}"] = {
            c.name: [f"{d.resource_name}:{i}" for d in c.devices for i in d.device_ids]
            for c in p.containers
        }
    return out


# ----------------------------------------------------------------------------- registration


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("akri.sh/foo", True),
        ("vendor.example.com/slot-1_a.b", True),
        ("akri.sh/" + "a" * 63, True),
        ("foo", False),
        ("kubernetes.io/foo", False),
        ("foo.kubernetes.io/bar", False),
        ("requests.akri.sh/foo", False),
        ("akri.sh/" + "a" * 64, False),
        ("Akri.sh/foo", False),
        ("akri.sh/-foo", False),
        ("akri.sh/foo/bar", False),
        ("akri.sh/", False),
        ("/foo", False),
        ("a" * 250 + ".io/foo", False),
    ],
)
def test_extended_resource_name_rules(name: str, ok: bool) -> None:
    assert is_extended_resource_name(name) is ok


async def test_register_rejects_bad_version_and_bad_name(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    plugin = await serve(plugins, kubelet, [("d0", H)], register=False)
    with pytest.raises(grpc.aio.AioRpcError) as bad_version:
        await plugin.register(version="v1alpha1")
    assert bad_version.value.code() == grpc.StatusCode.UNKNOWN
    assert 'requested API version "v1alpha1" is not supported' in (
        bad_version.value.details() or ""
    )
    for bad in ("nodomain", "kubernetes.io/foo", "akri.sh/" + "x" * 64):
        with pytest.raises(grpc.aio.AioRpcError) as bad_name:
            await plugin.register(resource=bad)
        assert f'the ResourceName "{bad}" is invalid' == bad_name.value.details()
    assert kubelet.registrations == []
    assert [a.error is not None for a in kubelet.register_attempts] == [True] * 4
    # A missing endpoint socket: the blocking dial times out (1 s here, 10 s in kubelet).
    with pytest.raises(grpc.aio.AioRpcError) as no_socket:
        await plugin.register(endpoint="missing.sock")
    assert "failed to dial device plugin" in (no_socket.value.details() or "")
    assert kubelet.capacity(RESOURCE) == 0
    # And a good one goes through.
    await plugin.register()
    reg = await kubelet.wait_registered(RESOURCE, 2)
    assert (reg.resource_name, reg.endpoint) == (RESOURCE, "foo.sock")


async def test_options_come_from_get_device_plugin_options(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    served = dp.DevicePluginOptions(get_preferred_allocation_available=True)
    plugin = await serve(plugins, kubelet, [("d0", H)], register=False, options=served)
    await plugin.register(options=dp.DevicePluginOptions(pre_start_required=True))
    reg = await kubelet.wait_registered(RESOURCE, 2)
    assert reg.options.get_preferred_allocation_available
    assert not reg.options.pre_start_required
    assert kubelet.register_attempts[-1].request.options.pre_start_required


# ----------------------------------------------------------------------------- ListAndWatch


async def test_list_and_watch_replaces_the_device_set(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    plugin = await serve(plugins, kubelet, [("a", H), ("b", H), ("c", U)])
    assert kubelet.devices(RESOURCE) == {"a": H, "b": H, "c": U}
    assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (3, 2)
    plugin.update([("a", U), ("d", H)])
    await kubelet.wait_list_and_watch(RESOURCE, 2)
    assert kubelet.devices(RESOURCE) == {"a": U, "d": H}
    assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (2, 1)
    plugin.update([])
    await kubelet.wait_list_and_watch(RESOURCE, 3)
    assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (0, 0)
    assert kubelet.list_and_watch_count[RESOURCE] == 3
    assert kubelet.list_and_watch_last[RESOURCE] >= kubelet.registrations[-1].time
    allocatable = await pod_resources(
        kubelet, "GetAllocatableResources", pr.AllocatableResourcesRequest()
    )
    assert list(allocatable.devices) == []  # type: ignore[attr-defined]


async def test_stream_end_marks_devices_unhealthy_and_stops_endpoint(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    plugin = await serve(plugins, kubelet, [("a", H), ("b", H), ("c", U)])
    assert kubelet.connected(RESOURCE)
    plugin.end_streams()
    await kubelet.wait_for(lambda: kubelet.endpoint_stopped(RESOURCE), 2)
    assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (3, 0)
    assert kubelet.devices(RESOURCE) == {"a": U, "b": U, "c": U}
    admission = await kubelet.admit_pod("default", "p", [("app", {RESOURCE: 1})])
    assert not admission.admitted
    assert admission.message == (  # kubelet 1.36 devicesToAllocate
        f"Allocate failed due to no healthy devices present; cannot allocate unhealthy "
        f"devices {RESOURCE}, which is unexpected"
    )
    # Forcing a device on a stopped endpoint fails in Allocate itself, without an RPC.
    forced = await kubelet.admit_pod(
        "default", "q", [("app", {RESOURCE: 1})], choose={RESOURCE: ["a"]}
    )
    assert forced.message == (
        f"Allocate failed due to endpoint {RESOURCE} has been stopped, which is unexpected"
    )
    assert plugin.allocate_requests == []
    # Re-registering replaces the endpoint and restores the devices.
    await plugin.register()
    await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 2, 2)
    assert not kubelet.endpoint_stopped(RESOURCE)


async def test_stopped_resource_is_deleted_after_grace_period(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    kubelet.endpoint_stop_grace_period = 0.2
    plugin = await serve(plugins, kubelet, [("a", H)])
    await plugin.stop()
    await kubelet.wait_for(lambda: kubelet.endpoint_stopped(RESOURCE), 2)
    assert kubelet.capacity(RESOURCE) == 1
    await kubelet.wait_for(lambda: RESOURCE not in kubelet.resources(), 2)
    assert kubelet.capacity(RESOURCE) == 0


async def test_reregistration_closes_old_stream(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    old = await serve(plugins, kubelet, [("a", H)], name="old.sock")
    new = await serve(plugins, kubelet, [("b", H), ("c", H)], name="new.sock")
    await kubelet.wait_for(lambda: old.open_streams == 0, 2)
    assert kubelet.endpoint(RESOURCE) == "new.sock"
    assert kubelet.devices(RESOURCE) == {"b": H, "c": H}
    await old.stop()
    # a later update on the new stream reaches the kubelet: it still listens to the new
    # plugin after the old one went away (instead of sleeping and hoping)
    new.update([("b", H), ("c", U)])
    await kubelet.wait_for(lambda: kubelet.healthy_devices(RESOURCE) == {"b"}, 2)
    assert kubelet.connected(RESOURCE) and not kubelet.endpoint_stopped(RESOURCE)
    assert kubelet.endpoint(RESOURCE) == "new.sock" and kubelet.allocatable(RESOURCE) == 1
    assert new.open_streams == 1
    assert [end for end in kubelet.stream_ends if end[1] == "new.sock"] == []


async def test_kubelet_mode_old_stream_end_disconnects_new_client(
    workdir: Path, plugins: list[FakePlugin]
) -> None:
    async with KubeletDouble(
        workdir / "dp", workdir / "pr.sock", reregistration="kubelet"
    ) as kubelet:
        old = await serve(plugins, kubelet, [("a", H)], name="old.sock")
        await serve(plugins, kubelet, [("b", H)], name="new.sock")
        assert old.open_streams == 1  # kubelet does not close the replaced client
        old.update([("z", H)])  # ... and its messages still land on the resource
        await kubelet.wait_list_and_watch(RESOURCE, 3)
        assert kubelet.devices(RESOURCE) == {"z": H}
        old.end_streams()
        await kubelet.wait_for(lambda: kubelet.endpoint_stopped(RESOURCE), 2)
        assert kubelet.allocatable(RESOURCE) == 0


# ----------------------------------------------------------------------------- admission


async def test_admission_allocates_healthy_free_devices_one_request_per_container(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    plugin = await serve(
        plugins, kubelet, [("d0", H), ("d1", H), ("d2", H), ("d3", U)], extra_response=True
    )
    first = await kubelet.admit_pod(
        "ns", "one", [("a", {RESOURCE: 1}), ("b", {RESOURCE: 1, "cpu": 1})]
    )
    assert first.admitted, first.message
    a, b = first.container("a"), first.container("b")
    assert len(a.devices[RESOURCE]) == 1 and len(b.devices[RESOURCE]) == 1
    assert set(a.devices[RESOURCE]) | set(b.devices[RESOURCE]) <= {"d0", "d1", "d2"}
    assert a.devices[RESOURCE] != b.devices[RESOURCE]
    assert b.skipped_resources == ["cpu"]
    assert [len(r.container_requests) for r in plugin.allocate_requests] == [1, 1]
    assert [list(r.container_requests[0].devices_ids) for r in plugin.allocate_requests] == [
        a.devices[RESOURCE],
        b.devices[RESOURCE],
    ]
    # Only container_responses[0] counts; the plugin's second (BOGUS) response is ignored.
    assert a.envs == {"FAKE_DEVICES": a.devices[RESOURCE][0]}
    assert a.annotations == {"fake/devices": a.devices[RESOURCE][0]}
    assert a.cdi_devices == [f"akri.sh/foo={a.devices[RESOURCE][0]}"]
    assert "BOGUS" not in str(first.containers)

    # One healthy device left: a pod asking for 2 fails, like the kubelet, without Allocate.
    second = await kubelet.admit_pod("ns", "two", [("c", {RESOURCE: 2})])
    assert not second.admitted
    assert second.reason == "UnexpectedAdmissionError"
    assert second.message == (
        "Allocate failed due to requested number of devices unavailable for akri.sh/foo. "
        "Requested: 2, Available: 1, which is unexpected"
    )
    assert len(plugin.allocate_requests) == 2
    assert kubelet.pod("ns", "two") is None
    assert kubelet.allocated_devices(RESOURCE) == set(first.devices())


async def test_init_container_devices_are_reused_by_app_containers(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    await serve(plugins, kubelet, [("d0", H), ("d1", H)])
    pod = await kubelet.admit_pod(
        "ns", "p", [("app1", {RESOURCE: 1}), ("app2", {RESOURCE: 1})], [("init", {RESOURCE: 2})]
    )
    assert pod.admitted, pod.message
    init = pod.container("init").devices[RESOURCE]
    app1, app2 = pod.container("app1").devices[RESOURCE], pod.container("app2").devices[RESOURCE]
    assert sorted(init) == ["d0", "d1"]
    assert sorted(app1 + app2) == ["d0", "d1"]  # reused, and not twice
    # Init containers are not in List (not restartable); app containers are.
    response = await pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    assert listed(response) == {  # type: ignore[arg-type]
        "ns/p": {"app1": [f"{RESOURCE}:{app1[0]}"], "app2": [f"{RESOURCE}:{app2[0]}"]}
    }


async def test_preferred_allocation_is_used_when_advertised(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    options = dp.DevicePluginOptions(get_preferred_allocation_available=True)
    plugin = await serve(
        plugins, kubelet, [("d0", H), ("d1", H), ("d2", H), ("d3", U)], options=options
    )
    pod = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 2})])
    assert pod.admitted, pod.message
    assert len(plugin.preferred_requests) == 1
    (creq,) = plugin.preferred_requests[0].container_requests
    assert sorted(creq.available_deviceIDs) == ["d0", "d1", "d2"]
    assert list(creq.must_include_deviceIDs) == []
    assert creq.allocation_size == 2
    assert pod.container("app").devices[RESOURCE] == ["d2", "d1"]  # the plugin's choice

    # A bogus preference (unknown + unhealthy ids) is intersected; the shortfall is filled.
    plugin.preference = lambda available, must, size: ["nope", "d3"]
    other = await kubelet.admit_pod("ns", "q", [("app", {RESOURCE: 1})])
    assert other.container("app").devices[RESOURCE] == ["d0"]
    assert kubelet.calls("GetPreferredAllocation", RESOURCE)[-1].pod == ("ns", "q")


async def test_preferred_allocation_not_called_without_option(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    plugin = await serve(plugins, kubelet, [("d0", H), ("d1", H)])
    pod = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 1})])
    assert pod.admitted and plugin.preferred_requests == []


async def test_allocate_error_fails_admission_and_releases_devices(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    plugin = await serve(
        plugins,
        kubelet,
        [("d0", H)],
        allocate_error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "slot d0 is taken"),
    )
    pod = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 1})])
    assert not pod.admitted
    assert pod.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert pod.grpc_details == "slot d0 is taken"
    assert pod.message == (
        "Allocate failed due to rpc error: code = ResourceExhausted desc = slot d0 is taken, "
        "which is unexpected"
    )
    assert kubelet.pods() == [] and kubelet.allocated_devices(RESOURCE) == set()
    plugin.allocate_error = None
    again = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 1})])
    assert again.admitted and again.devices() == ["d0"]


async def test_choose_forces_a_device_even_if_in_use(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    options = dp.DevicePluginOptions(get_preferred_allocation_available=True)
    plugin = await serve(plugins, kubelet, [("d0", H), ("d1", H)], options=options)
    first = await kubelet.admit_pod("ns", "a", [("app", {RESOURCE: 1})], choose={RESOURCE: ["d0"]})
    second = await kubelet.admit_pod("ns", "b", [("app", {RESOURCE: 1})], choose={RESOURCE: ["d0"]})
    assert first.devices() == second.devices() == ["d0"]
    assert plugin.preferred_requests == []
    assert [list(r.container_requests[0].devices_ids) for r in plugin.allocate_requests] == [
        ["d0"],
        ["d0"],
    ]


async def test_pre_start_container_when_required(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    options = dp.DevicePluginOptions(pre_start_required=True)
    plugin = await serve(plugins, kubelet, [("d0", H), ("d1", H)], options=options)
    pod = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 2})])
    assert pod.admitted and pod.container("app").prestart_error is None
    assert [sorted(r.devices_ids) for r in plugin.prestart_requests] == [["d0", "d1"]]


# ----------------------------------------------------------------------------- pod-resources


async def test_pod_resources_list_get_allocatable_and_delete(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    await serve(plugins, kubelet, [("d0", H), ("d1", H), ("d2", U)])
    pod = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 2}), ("side", {})])
    assert pod.admitted
    ids = sorted(pod.devices())
    response = await pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    assert listed(response) == {  # type: ignore[arg-type]
        "ns/p": {"app": [f"{RESOURCE}:{i}" for i in ids], "side": []}
    }
    # One ContainerDevices per device, full resource name, like the kubelet.
    app = response.pod_resources[0].containers[0]  # type: ignore[attr-defined]
    assert [(d.resource_name, list(d.device_ids)) for d in app.devices] == [
        (RESOURCE, [i]) for i in ids
    ]
    got = await pod_resources(
        kubelet, "Get", pr.GetPodResourcesRequest(pod_name="p", pod_namespace="ns")
    )
    assert got.pod_resources.name == "p"  # type: ignore[attr-defined]
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await pod_resources(
            kubelet, "Get", pr.GetPodResourcesRequest(pod_name="x", pod_namespace="ns")
        )
    assert missing.value.details() == "pod x not found in ns"
    allocatable = await pod_resources(
        kubelet, "GetAllocatableResources", pr.AllocatableResourcesRequest()
    )
    assert sorted(i for d in allocatable.devices for i in d.device_ids) == ["d0", "d1"]  # type: ignore[attr-defined]

    assert await kubelet.delete_pod("ns", "p")
    response = await pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    assert listed(response) == {}  # type: ignore[arg-type]
    assert kubelet.allocated_devices(RESOURCE) == set()
    again = await kubelet.admit_pod("ns", "q", [("app", {RESOURCE: 2})])
    assert again.admitted and sorted(again.devices()) == ids
    assert kubelet.pod_resources_calls["List"] == 2

    kubelet.list_enabled = False
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


# ----------------------------------------------------------------------------- restart


async def test_restart_wipes_sockets_and_forgets_registrations(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    directory = kubelet.device_plugin_dir
    plugin = await serve(plugins, kubelet, [("d0", H), ("d1", H)])
    pod = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 1})])
    assert pod.admitted
    (directory / "kubelet_internal_checkpoint").write_text("{}")
    (directory / "notes.txt").write_text("keep me")
    (directory / "subdir").mkdir()
    stray = socket.socket(socket.AF_UNIX)
    stray.bind(str(directory / "stray.sock"))
    stray.close()

    restarted = await kubelet.restart()
    assert kubelet.restart_time == restarted
    names = set(os.listdir(directory))
    assert "foo.sock" not in names and "stray.sock" not in names
    assert {"kubelet_internal_checkpoint", "notes.txt", "subdir", "kubelet.sock"} <= names
    assert stat.S_ISSOCK(os.lstat(kubelet.kubelet_socket).st_mode)
    # gRPC unlinks kubelet.sock when the old server stops; the rest is CleanupPluginDirectory.
    assert kubelet.cleanups[-1] == ["foo.sock", "stray.sock"]
    assert kubelet.start_count == 2
    assert kubelet.registrations == []
    assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (0, 0)
    assert kubelet.endpoint_stopped(RESOURCE)
    await kubelet.wait_for(lambda: plugin.open_streams == 0, 2)
    # Pods survive (checkpoint): still listed.
    response = await pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    assert list(listed(response)) == ["ns/p"]  # type: ignore[arg-type]

    # The plugin notices its socket is gone, serves again and re-registers.
    await plugin.stop()
    plugin.socket = directory / "foo2.sock"
    await plugin.start()
    await plugin.register()
    reg = await kubelet.wait_registered(RESOURCE, 2, after=restarted)
    assert reg.endpoint == "foo2.sock" and reg.time > restarted
    await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 2, 2)
    assert len(kubelet.all_registrations) == 2
    # Kubelet still remembers the pod's device: only one is free.
    other = await kubelet.admit_pod("ns", "q", [("app", {RESOURCE: 2})])
    assert not other.admitted and "Requested: 2, Available: 1" in (other.message or "")


async def test_stop_drops_connections_and_start_serves_again(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    plugin = await serve(plugins, kubelet, [("d0", H)])
    await kubelet.stop()
    assert not kubelet.running and not kubelet.connected(RESOURCE)
    await kubelet.wait_for(lambda: plugin.open_streams == 0, 2)
    with pytest.raises(grpc.aio.AioRpcError):
        await plugin.register()
    await kubelet.start()
    assert not (kubelet.device_plugin_dir / "foo.sock").exists()  # CleanupPluginDirectory
    await plugin.stop()
    await plugin.start()
    await plugin.register()
    await kubelet.wait_registered(RESOURCE, 2)
    assert kubelet.connected(RESOURCE)


# ----------------------------------------------------------------------------- checkpoint


def checkpointed_pods(kubelet: KubeletDouble) -> set[str]:
    data = json.loads((kubelet.device_plugin_dir / "kubelet_internal_checkpoint").read_text())
    return {entry["PodUID"] for entry in data["Data"]["PodDeviceEntries"]}


async def test_checkpoint_is_written_only_when_kubelet_writes_it(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    """kubelet 1.36 (``writeCheckpoint`` in ``pkg/kubelet/cm/devicemanager/manager.go``): after
    an allocation, on a plugin's ListAndWatch message, and when ``GetCapacity`` deletes a
    resource whose plugin stopped more than the grace ago — not when a pod ends, nor on a
    pod-resources ``List`` (which makes it forget the ended pod in memory only)."""
    kubelet.endpoint_stop_grace_period = 0.3
    plugin = await serve(plugins, kubelet, [("d0", H), ("d1", H)])
    pod = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 1})])
    assert checkpointed_pods(kubelet) == {pod.uid}
    writes = kubelet.checkpoint_writes
    assert await kubelet.delete_pod("ns", "p")
    await pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    kubelet.allocatable(RESOURCE)  # GetCapacity: nothing to delete, nothing written
    assert (kubelet.checkpoint_writes, checkpointed_pods(kubelet)) == (writes, {pod.uid})
    plugin.update([("d0", H), ("d1", H)])  # a plugin's message: the file is rewritten
    await kubelet.wait_for(lambda: kubelet.checkpoint_writes > writes, 5)
    assert checkpointed_pods(kubelet) == set()

    # no plugin at all: the file keeps an ended pod until a stopped resource is deleted
    other = await kubelet.admit_pod("ns", "q", [("app", {RESOURCE: 1})])
    await plugin.stop()
    await kubelet.wait_for(lambda: kubelet.endpoint_stopped(RESOURCE), 5)
    assert await kubelet.delete_pod("ns", "q")
    await pod_resources(kubelet, "List", pr.ListPodResourcesRequest())
    writes = kubelet.checkpoint_writes
    assert checkpointed_pods(kubelet) == {other.uid}
    await kubelet.wait_for(lambda: RESOURCE not in kubelet.resources(), 5)
    assert kubelet.checkpoint_writes == writes + 1
    assert checkpointed_pods(kubelet) == set()


async def test_a_plugin_listing_no_device_admits_no_pod(
    kubelet: KubeletDouble, plugins: list[FakePlugin]
) -> None:
    await serve(plugins, kubelet, [])
    assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (0, 0)
    refused = await kubelet.admit_pod("ns", "p", [("app", {RESOURCE: 1})])
    assert not refused.admitted
    assert refused.message == (
        f"Allocate failed due to no healthy devices present; cannot allocate unhealthy "
        f"devices {RESOURCE}, which is unexpected"
    )
