"""DiscoveryManager + runners against the local store with a scriptable handler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.core.ledger.decisions import SlotsInUse
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.configuration import Configuration, parse_configuration
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import ConfigurationEvent, EventType
from agent.core.store.local import LocalInstanceStore
from agent.node.deviceplugin.held_slots import HeldIndex
from agent.node.discovery import runner as runner_module
from agent.node.discovery.manager import DiscoveryManager, GraceSettings
from agent.node.discovery.ownership import ServedInstances
from agent.node.kubelet.state import KubeletStateError
from discovery_handlers.base import (
    Device,
    DiscoveryHandler,
    DiscoveryProperties,
    InvalidDiscoveryDetailsError,
)
from discovery_handlers.registry import HandlerRegistry


class ScriptedHandler(DiscoveryHandler):
    """Yields whatever lists the test pushes; raises if the test pushes an exception."""

    name = "scripted"

    def __init__(self, shared: bool = True) -> None:
        self._shared = shared
        self.queue: asyncio.Queue[list[Device] | Exception] = asyncio.Queue()
        self.started = 0
        self.details_seen: list[str] = []

    @property
    def shared(self) -> bool:
        return self._shared

    def validate(self, discovery_details: str) -> None:
        if "invalid" in discovery_details:
            raise InvalidDiscoveryDetailsError("scripted: details say invalid")

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        self.started += 1
        self.details_seen.append(discovery_details)
        while True:
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item


def cfg(
    name: str = "cfg",
    capacity: int = 2,
    details: str = "x",
    handler: str = "scripted",
    props: dict[str, str] | None = None,
) -> Configuration:
    return parse_configuration(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Configuration",
            "metadata": {"name": name},
            "spec": {
                "discoveryHandler": {"name": handler, "discoveryDetails": details},
                "capacity": capacity,
                "brokerProperties": props or {},
            },
        }
    )


async def until(predicate: Callable[[], bool], within: float = 30.0) -> None:
    # generous: a loaded CI machine must not turn slowness into a failure (a check that
    # holds returns at once)
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(
    tmp_path: Path, shared_grace: float
) -> AsyncIterator[tuple[LocalInstanceStore, ScriptedHandler, DiscoveryManager]]:
    """A local store, a scripted handler and a started manager with that shared grace."""
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    handler = ScriptedHandler()
    registry = HandlerRegistry()
    registry.register(handler)
    manager = DiscoveryManager(
        store, registry, "node-a", GraceSettings(local=0, shared=shared_grace)
    )
    await manager.start()
    try:
        yield store, handler, manager
    finally:
        await manager.close()
        await store.close()


@pytest.fixture
async def setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    async with running(tmp_path, shared_grace=0.3) as started:
        yield started


def instances(store: LocalInstanceStore) -> list[Instance]:
    return store.list_cached()


async def test_devices_become_instances_and_edits_converge(setup) -> None:  # type: ignore[no-untyped-def]
    store, handler, manager = setup
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.ADDED, ObjectKey("default", "cfg"), cfg())
    )
    await handler.queue.put([Device("d1", {"P": "1"}), Device("d2")])
    await until(lambda: len(instances(store)) == 2)
    first = instances(store)[0]
    assert first.nodes == ("node-a",) and first.capacity == 2
    # the runner records the devices once all of the list's Instances are written (it yields
    # between them): the Instance can be seen a moment before its device
    await until(lambda: manager.device_for(first.name) is not None)
    # capacity + brokerProperties edit: same discovery details, so no handler restart
    await manager.handle_configuration_event(
        ConfigurationEvent(
            EventType.MODIFIED, ObjectKey("default", "cfg"), cfg(capacity=3, props={"B": "2"})
        )
    )
    await until(
        lambda: all(
            i.capacity == 3 and i.broker_properties.get("B") == "2" for i in instances(store)
        )
    )
    assert handler.started == 1
    # details edit restarts discovery with the new details
    await manager.handle_configuration_event(
        ConfigurationEvent(
            EventType.MODIFIED, ObjectKey("default", "cfg"), cfg(capacity=3, details="y")
        )
    )
    await until(lambda: handler.started == 2)
    assert handler.details_seen[-1] == "y"
    await handler.queue.put([Device("d1")])
    await until(lambda: len(instances(store)) == 1)
    # deletion removes this node's instances
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.DELETED, ObjectKey("default", "cfg"), None)
    )
    await until(lambda: instances(store) == [])
    assert ObjectKey("default", "cfg") not in manager.runners


async def test_one_changed_device_among_many_is_the_only_one_re_examined(
    setup,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A list that changed one device of many re-examines that one Instance: the others'
    inputs (cached object, device, Configuration) are those of their last no-op."""
    store, handler, manager = setup
    joins: list[str] = []
    real_join = runner_module.join_instance

    def counting_join(instance: Instance, *args: object, **kwargs: object) -> Instance | None:
        joins.append(instance.name)
        return real_join(instance, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module, "join_instance", counting_join)
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.ADDED, ObjectKey("default", "cfg"), cfg())
    )
    devices = [Device(f"d{i}", {"P": "1"}) for i in range(20)]
    await handler.queue.put(devices)
    await until(lambda: len(instances(store)) == 20)
    await handler.queue.put(list(devices))  # the same list: every Instance is a no-op once
    await until(lambda: len(joins) >= 20)
    await asyncio.sleep(0.1)
    joins.clear()
    changed = [*devices[:-1], Device("d19", {"P": "2"})]
    await handler.queue.put(changed)
    await until(lambda: any(i.broker_properties.get("P") == "2" for i in instances(store)))
    await asyncio.sleep(0.1)
    # its write, then (woken by that write) the no-op that settles it: never the other 19
    assert len(set(joins)) == 1 and len(joins) <= 2, joins


