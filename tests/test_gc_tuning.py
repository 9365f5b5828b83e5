"""gc_tuning: startup objects move to the permanent generation; garbage is collected first."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from agent.gc_tuning import freeze_after_settling, freeze_long_lived


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


async def test_freeze_after_settling_freezes_later() -> None:
    assert gc.get_freeze_count() == 0
    await freeze_after_settling(0.01)
    assert gc.get_freeze_count() > 0
