"""Tests of the DRA test doubles: the kubelet/plugin-watcher double (against a tiny fake DRA
plugin over real unix-socket gRPC), the scheduler emulator and the CDI spec validator."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.protos.dra.v1 import api_pb2 as dra_v1
from agent.protos.dra.v1 import api_pb2_grpc as dra_v1_grpc
from agent.protos.dra.v1beta1 import api_pb2 as dra_v1beta1
from agent.protos.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from agent.protos.pluginregistration.v1 import api_pb2 as reg
from agent.protos.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.cdi_validate import (
    qualified_device_name_ok,
    validate_cdi_file,
    validate_cdi_spec,
)
from tests.doubles.dra_kubelet import DRA_V1, DRA_V1BETA1, DraKubeletDouble, PrepareError
from tests.doubles.dra_scheduler import (
    AllocationError,
    all_of,
    allocate_claim,
    cel_like,
    create_claim,
    release_claim,
    resource_slice,
)

DRIVER = "akri.sh"
CLAIMS = "resourceclaims.resource.k8s.io"
SLICES = "resourceslices.resource.k8s.io"


# --------------------------------------------------------------------------------------------
# A tiny fake DRA plugin
# --------------------------------------------------------------------------------------------


class FakeDraPlugin:
    """Serves ``pluginregistration.Registration`` on ``<registry>/<name>-reg.sock`` and the
    DRA services (v1 and v1beta1) on ``<base>/plugins/<name>/dra.sock`` (or on the
    registration socket when ``empty_endpoint``). Records every call in ``log``."""

    def __init__(
        self,
        base: Path,
        driver: str = DRIVER,
        *,
        socket_name: str | None = None,
        versions: Sequence[str] = (DRA_V1, DRA_V1BETA1),
        plugin_type: str = "DRAPlugin",
        empty_endpoint: bool = False,
    ) -> None:
        self.driver = driver
        self.registry_socket = base / "registry" / f"{socket_name or driver}-reg.sock"
        self.dra_socket = (
            self.registry_socket if empty_endpoint else base / "plugins" / driver / "dra.sock"
        )
        self.versions = list(versions)
        self.plugin_type = plugin_type
        self.empty_endpoint = empty_endpoint
        self.log: list[str] = []
        self.notifications: list[tuple[bool, str]] = []
        self.prepares: list[tuple[str, list[str]]] = []  # (service, claim uids)
        self.unprepares: list[tuple[str, list[str]]] = []
        self.omit: set[str] = set()  # claim uids left out of prepare answers
        self.claim_errors: dict[str, str] = {}
        self._servers: list[grpc.aio.Server] = []

    def prepare_answer(self, messages: Any, claims: Sequence[Any]) -> Any:
        response = messages.NodePrepareResourcesResponse()
        for claim in claims:
            if claim.uid in self.omit:
                continue
            entry = response.claims[claim.uid]
            if claim.uid in self.claim_errors:
                entry.error = self.claim_errors[claim.uid]
                continue
            entry.devices.add(
                request_names=["req"],
                pool_name="node-a",
                device_name=f"dev-{claim.name}",
                cdi_device_ids=[f"k8s.{self.driver}/dev={claim.uid}-dev"],
            )
        return response

    async def start(self) -> None:
        plugin = self

        class Registration(reg_grpc.RegistrationServicer):
            async def GetInfo(self, request: Any, context: Any) -> Any:
                plugin.log.append("GetInfo")
                return reg.PluginInfo(
                    type=plugin.plugin_type,
                    name=plugin.driver,
                    endpoint="" if plugin.empty_endpoint else str(plugin.dra_socket),
                    supported_versions=plugin.versions,
                )

            async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
                plugin.log.append(f"Notify({request.plugin_registered})")
                plugin.notifications.append((request.plugin_registered, request.error))
                return reg.RegistrationStatusResponse()

        def dra_servicer(base: Any, messages: Any, service: str) -> Any:
            class Servicer(base):  # type: ignore[misc]
                async def NodePrepareResources(self, request: Any, context: Any) -> Any:
                    plugin.log.append(f"Prepare({service})")
                    plugin.prepares.append((service, [c.uid for c in request.claims]))
                    return plugin.prepare_answer(messages, request.claims)

                async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
                    plugin.log.append(f"Unprepare({service})")
                    plugin.unprepares.append((service, [c.uid for c in request.claims]))
                    response = messages.NodeUnprepareResourcesResponse()
                    for claim in request.claims:
                        response.claims[claim.uid].error = ""
                    return response

            return Servicer()

        def add_dra(server: grpc.aio.Server) -> None:
            dra_v1_grpc.add_DRAPluginServicer_to_server(
                dra_servicer(dra_v1_grpc.DRAPluginServicer, dra_v1, "v1"), server
            )
            dra_v1beta1_grpc.add_DRAPluginServicer_to_server(
                dra_servicer(dra_v1beta1_grpc.DRAPluginServicer, dra_v1beta1, "v1beta1"), server
            )

        # The DRA socket first, so the plugin is usable when the kubelet sees the registration.
        if not self.empty_endpoint:
            self.dra_socket.parent.mkdir(parents=True, exist_ok=True)
            dra_server = grpc.aio.server()
            add_dra(dra_server)
            dra_server.add_insecure_port(f"unix://{self.dra_socket}")
            await dra_server.start()
            self._servers.append(dra_server)
        self.registry_socket.parent.mkdir(parents=True, exist_ok=True)
        reg_server = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(Registration(), reg_server)
        if self.empty_endpoint:
            add_dra(reg_server)
        reg_server.add_insecure_port(f"unix://{self.registry_socket}")
        await reg_server.start()
        self._servers.append(reg_server)

    async def stop(self) -> None:
        for server in self._servers:
            await server.stop(0)
        self._servers.clear()
        for path in (self.registry_socket, self.dra_socket):
            path.unlink(missing_ok=True)


@pytest.fixture
def base() -> Iterator[Path]:
    # Short paths: unix socket paths must stay below 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def plugin(base: Path) -> AsyncIterator[FakeDraPlugin]:
    fake = FakeDraPlugin(base)
    await fake.start()
    yield fake
    await fake.stop()


def claim_ref(
    name: str, uid: str | None = None, namespace: str = "default"
) -> tuple[str, str, str]:
    return (namespace, uid or f"uid-{name}", name)


MARKER = "marker.example.com"


async def watcher_caught_up(kubelet: DraKubeletDouble, base: Path) -> None:
    """Proof that the plugin watcher has completed whole passes over the registry since this
    call (instead of sleeping and hoping it did): a marker plugin appears and is registered
    in one pass, vanishes and is deregistered in a later one. Passes run one after another,
    so every registration attempt of the earlier pass (all sockets then present) is done."""
    marker = FakeDraPlugin(base, MARKER)
    await marker.start()
    try:
        await kubelet.wait_for_registration(MARKER)
    finally:
        await marker.stop()
    await kubelet.wait_for_deregistration(MARKER)


# --------------------------------------------------------------------------------------------
# Plugin watcher
# --------------------------------------------------------------------------------------------


async def test_registration_sequence_and_endpoint(base: Path, plugin: FakeDraPlugin) -> None:
    async with DraKubeletDouble(base / "registry", "node-a") as kubelet:
        registration = await kubelet.wait_for_registration(DRIVER)
        assert plugin.log == ["GetInfo", "Notify(True)"]
        assert plugin.notifications == [(True, "")]
        assert registration.service == DRA_V1
        assert registration.endpoint == str(plugin.dra_socket)
        assert registration.socket == plugin.registry_socket
        assert registration.supported_versions == (DRA_V1, DRA_V1BETA1)
        await watcher_caught_up(kubelet, base)
        assert plugin.log == ["GetInfo", "Notify(True)"]  # no re-registration: socket stayed


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        ((DRA_V1BETA1, DRA_V1), DRA_V1BETA1),
        (("v1alpha4.DRAPlugin", "v1.DRAResourceHealth", DRA_V1, DRA_V1BETA1), DRA_V1),
        (("v9.DRAPlugin", DRA_V1BETA1), DRA_V1BETA1),
    ],
)
async def test_first_supported_version_in_plugin_order(
    base: Path, versions: tuple[str, ...], expected: str
) -> None:
    fake = FakeDraPlugin(base, versions=versions)
    await fake.start()
    try:
        async with DraKubeletDouble(base / "registry", "node-a") as kubelet:
            assert (await kubelet.wait_for_registration(DRIVER)).service == expected
            ref = claim_ref("c1")
            await kubelet.prepare("pod-1", [ref])
            assert fake.prepares == [(expected.split(".")[0], [ref[1]])]
    finally:
        await fake.stop()


@pytest.mark.parametrize(
    ("versions", "plugin_type", "error_part"),
    [
        (("v9.DRAPlugin", "v1alpha4.DRAPlugin"), "DRAPlugin", "none of the services"),
        ((), "DRAPlugin", "empty list of supported versions"),
        ((DRA_V1,), "CSIPlugin", "no handler registered for plugin type: CSIPlugin"),
    ],
)
async def test_invalid_plugin_gets_registration_false(
    base: Path, versions: tuple[str, ...], plugin_type: str, error_part: str
) -> None:
    fake = FakeDraPlugin(base, versions=versions, plugin_type=plugin_type)
    await fake.start()
    try:
        async with DraKubeletDouble(base / "registry", "node-a", initial_backoff=0.2) as kubelet:
            attempts = await kubelet.wait_for_attempts(fake.registry_socket, count=2)
            assert kubelet.registration(DRIVER) is None
            assert fake.notifications[0][0] is False
            assert error_part in fake.notifications[0][1]
            assert not attempts[0].registered and attempts[0].notified
            # Retried from scratch, like the kubelet's reconciler.
            assert fake.log[:4] == ["GetInfo", "Notify(False)", "GetInfo", "Notify(False)"]
    finally:
        await fake.stop()


async def test_empty_endpoint_uses_registration_socket(base: Path) -> None:
    fake = FakeDraPlugin(base, empty_endpoint=True)
    await fake.start()
    try:
        async with DraKubeletDouble(base / "registry", "node-a") as kubelet:
            registration = await kubelet.wait_for_registration(DRIVER)
            assert registration.endpoint == str(fake.registry_socket)
            await kubelet.prepare("pod-1", [claim_ref("c1")])
            assert fake.prepares == [("v1", ["uid-c1"])]
    finally:
        await fake.stop()


async def test_dot_sockets_ignored_and_late_sockets_found(base: Path) -> None:
    hidden = FakeDraPlugin(base, "hidden.example.com", socket_name=".hidden")
    await hidden.start()
    late = FakeDraPlugin(base, "late.example.com")
    try:
        async with DraKubeletDouble(base / "registry", "node-a") as kubelet:
            await late.start()
            await kubelet.wait_for_registration("late.example.com", timeout=3)
            await watcher_caught_up(kubelet, base)
            assert hidden.log == []
            assert kubelet.drivers() == ["late.example.com"]
    finally:
        await hidden.stop()
        await late.stop()


async def test_socket_removal_deregisters_and_wipes_after_delay(base: Path) -> None:
    api = ApiServerDouble()
    api.create(resource_slice("a-1", pool="node-a", devices=["d0"], node_name="node-a"))
    api.create(resource_slice("b-1", pool="node-b", devices=["d0"], node_name="node-b"))
    api.create(
        resource_slice("a-other", pool="node-a", devices=["d0"], node_name="node-a", driver="x.io")
    )
    fake = FakeDraPlugin(base)
    await fake.start()
    async with DraKubeletDouble(base / "registry", "node-a", api, wipe_delay=0.3) as kubelet:
        await kubelet.wait_for_registration(DRIVER)
        await fake.stop()
        await kubelet.wait_for_deregistration(DRIVER, timeout=2)
        assert [d.driver for d in kubelet.deregistrations] == [DRIVER]
        assert api.get(SLICES, "a-1") is not None  # not before the wiping delay
        await kubelet.wait_for(lambda: api.get(SLICES, "a-1") is None, timeout=3)
        assert api.get(SLICES, "b-1") is not None  # other node
        assert api.get(SLICES, "a-other") is not None  # other driver


async def test_reregistration_within_wipe_delay_keeps_slices(base: Path) -> None:
    api = ApiServerDouble()
    api.create(resource_slice("a-1", pool="node-a", devices=["d0"], node_name="node-a"))
    fake = FakeDraPlugin(base)
    await fake.start()
    # a wipe delay a loaded machine re-registers well within (the old 0.5 s plus a sleep of
    # 0.7 s failed whenever the re-registration itself took longer than 0.5 s)
    async with DraKubeletDouble(base / "registry", "node-a", api, wipe_delay=2.0) as kubelet:
        await kubelet.wait_for_registration(DRIVER)
        await fake.stop()
        await kubelet.wait_for_deregistration(DRIVER, timeout=2)
        await fake.start()
        await kubelet.wait_for_registration(DRIVER, timeout=2)
        # a marker driver deregistered after ours has its wipe run: ours was due earlier
        await watcher_caught_up(kubelet, base)
        await kubelet.wait_for(
            lambda: any(driver == MARKER for driver, _names in kubelet.wiped),
            timeout=10,
            what="the marker's wipe",
        )
        assert [driver for driver, _names in kubelet.wiped] == [MARKER]
        assert api.get(SLICES, "a-1") is not None
    await fake.stop()


# --------------------------------------------------------------------------------------------
# DRA manager: prepare / unprepare
# --------------------------------------------------------------------------------------------


async def test_shared_claim_prepared_once_unprepared_after_last_pod(
    base: Path, plugin: FakeDraPlugin
) -> None:
    shared, own = claim_ref("shared"), claim_ref("own")
    async with DraKubeletDouble(base / "registry", "node-a") as kubelet:
        await kubelet.wait_for_registration(DRIVER)
        first = await kubelet.prepare("pod-1", [shared, own])
        assert plugin.prepares == [("v1", [shared[1], own[1]])]  # one call for the pod's claims
        assert first[shared[1]].devices[0].device_name == "dev-shared"
        second = await kubelet.prepare("pod-2", [shared])
        assert len(plugin.prepares) == 1  # already prepared on this node
        assert second[shared[1]] == first[shared[1]]
        # Concurrent pod starts sharing a new claim: still one call for it.
        other = claim_ref("other")
        await asyncio.gather(kubelet.prepare("pod-3", [other]), kubelet.prepare("pod-4", [other]))
        assert plugin.prepares[1:] == [("v1", [other[1]])]
        await kubelet.remove_pod("pod-3")
        await kubelet.remove_pod("pod-4")
        assert plugin.unprepares == [("v1", [other[1]])]
        plugin.unprepares.clear()
        assert kubelet.prepared == {shared[1], own[1]}

        released = await kubelet.remove_pod("pod-1")
        assert plugin.unprepares == [("v1", [own[1]])]
        assert set(released) == {own[1]}
        assert await kubelet.unprepare([shared]) == {}  # pod-2 still references it
        assert len(plugin.unprepares) == 1

        await kubelet.remove_pod("pod-2")
        assert plugin.unprepares == [("v1", [own[1]]), ("v1", [shared[1]])]
        assert kubelet.prepared == set()
        assert kubelet.pods == {}


async def test_missing_or_failed_claim_entries_fail_prepare(
    base: Path, plugin: FakeDraPlugin
) -> None:
    good, left_out, failing = claim_ref("good"), claim_ref("left-out"), claim_ref("failing")
    plugin.omit.add(left_out[1])
    plugin.claim_errors[failing[1]] = "device busy"
    async with DraKubeletDouble(base / "registry", "node-a") as kubelet:
        await kubelet.wait_for_registration(DRIVER)
        with pytest.raises(PrepareError) as info:
            await kubelet.prepare("pod-1", [good, left_out, failing])
        message = str(info.value)
        assert "left out 1 claims" in message and left_out[1] in message
        assert "failed for claim default/failing: device busy" in message
        assert kubelet.prepared == {good[1]}
        # The pod start is retried: only the unprepared claims are sent again.
        plugin.omit.clear()
        plugin.claim_errors.clear()
        await kubelet.prepare("pod-1", [good, left_out, failing])
        assert plugin.prepares[-1] == ("v1", [left_out[1], failing[1]])
        assert kubelet.prepared == {good[1], left_out[1], failing[1]}


async def test_v1beta1_service_explicitly(base: Path, plugin: FakeDraPlugin) -> None:
    ref = claim_ref("c1")
    async with DraKubeletDouble(base / "registry", "node-a") as kubelet:
        await kubelet.wait_for_registration(DRIVER)
        result = await kubelet.prepare_v1beta1("pod-1", [ref])
        assert isinstance(result[ref[1]], dra_v1beta1.NodePrepareResourceResponse)
        assert plugin.prepares == [("v1beta1", [ref[1]])]
        await kubelet.remove_pod("pod-1", service=DRA_V1BETA1)
        assert plugin.unprepares == [("v1beta1", [ref[1]])]
        raw = await kubelet.node_prepare_resources([ref], service=DRA_V1BETA1)
        assert list(raw.claims) == [ref[1]]
        assert kubelet.prepared == set()  # raw calls do no bookkeeping


async def test_restart_wipes_only_this_nodes_slices_and_keeps_checkpoint(
    base: Path, plugin: FakeDraPlugin
) -> None:
    api = ApiServerDouble()
    api.create(resource_slice("a-1", pool="node-a", devices=["d0"], node_name="node-a"))
    api.create(
        resource_slice("a-2", pool="node-a", devices=["d1"], node_name="node-a", driver="x.io")
    )
    api.create(resource_slice("b-1", pool="node-b", devices=["d0"], node_name="node-b"))
    api.create(resource_slice("all", pool="shared", devices=["d0"], all_nodes=True))
    ref = claim_ref("c1")
    async with DraKubeletDouble(base / "registry", "node-a", api, check_reserved_for=False) as k:
        await k.wait_for_registration(DRIVER)
        await k.prepare("pod-1", [ref], driver=DRIVER)
        assert len(plugin.prepares) == 1
        await k.restart()
        assert api.get(SLICES, "a-1") is None and api.get(SLICES, "a-2") is None
        assert api.get(SLICES, "b-1") is not None and api.get(SLICES, "all") is not None
        # The socket was not wiped: the plugin is registered again by the re-scan.
        await k.wait_for_registration(DRIVER)
        assert plugin.log[-2:] == ["GetInfo", "Notify(True)"]
        assert plugin.notifications == [(True, ""), (True, "")]
        # The checkpoint survived: no second prepare for the claim.
        assert k.prepared == {ref[1]}
        await k.prepare("pod-2", [ref], driver=DRIVER)
        assert len(plugin.prepares) == 1
        assert set(k.pods) == {"pod-1", "pod-2"}


async def test_prepare_with_api_checks_claim_and_uses_allocation_driver(
    base: Path, plugin: FakeDraPlugin
) -> None:
    api = ApiServerDouble()
    api.create(resource_slice("s1", pool="node-a", devices=["d0", "d1"], node_name="node-a"))
    claim = create_claim(api, "default", "c1")
    ref = ("default", claim["metadata"]["uid"], "c1")
    async with DraKubeletDouble(base / "registry", "node-a", api) as kubelet:
        await kubelet.wait_for_registration(DRIVER)
        with pytest.raises(PrepareError, match="not allocated"):
            await kubelet.prepare("pod-1", [ref])
        allocate_claim(api, "default", "c1", "node-a", pod_name="p1", pod_uid="pod-1")
        with pytest.raises(PrepareError, match="not allowed to use"):
            await kubelet.prepare("pod-2", [ref])
        with pytest.raises(PrepareError, match="does not match"):
            await kubelet.prepare("pod-1", [("default", "other-uid", "c1")])
        with pytest.raises(PrepareError, match="not found"):
            await kubelet.prepare("pod-1", [("default", "x", "missing")])
        assert plugin.prepares == []
        result = await kubelet.prepare("pod-1", [ref])
        assert plugin.prepares == [("v1", [ref[1]])]
        assert result[ref[1]].devices[0].pool_name == "node-a"


# --------------------------------------------------------------------------------------------
# Scheduler emulator
# --------------------------------------------------------------------------------------------


def results(claim: dict[str, Any]) -> list[tuple[str, str]]:
    return [(r["pool"], r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]]


def test_allocation_writes_status_with_first_fit_in_slice_name_order() -> None:
    api = ApiServerDouble()
    api.create(
        resource_slice("s-b", pool="node-a", devices=["b0"], slice_count=2, node_name="node-a")
    )
    api.create(
        resource_slice(
            "s-a", pool="node-a", devices=["a0", "a1"], slice_count=2, node_name="node-a"
        )
    )
    create_claim(api, "ns1", "c1", count=2)
    claim = allocate_claim(api, "ns1", "c1", "node-a", pod_name="p1", pod_uid="u1")
    assert results(claim) == [("node-a", "a0"), ("node-a", "a1")]
    stored = api.get(CLAIMS, "c1", "ns1")
    assert stored is not None
    allocation = stored["status"]["allocation"]
    assert allocation["devices"]["results"][0] == {
        "request": "req",
        "driver": DRIVER,
        "pool": "node-a",
        "device": "a0",
    }
    assert allocation["nodeSelector"] == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
        ]
    }
    assert stored["status"]["reservedFor"] == [{"resource": "pods", "name": "p1", "uid": "u1"}]
    assert stored["spec"]["devices"]["requests"][0]["exactly"] == {
        "deviceClassName": DRIVER,
        "allocationMode": "ExactCount",
        "count": 2,
    }
    # Slice-name order across pools too: pool "z" has the lowest slice name.
    api.create(resource_slice("0-first", pool="z", devices=["z0"], node_name="node-a"))
    create_claim(api, "ns1", "c2")
    assert results(allocate_claim(api, "ns1", "c2", "node-a")) == [("z", "z0")]


def test_allocation_uses_only_complete_pools_at_the_highest_generation() -> None:
    api = ApiServerDouble()
    # Pool p1: generation 2 has only one of its two slices yet -> incomplete.
    api.create(resource_slice("p1-old", pool="p1", devices=["old"], generation=1, node_name="n"))
    api.create(
        resource_slice(
            "p1-new", pool="p1", devices=["new"], generation=2, slice_count=2, node_name="n"
        )
    )
    create_claim(api, "default", "c1")
    with pytest.raises(AllocationError, match=r"incomplete pools: \['p1 \(generation 2: 1 of 2"):
        allocate_claim(api, "default", "c1", "n")
    api.create(
        resource_slice(
            "p1-new2", pool="p1", devices=["new2"], generation=2, slice_count=2, node_name="n"
        )
    )
    claim = allocate_claim(api, "default", "c1", "n")
    assert results(claim) == [("p1", "new")]  # never the stale generation-1 device


def test_allocation_node_selection() -> None:
    api = ApiServerDouble()
    api.create(resource_slice("1-other", pool="other", devices=["o0"], node_name="node-b"))
    api.create(
        resource_slice(
            "2-zone",
            pool="zone",
            devices=["z0"],
            node_selector={
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["east"]}]}
                ]
            },
        )
    )
    api.create(
        resource_slice(
            "3-named",
            pool="named",
            devices=["n0"],
            node_selector={
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": ["node-c"]}
                        ]
                    }
                ]
            },
        )
    )
    api.create(resource_slice("4-all", pool="all", devices=["x0"], all_nodes=True))
    for name in ("c1", "c2", "c3", "c4"):
        create_claim(api, "default", name)
    # node-a in zone west: only the allNodes pool.
    claim = allocate_claim(api, "default", "c1", "node-a", node_labels={"zone": "west"})
    assert results(claim) == [("all", "x0")]
    assert "nodeSelector" not in claim["status"]["allocation"]
    # node-a in zone east (labels from the Node object): the zone pool, its selector copied.
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "node-a", "labels": {"zone": "east"}},
        }
    )
    claim = allocate_claim(api, "default", "c2", "node-a")
    assert results(claim) == [("zone", "z0")]
    assert claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ] == [{"key": "zone", "operator": "In", "values": ["east"]}]
    # node-c: matchFields on metadata.name.
    claim = allocate_claim(api, "default", "c3", "node-c", node_labels={})
    assert results(claim) == [("named", "n0")]
    # Nothing left for node-a; node-b and node-c devices are not available there.
    with pytest.raises(AllocationError, match=r"2 already allocated.*2 not available"):
        allocate_claim(api, "default", "c4", "node-a")


def test_allocation_skips_devices_allocated_to_any_claim() -> None:
    api = ApiServerDouble()
    api.create(resource_slice("s1", pool="node-a", devices=["d0", "d1"], node_name="node-a"))
    create_claim(api, "ns1", "c1")
    create_claim(api, "ns2", "c2")
    create_claim(api, "ns2", "c3")
    assert results(allocate_claim(api, "ns1", "c1", "node-a")) == [("node-a", "d0")]
    assert results(allocate_claim(api, "ns2", "c2", "node-a")) == [("node-a", "d1")]
    with pytest.raises(AllocationError, match="2 already allocated"):
        allocate_claim(api, "ns2", "c3", "node-a")
    release_claim(api, "ns1", "c1")
    assert results(allocate_claim(api, "ns2", "c3", "node-a")) == [("node-a", "d0")]


def test_allocation_of_a_shared_claim_only_adds_the_pod() -> None:
    api = ApiServerDouble()
    api.create(resource_slice("s1", pool="node-a", devices=["d0"], node_name="node-a"))
    create_claim(api, "default", "shared", uid="fixed-uid")
    assert api.get(CLAIMS, "shared", "default")["metadata"]["uid"] == "fixed-uid"  # type: ignore[index]
    allocate_claim(api, "default", "shared", "node-a", pod_name="p1", pod_uid="u1")
    claim = allocate_claim(api, "default", "shared", "node-a", pod_name="p2", pod_uid="u2")
    assert results(claim) == [("node-a", "d0")]
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == ["u1", "u2"]
    with pytest.raises(AllocationError, match="not usable on node node-b"):
        allocate_claim(api, "default", "shared", "node-b", pod_uid="u3")
    claim = release_claim(api, "default", "shared", "u1")
    assert [r["uid"] for r in claim["status"]["reservedFor"]] == ["u2"]
    claim = release_claim(api, "default", "shared", "u2")
    assert "allocation" not in claim.get("status", {})


def test_allocation_selectors_over_typed_attributes() -> None:
    api = ApiServerDouble()
    devices: list[dict[str, Any]] = [
        {"name": "d0", "attributes": {"slot": {"int": 0}, "fw": {"version": "1.2.0"}}},
        {
            "name": "d1",
            "attributes": {"akri.sh/slot": {"int": 1}, "fw": {"version": "1.10.0"}},
        },
        {"name": "d2", "attributes": {"slot": {"int": 2}, "model": {"string": "X"}}},
        {"name": "d3", "taints": [{"key": "broken", "effect": "NoSchedule"}]},
    ]
    api.create(resource_slice("s1", pool="node-a", devices=devices, node_name="node-a"))
    for name in ("c1", "c2", "c3", "c4"):
        create_claim(api, "default", name)
    newer = cel_like("fw", ">=", "1.9.0")  # semver order, not string order
    claim = allocate_claim(api, "default", "c1", "node-a", selector=newer)
    assert results(claim) == [("node-a", "d1")]
    both = all_of(cel_like("akri.sh/slot", ">=", 1), cel_like("model", "==", "X"))
    assert results(allocate_claim(api, "default", "c2", "node-a", selector=both)) == [
        ("node-a", "d2")
    ]
    with pytest.raises(AllocationError, match="1 rejected by the selector, 1 tainted"):
        allocate_claim(api, "default", "c3", "node-a", selector=cel_like("slot", "==", "0"))
    assert results(allocate_claim(api, "default", "c4", "node-a", selector=cel_like("slot"))) == [
        ("node-a", "d0")
    ]


# --------------------------------------------------------------------------------------------
# CDI spec validator
# --------------------------------------------------------------------------------------------

VALID_SPEC: dict[str, Any] = {
    "cdiVersion": "1.1.0",
    "kind": "vendor.com/class",
    "annotations": {"k": "v"},
    "devices": [
        {
            "name": "dev0",
            "annotations": {},
            "containerEdits": {
                "env": ["NAME=value"],
                "deviceNodes": [
                    {
                        "path": "/dev/foo0",
                        "hostPath": "/dev/foo0",
                        "type": "c",
                        "major": 240,
                        "minor": 0,
                        "fileMode": 438,
                        "permissions": "rw",
                        "uid": 0,
                        "gid": 0,
                    }
                ],
                "mounts": [
                    {
                        "hostPath": "/opt/lib",
                        "containerPath": "/usr/lib/foo",
                        "type": "none",
                        "options": ["ro", "nosuid", "nodev", "bind"],
                    }
                ],
                "hooks": [
                    {
                        "hookName": "createContainer",
                        "path": "/usr/bin/hook",
                        "args": ["hook", "arg"],
                        "env": ["A=B"],
                        "timeout": 5,
                    }
                ],
                "additionalGids": [44],
                "intelRdt": {"closID": "x"},
                "netDevices": [{"hostInterfaceName": "eth1", "name": "net1"}],
            },
        }
    ],
    "containerEdits": {},
}


def mutated(path: str, value: Any) -> dict[str, Any]:
    """A copy of VALID_SPEC with ``value`` at a dotted path (``...`` deletes the key)."""
    spec = copy.deepcopy(VALID_SPEC)
    target: Any = spec
    parts = path.split(".")
    for part in parts[:-1]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if value is ...:
        del target[parts[-1]]
    else:
        target[parts[-1]] = value
    return spec


def test_cdi_valid_example_and_minimal_specs(tmp_path: Path) -> None:
    assert validate_cdi_spec(VALID_SPEC) == []
    minimal = {
        "cdiVersion": "0.3.0",
        "kind": "k8s.akri.sh/dev",
        "devices": [{"name": "claim-1", "containerEdits": {"env": ["A=1"]}}],
    }
    assert validate_cdi_spec(minimal) == []
    (tmp_path / "spec.json").write_text(json.dumps(VALID_SPEC))
    assert validate_cdi_file(tmp_path / "spec.json") == []
    (tmp_path / "spec.txt").write_text("{}")
    assert "must end in .json or .yaml" in validate_cdi_file(tmp_path / "spec.txt")[0]


E = "devices.0.containerEdits"


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("cdiVersion", ..., "cdiVersion: required"),
        ("cdiVersion", "1.x", "cdiVersion: '1.x' is not a semantic version"),
        ("cdiVersion", "0.2.0", "cdiVersion: '0.2.0' is not a released"),
        ("cdiVersion", "1.2.0", "cdiVersion: '1.2.0' is not a released"),
        (
            "cdiVersion",
            "1.0.0",
            "devices[0].containerEdits.netDevices: requires cdiVersion >= 1.1.0",
        ),
        (
            "cdiVersion",
            "0.6.0",
            "devices[0].containerEdits.additionalGids: requires cdiVersion >= 0.7.0",
        ),
        ("cdiVersion", "0.6.0", "devices[0].containerEdits.intelRdt: requires cdiVersion >= 0.7.0"),
        ("cdiVersion", "0.5.0", "annotations: requires cdiVersion >= 0.6.0"),
        ("cdiVersion", "0.4.0", "deviceNodes[0].hostPath: requires cdiVersion >= 0.5.0"),
        ("cdiVersion", "0.3.0", "mounts[0].type: requires cdiVersion >= 0.4.0"),
        ("kind", ..., "kind: required"),
        ("kind", "vendor.com", "kind: 'vendor.com' must be of the form <vendor>/<class>"),
        ("kind", "vendor.com/a/b", "must be of the form <vendor>/<class>"),
        ("kind", "Vendor_Com/class", "kind: vendor 'Vendor_Com' must be a DNS subdomain"),
        ("kind", "vendor.com/-class", "kind: class '-class' must consist of"),
        ("kind", "vendor.com/" + "c" * 64, "is longer than 63 characters"),
        ("devices", [], "devices: at least one device is required"),
        ("devices.0.name", "-dev", "devices[0].name: device name '-dev' must consist of"),
        ("devices.0.name", "dev/0", "devices[0].name"),
        ("devices.0.containerEdits", {}, "devices[0].containerEdits: empty container edits"),
        ("devices.0.containerEdits", ..., "devices[0].containerEdits: required"),
        (f"{E}.gpus", ["x"], "devices[0].containerEdits.gpus: unknown field"),
        ("extra", 1, "extra: unknown field"),
        ("devices.0.extra", 1, "devices[0].extra: unknown field"),
        (f"{E}.env", ["NOVALUE"], "containerEdits.env[0]: must be NAME=value"),
        (f"{E}.env", ["=v"], "containerEdits.env[0]: must be NAME=value"),
        (f"{E}.deviceNodes.0.path", ..., "deviceNodes[0].path: required"),
        (f"{E}.deviceNodes.0.path", "dev/foo", "deviceNodes[0].path: must be an absolute path"),
        (f"{E}.deviceNodes.0.hostPath", "foo", "deviceNodes[0].hostPath: must be an absolute"),
        (f"{E}.deviceNodes.0.permissions", "rwx", "deviceNodes[0].permissions: must be made of"),
        (f"{E}.deviceNodes.0.type", "x", "deviceNodes[0].type: must be one of b, c, u, p"),
        (f"{E}.deviceNodes.0.bogus", 1, "deviceNodes[0].bogus: unknown field"),
        (f"{E}.mounts.0.hostPath", "opt/lib", "mounts[0].hostPath: must be an absolute path"),
        (f"{E}.mounts.0.containerPath", ..., "mounts[0].containerPath: required"),
        (f"{E}.hooks.0.hookName", "preStart", "hooks[0].hookName: must be one of"),
        (f"{E}.hooks.0.path", "hook", "hooks[0].path: must be an absolute path"),
        (f"{E}.hooks.0.timeout", 0, "hooks[0].timeout: must be a positive integer"),
        (f"{E}.netDevices.0.name", ..., "netDevices[0].name: required"),
        (f"{E}.additionalGids", [-1], "additionalGids[0]: must be an integer"),
        (f"{E}.intelRdt", {"closID": "a/b"}, "intelRdt.closID: invalid closID"),
        (
            f"{E}.intelRdt",
            {"enableCMT": True},
            "intelRdt.enableCMT: is not valid for cdiVersion 1.1.0",
        ),
        ("annotations", {"bad key!": "v"}, "annotations['bad key!']: key must be a valid"),
    ],
)
def test_cdi_violations_are_reported_with_the_field(path: str, value: Any, expected: str) -> None:
    problems = validate_cdi_spec(mutated(path, value))
    assert any(expected in p for p in problems), problems


def test_cdi_duplicate_devices_and_versioned_names() -> None:
    spec = copy.deepcopy(VALID_SPEC)
    spec["devices"].append(copy.deepcopy(spec["devices"][0]))
    assert any(
        "devices[1].name: duplicate device name 'dev0'" in p for p in validate_cdi_spec(spec)
    )
    digit = {
        "cdiVersion": "0.4.0",
        "kind": "vendor.com/a.b",
        "devices": [{"name": "0dev", "containerEdits": {"env": ["A=1"]}}],
    }
    problems = validate_cdi_spec(digit)
    assert any(p.startswith("devices[0].name: requires cdiVersion >= 0.5.0") for p in problems)
    assert any(p.startswith("kind: requires cdiVersion >= 0.6.0") for p in problems)
    digit["cdiVersion"] = "0.6.0"
    assert validate_cdi_spec(digit) == []


def test_qualified_device_names() -> None:
    assert qualified_device_name_ok("vendor.com/class=dev0")
    assert qualified_device_name_ok("k8s.akri.sh/dev=3f2a-uid-0:slot-1")
    for bad in (
        "vendor.com/class",
        "vendor.com=dev",
        "vendor.com/class=",
        "/class=dev",
        "vendor.com/cl/ass=dev",
        "vendor.com/class=-dev",
        "Vendor!/class=dev",
    ):
        assert not qualified_device_name_ok(bad), bad