async def test_shared_grace_marks_offline_then_removes(setup) -> None:  # type: ignore[no-untyped-def]
    store, handler, manager = setup
    # a grace long enough to be seen on a loaded machine (0.3 s could pass between two polls)
    manager.grace = GraceSettings(local=0, shared=3.0)
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.ADDED, ObjectKey("default", "cfg"), cfg())
    )
    await handler.queue.put([Device("d1")])
    await until(lambda: len(instances(store)) == 1)
    name = instances(store)[0].name
    key = instances(store)[0].key
    await handler.queue.put([])
    await until(lambda: name in manager.offline_instances())
    assert store.get_cached(key) is not None  # kept during the grace period
    await until(lambda: store.get_cached(key) is None)
    # the runner drops it from its offline set once its pass ends (it may yield in between)
    await until(lambda: manager.offline_instances() == frozenset())


async def test_handler_failure_is_survived_and_restarted(setup, caplog) -> None:  # type: ignore[no-untyped-def]
    store, handler, manager = setup
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.ADDED, ObjectKey("default", "cfg"), cfg())
    )
    await handler.queue.put([Device("d1")])
    await until(lambda: len(instances(store)) == 1)
    with caplog.at_level(logging.ERROR):
        await handler.queue.put(RuntimeError("boom"))
        await until(lambda: handler.started == 2)
    assert any("boom" in r.getMessage() for r in caplog.records)
    await handler.queue.put([Device("d1")])
    await until(lambda: len(instances(store)) == 1)


async def test_a_failing_handler_keeps_its_last_devices(tmp_path: Path) -> None:
    """Issue 11 case 4: an exception is not an empty list. With a local grace of 0, a
    handler error used to delete every Instance at once (with the slots of live pods)."""
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    handler = ScriptedHandler(shared=False)
    registry = HandlerRegistry()
    registry.register(handler)
    manager = DiscoveryManager(store, registry, "node-a", GraceSettings(local=0, shared=0))
    await manager.start()
    try:
        key = ObjectKey("default", "cfg")
        await manager.handle_configuration_event(ConfigurationEvent(EventType.ADDED, key, cfg()))
        await handler.queue.put([Device("d1"), Device("d2")])
        await until(lambda: len(instances(store)) == 2)
        runner = manager.runners[key]
        runner.reconciled.clear()
        await handler.queue.put(RuntimeError("the bus went away"))
        await until(lambda: handler.started == 2)
        await runner.reconcile_once()  # what any later reconcile would decide
        assert len(instances(store)) == 2
        assert manager.offline_instances() == frozenset()
        # a successful report without d2 is what starts its (zero) grace
        await handler.queue.put([Device("d1")])
        await until(lambda: len(instances(store)) == 1)
    finally:
        await manager.close()
        await store.close()


