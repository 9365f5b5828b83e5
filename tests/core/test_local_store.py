"""Local backend: CAS semantics, events, atomic files, corruption, other processes."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
from pathlib import Path

import pytest

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import (
    AlreadyExistsError,
    ConflictError,
    CorruptStateError,
    EventType,
    InstanceEvent,
    NotFoundError,
    StoreError,
)
from agent.core.store.local import COUNTER_FILE, LocalInstanceStore, read_state_dir

KEY = ObjectKey("default", "cfg-abcdef")


def make(name: str = "cfg-abcdef", capacity: int = 2) -> Instance:
    return Instance(
        name=name,
        configuration_name="cfg",
        capacity=capacity,
        nodes=("n1",),
        device_usage={f"{name}-{i}": "" for i in range(capacity)},
    )


@pytest.fixture
async def store(tmp_path: Path) -> LocalInstanceStore:
    s = LocalInstanceStore(tmp_path / "state", poll_interval=0.05)
    await s.start()
    yield s  # type: ignore[misc]
    await s.close()


async def test_create_assigns_version_and_uid(store: LocalInstanceStore) -> None:
    created = await store.create(make())
    assert created.resource_version is not None and created.resource_version.isdigit()
    assert created.uid
    assert store.get_cached(KEY) == created
    assert await store.get(KEY) == created
    with pytest.raises(AlreadyExistsError):
        await store.create(make())


async def test_update_is_compare_and_swap(store: LocalInstanceStore) -> None:
    created = await store.create(make())
    first = await store.update(created.evolve(nodes=("n1", "n2")))
    assert int(first.resource_version or 0) > int(created.resource_version or 0)
    assert first.uid == created.uid
    with pytest.raises(ConflictError):
        await store.update(created.evolve(nodes=("n3",)))  # decided on the old version
    assert (await store.get(created.key)).nodes == ("n1", "n2")
    with pytest.raises(ConflictError):
        await store.update(created.evolve(resource_version=None))
    with pytest.raises(NotFoundError):
        await store.update(make("other-abcdef").evolve(resource_version="1"))


async def test_delete_with_precondition(store: LocalInstanceStore) -> None:
    created = await store.create(make())
    updated = await store.update(created.evolve(nodes=()))
    with pytest.raises(ConflictError):
        await store.delete(created.key, resource_version=created.resource_version)
    await store.delete(created.key, resource_version=updated.resource_version)
    assert store.get_cached(created.key) is None
    with pytest.raises(NotFoundError):
        await store.delete(created.key)
    with pytest.raises(NotFoundError):
        await store.get(created.key)


async def test_versions_never_reused_after_delete_and_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = LocalInstanceStore(state)
    await first.start()
    a = await first.create(make())
    await first.delete(a.key)
    await first.close()
    second = LocalInstanceStore(state)
    await second.start()
    b = await second.create(make())
    assert int(b.resource_version or 0) > int(a.resource_version or 0) + 0
    assert b.resource_version != a.resource_version
    await second.close()


async def test_invalid_names_rejected(store: LocalInstanceStore) -> None:
    for bad in ["../escape", "UPPER", "a/b", ""]:
        with pytest.raises(StoreError):
            await store.create(make().evolve(name=bad))


async def test_subscribers_get_current_state_then_changes(store: LocalInstanceStore) -> None:
    created = await store.create(make())
    events: list[InstanceEvent] = []
    subscription = store.subscribe_instances()
    updated = await store.update(created.evolve(nodes=("n1", "n2")))
    await store.delete(created.key)
    for _ in range(3):
        events.append(await asyncio.wait_for(subscription.__anext__(), 1))
    subscription.close()
    assert [e.type for e in events] == [EventType.ADDED, EventType.MODIFIED, EventType.DELETED]
    assert events[0].instance == created
    assert events[1].instance == updated and events[1].previous == created


async def test_files_are_complete_json_and_temp_files_cleaned(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = LocalInstanceStore(state)
    await store.start()
    await store.create(make())
    await store.close()
    path = state / "instances" / "cfg-abcdef.json"
    obj = json.loads(path.read_text())
    assert obj["apiVersion"] == "akri.sh/v0" and obj["kind"] == "Instance"
    assert obj["spec"]["deviceUsage"] == {"cfg-abcdef-0": "", "cfg-abcdef-1": ""}
    # a write killed before its rename leaves only a temp file: ignored and removed
    stray = state / "instances" / ".tmp-cfg-abcdef.json.999"
    stray.write_text("{half")
    store = LocalInstanceStore(state)
    await store.start()
    assert not stray.exists()
    assert [i.name for i in store.list_cached()] == ["cfg-abcdef"]
    await store.close()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "not valid JSON"),
        ('{"metadata": {"name": "cfg-abcdef"}, "spec": {}}', "configurationName"),
        ("[]", "must be an object"),
    ],
)
async def test_corrupt_state_refuses_to_start_naming_the_file(
    tmp_path: Path, content: str, reason: str
) -> None:
    state = tmp_path / "state"
    (state / "instances").mkdir(parents=True)
    bad = state / "instances" / "cfg-abcdef.json"
    bad.write_text(content)
    store = LocalInstanceStore(state)
    with pytest.raises(CorruptStateError) as info:
        await store.start()
    assert str(bad) in str(info.value)
    assert reason in str(info.value)
    with pytest.raises(CorruptStateError):
        read_state_dir(state)


async def test_corrupt_counter_file_is_reported(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "resource-version").write_text("garbage")
    with pytest.raises(CorruptStateError, match="resource-version"):
        await LocalInstanceStore(state).start()


async def test_changes_by_another_store_are_picked_up(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ours = LocalInstanceStore(state, poll_interval=0.05)
    theirs = LocalInstanceStore(state, poll_interval=0.05)
    await ours.start()
    await theirs.start()
    created = await theirs.create(make())
    for _ in range(100):
        if ours.get_cached(created.key) is not None:
            break
        await asyncio.sleep(0.02)
    assert ours.get_cached(created.key) == created
    # a write based on our (now stale after their update) cache conflicts
    await theirs.update(created.evolve(nodes=("n1", "n2")))
    with pytest.raises(ConflictError):
        await ours.update(created.evolve(nodes=("n9",)))
    await ours.close()
    await theirs.close()


async def test_own_burst_of_writes_never_rereads_the_directory(tmp_path: Path) -> None:
    """Each write bumps the counter file the poll watches; the poll must know its own process's
    writes (even while the writer thread has not recorded them yet) or every write costs a full
    directory read — 1,000 MQTT announcements took 15 s."""
    store = LocalInstanceStore(tmp_path / "state", poll_interval=0.05, durable=False)
    await store.start()
    rescans = 0
    real_rescan = store._rescan

    def counting_rescan(*, publish: bool) -> None:
        nonlocal rescans
        rescans += 1
        real_rescan(publish=publish)

    store._rescan = counting_rescan  # type: ignore[method-assign]
    polled = asyncio.Event()
    real_poll = store._poll_once

    def signalling_poll() -> None:
        real_poll()
        polled.set()

    store._poll_once = signalling_poll  # type: ignore[method-assign]
    try:
        for index in range(300):
            await store.create(make(f"burst-{index}", capacity=1))
            if index % 10 == 0:
                await asyncio.sleep(0)  # let the poll run mid-burst, as it does in the agent
        # a poll that runs from now on comes after every poll the burst woke (they run one
        # at a time), so it proves the burst was looked at; touching the counter (its value
        # is still our own last write) makes sure one runs
        polled.clear()
        os.utime(tmp_path / "state" / COUNTER_FILE)
        await asyncio.wait_for(polled.wait(), 10)
        assert rescans == 0
        # and another process's write is still noticed
        other = LocalInstanceStore(tmp_path / "state", poll_interval=0.05, durable=False)
        await other.start()
        created = await other.create(make("from-other", capacity=1))
        for _ in range(100):
            if store.get_cached(created.key) is not None:
                break
            await asyncio.sleep(0.02)
        assert store.get_cached(created.key) == created
        assert rescans >= 1
        await other.close()
    finally:
        await store.close()


def _hammer(state: str, worker: int, rounds: int) -> None:
    """Child process: append its own marker to brokerProperties with CAS retries."""

    async def run() -> None:
        store = LocalInstanceStore(Path(state), poll_interval=10)
        await store.start()
        for round_ in range(rounds):
            while True:
                current = await store.get(KEY)
                props = dict(current.broker_properties)
                props[f"w{worker}-{round_}"] = "x"
                try:
                    await store.update(current.evolve(broker_properties=props))
                    break
                except ConflictError:
                    continue
        await store.close()

    asyncio.run(run())


async def test_concurrent_processes_never_lose_an_update(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = LocalInstanceStore(state)
    await store.start()
    await store.create(make())
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_hammer, args=(str(state), w, 15)) for w in range(4)]
    for process in workers:
        process.start()
    await asyncio.to_thread(lambda: [p.join(60) for p in workers])
    assert all(p.exitcode == 0 for p in workers)
    final = await store.get(KEY)
    expected = {f"w{w}-{r}" for w in range(4) for r in range(15)}
    assert set(final.broker_properties) == expected
    await store.close()
