"""Slot decisions: unit cases plus a property test over random claim/release sequences."""

from __future__ import annotations

import base64
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.ledger.decisions import (
    Drain,
    Granted,
    Leave,
    Owner,
    Refused,
    Released,
    SlotConflict,
    SlotsInUse,
    decide_adopt,
    decide_claim,
    decide_claim_any,
    decide_leave,
    decide_release,
    decide_release_values,
    decide_update,
    free_slots,
    held_count,
    initial_usage,
    node_slots,
    resize_usage,
)
from agent.core.model.device_usage import parse_usage
from agent.core.model.instance import Instance
from agent.core.model.naming import DRAINING_ANNOTATION
from agent.node.kubelet.evidence import configuration_level_in_use
from agent.node.kubelet.state import instance_digests, parse_checkpoint_allocations
from agent.protos.deviceplugin.v1beta1 import api_pb2

NAME = "cams-8120fe"


NODES = ("node-a", "node-b", "node-c", "n")


def inst(capacity: int = 2, **usage: str) -> Instance:
    base = Instance(name=NAME, configuration_name="cams", capacity=capacity, nodes=NODES)
    mapping = {f"{NAME}-{i}": "" for i in range(capacity)}
    mapping.update({f"{NAME}-{k.lstrip('s')}": v for k, v in usage.items()})
    return base.evolve(device_usage=mapping)


def apply(instance: Instance, decision: Granted | Released | Refused) -> Instance:
    assert not isinstance(decision, Refused), decision
    return instance.evolve(device_usage=dict(decision.device_usage))


def test_claim_free_slot_then_idempotent_repeat() -> None:
    node_a = Owner.instance_level("node-a")
    first = decide_claim(inst(), f"{NAME}-0", node_a)
    assert isinstance(first, Granted) and first.changed
    after = apply(inst(), first)
    assert after.device_usage[f"{NAME}-0"] == "node-a"
    again = decide_claim(after, f"{NAME}-0", node_a)
    assert isinstance(again, Granted) and not again.changed  # kubelet knows best


def test_claim_held_slot_is_refused_with_holder() -> None:
    result = decide_claim(inst(s0="node-b"), f"{NAME}-0", Owner.instance_level("node-a"))
    assert isinstance(result, Refused)
    assert result.reason == "SlotInUse"
    assert "node-b" in result.message


def test_unknown_and_out_of_range_slots_are_refused() -> None:
    owner = Owner.instance_level("node-a")
    for slot in ["other-1", f"{NAME}-2", f"{NAME}-x", f"{NAME}-01"]:
        result = decide_claim(inst(), slot, owner)
        assert isinstance(result, Refused) and result.reason == "UnknownSlot", slot


def test_configuration_level_and_claim_owners_write_akri_forms() -> None:
    cl = decide_claim(inst(), f"{NAME}-1", Owner.configuration_level("cams-0", "node-b"))
    assert isinstance(cl, Granted)
    assert cl.device_usage[f"{NAME}-1"] == "C:cams-0:node-b"
    dra = decide_claim(inst(), f"{NAME}-0", Owner.claim("uid-1", "node-c"))
    assert isinstance(dra, Granted)
    assert dra.device_usage[f"{NAME}-0"] == "D:uid-1:node-c"


def test_reclaimable_only_for_same_node() -> None:
    stale = "C:cams-0:node-a"
    held = inst(s0=stale, s1="node-b")
    mine = decide_claim(held, f"{NAME}-0", Owner.instance_level("node-a"), reclaimable={stale})
    assert isinstance(mine, Granted) and mine.replaced == stale
    other = decide_claim(held, f"{NAME}-0", Owner.instance_level("node-c"), reclaimable={stale})
    assert isinstance(other, Refused)


def test_unknown_values_are_never_handed_out() -> None:
    broken = inst(s0="C:garbage")
    assert isinstance(decide_claim(broken, f"{NAME}-0", Owner.instance_level("n")), Refused)
    any_claim = decide_claim_any(broken, Owner.instance_level("n"))
    assert isinstance(any_claim, Granted) and any_claim.slot == f"{NAME}-1"


