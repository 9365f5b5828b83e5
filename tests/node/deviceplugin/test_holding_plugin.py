"""A name nobody serves any more keeps a plugin registered while slots are held under it.

On a node where a name went to DRA (or its Instance left the node), pods that got slots
through its device plugin still hold them; kubelet rewrites its device-manager checkpoint only
after an allocation or a plugin's ListAndWatch message, and the reclaimer counts a device in use
while that file lists it. So the manager keeps a *holding* plugin for each such name: it lists
no device (kubelet's allocatable stays 0, the scheduler keeps routing the name to DRA),
refuses Allocate, re-sends its empty list when the reclaimer nudges kubelet, and stops once no
slot is held under the name (ACCEPTANCE.md F1; docs/device-plugins.md, "A name nobody serves
any more")."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc
import pytest

from agent.core.model.instance import Instance
from agent.node.deviceplugin.manager import DevicePluginManager
from agent.node.deviceplugin.plugins import HoldingPlugin
from agent.node.dra.name_paths import DEVICE_PLUGINS, DRA, NodeNamePaths
from agent.protos.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from tests.doubles.kubelet_double import KubeletDouble
from tests.doubles.memory_store import MemoryStore
from tests.node.deviceplugin.support import CL, NODE, Factory, il, instance, registered


class Mode:
    """This node's mode, as the agent would switch it."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def paths(self) -> NodeNamePaths:
        return NodeNamePaths(NODE, lambda: self.mode, lambda: {})


def holding(
    index: int, usage: Sequence[str], configuration: str = "cam", capacity: int = 2
) -> Instance:
    base = instance(index, configuration, capacity)
    slots = sorted(base.device_usage)
    return dataclasses.replace(
        base, device_usage={slot: value for slot, value in zip(slots, usage, strict=True)}
    )


def holders(manager: DevicePluginManager) -> set[str]:
    return set(manager.holding_plugins)


async def allocate_directly(manager: DevicePluginManager, resource: str) -> grpc.aio.AioRpcError:
    endpoint = manager.holding_plugins[resource]
    async with grpc.aio.insecure_channel(f"unix://{endpoint.socket_path}") as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["cam-000000-0"])]
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Allocate(request, timeout=10)
    return refused.value