async def test_unknown_handler_and_bad_details_leave_others_running(setup, caplog) -> None:  # type: ignore[no-untyped-def]
    store, handler, manager = setup
    with caplog.at_level(logging.ERROR):
        await manager.handle_configuration_event(
            ConfigurationEvent(
                EventType.ADDED, ObjectKey("default", "bad"), cfg(name="bad", handler="nope")
            )
        )
        await manager.handle_configuration_event(
            ConfigurationEvent(
                EventType.ADDED, ObjectKey("default", "worse"), cfg(name="worse", details="invalid")
            )
        )
    messages = [r.getMessage() for r in caplog.records]
    assert any("spec.discoveryHandler.name" in m and "'nope'" in m for m in messages)
    assert any("discoveryDetails" in m and "worse" in m for m in messages)
    assert set(manager.runners) == set()
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.ADDED, ObjectKey("default", "cfg"), cfg())
    )
    await handler.queue.put([Device("d1")])
    await until(lambda: len(instances(store)) == 1)
    # an invalid edit of a running Configuration keeps the last good version running
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.MODIFIED, ObjectKey("default", "cfg"), cfg(details="invalid"))
    )
    assert (
        manager.runners[
            ObjectKey("default", "cfg")
        ].configuration.discovery_handler.discovery_details
        == "x"
    )


async def test_instance_deleted_by_someone_else_is_recreated(setup) -> None:  # type: ignore[no-untyped-def]
    store, handler, manager = setup
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.ADDED, ObjectKey("default", "cfg"), cfg())
    )
    await handler.queue.put([Device("d1")])
    await until(lambda: len(instances(store)) == 1)
    key = instances(store)[0].key
    await store.delete(key)
    await until(lambda: store.get_cached(key) is not None)


async def test_orphans_of_vanished_configurations_are_swept(tmp_path: Path) -> None:
    store = LocalInstanceStore(tmp_path / "state")
    await store.start()
    await store.create(
        Instance(name="gone-abcdef", configuration_name="gone", capacity=1, nodes=("node-a",))
    )
    await store.create(
        Instance(
            name="gone-bbbbbb",
            configuration_name="gone",
            capacity=1,
            nodes=("node-a", "node-b"),
            device_usage={"gone-bbbbbb-0": "node-a"},
        )
    )
    manager = DiscoveryManager(store, HandlerRegistry(), "node-a")
    await manager.start()
    free = ObjectKey("default", "gone-abcdef")
    held = ObjectKey("default", "gone-bbbbbb")
    await until(lambda: store.get_cached(free) is None)
    # node-a still holds a slot there: it stays (draining), nothing is freed
    await until(lambda: "gone-bbbbbb" in manager.offline_instances())
    kept = store.get_cached(held)
    assert kept is not None and kept.nodes == ("node-a", "node-b")
    assert kept.device_usage["gone-bbbbbb-0"] == "node-a"
    assert kept.draining_nodes == ("node-a",)
    # once the slot is released (by the reclaimer, in the agent), node-a leaves
    await manager.ledger.release_values(held, {"node-a"})
    await until(lambda: (store.get_cached(held) or kept).nodes == ("node-b",))
    left = store.get_cached(held)
    assert left is not None and left.draining_nodes == ()
    assert manager.offline_instances() == frozenset()
    await manager.close()
    await store.close()


async def test_nothing_is_taken_for_an_orphan_while_a_configuration_file_is_unreadable(
    tmp_path: Path,
) -> None:
    """Issue 11 case 1 in local mode: a half-saved file at start. Its Configurations are
    unknown, so their Instances must be left exactly as they are until it can be read."""
    config = tmp_path / "cams.yaml"
    config.write_text("apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: cam")
    state = tmp_path / "state"
    seed = LocalInstanceStore(state)
    await seed.start()
    unused = await seed.create(
        Instance(name="cam-abcdef", configuration_name="cam", capacity=1, nodes=("node-a",))
    )
    await seed.close()
    store = LocalInstanceStore(state, [config], poll_interval=0.05)
    await store.start()
    manager = DiscoveryManager(store, HandlerRegistry(), "node-a")
    await manager.start()
    try:
        assert store.unreadable_sources()
        assert manager.retirements == {}
        assert store.get_cached(unused.key) == unused
        # the file is fixed and does not define "cam": now it is an orphan, and it goes
        config.write_text(
            "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata: {name: other}\n"
            "spec: {discoveryHandler: {name: scripted}, capacity: 1}\n"
        )
        await until(lambda: store.get_cached(unused.key) is None)
    finally:
        await manager.close()
        await store.close()