def test_claim_any_prefers_held_then_lowest_free() -> None:
    owner = Owner.instance_level("node-a")
    held = inst(capacity=3, s1="node-a")
    result = decide_claim_any(held, owner)
    assert isinstance(result, Granted) and result.slot == f"{NAME}-1" and not result.changed
    result = decide_claim_any(inst(capacity=3, s0="node-b"), owner)
    assert isinstance(result, Granted) and result.slot == f"{NAME}-1"
    full = inst(capacity=1, s0="node-b")
    refused = decide_claim_any(full, owner)
    assert isinstance(refused, Refused) and refused.reason == "CapacityReached"


def test_release_only_by_holder_and_free_is_noop() -> None:
    held = inst(s0="node-a")
    ok = decide_release(held, f"{NAME}-0", Owner.instance_level("node-a"))
    assert isinstance(ok, Released) and ok.changed
    assert ok.device_usage[f"{NAME}-0"] == ""  # explicit free value, not a missing key
    wrong = decide_release(held, f"{NAME}-0", Owner.instance_level("node-b"))
    assert isinstance(wrong, Refused) and wrong.reason == "NotHolder"
    noop = decide_release(inst(), f"{NAME}-0", Owner.instance_level("node-a"))
    assert isinstance(noop, Released) and not noop.changed


def test_node_slots_are_every_plugin_of_that_node_only() -> None:
    held = inst(capacity=4, s0="node-a", s1="C:cams-0:node-a", s2="D:u:node-a", s3="node-b")
    assert node_slots(held, "node-a") == (f"{NAME}-0", f"{NAME}-1", f"{NAME}-2")
    assert node_slots(held, "node-b") == (f"{NAME}-3",)
    assert decide_release_values(held, {"nope"}).changed is False


def test_capacity_decrease_keeps_held_slots_draining() -> None:
    held = inst(capacity=3, s2="node-a")
    shrunk = held.evolve(capacity=1, device_usage=resize_usage(held, 1))
    assert f"{NAME}-1" not in shrunk.device_usage  # free slot beyond capacity dropped
    assert shrunk.device_usage[f"{NAME}-2"] == "node-a"  # held one drains
    assert held_count(shrunk) == 1
    assert free_slots(shrunk) == []  # the draining slot still counts against capacity
    refused = decide_claim(shrunk, f"{NAME}-0", Owner.instance_level("node-b"))
    assert isinstance(refused, Refused) and refused.reason == "CapacityReached"
    released = decide_release(shrunk, f"{NAME}-2", Owner.instance_level("node-a"))
    assert isinstance(released, Released)
    assert f"{NAME}-2" not in released.device_usage  # beyond capacity: key removed
    grown = shrunk.evolve(capacity=3, device_usage=resize_usage(shrunk, 3))
    assert set(grown.device_usage) == {f"{NAME}-{i}" for i in range(3)}


def test_deleting_instance_refuses_claims() -> None:
    deleting = inst().evolve(deletion_timestamp="2026-01-01T00:00:00Z")
    assert isinstance(decide_claim(deleting, f"{NAME}-0", Owner.instance_level("n")), Refused)
    assert isinstance(decide_claim_any(deleting, Owner.instance_level("n")), Refused)


OWNERS = st.sampled_from(
    [
        Owner.instance_level("node-a"),
        Owner.instance_level("node-b"),
        Owner.configuration_level("cams-0", "node-a"),
        Owner.configuration_level("cams-1", "node-b"),
        Owner.claim("uid-1", "node-c"),
        Owner.claim("uid-2", "node-a"),
    ]
)
ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["claim", "claim_any", "release", "resize", "reclaim"]),
        OWNERS,
        st.integers(min_value=0, max_value=5),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=1, max_value=4), ACTIONS)
