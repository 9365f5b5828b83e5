"""Issue 23 item 7: the suspicions about the slot pool, each tested.

(a) configuration-level evidence after an Instance is re-created; (b) an init container's slot
beyond a lowered capacity; (d) configuration-level vdevs listed Healthy that Allocate refuses.
See docs/slot-model.md ("Suspicions tested") for what each showed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from agent.core.ledger.decisions import (
    Granted,
    Owner,
    Refused,
    decide_adopt,
    decide_claim,
    decide_claim_any,
    resize_usage,
)
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.local import LocalInstanceStore
from agent.node.deviceplugin.plugins import ConfigurationPlugin
from agent.node.deviceplugin.service import AllocationError
from agent.node.kubelet.evidence import NodeEvidence
from agent.node.kubelet.state import KubeletState
from agent.protos.deviceplugin.v1beta1 import api_pb2

NAME = "cams-8120fe"
NODES = ("node-a", "node-b")
NS = "default"


def inst(capacity: int, **usage: str) -> Instance:
    base = Instance(name=NAME, configuration_name="cams", capacity=capacity, nodes=NODES)
    mapping = {f"{NAME}-{i}": "" for i in range(capacity)}
    mapping.update({f"{NAME}-{k.lstrip('s')}": v for k, v in usage.items()})
    return base.evolve(device_usage=mapping)


# -- (b) ------------------------------------------------------------------------------------
def test_b_app_container_gets_the_init_containers_slot_beyond_a_lowered_capacity() -> None:
    """kubelet hands an init container's devices to the pod's app containers and calls
    Allocate for them again. With the capacity lowered meanwhile (4 -> 1) the init
    container's slot 3 is draining beyond the capacity, still held by this node: the repeat
    is an idempotent re-grant, not UnknownSlot."""
    held = inst(4, s3="node-a")
    shrunk = held.evolve(capacity=1, device_usage=resize_usage(held, 1))
    assert shrunk.device_usage == {f"{NAME}-0": "", f"{NAME}-3": "node-a"}
    again = decide_claim(shrunk, f"{NAME}-3", Owner.instance_level("node-a"))
    assert isinstance(again, Granted) and again.changed is False
    assert again.device_usage == shrunk.device_usage
    # the same for a configuration-level holder (claim_any finds its slot first)
    cl = held.evolve(device_usage={**held.device_usage, f"{NAME}-3": "C:cams-0:node-a"})
    cl_shrunk = cl.evolve(capacity=1, device_usage=resize_usage(cl, 1))
    cl_again = decide_claim_any(cl_shrunk, Owner.configuration_level("cams-0", "node-a"))
    assert isinstance(cl_again, Granted) and cl_again.slot == f"{NAME}-3"
    assert cl_again.changed is False


def test_b_beyond_capacity_stays_refused_for_anyone_else() -> None:
    held = inst(4, s3="node-a")
    shrunk = held.evolve(capacity=1, device_usage=resize_usage(held, 1))
    for owner in (Owner.instance_level("node-b"), Owner.configuration_level("cams-0", "node-a")):
        refused = decide_claim(shrunk, f"{NAME}-3", owner)
        assert isinstance(refused, Refused) and refused.reason == "UnknownSlot"
    # a slot beyond capacity that nobody holds is no slot at all
    refused = decide_claim(shrunk, f"{NAME}-2", Owner.instance_level("node-a"))
    assert isinstance(refused, Refused) and refused.reason == "UnknownSlot"


# -- (d) ------------------------------------------------------------------------------------
class _Online:
    """Discovery's view for the plugins: nothing offline, no device details."""

    def offline_instances(self) -> frozenset[str]:
        return frozenset()

    def device_for(self, instance: str) -> None:
        return None


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LocalInstanceStore]:
    result = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await result.start()
    yield result
    await result.close()


async def _put(store: LocalInstanceStore, name: str, capacity: int, **usage: str) -> Instance:
    base = Instance(
        name=name, configuration_name="cams", capacity=capacity, nodes=("node-a",)
    ).evolve(device_usage={f"{name}-{i}": usage.get(f"s{i}", "") for i in range(capacity)})
    return await store.create(base)


