"""Pure device-plugin decisions: health rules, CL virtual devices, planning, envs, reclaim."""

from __future__ import annotations

import pytest

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import DRAINING_ANNOTATION
from agent.node.deviceplugin.container_env import container_edits, env_name
from agent.node.deviceplugin.held_slots import HeldSlot, held_in
from agent.node.deviceplugin.reclaimer import plan_reclaim
from agent.node.deviceplugin.views import (
    InsufficientInstancesError,
    configuration_devices,
    configuration_resource,
    instance_devices,
    instance_resource,
    plan_configuration_allocation,
    preferred_configuration_devices,
)
from discovery_handlers.base import Device, DeviceSpec, Mount


def inst(
    name: str, capacity: int = 2, nodes: tuple[str, ...] = ("n1", "n2"), **usage: str
) -> Instance:
    mapping = {f"{name}-{i}": "" for i in range(capacity)}
    mapping.update({f"{name}-{k[1:]}": v for k, v in usage.items()})
    return Instance(
        name=name,
        configuration_name="cams",
        capacity=capacity,
        nodes=nodes,
        device_usage=mapping,
        broker_properties={"P": name},
    )


def health(views: list) -> dict[str, bool]:  # type: ignore[type-arg]
    return {v.id: v.healthy for v in views}


def test_resource_names() -> None:
    assert instance_resource("cams-abcdef") == "akri.sh/cams-abcdef"
    assert configuration_resource("cams") == "akri.sh/cams"


def test_il_health_rules() -> None:
    i = inst("cams-aaaaaa", capacity=4, s0="n1", s1="n2", s2="C:cams-0:n1")
    assert health(instance_devices(i, "n1", offline=False)) == {
        "cams-aaaaaa-0": True,  # ours: kubelet may re-offer it (idempotent)
        "cams-aaaaaa-1": False,  # another node
        "cams-aaaaaa-2": False,  # our own CL plugin: not for IL
        "cams-aaaaaa-3": True,  # free
    }
    assert not any(health(instance_devices(i, "n1", offline=True)).values())
    assert instance_devices(i, "n3", offline=False) == []  # not on this node
    full = inst("cams-bbbbbb", capacity=1, s0="n2")
    assert health(instance_devices(full, "n1", False)) == {"cams-bbbbbb-0": False}
    deleting = inst("cams-cccccc").evolve(deletion_timestamp="2026-01-01T00:00:00Z")
    assert not any(health(instance_devices(deleting, "n1", False)).values())


def test_il_draining_slots_make_free_ones_unhealthy() -> None:
    drained = inst("cams-dddddd", capacity=1, s0="", s1="n2")  # capacity lowered from 2
    assert health(instance_devices(drained, "n1", False)) == {"cams-dddddd-0": False}


def test_cl_lists_held_vdevs_plus_one_free_per_instance() -> None:
    a = inst("cams-aaaaaa", capacity=2, s0="C:cams-0:n1")
    b = inst("cams-bbbbbb", capacity=2)
    c = inst("cams-cccccc", capacity=1, s0="n2")  # full
    d = inst("cams-dddddd", capacity=2, nodes=("n2",))  # not on n1
    devices = configuration_devices("cams", [a, b, c, d], "n1", offline=set())
    assert [(v.id, v.instance, v.slot, v.healthy) for v in devices] == [
        ("cams-0", "cams-aaaaaa", "cams-aaaaaa-0", True),
        ("cams-1", "cams-aaaaaa", None, True),
        ("cams-2", "cams-bbbbbb", None, True),
    ]
    offline = configuration_devices("cams", [a, b, c, d], "n1", offline={"cams-aaaaaa"})
    assert [(v.id, v.healthy) for v in offline] == [("cams-0", False), ("cams-1", True)]


def test_cl_plan_keeps_held_vdevs_and_spreads_new_ones() -> None:
    a = inst("cams-aaaaaa", capacity=3, s0="C:cams-0:n1")
    b = inst("cams-bbbbbb", capacity=3, s0="n2", s1="n2")
    c = inst("cams-cccccc", capacity=3)
    devices = configuration_devices("cams", [a, b, c], "n1", set())
    by_name = {i.name: i for i in (a, b, c)}
    plan = plan_configuration_allocation(["cams-0", "cams-9"], devices, by_name)
    assert plan[0].held_in == "cams-aaaaaa"  # re-offered vdev stays where it is
    assert plan[1].candidates[0] == "cams-cccccc"  # most free slots, not the held instance
    assert "cams-aaaaaa" not in plan[1].candidates  # distinct instances per container
    with pytest.raises(InsufficientInstancesError):
        plan_configuration_allocation(["cams-1", "cams-2", "cams-3", "cams-4"], devices, by_name)


