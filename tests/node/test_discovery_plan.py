"""Pure discovery decisions: names, collisions, joins, departures, grace."""

from __future__ import annotations

from typing import Any

import pytest

from agent.core.model.configuration import Configuration, DiscoveryHandlerInfo
from agent.core.model.instance import Instance
from agent.core.model.naming import DEVICE_DIGEST_ANNOTATION
from agent.node.discovery import plan as plan_mod
from agent.node.discovery.plan import (
    assign_names,
    grace_for,
    join_instance,
    new_instance,
    plan_discovery,
)
from discovery_handlers.base import Device


def config(capacity: int = 2, **kwargs: Any) -> Configuration:
    return Configuration(
        name="cfg",
        namespace="default",
        discovery_handler=DiscoveryHandlerInfo("debugEcho", "descriptions: [a]"),
        capacity=capacity,
        broker_properties=kwargs.pop("broker_properties", {"B": "cfg"}),
        **kwargs,
    )


def by_name(*instances: Instance) -> dict[str, Instance]:
    return {i.name: i for i in instances}


def test_names_follow_akri_and_include_node_for_local_devices() -> None:
    shared, _ = assign_names("cfg", "n1", True, [Device("d1")], {})
    local, _ = assign_names("cfg", "n1", False, [Device("d1")], {})
    other_node, _ = assign_names("cfg", "n2", False, [Device("d1")], {})
    assert shared[0].name != local[0].name != other_node[0].name
    assert shared[0].name == assign_names("cfg", "n2", True, [Device("d1")], {})[0][0].name


def test_duplicate_ids_in_one_list_are_dropped_and_reported() -> None:
    desired, dupes = assign_names("cfg", "n1", True, [Device("a"), Device("a")], {})
    assert len(desired) == 1 and dupes == ["a"]


def test_colliding_digests_get_distinct_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    # force every device onto the same first candidate name
    real = plan_mod.candidate_names

    def colliding(configuration: str, key: str):  # type: ignore[no-untyped-def]
        yield "cfg-aaaaaa", "aaaaaa"
        generator = real(configuration, key)
        next(generator)
        yield from generator

    monkeypatch.setattr(plan_mod, "candidate_names", colliding)
    desired, _ = assign_names("cfg", "n1", True, [Device("x"), Device("y")], {})
    names = [d.name for d in desired]
    assert len(set(names)) == 2
    assert names[0] == "cfg-aaaaaa"  # "x" sorts first and keeps the Akri name
    # an existing Instance of device "y" keeps its name even though "x" sorts first
    existing = new_instance(config(), desired[1], "n1", True)
    y_fingerprint = desired[1].fingerprint
    renamed = existing.evolve(
        name="cfg-aaaaaa", annotations={DEVICE_DIGEST_ANNOTATION: y_fingerprint}
    )
    desired2, _ = assign_names("cfg", "n1", True, [Device("x"), Device("y")], by_name(renamed))
    mapping = {d.device.id: d.name for d in desired2}
    assert mapping["y"] == "cfg-aaaaaa"
    assert mapping["x"] != "cfg-aaaaaa"


def test_akri_written_instance_without_fingerprint_is_adopted() -> None:
    desired, _ = assign_names("cfg", "n1", True, [Device("d1")], {})
    akri_made = Instance(name=desired[0].name, configuration_name="cfg", capacity=2)
    again, _ = assign_names("cfg", "n1", True, [Device("d1")], by_name(akri_made))
    assert again[0].name == desired[0].name


def test_instance_of_other_configuration_is_never_taken() -> None:
    desired, _ = assign_names("cfg", "n1", True, [Device("d1")], {})
    foreign = Instance(name=desired[0].name, configuration_name="other", capacity=1)
    again, _ = assign_names("cfg", "n1", True, [Device("d1")], by_name(foreign))
    assert again[0].name != desired[0].name


