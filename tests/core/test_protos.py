"""Tests for the .proto sources and the generated stubs in agent/protos."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FieldDescriptor

from tests.paths import REPO

REPO_ROOT = REPO
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"
STUB_DIR = REPO_ROOT / "agent" / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
REGENERATE_HINT = "regenerate with: python scripts/gen_protos.py (then commit agent/protos)"

# import path of the _pb2 module -> descriptor file name (include-relative, must be unique)
PROTO_MODULES = {
    "agent.protos.deviceplugin.v1beta1.api_pb2": "deviceplugin/v1beta1/api.proto",
    "agent.protos.pluginregistration.v1.api_pb2": "pluginregistration/v1/api.proto",
    "agent.protos.dra.v1.api_pb2": "dra/v1/api.proto",
    "agent.protos.dra.v1beta1.api_pb2": "dra/v1beta1/api.proto",
    "agent.protos.podresources.v1.api_pb2": "podresources/v1/api.proto",
    "agent.protos.akri.discovery.v0.discovery_pb2": "akri/discovery/v0/discovery.proto",
    "agent.protos.dra_health.v1alpha1.api_pb2": "dra_health/v1alpha1/api.proto",
    "agent.protos.dra_health.v1beta1.api_pb2": "dra_health/v1beta1/api.proto",
    "agent.protos.dra_health.v1.api_pb2": "dra_health/v1/api.proto",
}

# _pb2 module -> {service full name: [methods in declaration order]}
EXPECTED_SERVICES: dict[str, dict[str, list[str]]] = {
    "agent.protos.deviceplugin.v1beta1.api_pb2": {
        "v1beta1.Registration": ["Register"],
        "v1beta1.DevicePlugin": [
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    },
    "agent.protos.pluginregistration.v1.api_pb2": {
        "pluginregistration.Registration": ["GetInfo", "NotifyRegistrationStatus"],
    },
    "agent.protos.dra.v1.api_pb2": {
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": [
            "NodePrepareResources",
            "NodeUnprepareResources",
        ],
    },
    "agent.protos.dra.v1beta1.api_pb2": {
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin": [
            "NodePrepareResources",
            "NodeUnprepareResources",
        ],
    },
    "agent.protos.podresources.v1.api_pb2": {
        "v1.PodResourcesLister": ["List", "GetAllocatableResources", "Get"],
    },
    "agent.protos.akri.discovery.v0.discovery_pb2": {
        "v0.Registration": ["RegisterDiscoveryHandler"],
        "v0.DiscoveryHandler": ["Discover"],
    },
    "agent.protos.dra_health.v1alpha1.api_pb2": {
        "v1alpha1.DRAResourceHealth": ["NodeWatchResources"],
    },
    "agent.protos.dra_health.v1beta1.api_pb2": {
        "v1beta1.DRAResourceHealth": ["NodeWatchResources"],
    },
    "agent.protos.dra_health.v1.api_pb2": {
        "v1.DRAResourceHealth": ["NodeWatchResources"],
    },
}

# full gRPC method paths the kubelet / Akri use on the wire
REQUIRED_METHOD_PATHS = {
    "/v1beta1.Registration/Register",
    "/v1beta1.DevicePlugin/GetDevicePluginOptions",
    "/v1beta1.DevicePlugin/ListAndWatch",
    "/v1beta1.DevicePlugin/GetPreferredAllocation",
    "/v1beta1.DevicePlugin/Allocate",
    "/v1beta1.DevicePlugin/PreStartContainer",
    "/pluginregistration.Registration/GetInfo",
    "/pluginregistration.Registration/NotifyRegistrationStatus",
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
    "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
    "/v1.PodResourcesLister/List",
    "/v1.PodResourcesLister/GetAllocatableResources",
    "/v1.PodResourcesLister/Get",
    "/v0.Registration/RegisterDiscoveryHandler",
    "/v0.DiscoveryHandler/Discover",
    "/v1alpha1.DRAResourceHealth/NodeWatchResources",
    "/v1beta1.DRAResourceHealth/NodeWatchResources",
    "/v1.DRAResourceHealth/NodeWatchResources",
}

SERVER_STREAMING = {
    "/v1beta1.DevicePlugin/ListAndWatch",
    "/v0.DiscoveryHandler/Discover",
    "/v1alpha1.DRAResourceHealth/NodeWatchResources",
    "/v1beta1.DRAResourceHealth/NodeWatchResources",
    "/v1.DRAResourceHealth/NodeWatchResources",
}


def _grpc_module(pb2_name: str) -> str:
    return pb2_name + "_grpc"


def _load(name: str) -> ModuleType:
    return importlib.import_module(name)


# --------------------------------------------------------------------------- staleness


def _generated_files(root: Path) -> set[Path]:
    return {
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpc_tools (grpcio-tools) is not installed; cannot regenerate stubs")
    out = tmp_path / "protos_out"
    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--out", str(out)],
        cwd=tmp_path,  # the output must not depend on the working directory
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"gen_protos.py failed:\n{result.stdout}{result.stderr}"

    fresh, committed = _generated_files(out), _generated_files(STUB_DIR)
    assert fresh, "gen_protos.py generated nothing"
    missing = sorted(str(p) for p in fresh - committed)
    extra = sorted(str(p) for p in committed - fresh)
    changed = sorted(
        str(p) for p in fresh & committed if (out / p).read_bytes() != (STUB_DIR / p).read_bytes()
    )
    problems = []
    if missing:
        problems.append(f"missing from agent/protos: {missing}")
    if extra:
        problems.append(f"not generated from protos/ any more: {extra}")
    if changed:
        problems.append(f"differ from a fresh generation: {changed}")
    assert not problems, (
        "generated stubs in agent/protos are stale; " + "; ".join(problems) + f"\n{REGENERATE_HINT}"
    )


def test_every_stub_directory_is_a_package() -> None:
    for rel in _generated_files(STUB_DIR):
        d = (STUB_DIR / rel).parent
        while True:
            assert (d / "__init__.py").is_file(), f"{d} lacks __init__.py; {REGENERATE_HINT}"
            if d == STUB_DIR:
                break
            d = d.parent


def test_every_proto_has_committed_stubs() -> None:
    protos = sorted(
        p.relative_to(REPO_ROOT / "protos") for p in (REPO_ROOT / "protos").rglob("*.proto")
    )
    assert {p.as_posix() for p in protos} == set(PROTO_MODULES.values())
    for proto in protos:
        base = STUB_DIR / proto.with_suffix("")
        for suffix in GENERATED_SUFFIXES:
            path = base.parent / (base.name + suffix)
            assert path.is_file(), f"{path} missing; {REGENERATE_HINT}"


# --------------------------------------------------------------------------- imports, services


@pytest.mark.parametrize("name", sorted(PROTO_MODULES))
def test_modules_import(name: str) -> None:
    pb2 = _load(name)
    grpc_mod = _load(_grpc_module(name))
    assert pb2.DESCRIPTOR.name == PROTO_MODULES[name]
    # message classes report their real import path (pickling, reprs)
    first_message = next(iter(pb2.DESCRIPTOR.message_types_by_name))
    assert getattr(pb2, first_message).__module__ == name
    assert grpc_mod.__name__ == _grpc_module(name)


@pytest.mark.parametrize("name", sorted(EXPECTED_SERVICES))
def test_service_descriptors(name: str) -> None:
    pb2 = _load(name)
    grpc_mod = _load(_grpc_module(name))
    services = pb2.DESCRIPTOR.services_by_name
    expected = EXPECTED_SERVICES[name]
    assert {s.full_name for s in services.values()} == set(expected)
    for full_name, methods in expected.items():
        short = full_name.rsplit(".", 1)[1]
        service = services[short]
        assert service.full_name == full_name
        assert [m.name for m in service.methods] == methods
        # generated stub/servicer/registration helpers exist for every service
        assert hasattr(grpc_mod, f"{short}Stub")
        assert hasattr(grpc_mod, f"{short}Servicer")
        assert hasattr(grpc_mod, f"add_{short}Servicer_to_server")


def test_full_method_paths() -> None:
    paths: dict[str, Any] = {}
    for name in EXPECTED_SERVICES:
        for service in _load(name).DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                paths[f"/{service.full_name}/{method.name}"] = method
    assert set(paths) == REQUIRED_METHOD_PATHS
    for path, method in paths.items():
        assert method.server_streaming == (path in SERVER_STREAMING), path
        assert not method.client_streaming, path


# --------------------------------------------------------------------------- wire format


def _field(module: str, message: str, field: str) -> FieldDescriptor:
    desc = _load(module).DESCRIPTOR.message_types_by_name
    parts = message.split(".")
    msg = desc[parts[0]]
    for nested in parts[1:]:
        msg = msg.nested_types_by_name[nested]
    result: FieldDescriptor = msg.fields_by_name[field]
    return result


DP = "agent.protos.deviceplugin.v1beta1.api_pb2"
REG = "agent.protos.pluginregistration.v1.api_pb2"
DRA1 = "agent.protos.dra.v1.api_pb2"
DRA1B = "agent.protos.dra.v1beta1.api_pb2"
POD = "agent.protos.podresources.v1.api_pb2"
AKRI = "agent.protos.akri.discovery.v0.discovery_pb2"


@pytest.mark.parametrize(
    ("module", "message", "field", "number"),
    [
        (DP, "RegisterRequest", "version", 1),
        (DP, "RegisterRequest", "endpoint", 2),
        (DP, "RegisterRequest", "resource_name", 3),
        (DP, "RegisterRequest", "options", 4),
        (DP, "DevicePluginOptions", "get_preferred_allocation_available", 2),
        (DP, "Device", "ID", 1),
        (DP, "Device", "health", 2),
        (DP, "Device", "topology", 3),
        (DP, "NUMANode", "ID", 1),
        (DP, "ContainerPreferredAllocationRequest", "available_deviceIDs", 1),
        (DP, "ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2),
        (DP, "ContainerPreferredAllocationRequest", "allocation_size", 3),
        (DP, "ContainerPreferredAllocationResponse", "deviceIDs", 1),
        (DP, "ContainerAllocateRequest", "devices_ids", 1),
        (DP, "ContainerAllocateResponse", "envs", 1),
        (DP, "ContainerAllocateResponse", "mounts", 2),
        (DP, "ContainerAllocateResponse", "devices", 3),
        (DP, "ContainerAllocateResponse", "annotations", 4),
        (DP, "ContainerAllocateResponse", "cdi_devices", 5),
        (DP, "DeviceSpec", "permissions", 3),
        (DP, "Mount", "read_only", 3),
        (REG, "PluginInfo", "type", 1),
        (REG, "PluginInfo", "supported_versions", 4),
        (REG, "RegistrationStatus", "plugin_registered", 1),
        (REG, "RegistrationStatus", "error", 2),
        (DRA1, "Device", "request_names", 1),
        (DRA1, "Device", "pool_name", 2),
        (DRA1, "Device", "device_name", 3),
        (DRA1, "Device", "cdi_device_ids", 4),
        (DRA1, "Device", "share_id", 5),
        (DRA1, "Claim", "uid", 2),
        (DRA1, "NodePrepareResourceResponse", "error", 2),
        (DRA1B, "Device", "cdi_device_ids", 4),
        (POD, "DynamicResource", "claim_name", 2),
        (POD, "DynamicResource", "claim_namespace", 3),
        (POD, "DynamicResource", "claim_resources", 4),
        (POD, "ClaimResource", "cdi_devices", 1),
        (POD, "ClaimResource", "driver_name", 2),
        (POD, "ClaimResource", "device_name", 4),
        (POD, "ClaimResource", "share_id", 5),
        (POD, "ContainerResources", "dynamic_resources", 5),
        (POD, "ContainerDevices", "device_ids", 2),
        (POD, "PodResources", "memory", 5),
        (POD, "GetPodResourcesRequest", "pod_namespace", 2),
        (AKRI, "RegisterDiscoveryHandlerRequest", "endpoint_type", 3),
        (AKRI, "RegisterDiscoveryHandlerRequest", "shared", 4),
        (AKRI, "ByteData", "vec", 1),
        (AKRI, "DiscoverRequest", "discovery_properties", 2),
        (AKRI, "Device", "device_specs", 4),
    ],
)
def test_field_numbers(module: str, message: str, field: str, number: int) -> None:
    assert _field(module, message, field).number == number


def test_field_presence_and_types() -> None:
    share_id = _field(DRA1, "Device", "share_id")
    assert share_id.has_presence
    assert share_id.type == FieldDescriptor.TYPE_STRING
    assert "share_id" not in _load(DRA1B).Device.DESCRIPTOR.fields_by_name
    assert _field(POD, "ClaimResource", "share_id").has_presence
    assert "class_name" not in _load(POD).DynamicResource.DESCRIPTOR.fields_by_name
    vec = _field(AKRI, "ByteData", "vec")
    assert vec.has_presence
    assert vec.type == FieldDescriptor.TYPE_BYTES
    assert not _field(DRA1, "Device", "pool_name").has_presence
    envs_entry = _field(DP, "ContainerAllocateResponse", "envs").message_type
    assert envs_entry is not None and envs_entry.GetOptions().map_entry

    akri = _load(AKRI)
    enum = akri.RegisterDiscoveryHandlerRequest.DESCRIPTOR.enum_types_by_name["EndpointType"]
    assert {v.name: v.number for v in enum.values} == {"UDS": 0, "NETWORK": 1}
    assert akri.RegisterDiscoveryHandlerRequest.NETWORK == 1

    # presence is observable in Python: unset vs explicitly empty
    bd = akri.ByteData()
    assert not bd.HasField("vec")
    bd.vec = b""
    assert bd.HasField("vec")
    dev = _load(DRA1).Device(pool_name="p", device_name="d")
    assert not dev.HasField("share_id")


def test_wire_bytes_match_hand_encoding() -> None:
    dp = _load(DP)
    resp = dp.ContainerAllocateResponse(cdi_devices=[dp.CDIDevice(name="a/b=c")])
    # field 5, wire type 2 -> tag 0x2a; nested CDIDevice field 1 -> tag 0x0a
    assert resp.SerializeToString() == b"\x2a\x07\x0a\x05a/b=c"
    dra = _load(DRA1)
    assert dra.Device(share_id="").SerializeToString() == b"\x2a\x00"
    pod = _load(POD)
    assert pod.DynamicResource(claim_name="x").SerializeToString() == b"\x12\x01x"


def test_all_files_load_into_default_pool() -> None:
    for name in PROTO_MODULES:
        _load(name)
        _load(_grpc_module(name))
    pool = descriptor_pool.Default()
    for name, file_name in PROTO_MODULES.items():
        fd = pool.FindFileByName(file_name)
        assert fd is _load(name).DESCRIPTOR or fd.name == file_name
    assert len(set(PROTO_MODULES.values())) == len(PROTO_MODULES)
    # same-named messages in different packages stay distinct
    assert pool.FindMessageTypeByName("v1beta1.Mount") is not pool.FindMessageTypeByName("v0.Mount")
    assert pool.FindMessageTypeByName("v1.TopologyInfo").full_name == "v1.TopologyInfo"
    assert (
        pool.FindMessageTypeByName("k8s.io.kubelet.pkg.apis.dra.v1.Device").file.name
        == "dra/v1/api.proto"
    )


def test_all_modules_import_in_a_fresh_interpreter() -> None:
    code = (
        "; ".join(f"import {m}, {_grpc_module(m)}" for m in sorted(PROTO_MODULES)) + "; print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# --------------------------------------------------------------------------- round trips


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # short path: AF_UNIX socket paths are limited to ~108 bytes
    with tempfile.TemporaryDirectory(prefix="pt-") as d:
        yield Path(d)


async def test_device_plugin_round_trip(sock_dir: Path) -> None:
    dp = _load(DP)
    dp_grpc = _load(_grpc_module(DP))
    sock = sock_dir / "dp.sock"
    servicer_base: Any = dp_grpc.DevicePluginServicer

    class Plugin(servicer_base):  # type: ignore[misc]
        async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
            return dp.DevicePluginOptions(pre_start_required=False)

        async def ListAndWatch(self, request: Any, context: Any) -> AsyncIterator[Any]:
            yield dp.ListAndWatchResponse(devices=[dp.Device(ID="slot-0", health="Healthy")])
            yield dp.ListAndWatchResponse(
                devices=[
                    dp.Device(ID="slot-0", health="Healthy"),
                    dp.Device(
                        ID="slot-1",
                        health="Unhealthy",
                        topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=1)]),
                    ),
                ]
            )

        async def Allocate(self, request: Any, context: Any) -> Any:
            responses = []
            for creq in request.container_requests:
                responses.append(
                    dp.ContainerAllocateResponse(
                        envs={"SLOTS": ",".join(creq.devices_ids)},
                        mounts=[dp.Mount(container_path="/c", host_path="/h", read_only=True)],
                        devices=[
                            dp.DeviceSpec(
                                container_path="/dev/x", host_path="/dev/x", permissions="rw"
                            )
                        ],
                        annotations={"a": "b"},
                        cdi_devices=[dp.CDIDevice(name="akri.sh/x=slot-0")],
                    )
                )
            return dp.AllocateResponse(container_responses=responses)

    server = grpc.aio.server()
    dp_grpc.add_DevicePluginServicer_to_server(Plugin(), server)
    assert server.add_insecure_port(f"unix:{sock}") != 0
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
            stub = dp_grpc.DevicePluginStub(channel)
            opts = await stub.GetDevicePluginOptions(dp.Empty(), timeout=10)
            assert not opts.pre_start_required

            updates = [msg async for msg in stub.ListAndWatch(dp.Empty(), timeout=10)]
            assert [[d.ID for d in u.devices] for u in updates] == [
                ["slot-0"],
                ["slot-0", "slot-1"],
            ]
            assert updates[1].devices[1].health == "Unhealthy"
            assert updates[1].devices[1].topology.nodes[0].ID == 1

            resp = await stub.Allocate(
                dp.AllocateRequest(
                    container_requests=[dp.ContainerAllocateRequest(devices_ids=["slot-0"])]
                ),
                timeout=10,
            )
            (c,) = resp.container_responses
            assert dict(c.envs) == {"SLOTS": "slot-0"}
            assert c.mounts[0].read_only and c.devices[0].permissions == "rw"
            assert dict(c.annotations) == {"a": "b"}
            assert [d.name for d in c.cdi_devices] == ["akri.sh/x=slot-0"]

            # unimplemented methods answer UNIMPLEMENTED through the generated servicer
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PreStartContainer(dp.PreStartContainerRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)


async def test_discovery_handler_round_trip(sock_dir: Path) -> None:
    akri = _load(AKRI)
    akri_grpc = _load(_grpc_module(AKRI))
    sock = sock_dir / "dh.sock"
    seen: list[Any] = []
    handler_base: Any = akri_grpc.DiscoveryHandlerServicer
    registrar_base: Any = akri_grpc.RegistrationServicer

    class Handler(handler_base):  # type: ignore[misc]
        async def Discover(self, request: Any, context: Any) -> AsyncIterator[Any]:
            seen.append(request)
            yield akri.DiscoverResponse(devices=[])
            yield akri.DiscoverResponse(
                devices=[
                    akri.Device(
                        id="dev-1",
                        properties={"DEBUG_ECHO_DESCRIPTION": "foo"},
                        mounts=[akri.Mount(container_path="/m", host_path="/h")],
                        device_specs=[
                            akri.DeviceSpec(
                                container_path="/dev/v", host_path="/dev/v", permissions="rwm"
                            )
                        ],
                    )
                ]
            )

    class Registrar(registrar_base):  # type: ignore[misc]
        async def RegisterDiscoveryHandler(self, request: Any, context: Any) -> Any:
            seen.append(request)
            return akri.Empty()

    server = grpc.aio.server()
    akri_grpc.add_DiscoveryHandlerServicer_to_server(Handler(), server)
    akri_grpc.add_RegistrationServicer_to_server(Registrar(), server)
    assert server.add_insecure_port(f"unix:{sock}") != 0
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
            await akri_grpc.RegistrationStub(channel).RegisterDiscoveryHandler(
                akri.RegisterDiscoveryHandlerRequest(
                    name="debugEcho",
                    endpoint=str(sock),
                    endpoint_type=akri.RegisterDiscoveryHandlerRequest.UDS,
                    shared=True,
                ),
                timeout=10,
            )
            stub = akri_grpc.DiscoveryHandlerStub(channel)
            request = akri.DiscoverRequest(
                discovery_details="descriptions: [foo]",
                discovery_properties={"k": akri.ByteData(vec=b"v"), "unset": akri.ByteData()},
            )
            responses = [r async for r in stub.Discover(request, timeout=10)]
    finally:
        await server.stop(None)

    assert [len(r.devices) for r in responses] == [0, 1]
    dev = responses[1].devices[0]
    assert dev.id == "dev-1"
    assert dict(dev.properties) == {"DEBUG_ECHO_DESCRIPTION": "foo"}
    assert dev.mounts[0].host_path == "/h" and dev.device_specs[0].permissions == "rwm"

    reg, disc = seen
    assert reg.name == "debugEcho" and reg.shared and reg.endpoint_type == 0
    assert disc.discovery_details == "descriptions: [foo]"
    assert disc.discovery_properties["k"].vec == b"v"
    assert disc.discovery_properties["k"].HasField("vec")
    assert not disc.discovery_properties["unset"].HasField("vec")