def test_cl_plan_prefers_the_bound_instance() -> None:
    a = inst("cams-aaaaaa", capacity=2)
    b = inst("cams-bbbbbb", capacity=3)
    devices = configuration_devices("cams", [a, b], "n1", set())
    bound = {d.id: d.instance for d in devices}
    plan = plan_configuration_allocation(["cams-0"], devices, {"cams-aaaaaa": a, "cams-bbbbbb": b})
    assert plan[0].candidates[0] == bound["cams-0"]


def test_cl_preferred_allocation_spreads_over_instances() -> None:
    a = inst("cams-aaaaaa", capacity=3, s0="C:cams-0:n1")
    b = inst("cams-bbbbbb", capacity=3)
    devices = configuration_devices("cams", [a, b], "n1", set())
    ids = [d.id for d in devices]
    chosen = preferred_configuration_devices(
        ids, [], 2, devices, {"cams-aaaaaa": a, "cams-bbbbbb": b}
    )
    instances = {next(d.instance for d in devices if d.id == v) for v in chosen}
    assert len(chosen) == 2 and len(instances) == 2
    assert preferred_configuration_devices(ids, ["cams-0"], 1, devices, {})[0] == "cams-0"


def test_env_names_are_sanitised_and_suffixed() -> None:
    assert env_name("USB_RESOURCE_AKRI_SH_UDEV-USB") == "USB_RESOURCE_AKRI_SH_UDEV_USB"
    assert env_name("9lives") == "_9lives"
    assert env_name("a.b/c d") == "a_b_c_d"
    assert env_name("") == "_"
    a = inst("cams-aaaaaa")
    b = inst("cams-bbbbbb")
    edits = container_edits(
        [b, a],
        {
            "cams-aaaaaa": Device(
                "x", device_specs=(DeviceSpec("/dev/video0", "/dev/video0", "rw"),)
            ),
            "cams-bbbbbb": Device(
                "y",
                device_specs=(DeviceSpec("/dev/video0", "/dev/video0", "rw"),),
                mounts=(Mount("/data", "/host/data", True),),
            ),
        },
    )
    assert edits.envs["P"] == "cams-aaaaaa"  # deterministic: first instance name wins
    assert edits.envs["P_AAAAAA"] == "cams-aaaaaa" and edits.envs["P_BBBBBB"] == "cams-bbbbbb"
    assert [s.container_path for s in edits.device_specs] == ["/dev/video0"]
    assert [m.host_path for m in edits.mounts] == ["/host/data"]


def test_reclaim_decisions() -> None:
    a = inst("cams-aaaaaa", capacity=4, s0="n1", s1="C:cams-3:n1", s2="n2", s3="D:uid:n1")
    held = list(held_in(a, "n1"))
    assert held == [
        HeldSlot(a.key, "cams-aaaaaa-0", "n1", "akri.sh/cams-aaaaaa", "cams-aaaaaa-0"),
        HeldSlot(a.key, "cams-aaaaaa-1", "C:cams-3:n1", "akri.sh/cams", "cams-3"),
    ]
    since: dict[tuple[ObjectKey, str], float] = {}
    in_use = {"akri.sh/cams-aaaaaa": frozenset({"cams-aaaaaa-0"})}
    assert plan_reclaim(held, in_use, since, now=0.0, grace=3.0).due == ()
    assert plan_reclaim(held, in_use, since, now=2.0, grace=3.0).due == ()
    due = plan_reclaim(held, in_use, since, now=3.0, grace=3.0).due
    assert [h.slot for h in due] == ["cams-aaaaaa-1"]
    # back in use resets the timer
    in_use2 = {**in_use, "akri.sh/cams": frozenset({"cams-3"})}
    assert plan_reclaim(held, in_use2, since, now=10.0, grace=3.0).due == ()
    assert since == {}


def test_socket_names_fit_the_unix_path_limit(tmp_path_factory: pytest.TempPathFactory) -> None:
    from pathlib import Path

    from agent.node.deviceplugin.endpoint import UNIX_PATH_MAX, socket_file_name

    longest = "akri.sh/" + "a" * 59
    for directory in [Path("/var/lib/kubelet/device-plugins"), Path("/tmp/" + "d" * 65)]:
        name = socket_file_name(longest, directory)
        assert len(str(directory / name)) <= UNIX_PATH_MAX
        assert name.endswith(".sock")
    with pytest.raises(ValueError, match="too long"):
        socket_file_name(longest, Path("/tmp/" + "d" * 95))
    short = socket_file_name("akri.sh/cam-8120fe", Path("/var/lib/kubelet/device-plugins"))
    assert short.startswith("akri.sh-cam-8120fe-")