def namespaced_file(path: Path, namespace: str, name: str = "cam") -> Path:
    path.write_text(
        "apiVersion: akri.sh/v0\nkind: Configuration\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\n"
        "spec: {discoveryHandler: {name: scripted}, capacity: 1}\n"
    )
    return path


async def start_two_namespaces(
    tmp_path: Path,
) -> tuple[LocalInstanceStore, ScriptedHandler, DiscoveryManager, Path]:
    """``default/cam`` (owner: no Instances anywhere, and "default" sorts first) and
    ``other/cam`` (refused), both read from files."""
    mine = namespaced_file(tmp_path / "a.yaml", "default")
    theirs = namespaced_file(tmp_path / "b.yaml", "other")
    store = LocalInstanceStore(tmp_path / "state", [mine, theirs], poll_interval=0.05)
    await store.start()
    handler = ScriptedHandler()
    registry = HandlerRegistry()
    registry.register(handler)
    manager = DiscoveryManager(store, registry, "node-a", GraceSettings(local=0, shared=60))
    await manager.start()
    await until(lambda: ObjectKey("other", "cam") in manager.refused)
    assert set(manager.runners) == {ObjectKey("default", "cam")}
    return store, handler, manager, theirs


async def test_a_running_configuration_stops_when_its_name_moves_to_another_namespace(
    tmp_path: Path,
) -> None:
    """Kubelet and DRA names are node-global: once another namespace owns the name (here it
    got the only Instances of it), the running Configuration must stop, or two namespaces'
    runners would serve one name. Before: only refused Configurations were looked at."""
    store, _handler, manager, _theirs = await start_two_namespaces(tmp_path)
    try:
        # default/cam has no Instance yet; one of other/cam appears (written elsewhere)
        await store.create(
            Instance(name="cam-abcdef", namespace="other", configuration_name="cam", capacity=1)
        )
        await until(lambda: set(manager.runners) == {ObjectKey("other", "cam")})
        assert ObjectKey("default", "cam") in manager.refused
        assert manager.ownership.owner("cam") == "other"
    finally:
        await manager.close()
        await store.close()


async def test_another_namespace_s_draining_instance_does_not_take_the_owner_s_offline(
    tmp_path: Path,
) -> None:
    """``offline_instances()`` names node-global Instances: a same-named Instance of another
    namespace, draining because its Configuration was deleted, must not make the owner's
    Instance Unhealthy. Before: bare names from every runner and retirement."""
    store, handler, manager, theirs = await start_two_namespaces(tmp_path)
    try:
        await handler.queue.put([Device("d1")])
        await until(lambda: len(store.list_cached(ObjectKey("default", "cam"))) == 1)
        served = store.list_cached(ObjectKey("default", "cam"))[0]
        # the same name in "other", holding a slot on this node (a live container there)
        await store.create(
            Instance(
                name=served.name,
                namespace="other",
                configuration_name="cam",
                capacity=1,
                nodes=("node-a",),
                device_usage={f"{served.name}-0": "node-a"},
            )
        )
        assert manager.ownership.owner("cam") == "default"  # both have Instances: oldest
        theirs.unlink()  # other/cam deleted: its Instance drains (the slot is held)
        retiring = ObjectKey("other", "cam")
        await until(
            lambda: (
                retiring in manager.retirements
                and served.name in manager.retirements[retiring].offline
            ),
            within=5,
        )
        assert manager.offline_instances() == frozenset()
        assert manager.device_for(served.name) == Device("d1")
    finally:
        await manager.close()
        await store.close()


class BrokenForOneInstance:
    """This node's evidence for the first Instance it is asked about cannot be read (e.g. a
    half-written kubelet checkpoint) while ``broken``; the others read fine."""

    def __init__(self) -> None:
        self.broken = True
        self.victim: str | None = None
        self.asked: list[str] = []

    async def in_use(self, instance: Instance, not_before: float) -> SlotsInUse:
        self.asked.append(instance.name)
        if self.victim is None:
            self.victim = instance.name
        if self.broken and instance.name == self.victim:
            raise KubeletStateError("kubelet checkpoint is not JSON: truncated")
        return SlotsInUse()


