"""Processes that race on one local state directory (tests/core/test_torn_reads.py, issue 34.1-2).

    python -m tests.core.state_racers ROLE STATE_DIR SECONDS NAME

Every role works on Instance NAME until SECONDS have passed and then prints one JSON line
(what it did). The journal compacts every ``AKRI_TEST_COMPACT_AFTER`` records (default: the
shipped value), so a short run sees many compactions: the moment a reader that read
``<name>.json`` and ``<name>.journal`` apart could combine an old file with a newer journal.

Roles:

``writer``
    Claims the highest free slot, one per write, from what it wrote last (as an agent claims
    from its cache; a fresh ``get`` after a conflict). After ``AKRI_TEST_CYCLE`` (300) claims
    it frees every slot and flips the capacity between 1000 and 999 (a full rewrite with
    other slot names). Alone, every state it writes holds exactly the top k slots of its
    capacity. With ``AKRI_TEST_PAUSE`` it sleeps that long after every ``AKRI_TEST_BURST``
    writes. Reports each write: ``[resourceVersion, slot]`` for a claim, ``[rv, null]`` for
    a reset.
``get`` / ``status``
    Reads the Instance with ``LocalInstanceStore.get`` / the whole directory with
    ``read_state_dir`` (what ``akri status`` does) in a loop, and counts the views that are no
    state the writer wrote (:func:`torn`) and the reads refused as corrupt.
``gap-claimer``
    Reads the Instance with ``get`` (as ``cas_update`` does after a conflict) and claims, with
    a resourceVersion-checked update, every free slot of the view that lies above a held
    one. The writer's states have none, so this process writes only when a view was torn,
    and each of its writes that is accepted takes slots the writer was granted. Reports the
    accepted writes as ``[rv, slot...]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store import journal
from agent.core.store.base import ConflictError, CorruptStateError
from agent.core.store.local import LocalInstanceStore, read_state_dir

PAUSE = float(os.environ.get("AKRI_TEST_PAUSE", "0"))
BURST = int(os.environ.get("AKRI_TEST_BURST", "1"))
if "AKRI_TEST_COMPACT_AFTER" in os.environ:
    journal.COMPACT_AFTER = int(os.environ["AKRI_TEST_COMPACT_AFTER"])


def fresh(name: str, capacity: int) -> Instance:
    """An Instance with every slot free."""
    return Instance(
        name=name,
        configuration_name=name.rsplit("-", 1)[0],
        capacity=capacity,
        nodes=("n1",),
        shared=True,
        device_usage={f"{name}-{i}": "" for i in range(capacity)},
    )


def slot_numbers(instance: Instance, held: bool) -> list[int]:
    """The held (or free) slots of ``instance``, as numbers, ascending."""
    prefix = f"{instance.name}-"
    return sorted(
        int(slot.removeprefix(prefix))
        for slot, holder in instance.device_usage.items()
        if bool(holder) == held
    )


def gaps(instance: Instance) -> list[int]:
    """Free slots above the lowest held one (the writer's states have none)."""
    held = slot_numbers(instance, held=True)
    return [n for n in slot_numbers(instance, held=False) if held and n > held[0]]


def torn(instance: Instance) -> str | None:
    """Why ``instance`` is no state the writer wrote (None when it is one): the writer's
    states have exactly the slots of their capacity and hold the top k of them."""
    prefix = f"{instance.name}-"
    slots = {int(slot.removeprefix(prefix)) for slot in instance.device_usage}
    if slots != set(range(instance.capacity)):
        return f"rv {instance.resource_version}: not the slots of capacity {instance.capacity}"
    free = gaps(instance)
    if free:
        return (
            f"rv {instance.resource_version}: {len(slot_numbers(instance, held=True))} slots "
            f"held, {len(free)} free among them (e.g. {free[:3]})"
        )
    return None


async def writer(store: LocalInstanceStore, key: ObjectKey, deadline: float) -> dict[str, Any]:
    cycle = int(os.environ.get("AKRI_TEST_CYCLE", "300"))
    await store.start()
    current = await store.get(key)
    writes: list[list[int | None]] = []
    conflicts = 0
    while time.monotonic() < deadline:
        free = slot_numbers(current, held=False)
        held = current.capacity - len(free)
        if held >= cycle or not free:
            capacity = 999 if current.capacity == 1000 else 1000
            after = fresh(key.name, capacity).evolve(resource_version=current.resource_version)
            slot = None
        else:
            slot = free[-1]
            usage = {**current.device_usage, f"{key.name}-{slot}": "writer"}
            after = current.evolve(device_usage=usage)
        try:
            current = await store.update(after)
        except ConflictError:
            conflicts += 1
            current = await store.get(key)
            continue
        writes.append([int(current.resource_version or 0), slot])
        if PAUSE and len(writes) % BURST == 0:
            await asyncio.sleep(PAUSE)
    await store.close()
    return {"writes": writes, "conflicts": conflicts}


async def reader(
    store: LocalInstanceStore, key: ObjectKey, deadline: float, how: str
) -> dict[str, Any]:
    views = torn_views = corrupt = 0
    examples: list[str] = []
    while time.monotonic() < deadline:
        try:
            seen = [await store.get(key)] if how == "get" else read_state_dir(store.state_dir)
        except CorruptStateError as error:
            corrupt += 1
            if len(examples) < 5:
                examples.append(f"corrupt: {error}")
            continue
        for instance in seen:
            views += 1
            why = torn(instance)
            if why is not None:
                torn_views += 1
                if len(examples) < 5:
                    examples.append(why)
    return {"views": views, "torn": torn_views, "corrupt": corrupt, "examples": examples}


async def gap_claimer(store: LocalInstanceStore, key: ObjectKey, deadline: float) -> dict[str, Any]:
    reads = attempts = 0
    accepted: list[list[int]] = []
    while time.monotonic() < deadline:
        try:
            view = await store.get(key)
        except CorruptStateError:
            continue  # refused, never written from
        reads += 1
        wanted = gaps(view)
        if not wanted:
            continue
        attempts += 1
        usage = {**view.device_usage, **{f"{key.name}-{n}": "gap-claimer" for n in wanted}}
        try:
            stored = await store.update(view.evolve(device_usage=usage))
        except ConflictError:
            continue
        accepted.append([int(stored.resource_version or 0), *wanted])
    return {"reads": reads, "attempts": attempts, "accepted": accepted}


def main(argv: list[str]) -> int:
    role, state, seconds, name = argv
    deadline = time.monotonic() + float(seconds)
    key = ObjectKey("default", name)
    # Readers are not started: the poll loop's rescans would take the time they should
    # spend reading the way they were asked to. Nothing here fsyncs: races, not power loss.
    store = LocalInstanceStore(Path(state), poll_interval=3600, durable=False)
    if role == "writer":
        result = asyncio.run(writer(store, key, deadline))
    elif role in ("get", "status"):
        result = asyncio.run(reader(store, key, deadline, role))
    elif role == "gap-claimer":
        result = asyncio.run(gap_claimer(store, key, deadline))
    else:
        print(f"unknown role {role!r}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