def test_no_sequence_yields_two_holders_or_more_than_capacity(
    capacity: int, actions: list[tuple[str, Owner, int]]
) -> None:
    instance = inst(capacity=capacity)
    holders: dict[str, str] = {}  # our own model: slot -> value
    for action, owner, number in actions:
        slot = f"{NAME}-{number}"
        if action == "claim":
            decision: Granted | Released | Refused = decide_claim(instance, slot, owner)
        elif action == "claim_any":
            decision = decide_claim_any(instance, owner)
        elif action == "release":
            decision = decide_release(instance, slot, owner)
        elif action == "reclaim":
            value = instance.device_usage.get(slot, "")
            decision = decide_claim(instance, slot, owner, reclaimable={value} if value else set())
        else:
            new_capacity = max(1, number)
            instance = instance.evolve(
                capacity=new_capacity, device_usage=resize_usage(instance, new_capacity)
            )
            continue
        if isinstance(decision, Refused):
            continue
        before = dict(instance.device_usage)
        instance = apply(instance, decision)
        changed = {
            k
            for k in set(before) | set(instance.device_usage)
            if before.get(k, "") != instance.device_usage.get(k, "")
        }
        if isinstance(decision, Granted):
            # a grant changes at most the granted slot, and only from free or a proven-stale
            # value of the same node
            assert changed <= {decision.slot}
            if changed:
                old = before.get(decision.slot, "")
                assert old == "" or old == decision.replaced
        for key in changed:
            holders[key] = instance.device_usage.get(key, "")
        if isinstance(decision, Granted) and decision.replaced:
            # a proven-stale holder is only ever taken over by the same node
            assert parse_usage(decision.replaced) != parse_usage("")
            assert decision.replaced.endswith(":" + owner.node) or decision.replaced == owner.node
        # capacity: no grant ever raises the held count above capacity
        if isinstance(decision, Granted) and decision.changed:
            assert held_count(instance) <= instance.capacity
        held_in_range = [k for k in instance.slot_ids() if instance.device_usage.get(k, "")]
        assert len(held_in_range) <= instance.capacity
        assert all(key.startswith(NAME + "-") for key in instance.device_usage)
    assert holders is not None


def test_stale_takeover_is_refused_while_draining() -> None:
    # found by hypothesis: capacity lowered 2 -> 1 with both slots held; a takeover of the
    # stale slot 0 would keep two holders on a capacity-1 Instance
    held = inst(capacity=2, s0="node-b", s1="node-a")
    shrunk = held.evolve(capacity=1, device_usage=resize_usage(held, 1))
    result = decide_claim(
        shrunk, f"{NAME}-0", Owner.configuration_level("cams-1", "node-b"), reclaimable={"node-b"}
    )
    assert isinstance(result, Refused)


def test_a_node_not_in_nodes_cannot_claim() -> None:
    outsider = Owner.instance_level("node-z")
    result = decide_claim(inst(), f"{NAME}-0", outsider)
    assert isinstance(result, Refused) and result.reason == "NotOnNode"
    assert "node-z" in result.message
    any_slot = decide_claim_any(inst(), Owner.claim("uid-9", "node-z"))
    assert isinstance(any_slot, Refused) and any_slot.reason == "NotOnNode"


def test_initial_usage_holds_only_valid_slots_in_use() -> None:
    usage = initial_usage(
        inst(capacity=3),
        {
            f"{NAME}-1": "node-a",
            f"{NAME}-4": "D:uid-1:node-a",  # beyond capacity: kept held, it drains
            "other-0": "node-a",  # not a slot of this Instance
            f"{NAME}-2": "C:x",  # not a held value
        },
    )
    assert usage == {
        f"{NAME}-0": "",
        f"{NAME}-1": "node-a",
        f"{NAME}-2": "",
        f"{NAME}-4": "D:uid-1:node-a",
    }


def test_update_carries_held_slots_over_whatever_the_change_says() -> None:
    current = inst(capacity=3, s2="node-b")
    # the change was decided on an older copy: its deviceUsage must not win
    changed = current.evolve(capacity=1, device_usage={}, nodes=("node-a",))
    updated = decide_update(current, changed)
    assert updated is not None
    assert updated.device_usage == {f"{NAME}-0": "", f"{NAME}-2": "node-b"}
    assert updated.nodes == ("node-a",)
    assert decide_update(current, current) is None


def test_leave_waits_while_the_node_holds_slots() -> None:
    held = inst(s0="node-a", s1="D:uid:node-b")
    drain = decide_leave(held, "node-a")
    assert isinstance(drain, Drain) and drain.slots == (f"{NAME}-0",)
    assert drain.instance is not None and drain.instance.draining_nodes == ("node-a",)
    marked = drain.instance
    again = decide_leave(marked, "node-a")
    assert isinstance(again, Drain) and again.instance is None  # no second write
    # node-c holds nothing: it leaves; node-b's DRA slot keeps the Instance alive
    leave = decide_leave(marked, "node-c")
    assert isinstance(leave, Leave) and not leave.delete
    assert "node-c" not in leave.instance.nodes
    assert decide_leave(leave.instance, "node-c") is None