async def test_unreadable_evidence_for_one_instance_holds_back_only_that_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the evidence error left ``reconcile_once`` and no Instance of the
    Configuration was created, joined or resized while it lasted. Now that one Instance is
    left untouched (logged once a minute), the others go on, and it is retried."""
    monkeypatch.setattr(runner_module, "EVIDENCE_RETRY", (0.01, 0.05))
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    handler = ScriptedHandler()
    registry = HandlerRegistry()
    registry.register(handler)
    evidence = BrokenForOneInstance()
    ledger = SlotLedger(store, "node-a", evidence=evidence)
    manager = DiscoveryManager(store, registry, "node-a", ledger=ledger)
    await manager.start()
    key = ObjectKey("default", "cfg")
    try:
        with caplog.at_level(logging.ERROR, logger="agent.discovery"):
            added = ConfigurationEvent(EventType.ADDED, key, cfg())
            await manager.handle_configuration_event(added)
            await handler.queue.put([Device("d1"), Device("d2")])
            await until(lambda: len(instances(store)) == 1)
            victim = evidence.victim
            assert victim is not None and instances(store)[0].name != victim
            # the other one is still resized while the victim waits
            await manager.handle_configuration_event(
                ConfigurationEvent(EventType.MODIFIED, key, cfg(capacity=3))
            )
            await until(lambda: instances(store)[0].capacity == 3)
            await until(lambda: evidence.asked.count(victim) >= 4)  # retried by itself
            assert store.get_cached(ObjectKey("default", victim)) is None
            lines = [r for r in caplog.records if "cannot be read now" in r.getMessage()]
            assert len(lines) == 1 and victim in lines[0].getMessage()
            evidence.broken = False
            await until(lambda: store.get_cached(ObjectKey("default", victim)) is not None)
        created = store.get_cached(ObjectKey("default", victim))
        assert created is not None and created.capacity == 3
    finally:
        await manager.close()
        await store.close()


def dated_file(path: Path, namespace: str, created: str) -> Path:
    path.write_text(
        "apiVersion: akri.sh/v0\nkind: Configuration\n"
        f"metadata: {{name: cam, namespace: {namespace}, creationTimestamp: '{created}'}}\n"
        "spec: {discoveryHandler: {name: scripted}, capacity: 1}\n"
    )
    return path


async def test_a_displaced_configuration_s_instances_drain_and_go(tmp_path: Path) -> None:
    """``default/cam`` runs here with an Instance whose slot a live container holds; then
    ``other/cam`` (the older Configuration) gets an Instance too and takes the name (rule 2).
    Before: the runner was stopped and nothing ever looked at its Instance again — no
    retirement, and the reclaimers saw only the owner's Instances — so the slot was never
    freed and the Instance never went. Now it drains (the reclaimers see it), then goes."""
    state = tmp_path / "state"
    seed = LocalInstanceStore(state)
    await seed.start()
    held = await seed.create(
        Instance(
            name="cam-111111",
            configuration_name="cam",
            capacity=1,
            nodes=("node-a",),
            device_usage={"cam-111111-0": "node-a"},
        )
    )
    await seed.close()
    mine = dated_file(tmp_path / "a.yaml", "default", "2024-01-01T00:00:00Z")
    theirs = dated_file(tmp_path / "b.yaml", "other", "2020-01-01T00:00:00Z")
    store = LocalInstanceStore(state, [mine, theirs], poll_interval=0.05)
    await store.start()
    registry = HandlerRegistry()
    registry.register(ScriptedHandler())
    manager = DiscoveryManager(store, registry, "node-a")
    served = ServedInstances(store, manager.ownership)
    await manager.start()
    displaced = ObjectKey("default", "cam")
    try:
        # only default has Instances: it owns the name (rule 1) and runs
        await until(lambda: set(manager.runners) == {displaced})
        assert served.get(held.name) is not None and served.served(held)
        await store.create(
            Instance(name="cam-222222", namespace="other", configuration_name="cam", capacity=1)
        )
        await until(lambda: set(manager.runners) == {ObjectKey("other", "cam")})
        assert manager.ownership.owner("cam") == "other"
        # held: draining, not left; the device plugins do not serve it, the reclaimers see it
        await until(lambda: "node-a" in (store.get_cached(held.key) or held).draining_nodes)
        draining = store.get_cached(held.key)
        assert draining is not None and draining.nodes == ("node-a",)
        assert draining.device_usage == held.device_usage
        assert manager.draining() == {held.key: ("cam-111111-0",)}
        assert served.get(held.name) is None and served.served(draining)
        index = HeldIndex("node-a", served.served)  # the device-plugin reclaimer's view
        index.update(draining)
        assert [h.slot for h in index] == ["cam-111111-0"]
        assert held.name not in manager.offline_instances()  # not the owner's name to hide
        # its container ends: the reclaimer frees the slot, and the node leaves (the last
        # one: the Instance is deleted)
        freed = await manager.ledger.release_slots(held.key, {"cam-111111-0": "node-a"})
        assert freed == ("cam-111111-0",)
        await until(lambda: store.get_cached(held.key) is None)
        await until(lambda: displaced not in manager.retirements)
    finally:
        await manager.close()
        await store.close()


class InUseIn:
    """This node's kubelet shows a live container on slot 0 of ``name`` only."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.asked: list[str] = []

    async def in_use(self, instance: Instance, not_before: float) -> SlotsInUse:
        self.asked.append(instance.name)
        if instance.name == self.name:
            return SlotsInUse({f"{self.name}-0": "node-a"})
        return SlotsInUse()