def _reference_configuration_devices(
    configuration: str, instances: list[Instance], node: str, offline: set[str]
) -> list[tuple[str, str, str | None, bool]]:
    """The CL list exactly as computed before the per-Instance cache (the specification)."""
    from agent.core.ledger.decisions import free_slots
    from agent.core.model.device_usage import ConfigurationUsage, parse_usage

    mine = sorted(
        (i for i in instances if i.configuration_name == configuration and node in i.nodes),
        key=lambda i: i.name,
    )
    result: list[tuple[str, str, str | None, bool]] = []
    used: set[str] = set()
    for i in mine:
        for slot, value in sorted(i.device_usage.items()):
            usage = parse_usage(value)
            if isinstance(usage, ConfigurationUsage) and usage.node == node:
                if usage.vdev in used:
                    continue
                used.add(usage.vdev)
                healthy = i.name not in offline and i.deletion_timestamp is None
                result.append((usage.vdev, i.name, slot, healthy))
    number = 0
    for i in mine:
        if i.name in offline or i.deletion_timestamp is not None or not free_slots(i):
            continue
        while f"{configuration}-{number}" in used:
            number += 1
        used.add(f"{configuration}-{number}")
        result.append((f"{configuration}-{number}", i.name, None, True))
    return result


def test_cached_cl_view_matches_the_full_computation_through_random_changes() -> None:
    import random

    from agent.node.deviceplugin.views import ConfigurationDevices

    rng = random.Random(7)
    values = ["", "", "", "n1", "n2", "C:cams-{v}:n1", "C:cams-{v}:n2", "D:uid:n1", "bad:x:y:z"]
    vdevs = ["0", "1", "2", "3", "01", "x", "²"]

    def random_instance(k: int) -> Instance:
        name = f"cams-{k:06d}"
        capacity = rng.randint(1, 3)
        usage = {
            f"{name}-{s}": rng.choice(values).format(v=rng.choice(vdevs))
            for s in range(capacity + rng.randint(0, 1))  # sometimes a draining slot
        }
        return Instance(
            name=name,
            configuration_name=rng.choice(["cams", "cams", "other"]),
            capacity=capacity,
            nodes=rng.choice([("n1",), ("n1", "n2"), ("n2",)]),
            device_usage=usage,
            deletion_timestamp=rng.choice([None, None, None, "2026-01-01T00:00:00Z"]),
        )

    view = ConfigurationDevices("cams", "n1")
    current = {k: random_instance(k) for k in range(30)}
    for _ in range(300):
        for k in rng.sample(sorted(current), rng.randint(0, 3)):
            current[k] = random_instance(k)  # a changed Instance is a new object
        if rng.random() < 0.1:
            current.pop(rng.choice(sorted(current)))
        if rng.random() < 0.1:
            new = max(current, default=0) + 1
            current[new] = random_instance(new)
        offline = {i.name for i in current.values() if rng.random() < 0.1}
        instances = [current[k] for k in sorted(current)]
        got = [(v.id, v.instance, v.slot, v.healthy) for v in view(instances, offline)]
        assert got == _reference_configuration_devices("cams", instances, "n1", offline)


def test_cached_cl_view_parses_only_changed_instances() -> None:
    from agent.node.deviceplugin.views import ConfigurationDevices

    instances = [inst(f"cams-{k:06d}", capacity=2) for k in range(100)]
    view = ConfigurationDevices("cams", "n1")
    first = view(instances, set())
    assert view.parsed == 100 and len(first) == 100
    instances[50] = instances[50].evolve(device_usage={"cams-000050-0": "n2"})  # still room
    second = view(instances, set())
    assert view.parsed == 101  # one Instance re-parsed, not 100
    assert [v.id for v in second] == [v.id for v in first]
    # the free vdevs whose number did not change are the very same objects
    assert sum(1 for old, new in zip(first, second, strict=True) if old is new) == 100
    instances[50] = instances[50].evolve(device_usage={"cams-000050-0": "C:cams-7:n1"})
    third = view(instances, set())
    assert view.parsed == 102
    assert ("cams-7", "cams-000050", "cams-000050-0", True) in {
        (v.id, v.instance, v.slot, v.healthy) for v in third
    }