def test_last_node_deletes_only_when_nothing_is_held() -> None:
    alone = inst().evolve(nodes=("node-a",))
    leave = decide_leave(alone, "node-a")
    assert isinstance(leave, Leave) and leave.delete
    foreign = inst(s1="D:uid:node-gone").evolve(nodes=("node-a",))
    kept = decide_leave(foreign, "node-a")
    assert isinstance(kept, Leave) and not kept.delete and kept.instance.nodes == ()


# -- joining: take the free slots this node's containers use -------------------------------------


def test_adopt_takes_free_slots_in_use_and_leaves_its_own_alone() -> None:
    instance = inst(capacity=3, s1="node-a")
    adoption = decide_adopt(
        instance,
        SlotsInUse({f"{NAME}-0": "node-a", f"{NAME}-1": "node-a", f"{NAME}-2": "D:u:node-a"}),
    )
    assert adoption.adopted == ((f"{NAME}-0", "node-a"), (f"{NAME}-2", "D:u:node-a"))
    assert adoption.conflicts == ()
    assert adoption.device_usage == {
        f"{NAME}-0": "node-a",
        f"{NAME}-1": "node-a",
        f"{NAME}-2": "D:u:node-a",
    }


def test_adopt_never_takes_a_slot_held_by_another_holder() -> None:
    """Another node handed the slot out already: both use the device; report, don't steal."""
    instance = inst(s0="node-b", s1="C:x")
    adoption = decide_adopt(instance, SlotsInUse({f"{NAME}-0": "node-a", f"{NAME}-1": "node-a"}))
    assert adoption.adopted == ()
    assert adoption.device_usage == instance.device_usage
    assert adoption.conflicts == (
        SlotConflict(f"{NAME}-0", "node-a", "node-b"),
        SlotConflict(f"{NAME}-1", "node-a", "C:x"),  # an unknown value is a holder too
    )


def test_adopt_ignores_foreign_ids_and_values_that_hold_nothing() -> None:
    instance = inst()
    adoption = decide_adopt(
        instance, SlotsInUse({"other-0": "node-a", f"{NAME}-0": "", f"{NAME}-1": "C:x"})
    )
    assert adoption.adopted == () and adoption.conflicts == ()
    assert not SlotsInUse() and SlotsInUse(anywhere=("C:v:n",))


def test_adopt_holds_a_slot_beyond_the_capacity_so_it_drains() -> None:
    adoption = decide_adopt(inst(capacity=1), SlotsInUse({f"{NAME}-3": "node-a"}))
    assert adoption.adopted == ((f"{NAME}-3", "node-a"),)
    assert adoption.device_usage[f"{NAME}-3"] == "node-a"


def test_adopt_places_configuration_level_values_on_the_highest_free_slot() -> None:
    """kubelet knows a CL container's virtual device and Instance, not the slot: any free
    slot will do (the highest: another node's unseen IL container more likely sits low); a
    value already held anywhere is left alone; known slots are placed first."""
    instance = inst(capacity=4, s0="node-b", s2="C:cam-1:node-a")
    adoption = decide_adopt(
        instance,
        SlotsInUse({f"{NAME}-3": "node-a"}, anywhere=("C:cam-0:node-a", "C:cam-1:node-a")),
    )
    assert adoption.adopted == ((f"{NAME}-3", "node-a"), (f"{NAME}-1", "C:cam-0:node-a"))
    assert adoption.conflicts == ()


def test_adopt_reports_a_configuration_level_value_without_a_free_slot() -> None:
    instance = inst(capacity=2, s0="node-b", s1="C:cam-9:node-c")
    adoption = decide_adopt(instance, SlotsInUse(anywhere=("C:cam-0:node-a",)))
    assert adoption.adopted == ()
    assert adoption.conflicts == (SlotConflict(None, "C:cam-0:node-a", "C:cam-9:node-c, node-b"),)


