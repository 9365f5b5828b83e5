"""gc_tuning: startup objects move to the permanent generation; garbage is collected first."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Iterator

import pytest

from agent.ops.gc_tuning import freeze_long_lived, freeze_when_settled


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_collects_garbage_then_freezes_the_living() -> None:
    dead = weakref.ref(cycle())  # unreachable cycle: only a collection frees it
    alive = cycle()
    assert dead() is not None
    freeze_long_lived()
    assert dead() is None
    assert gc.get_freeze_count() > 0
    # the living cycle is no longer in any generation a collection walks
    assert not any(alive is obj for generation in range(3) for obj in gc.get_objects(generation))


def test_freeze_never_walks_the_oldest_generation() -> None:
    """A full collection at 1,000 Instances held the loop 116 ms and found nothing."""
    collected: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collected.append(info["generation"])

    gc.callbacks.append(record)
    try:
        freeze_long_lived()
    finally:
        gc.callbacks.remove(record)
    assert collected and max(collected) < 2, collected


async def test_freezes_once_the_changes_have_been_quiet() -> None:
    changes: asyncio.Queue[int] = asyncio.Queue()

    async def stream() -> AsyncIterator[int]:
        while True:
            yield await changes.get()

    task = asyncio.create_task(freeze_when_settled(stream(), quiet=0.2))
    for i in range(5):  # a burst of changes, each within the quiet period of the last
        changes.put_nowait(i)
        await asyncio.sleep(0.05)
        assert gc.get_freeze_count() == 0 and not task.done()
    await asyncio.wait_for(task, 5)
    assert gc.get_freeze_count() > 0


async def test_a_long_burst_is_frozen_as_it_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A startup that keeps changing for longer than FREEZE_EVERY_SECONDS is frozen along the
    way, before it settles (so automatic full collections never walk all it built)."""
    monkeypatch.setattr("agent.ops.gc_tuning.FREEZE_EVERY_SECONDS", 0.1)
    changes: asyncio.Queue[int] = asyncio.Queue()

    async def stream() -> AsyncIterator[int]:
        while True:
            yield await changes.get()

    task = asyncio.create_task(freeze_when_settled(stream(), quiet=5))
    for i in range(6):
        changes.put_nowait(i)
        await asyncio.sleep(0.05)
    assert not task.done() and gc.get_freeze_count() > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_no_freeze_when_the_changes_end() -> None:
    async def ended() -> AsyncIterator[int]:
        yield 1

    await asyncio.wait_for(freeze_when_settled(ended(), quiet=5), 1)
    assert gc.get_freeze_count() == 0