async def test_a_recreated_instance_this_node_does_not_discover_records_its_live_slot(
    tmp_path: Path,
) -> None:
    """node-b re-created the Instance with every slot free while node-a's container uses
    slot 0, and node-a does not report the device (lost it). Before: node-a never joined, so
    the slot stayed free for node-b to hand out. Now node-a joins it draining with exactly
    that slot, offers nothing, and leaves once the slot is freed."""
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    handler = ScriptedHandler()
    registry = HandlerRegistry()
    registry.register(handler)
    evidence = InUseIn("cfg-aaaaaa")
    ledger = SlotLedger(store, "node-a", evidence=evidence)
    manager = DiscoveryManager(store, registry, "node-a", ledger=ledger)
    await manager.start()
    key = ObjectKey("default", "cfg")
    free = {"-0": "", "-1": ""}

    def by_node_b(name: str) -> Instance:
        usage = {f"{name}{suffix}": value for suffix, value in free.items()}
        return Instance(
            name=name,
            configuration_name="cfg",
            capacity=2,
            shared=True,
            nodes=("node-b",),
            device_usage=usage,
        )

    try:
        await manager.handle_configuration_event(ConfigurationEvent(EventType.ADDED, key, cfg()))
        await handler.queue.put([])  # node-a sees no device
        await store.create(by_node_b("cfg-bbbbbb"))  # nothing of node-a's in it
        recreated = await store.create(by_node_b("cfg-aaaaaa"))
        await until(lambda: "node-a" in (store.get_cached(recreated.key) or recreated).nodes)
        joined = store.get_cached(recreated.key)
        assert joined is not None and joined.draining_nodes == ("node-a",)
        assert joined.nodes == ("node-b", "node-a")
        assert joined.device_usage == {"cfg-aaaaaa-0": "node-a", "cfg-aaaaaa-1": ""}
        await until(lambda: "cfg-aaaaaa" in manager.offline_instances())
        assert manager.draining() == {recreated.key: ("cfg-aaaaaa-0",)}
        other = store.get_cached(ObjectKey("default", "cfg-bbbbbb"))
        assert other is not None and other.nodes == ("node-b",)  # nothing in use: untouched
        asked = evidence.asked.count("cfg-bbbbbb")
        await handler.queue.put([])  # another reconcile: asked once per Instance version
        await asyncio.sleep(0.1)
        assert evidence.asked.count("cfg-bbbbbb") == asked == 1
        # the container ends: the reclaimer frees the slot, node-a leaves
        await ledger.release_slots(recreated.key, {"cfg-aaaaaa-0": "node-a"})
        await until(lambda: (store.get_cached(recreated.key) or joined).nodes == ("node-b",))
        assert manager.draining() == {} and manager.offline_instances() == frozenset()
    finally:
        await manager.close()
        await store.close()


class RacingStore(LocalInstanceStore):
    """Another node creates every Instance just before this one does (all nodes see a shared
    device at the same moment): ``create`` stores the other node's and answers
    AlreadyExists, as the API server does to the loser. ``get`` calls are counted."""

    gets = 0

    async def create(self, instance: Instance) -> Instance:
        from agent.core.store.base import AlreadyExistsError

        await super().create(instance.evolve(nodes=("node-0",)))
        raise AlreadyExistsError(str(instance.key))

    async def get(self, key: ObjectKey) -> Instance:
        self.gets += 1
        return await super().get(key)