@given(
    usage=st.lists(
        st.sampled_from(["", "node-a", "node-b", "C:v:node-a", "D:u:node-b"]),
        min_size=1,
        max_size=4,
    ),
    evidence=st.dictionaries(st.integers(0, 5), st.sampled_from(["node-a", "C:w:node-a"])),
    anywhere=st.lists(st.sampled_from(["C:v:node-a", "C:w:node-a", "C:z:node-a"]), max_size=3),
)
@settings(max_examples=300, deadline=None)
def test_adopt_changes_only_free_slots(
    usage: list[str], evidence: dict[int, str], anywhere: list[str]
) -> None:
    instance = inst(capacity=len(usage), **{f"s{i}": v for i, v in enumerate(usage)})
    in_use = SlotsInUse({f"{NAME}-{i}": v for i, v in evidence.items()}, tuple(anywhere))
    adoption = decide_adopt(instance, in_use)
    for slot, value in instance.device_usage.items():
        if value:  # a held slot is never changed, whoever holds it
            assert adoption.device_usage[slot] == value
    for slot, value in adoption.adopted:
        assert not instance.device_usage.get(slot) and adoption.device_usage[slot] == value
    changed = {s for s, v in adoption.device_usage.items() if instance.device_usage.get(s, "") != v}
    assert changed == {slot for slot, _ in adoption.adopted}


# -- configuration-level evidence from kubelet's checkpoint ---------------------------------------


def checkpoint(*entries: tuple[str, list[str], dict[str, str] | str]) -> bytes:
    """A kubelet checkpoint: (resource, device ids, env vars of AllocResp or raw AllocResp)."""
    items = []
    for resource, ids, envs in entries:
        encoded = (
            envs
            if isinstance(envs, str)
            else base64.b64encode(
                api_pb2.ContainerAllocateResponse(envs=envs).SerializeToString()
            ).decode()
        )
        items.append(
            {
                "PodUID": "u",
                "ContainerName": "c",
                "ResourceName": resource,
                "DeviceIDs": {"-1": ids},
                "AllocResp": encoded,
            }
        )
    return json.dumps({"Data": {"PodDeviceEntries": items}, "Checksum": 0}).encode()


def cam(digest: str, **usage: str) -> Instance:
    return Instance(
        name=f"cam-{digest}", configuration_name="cam", capacity=2, nodes=("node-a",)
    ).evolve(device_usage={f"cam-{digest}-{k.lstrip('s')}": v for k, v in usage.items()})


def test_configuration_level_evidence_finds_the_instance_by_its_env_var_digest() -> None:
    allocations = parse_checkpoint_allocations(
        checkpoint(
            ("akri.sh/cam", ["cam-1"], {"DESC": "x", "DESC_8120FE": "x"}),
            ("akri.sh/cam", ["cam-0"], {"DESC": "y", "DESC_A19705": "y"}),
            ("akri.sh/cam-8120fe", ["cam-8120fe-0"], {"DESC_8120FE": "x"}),  # IL: not here
            ("akri.sh/mic", ["mic-0"], {"DESC_8120FE": "x"}),  # another configuration
        )
    )
    assert configuration_level_in_use(cam("8120fe"), "node-a", allocations) == {
        "C:cam-1:node-a": frozenset({"C:cam-1:node-a"})
    }
    assert list(configuration_level_in_use(cam("a19705"), "node-a", allocations)) == [
        "C:cam-0:node-a"
    ]
    assert configuration_level_in_use(cam("ffffff"), "node-a", allocations) == {}


def test_configuration_level_evidence_pairs_a_containers_vdevs_once() -> None:
    """Two vdevs, two Instances in one container: paired in sorted order; an entry already
    held in the Instance under any of its vdevs is not added again — decided by the ledger on
    the version it writes over, since the evidence names the container's whole group."""
    allocations = parse_checkpoint_allocations(
        checkpoint(
            ("akri.sh/cam", ["cam-3", "cam-2"], {"P": "a", "P_A19705": "a", "P_8120FE": "b"})
        )
    )
    group = frozenset({"C:cam-2:node-a", "C:cam-3:node-a"})
    assert configuration_level_in_use(cam("8120fe"), "node-a", allocations) == {
        "C:cam-2:node-a": group
    }
    assert configuration_level_in_use(cam("a19705"), "node-a", allocations) == {
        "C:cam-3:node-a": group
    }
    represented = cam("8120fe", s0="C:cam-3:node-a")
    # the evidence does not depend on the version it was asked for
    found = configuration_level_in_use(represented, "node-a", allocations)
    assert found == {"C:cam-2:node-a": group}
    in_use = SlotsInUse(anywhere=tuple(found), represented_by=found)
    assert decide_adopt(represented, in_use).adopted == ()
    adoption = decide_adopt(cam("8120fe"), in_use)  # e.g. re-created meanwhile: all free
    assert adoption.adopted == (("cam-8120fe-1", "C:cam-2:node-a"),)


