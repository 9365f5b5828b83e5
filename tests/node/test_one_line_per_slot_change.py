"""Issue 27: one INFO line per slot change (the activity log's), none per re-grant: kubelet
re-offering a slot its owner already holds is the hot path of admissions and writes nothing."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from agent.core.ledger.decisions import Owner
from agent.core.ledger.ledger import SlotLedger
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import EventType, InstanceEvent
from agent.core.store.local import LocalInstanceStore
from agent.node.activity_log import describe, log_instance_changes

NAME = "cfg-abcdef"
KEY = ObjectKey("default", NAME)


class Lines(logging.Handler):
    """INFO-and-above records of the ``agent`` loggers; wakes a waiter on each."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.arrived = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")
        self.arrived.set()

    async def until(self, text: str) -> None:
        async with asyncio.timeout(30):  # generous: the event arrives in milliseconds
            while not any(text in line for line in self.lines):
                self.arrived.clear()
                await self.arrived.wait()


async def test_each_slot_change_is_one_info_line_and_a_regrant_none(tmp_path: Path) -> None:
    store = LocalInstanceStore(tmp_path, poll_interval=0.05)
    await store.start()
    lines = Lines()
    agent_logger = logging.getLogger("agent")
    agent_logger.addHandler(lines)
    saved = agent_logger.level
    agent_logger.setLevel(logging.INFO)
    activity = asyncio.create_task(log_instance_changes(store.subscribe_instances()))
    try:
        usage = {f"{NAME}-{i}": "" for i in range(4)}
        await store.create(
            Instance(NAME, "cfg", 4, shared=True, nodes=("node-a",), device_usage=usage)
        )
        await lines.until(f"instance {NAME} added")
        ledger = SlotLedger(store, "node-a")
        owner = Owner.instance_level("node-a")
        assert (await ledger.claim(KEY, f"{NAME}-1", owner)).changed
        for _ in range(5):  # kubelet re-offers the slot: nothing is written, nothing logged
            assert not (await ledger.claim(KEY, f"{NAME}-1", owner)).changed
        assert await ledger.release(KEY, f"{NAME}-1", owner)
        await lines.until(f"slot {NAME}-1: node-a -> free")
    finally:
        activity.cancel()
        agent_logger.removeHandler(lines)
        agent_logger.setLevel(saved)
        await store.close()
    slot_lines = [line for line in lines.lines if f"{NAME}-1" in line]
    assert slot_lines == [
        f"agent.instances: slot {NAME}-1: free -> node-a",
        f"agent.instances: slot {NAME}-1: node-a -> free",
    ]


@pytest.mark.parametrize("capacity", [1, 1000])
def test_only_the_changed_slots_are_described(capacity: int) -> None:
    usage = {f"{NAME}-{i}": "" for i in range(capacity)}
    old = Instance(NAME, "cfg", capacity, shared=True, nodes=("n1",), device_usage=usage)
    slot = f"{NAME}-{capacity - 1}"
    new = old.evolve(device_usage={**usage, slot: "n1"})
    assert describe(InstanceEvent(EventType.MODIFIED, new, old)) == [f"slot {slot}: free -> n1"]