async def test_losing_a_create_race_joins_from_the_cache(tmp_path: Path) -> None:
    """Before: every node that lost the race to create a shared Instance read it back with a
    GET (N-1 GETs per Instance when N nodes see a device at once); the created object is in
    the cache already (here at once; on a cluster usually, by the watch)."""
    store = RacingStore(tmp_path / "state", poll_interval=0.05)
    await store.start()
    handler = ScriptedHandler()
    registry = HandlerRegistry()
    registry.register(handler)
    manager = DiscoveryManager(store, registry, "node-a", GraceSettings(local=0, shared=0.3))
    await manager.start()
    try:
        await manager.handle_configuration_event(
            ConfigurationEvent(EventType.ADDED, ObjectKey("default", "cfg"), cfg())
        )
        await handler.queue.put([Device("d1")])
        await until(lambda: [sorted(i.nodes) for i in instances(store)] == [["node-0", "node-a"]])
        assert store.gets == 0
    finally:
        await manager.close()
        await store.close()


async def test_the_seen_listeners_hear_when_a_device_is_first_reported(setup) -> None:  # type: ignore[no-untyped-def]
    """An offline mark this node left before a restart is cleared only once its handler
    reports the device (:meth:`DiscoveryManager.seen_instances`); the offline set does not
    change then, so the marks must hear of it otherwise — before, they waited for their 30 s
    recheck (seen as a flaky multi-agent test under load)."""
    _store, handler, manager = setup
    heard: list[frozenset[str]] = []
    manager.add_seen_listener(lambda: heard.append(manager.seen_instances()))
    await manager.handle_configuration_event(
        ConfigurationEvent(EventType.ADDED, ObjectKey("default", "cfg"), cfg())
    )
    await handler.queue.put([Device("d1")])
    await until(lambda: len(heard) == 1)
    (name,) = heard[0]
    assert manager.offline_instances() == frozenset()  # nothing else would have told them
    await handler.queue.put([Device("d1")])  # the same list again: nothing new seen
    await handler.queue.put([Device("d1"), Device("d2")])
    await until(lambda: len(heard) == 2)
    assert name in heard[1] and len(heard[1]) == 2


async def test_a_device_an_edited_configuration_no_longer_selects_goes_without_the_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 42.6: a filter edit is not an outage. With a 300 s shared grace, a device the
    edited Configuration no longer selects (missing from its first full list) is left at
    once — draining while this node holds a slot, then gone when it is released — instead
    of staying offline for the grace as if it had gone. A device that goes missing later
    (not in the first list after an edit) still gets the grace."""
    from agent.core.ledger.decisions import Owner

    key = ObjectKey("default", "cfg")
    async with running(tmp_path, shared_grace=300) as (store, handler, manager):
        await manager.handle_configuration_event(
            ConfigurationEvent(EventType.ADDED, key, cfg(details="names: [a, b, c]"))
        )
        await handler.queue.put([Device("a"), Device("b"), Device("c")])
        await until(lambda: len(instances(store)) == 3)
        runner = manager.runners[key]
        await until(lambda: len(runner.devices_by_instance) == 3)
        names = {device.id: name for name, device in runner.devices_by_instance.items()}
        held = ObjectKey("default", names["b"])
        await manager.ledger.claim(held, f"{names['b']}-0", Owner.instance_level("node-a"))
        # the filter is edited: a is no longer selected, b neither (and a slot of it is held)
        await manager.handle_configuration_event(
            ConfigurationEvent(EventType.MODIFIED, key, cfg(details="names: [c]"))
        )
        await until(lambda: handler.started == 2)
        with caplog.at_level(logging.INFO, logger="agent.discovery"):
            await handler.queue.put([Device("c")])
            await until(lambda: store.get_cached(ObjectKey("default", names["a"])) is None)
            await until(
                lambda: "node-a" in (store.get_cached(held) or Instance("x")).draining_nodes
            )
        assert "no longer selected" in caplog.text
        assert "its Configuration no longer selects the device" in caplog.text
        assert manager.draining() == {held: (f"{names['b']}-0",)}
        await manager.ledger.release_slots(held, {f"{names['b']}-0": "node-a"})
        await until(lambda: store.get_cached(held) is None)
        # a device missing from a later list is offline for the grace, not gone
        await handler.queue.put([])
        c = ObjectKey("default", names["c"])
        await until(lambda: names["c"] in manager.offline_instances())
        assert store.get_cached(c) is not None