async def test_a_name_on_dra_keeps_a_holding_plugin_until_its_slots_are_freed(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    claims: list[bool] = []

    async def claims_needed(needed: bool) -> None:
        claims.append(needed)

    # an IL slot (this node) and a CL slot (its vdev) held, both names on DRA here
    store.put(holding(0, [NODE, f"C:cam-0:{NODE}"]))
    manager = await make_manager(paths=Mode(DRA).paths(), claims_needed=claims_needed)
    await registered(kubelet, [il(0), CL])
    assert manager.serving_endpoints() == [] and holders(manager) == {il(0), CL}
    for resource in (il(0), CL):
        await kubelet.wait_list_and_watch(resource)
        assert kubelet.devices(resource) == {}  # nothing offered: allocatable 0, capacity 0
        assert (kubelet.capacity(resource), kubelet.allocatable(resource)) == (0, 0)
    assert True not in claims  # offering nothing, they need no following of DRA claims

    # what the reclaimer asks: a list re-sent, so kubelet rewrites its checkpoint
    writes = kubelet.checkpoint_writes
    assert manager.nudge_kubelet()
    await kubelet.wait_for(lambda: kubelet.checkpoint_writes > writes, 10)

    refused = await allocate_directly(manager, il(0))
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no device is offered through this device plugin on node n1" in str(refused.details())

    # the IL slot freed: its holding plugin goes; the CL one stays while its slot is held
    store.put(holding(0, ["", f"C:cam-0:{NODE}"]))
    await kubelet.wait_for(lambda: kubelet.endpoint_stopped(il(0)), 10, "IL holder stopped")
    assert holders(manager) == {CL} and kubelet.connected(CL)
    store.put(holding(0, ["", ""]))
    await kubelet.wait_for(lambda: kubelet.endpoint_stopped(CL), 10, "CL holder stopped")
    assert manager.endpoints() == []


async def test_a_name_moving_between_the_paths_swaps_its_plugin_and_holder(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    mode = Mode(DEVICE_PLUGINS)
    store.put(holding(0, [NODE, ""]))
    manager = await make_manager(paths=mode.paths())
    await registered(kubelet, [il(0), CL])
    await kubelet.wait_for(lambda: kubelet.allocatable(il(0)) == 2, 10)  # its own slot: Healthy
    assert holders(manager) == set()

    # the node moves to DRA in place (auto's switch): the plugin goes, a holder takes its name
    mode.mode = DRA
    after = kubelet.registrations[-1].time
    manager.paths_changed()
    await registered(kubelet, [il(0)], after=after)
    await kubelet.wait_for(lambda: holders(manager) == {il(0)} and kubelet.connected(il(0)), 10)
    assert isinstance(manager.holding_plugins[il(0)].service.logic, HoldingPlugin)
    assert manager.serving_endpoints() == []
    # its empty list: nothing offered (allocatable and capacity 0)
    await kubelet.wait_for(lambda: kubelet.devices(il(0)) == {}, 10)
    assert (kubelet.capacity(il(0)), kubelet.allocatable(il(0))) == (0, 0)
    # the CL name holds nothing here: no holder for it
    await kubelet.wait_for(lambda: kubelet.endpoint_stopped(CL), 10)

    # and back (a device-plugin node joined the device): the holder gives the name back
    mode.mode = DEVICE_PLUGINS
    after = kubelet.registrations[-1].time
    manager.paths_changed()
    await registered(kubelet, [il(0), CL], after=after)
    await kubelet.wait_for(lambda: kubelet.allocatable(il(0)) == 2, 10)
    assert holders(manager) == set() and instance(0).name in manager.instance_plugins


async def test_an_instance_that_left_the_node_keeps_a_holder_while_its_slot_is_held(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    """Also on a device-plugin node: the Instance no longer lists the node (its device is
    gone) while a pod still holds its slot — the name's plugin stops, a holder stays."""
    store.put(holding(0, [NODE, ""]))
    store.put(holding(1, ["", ""]))
    manager = await make_manager()
    await registered(kubelet, [il(0), il(1), CL])
    after = kubelet.registrations[-1].time
    store.put(dataclasses.replace(holding(0, [NODE, ""]), nodes=("elsewhere",)))
    await registered(kubelet, [il(0)], after=after)
    await kubelet.wait_for(lambda: holders(manager) == {il(0)}, 10)
    assert instance(0).name not in manager.instance_plugins
    await kubelet.wait_for(lambda: kubelet.allocatable(il(0)) == 0, 10)
    store.remove(instance(0).name)
    await kubelet.wait_for(lambda: kubelet.endpoint_stopped(il(0)), 10, "holder stopped")
    assert holders(manager) == set()


async def test_a_holding_plugin_registers_again_after_a_kubelet_restart(
    store: MemoryStore, kubelet: KubeletDouble, make_manager: Factory
) -> None:
    """kubelet restarted (its socket directory wiped): the holding plugin registers again like
    every plugin, so the reclaimer can still have kubelet rewrite its checkpoint."""
    store.put(holding(0, [NODE, ""]))
    manager = await make_manager(paths=Mode(DRA).paths())
    await registered(kubelet, [il(0)])
    restarted = await kubelet.restart()
    await manager.check_sockets()
    await registered(kubelet, [il(0)], after=restarted)
    await kubelet.wait_for(lambda: kubelet.connected(il(0)), 10)
    writes = kubelet.checkpoint_writes
    assert manager.nudge_kubelet()
    await kubelet.wait_for(lambda: kubelet.checkpoint_writes > writes, 10)
    assert kubelet.devices(il(0)) == {} and holders(manager) == {il(0)}