def test_new_instance_has_akri_fields_and_leaves_slots_to_the_ledger() -> None:
    desired, _ = assign_names("cfg", "n1", True, [Device("d1", {"P": "dev", "B": "dev"})], {})
    inst = new_instance(config(uid="u-1"), desired[0], "n1", True)
    assert inst.nodes == ("n1",)
    assert inst.capacity == 2 and inst.shared
    assert inst.broker_properties == {"P": "dev", "B": "cfg"}  # Configuration overrides
    assert inst.device_usage == {}  # the ledger decides them (agent.core.ledger.decisions)
    assert inst.cdi_name == f"akri.sh/cfg={desired[0].digest}"
    assert inst.owner_references[0]["uid"] == "u-1"
    assert inst.labels["akri.sh/configuration"] == "cfg"


def test_join_adds_node_and_applies_configuration_changes_only_when_needed() -> None:
    desired, _ = assign_names("cfg", "n1", True, [Device("d1")], {})
    inst = new_instance(config(), desired[0], "n1", True).evolve(resource_version="5")
    assert join_instance(inst, config(), desired[0], "n1", True) is None
    joined = join_instance(inst, config(), desired[0], "n2", True)
    assert joined is not None and joined.nodes == ("n1", "n2")
    held = inst.evolve(device_usage={f"{inst.name}-0": "n1", f"{inst.name}-1": ""})
    grown = join_instance(held, config(capacity=3), desired[0], "n1", True)
    assert grown is not None and grown.capacity == 3
    assert grown.device_usage == held.device_usage  # resized by the ledger, not here
    props = join_instance(inst, config(broker_properties={"B": "new"}), desired[0], "n1", True)
    assert props is not None and props.broker_properties["B"] == "new"


def test_joining_again_ends_this_nodes_draining() -> None:
    desired, _ = assign_names("cfg", "n1", True, [Device("d1")], {})
    inst = new_instance(config(), desired[0], "n1", True).evolve(
        nodes=("n1", "n2"),
        annotations={
            **new_instance(config(), desired[0], "n1", True).annotations,
            "akri.sh/draining": "n1,n2",
        },
    )
    back = join_instance(inst, config(), desired[0], "n1", True)
    assert back is not None and back.draining_nodes == ("n2",)


def test_grace_period_keeps_then_leaves() -> None:
    cfg = config()
    desired, _ = assign_names("cfg", "n1", True, [Device("d1")], {})
    inst = new_instance(cfg, desired[0], "n1", True)
    instances = by_name(inst)
    first = plan_discovery(cfg, "n1", True, [], instances, {}, now=100.0, grace=10.0)
    assert first.offline == (inst.name,) and first.leave == ()
    assert first.next_deadline == 110.0
    later = plan_discovery(cfg, "n1", True, [], instances, first.missing_since, 105.0, 10.0)
    assert later.offline == (inst.name,) and later.missing_since[inst.name] == 100.0
    expired = plan_discovery(cfg, "n1", True, [], instances, later.missing_since, 110.0, 10.0)
    assert expired.leave == (inst.name,) and expired.offline == ()
    back = plan_discovery(cfg, "n1", True, [Device("d1")], instances, later.missing_since, 106, 10)
    assert back.offline == () and back.missing_since == {}
    immediate = plan_discovery(cfg, "n1", False, [], instances, {}, 100.0, 0.0)
    assert immediate.leave == (inst.name,)


def test_other_nodes_instances_are_not_ours_to_leave() -> None:
    cfg = config()
    desired, _ = assign_names("cfg", "n1", True, [Device("d1")], {})
    theirs = new_instance(cfg, desired[0], "n2", True)
    result = plan_discovery(cfg, "n1", True, [], by_name(theirs), {}, 0.0, 0.0)
    assert result.leave == () and result.offline == ()


def test_grace_annotation_overrides_default() -> None:
    assert grace_for(config(), True, 0, 300) == 300
    assert grace_for(config(), False, 0, 300) == 0
    annotated = config(annotations={"akri.sh/offline-grace-seconds": "12"})
    assert grace_for(annotated, True, 0, 300) == 12
    bad = config(annotations={"akri.sh/offline-grace-seconds": "soon"})
    assert grace_for(bad, True, 0, 300) == 300