async def test_d_every_vdev_listed_healthy_can_be_allocated_together(
    store: LocalInstanceStore,
) -> None:
    """Two pods each took a vdev of the one Instance with room (cams-0, cams-1 on A); both
    ended and the reclaimer has not freed their slots yet. kubelet now sees both vdevs free
    and Healthy and may give both to one container. The second must not be refused with
    RESOURCE_EXHAUSTED while B has room: it moves to B (its old slot in A is released, since
    kubelet handed its id to this container, no other container on the node has it)."""
    a = await _put(store, "cams-aaaaaa", 2, s0="C:cams-0:node-a", s1="C:cams-1:node-a")
    b = await _put(store, "cams-bbbbbb", 1)
    plugin = ConfigurationPlugin(
        "cams",
        lambda configuration: store.list_cached(ObjectKey(NS, configuration)),
        SlotLedger(store, "node-a"),
        _Online(),
    )
    listed = {d.id: d.healthy for d in plugin.devices()}
    assert listed == {"cams-0": True, "cams-1": True, "cams-2": True}
    (response,) = await plugin.allocate([["cams-0", "cams-1"]])
    assert response is not None
    after_a = store.get_cached(a.key)
    after_b = store.get_cached(b.key)
    assert after_a is not None and after_b is not None
    held = {
        value: inst.name
        for inst in (after_a, after_b)
        for value in inst.device_usage.values()
        if value
    }
    assert held == {"C:cams-0:node-a": "cams-aaaaaa", "C:cams-1:node-a": "cams-bbbbbb"}


async def test_d_two_vdevs_of_one_instance_without_another_are_refused_and_kept(
    store: LocalInstanceStore,
) -> None:
    """Without another Instance with room the request cannot get two distinct Instances:
    refused (RESOURCE_EXHAUSTED) and nothing changes."""
    a = await _put(store, "cams-aaaaaa", 2, s0="C:cams-0:node-a", s1="C:cams-1:node-a")
    plugin = ConfigurationPlugin(
        "cams",
        lambda configuration: store.list_cached(ObjectKey(NS, configuration)),
        SlotLedger(store, "node-a"),
        _Online(),
    )
    with pytest.raises(AllocationError) as refused:
        await plugin.allocate([["cams-0", "cams-1"]])
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    after = store.get_cached(a.key)
    assert after is not None and after.device_usage == a.device_usage
    # each alone is an idempotent re-grant, as listed
    for vdev in ("cams-0", "cams-1"):
        assert len(await plugin.allocate([[vdev]])) == 1


# -- (a) ------------------------------------------------------------------------------------
def _checkpoint(entries: list[tuple[str, list[str], dict[str, str]]]) -> bytes:
    """kubelet's device-manager checkpoint with one container per entry."""
    items = [
        {
            "PodUID": f"pod-{n}",
            "ContainerName": "c",
            "ResourceName": resource,
            "DeviceIDs": {"-1": ids},
            "AllocResp": base64.b64encode(
                api_pb2.ContainerAllocateResponse(envs=envs).SerializeToString()
            ).decode(),
        }
        for n, (resource, ids, envs) in enumerate(entries)
    ]
    return json.dumps({"Data": {"PodDeviceEntries": items}, "Checksum": 0}).encode()


def _cam(digest: str, **usage: str) -> Instance:
    return Instance(
        name=f"cam-{digest}", configuration_name="cam", capacity=2, nodes=("node-a",)
    ).evolve(
        device_usage={f"cam-{digest}-{i}": usage.get(f"s{i}", "") for i in range(2)},
    )


async def test_a_a_recreated_instance_never_takes_the_vdev_its_sibling_holds(
    tmp_path: Path,
) -> None:
    """One container holds two vdevs, cam-3 on A (8120fe) and cam-2 on B (a19705): the
    reverse of their sorted pairing (cam-2 -> 8120fe, cam-3 -> a19705). B is re-created, all
    free. Its evidence must give it cam-2 (the vdev A does not hold), not cam-3 — which would
    put C:cam-3:node-a in both Instances and keep B's slot held whenever cam-3 is in use."""
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_bytes(
        _checkpoint(
            [("akri.sh/cam", ["cam-3", "cam-2"], {"P": "a", "P_8120FE": "a", "P_A19705": "b"})]
        )
    )
    evidence = NodeEvidence("node-a", KubeletState(tmp_path / "no-pod-resources.sock", path))
    a = _cam("8120fe", s0="C:cam-3:node-a")
    recreated_b = _cam("a19705")
    evidence.siblings = lambda instance: [a, recreated_b]
    in_use = await evidence.in_use(recreated_b, 0.0)
    adoption = decide_adopt(recreated_b, in_use)
    assert [value for _, value in adoption.adopted] == ["C:cam-2:node-a"]
    # A, looked at with B re-created, keeps what it holds and gets nothing more
    assert decide_adopt(a, await evidence.in_use(a, 0.0)).adopted == ()
    # both re-created (no sibling holds anything): sorted pairing, still one value each
    evidence.siblings = lambda instance: [_cam("8120fe"), recreated_b]
    values = [
        value
        for inst in (_cam("8120fe"), recreated_b)
        for _, value in decide_adopt(inst, await evidence.in_use(inst, 0.0)).adopted
    ]
    assert sorted(values) == ["C:cam-2:node-a", "C:cam-3:node-a"]
