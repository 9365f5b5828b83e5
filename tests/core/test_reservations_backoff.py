"""Pure pieces of issue 30: the reservation overlay the device plugins see, and the per-key
failure backoff with rate-limited reporting."""

from __future__ import annotations

from agent.core.aio.backoff import FailureBackoff
from agent.core.ledger.reservations import DRA_ALLOCATED, RESERVED, UNSETTLED, Reservations
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey

KEY = ObjectKey("default", "cam-8120fe")


def make(**usage: str) -> Instance:
    base = {f"cam-8120fe-{i}": "" for i in range(3)}
    return Instance("cam-8120fe", "cam", 3, nodes=("a",), device_usage={**base, **usage})


def test_overlay_shows_reserved_free_slots_held_and_keeps_identity_otherwise() -> None:
    reservations = Reservations()
    changes: list[set[ObjectKey]] = []
    reservations.add_listener(changes.append)
    instance = make(**{"cam-8120fe-1": "D:u1:a"})
    assert reservations.overlay(instance) is instance  # nothing reserved: the same object
    reservations.replace(DRA_ALLOCATED, {KEY: {"cam-8120fe-0", "cam-8120fe-1"}})
    reservations.add(UNSETTLED, KEY, "cam-8120fe-2")
    seen = reservations.overlay(instance)
    # free reserved slots look held; a held one keeps its holder
    assert seen.device_usage == {
        "cam-8120fe-0": RESERVED,
        "cam-8120fe-1": "D:u1:a",
        "cam-8120fe-2": RESERVED,
    }
    assert instance.device_usage["cam-8120fe-0"] == ""  # never written
    reservations.discard(UNSETTLED, KEY, "cam-8120fe-2")
    reservations.replace(DRA_ALLOCATED, {})
    assert reservations.slots(KEY) == frozenset()
    assert changes == [{KEY}, {KEY}, {KEY}, {KEY}]
    reservations.replace(DRA_ALLOCATED, {})  # no change: no notification
    assert len(changes) == 4


def test_backoff_doubles_to_the_cap_and_reports_rarely() -> None:
    backoff: FailureBackoff[str] = FailureBackoff(initial=1.0, maximum=8.0, log_every=30.0)
    now = 0.0
    logged = []
    delays = []
    while now < 60.0:
        if backoff.due("x", now):
            failure = backoff.failed("x", now)
            delays.append(failure.delay)
            if failure.log:
                logged.append((now, failure.unlogged))
        now += 1.0
    assert delays[:5] == [1.0, 2.0, 4.0, 8.0, 8.0] and max(delays) == 8.0
    assert logged[0] == (0.0, 0) and len(logged) == 2  # the first, then one 30 s later
    assert logged[1][1] > 0  # with how many were not logged
    assert backoff.succeeded("x") == len(delays)
    assert backoff.due("x", now) and backoff.succeeded("x") == 0