def test_adopt_leaves_a_container_alone_that_another_of_its_vdevs_holds() -> None:
    """Pure: the group check runs on the version being replaced."""
    value, other = "C:cam-2:node-a", "C:cam-3:node-a"
    in_use = SlotsInUse(anywhere=(value,), represented_by={value: frozenset({value, other})})
    assert decide_adopt(inst(capacity=2, s0=other), in_use).adopted == ()
    assert decide_adopt(inst(capacity=2, s0=value), in_use).adopted == ()
    assert decide_adopt(inst(capacity=2), in_use).adopted == ((f"{NAME}-1", value),)


def test_configuration_level_evidence_ignores_what_it_cannot_read() -> None:
    allocations = parse_checkpoint_allocations(
        checkpoint(
            ("akri.sh/cam", ["cam-0"], "not base64!"),
            ("akri.sh/cam", ["cam-1"], base64.b64encode(b"\xff\xff").decode()),
            ("akri.sh/cam", ["cam-2"], {"P_8120fe": "lower case is no digest", "Q_81": "x"}),
        )
    )
    assert [a.digests for a in allocations] == [frozenset()] * 3
    assert configuration_level_in_use(cam("8120fe"), "node-a", allocations) == {}


def test_a_property_name_ending_in_six_hex_digits_is_no_digest() -> None:
    """Allocate sets every property K as K and K_<DIGEST>: ``SERIAL_123456`` (a property of
    its own, set as itself and as ``SERIAL_123456_8120FE``) names no Instance ``123456``."""
    envs = {
        "SERIAL_123456": "s",
        "SERIAL_123456_8120FE": "s",
        "DESC": "d",
        "DESC_8120FE": "d",
        "ONLY_ABCDEF": "no ONLY",
    }
    assert instance_digests(envs) == {"8120FE"}
    allocations = parse_checkpoint_allocations(checkpoint(("akri.sh/cam", ["cam-0"], envs)))
    assert allocations[0].digests == frozenset({"8120FE"})
    assert configuration_level_in_use(cam("123456"), "node-a", allocations) == {}
    assert list(configuration_level_in_use(cam("8120fe"), "node-a", allocations)) == [
        "C:cam-0:node-a"
    ]


def draining_on(instance: Instance, node: str) -> Instance:
    return instance.with_node_mark(DRAINING_ANNOTATION, node, True)


def test_a_draining_node_keeps_its_slots_but_takes_no_new_one() -> None:
    """Reviewer's case: node-b re-created the Instance (all free); node-a, which does not see
    the device, adopted slot 0 draining. Before, a claim from node-a on slot 1 was granted."""
    adopted = draining_on(inst(s0="node-a"), "node-a")
    node_a = Owner.instance_level("node-a")
    refused = decide_claim(adopted, f"{NAME}-1", node_a)
    assert isinstance(refused, Refused) and refused.reason == "Draining"
    assert "node-a" in refused.message and "draining" in refused.message
    # kubelet re-offering the slot node-a already holds is still granted (idempotent)
    again = decide_claim(adopted, f"{NAME}-0", node_a)
    assert isinstance(again, Granted) and not again.changed
    any_slot = decide_claim_any(adopted, Owner.configuration_level("cams-0", "node-a"))
    assert isinstance(any_slot, Refused) and any_slot.reason == "Draining"
    held_cl = draining_on(inst(s0="C:cams-0:node-a"), "node-a")
    kept = decide_claim_any(held_cl, Owner.configuration_level("cams-0", "node-a"))
    assert isinstance(kept, Granted) and not kept.changed and kept.slot == f"{NAME}-0"
    # a stale slot of its own is not taken over for a new container either
    stale = decide_claim(
        draining_on(inst(s0="node-a"), "node-a"),
        f"{NAME}-0",
        Owner.configuration_level("cams-1", "node-a"),
        reclaimable={"node-a"},
    )
    assert isinstance(stale, Refused) and stale.reason == "Draining"
    # another node, not draining, still claims the free slot
    node_b = decide_claim(adopted, f"{NAME}-1", Owner.instance_level("node-b"))
    assert isinstance(node_b, Granted) and node_b.changed