def test_cached_cl_view_returns_the_same_tuple_while_no_part_changes() -> None:
    from agent.node.deviceplugin.views import ConfigurationDevices

    instances = [inst(f"cams-{k:06d}", capacity=3) for k in range(3)]
    view = ConfigurationDevices("cams", "n1")
    first = view(instances, set())
    # an IL claim of one slot (room left): a new Instance object, the same CL part
    instances[1] = instances[1].evolve(device_usage={"cams-000001-0": "n1"})
    assert view(instances, set()) is first
    assert view.parsed == 4  # it was parsed again, and found equal
    # anything that changes a part, the offline set or the Instances gives a new list
    offline = view(instances, {"cams-000002"})
    assert offline is not first and len(offline) == 2
    assert view(instances, {"cams-000002", "cams-999999"}) is offline  # not one of ours
    back = view(instances, set())
    assert back is not offline and back == first
    instances[1] = instances[1].evolve(
        device_usage={"cams-000001-0": "n1", "cams-000001-1": "n2", "cams-000001-2": "D:u:n2"}
    )  # full: no free vdev for it any more
    assert [v.instance for v in view(instances, set())] == ["cams-000000", "cams-000002"]
    assert view(instances[:2], set()) != view(instances, set())


def test_il_health_key_equal_means_the_same_list_through_random_instances() -> None:
    import random

    from agent.node.deviceplugin.views import InstanceDevices, instance_health_key

    rng = random.Random(11)
    values = ["", "", "", "n1", "n1", "n2", "C:cams-0:n1", "D:uid:n1", "bad"]
    seen: dict[object, list[tuple[str, bool]]] = {}
    view = InstanceDevices("n1")
    for _ in range(3000):
        capacity = rng.randint(1, 4)
        usage = {
            f"cams-aaaaaa-{s}": rng.choice(values)
            for s in range(capacity + rng.randint(-1, 2))  # missing or draining slots too
        }
        instance = Instance(
            name="cams-aaaaaa",
            configuration_name="cams",
            capacity=capacity,
            nodes=rng.choice([("n1",), ("n1", "n2"), ("n2",)]),
            device_usage=usage,
            deletion_timestamp=rng.choice([None, None, None, "2026-01-01T00:00:00Z"]),
        )
        if rng.random() < 0.1:
            instance = instance.with_node_mark(DRAINING_ANNOTATION, "n1", True)
        offline = rng.random() < 0.1
        expected = [(d.id, d.healthy) for d in instance_devices(instance, "n1", offline)]
        key = instance_health_key(instance, "n1", offline)
        assert seen.setdefault(key, expected) == expected, (key, usage)
        assert [(d.id, d.healthy) for d in view(instance, offline)] == expected
    assert view(None, False) == ()


def test_il_view_keeps_its_tuple_for_a_claim_that_changes_no_health() -> None:
    from agent.node.deviceplugin.views import InstanceDevices

    view = InstanceDevices("n1")
    big = inst("cams-aaaaaa", capacity=1000, s999="n2")
    first = view(big, False)
    claimed = big.evolve(device_usage={**big.device_usage, "cams-aaaaaa-0": "n1"})
    assert view(claimed, False) is first and view.computed == 1
    # another node's claim, or the device going offline, changes the list
    taken = claimed.evolve(device_usage={**claimed.device_usage, "cams-aaaaaa-1": "n2"})
    assert health(list(view(taken, False)))["cams-aaaaaa-1"] is False
    assert not any(d.healthy for d in view(taken, True)) and view.computed == 3


def test_a_draining_node_offers_nothing_whatever_its_offline_set_says() -> None:
    """Reviewer's case: node-b re-created the Instance, n1 adopted slot 0 draining (the
    stored mark), but n1's runner has not (yet) put it in its offline set. Before, the IL
    plugin listed slot 1 Healthy and the CL plugin offered a free vdev."""
    adopted = inst("cams-aaaaaa", capacity=2, s0="n1").with_node_mark(
        DRAINING_ANNOTATION, "n1", True
    )
    assert health(instance_devices(adopted, "n1", offline=False)) == {
        "cams-aaaaaa-0": False,
        "cams-aaaaaa-1": False,
    }
    assert health(instance_devices(adopted, "n2", offline=False))["cams-aaaaaa-1"]  # n2 serves
    cl = inst("cams-bbbbbb", capacity=2, s0="C:cams-0:n1").with_node_mark(
        DRAINING_ANNOTATION, "n1", True
    )
    devices = configuration_devices("cams", [cl], "n1", offline=set())
    assert [(d.id, d.healthy) for d in devices] == [("cams-0", False)]  # no free vdev
