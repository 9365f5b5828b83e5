"""Informer: the cache never keeps managedFields; versions are opaque; our own writes are
never undone by an older list or watch event; every error event relists."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from agent.core.kube import make_kube_client, resource_path
from agent.core.kube.client import MAX_RETRY_AFTER
from agent.core.kube.errors import ApiError
from agent.core.store.informer import (
    Informer,
    Obj,
    RawEvent,
    WatchExpiredError,
    parse_watch_line,
    retry_delay,
    watch_events,
)
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS

MANAGED = [{"manager": "kubectl", "operation": "Update", "fieldsV1": {"f:spec": {}}}]


def obj(name: str, version: str) -> Obj:
    return {
        "metadata": {
            "name": name,
            "namespace": "default",
            "resourceVersion": version,
            "managedFields": MANAGED,
        },
        "spec": {"x": version},
    }


async def test_cache_and_events_have_no_managed_fields() -> None:
    seen: list[RawEvent] = []
    watched = asyncio.Event()

    async def list_fn() -> tuple[list[Obj], str]:
        return [obj("a", "1")], "1"

    async def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        yield "MODIFIED", obj("a", "2")
        yield "ADDED", obj("b", "3")
        watched.set()
        await asyncio.Event().wait()

    informer = Informer("things", list_fn, watch_fn, seen.append)
    await informer.initial_list()
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(watched.wait(), 5)
        await asyncio.sleep(0)
        informer.apply_local(RawEvent("MODIFIED", obj("b", "4")))
    finally:
        task.cancel()
    assert [(e.type, e.obj["metadata"]["resourceVersion"]) for e in seen] == [
        ("ADDED", "1"),
        ("MODIFIED", "2"),
        ("ADDED", "3"),
        ("MODIFIED", "4"),
    ]
    everything: list[dict[str, Any]] = [e.obj for e in seen] + list(informer.cache.values())
    assert all("managedFields" not in o["metadata"] for o in everything)
    assert informer.cache["default/b"]["spec"] == {"x": "4"}


def versions(seen: list[RawEvent]) -> list[tuple[str, str]]:
    return [(e.type, e.obj["metadata"]["resourceVersion"]) for e in seen]


async def test_resource_versions_are_opaque_strings() -> None:
    """A real server's versions need not be integers, nor grow as strings: any version other
    than the cached one is news."""
    seen: list[RawEvent] = []
    watched = asyncio.Event()

    async def list_fn() -> tuple[list[Obj], str]:
        return [obj("a", "zz9")], "zz9"

    async def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        yield "MODIFIED", obj("a", "aa1")  # "smaller" as a string, still the newer one
        yield "MODIFIED", obj("a", "aa1")  # the same version again: no event
        yield "MODIFIED", obj("a", "10")
        watched.set()
        await asyncio.Event().wait()

    informer = Informer("things", list_fn, watch_fn, seen.append)
    await informer.initial_list()
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(watched.wait(), 5)
    finally:
        task.cancel()
    assert versions(seen) == [("ADDED", "zz9"), ("MODIFIED", "aa1"), ("MODIFIED", "10")]
    assert informer.cache["default/a"]["spec"] == {"x": "10"}


async def test_relist_does_not_move_the_cache_behind_our_own_write() -> None:
    """A list asked for before our write completed may answer from an older snapshot; the
    cache keeps our write, and the watch's older events for the object are skipped until our
    own version comes by."""
    seen: list[RawEvent] = []
    listing = asyncio.Event()
    release_list = asyncio.Event()
    watched = asyncio.Event()
    lists = 0

    async def list_fn() -> tuple[list[Obj], str]:
        nonlocal lists
        lists += 1
        if lists == 1:
            return [obj("a", "v1")], "v1"
        listing.set()
        await release_list.wait()
        return [obj("a", "v1")], "v1"  # a snapshot from before our write

    watches = 0

    async def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        nonlocal watches
        watches += 1
        if watches == 1:
            raise WatchExpiredError("error event 410: too old")
        yield "MODIFIED", obj("a", "v1b")  # someone else's write, before ours
        yield "MODIFIED", obj("a", "mine")  # our write, echoed
        yield "MODIFIED", obj("a", "v3")  # a later write by someone else
        watched.set()
        await asyncio.Event().wait()

    informer = Informer("things", list_fn, watch_fn, seen.append, max_backoff=0.01)
    await informer.initial_list()
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(listing.wait(), 5)
        informer.apply_local(RawEvent("MODIFIED", obj("a", "mine")))
        release_list.set()
        await asyncio.wait_for(watched.wait(), 5)
        await asyncio.sleep(0)
    finally:
        task.cancel()
    assert versions(seen) == [("ADDED", "v1"), ("MODIFIED", "mine"), ("MODIFIED", "v3")]
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "v3"


async def test_an_unconfirmed_own_write_is_forgotten_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If the watch never shows our version (it had moved past it), the object's later events
    are applied once the confirmation window has passed: the cache never freezes."""
    seen: list[RawEvent] = []
    informer = Informer("things", _no_list, _no_watch, seen.append)
    informer.apply_local(RawEvent("ADDED", obj("a", "mine")))
    informer._from_watch(RawEvent("MODIFIED", obj("a", "other")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "mine"
    now = time.monotonic()
    monkeypatch.setattr("agent.core.store.informer.time.monotonic", lambda: now + 31)
    informer._from_watch(RawEvent("MODIFIED", obj("a", "later")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "later"


async def _no_list() -> tuple[list[Obj], str]:
    return [], ""


async def _no_watch(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
    await asyncio.Event().wait()
    yield "", {}


@pytest.mark.parametrize(
    ("code", "message"),
    [(410, "too old resource version"), (500, "Too large resource version: 99, current: 7")],
)
def test_every_error_event_asks_for_a_relist(code: int, message: str) -> None:
    line = json.dumps(
        {"type": "ERROR", "object": {"kind": "Status", "code": code, "message": message}}
    ).encode()
    with pytest.raises(WatchExpiredError, match=str(code)):
        parse_watch_line(line)


async def test_an_error_event_relists_instead_of_resuming_from_the_same_version() -> None:
    watched_from: list[str] = []
    lists = 0
    done = asyncio.Event()

    async def list_fn() -> tuple[list[Obj], str]:
        nonlocal lists
        lists += 1
        return [obj("a", "1")], f"list{lists}"

    async def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        watched_from.append(version)
        if len(watched_from) == 1:
            yield "BOOKMARK", {"metadata": {"resourceVersion": "bm7"}}
            parse_watch_line(b'{"type":"ERROR","object":{"code":500,"message":"too large"}}')
        done.set()
        await asyncio.Event().wait()

    informer = Informer("things", list_fn, watch_fn, lambda event: None, max_backoff=0.01)
    await informer.initial_list()
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(done.wait(), 5)
    finally:
        task.cancel()
    assert watched_from == ["list1", "list2"]
    assert informer.relists == 2


def test_a_watch_retry_waits_at_least_what_the_server_asked() -> None:
    """A 429 the client gave up on (too many, or past its deadline) carries
    ``retryAfterSeconds``: the informer must not reconnect sooner than that."""
    throttled = ApiError(429, "TooManyRequests", '{"details": {"retryAfterSeconds": 7}}')
    assert retry_delay(0.5, throttled) == 7.0
    assert 0.25 <= retry_delay(0.5, ApiError(503, "ServiceUnavailable", "{}")) <= 0.5
    assert 0.25 <= retry_delay(0.5, OSError("refused")) <= 0.5
    assert 15.0 <= retry_delay(30.0, throttled) <= 30.0  # a longer backoff stays


def test_a_watch_retry_waits_no_longer_than_the_client_would() -> None:
    """Before: a retryAfterSeconds of an hour left the cache unwatched for an hour (the
    client caps its own waits at MAX_RETRY_AFTER)."""
    hour = ApiError(429, "TooManyRequests", '{"details": {"retryAfterSeconds": 3600}}')
    assert retry_delay(0.5, hour) == MAX_RETRY_AFTER
    assert 15.0 <= retry_delay(30.0, hour) <= 30.0  # a longer own backoff stays


async def test_a_watch_that_fails_at_once_every_time_is_relisted_with_backoff(
    tmp_path: Path,
) -> None:
    """Every watch is answered 410 at once: the first relists at once, every later one in
    a row waits (jittered, doubling from 0.5 s, capped). Before: each relisted at once, a
    tight loop of LISTs against the API server."""
    sleeps: list[float] = []
    enough = asyncio.Event()
    path = resource_path("akri.sh", "v0", "instances", "default")

    async def record(seconds: float) -> None:
        sleeps.append(seconds)

    async with ApiServerDouble(crds=CRDS) as api:
        kube = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")), timeout=5)

        async def list_fn() -> tuple[list[Obj], str]:
            listed = await kube.list_all(path)
            if len(api.requests_for(verb="list")) >= 7:
                enough.set()
            return listed

        def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
            return watch_events(kube.watch(path, version, timeout_seconds=60), "instances")

        api.fail(410, verb="watch", times=None)
        informer = Informer(
            "instances", list_fn, watch_fn, lambda e: None, max_backoff=4.0, sleep=record
        )
        await informer.initial_list()
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(enough.wait(), 10)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await kube.close()
        lists = len(api.requests_for(verb="list"))
    # the initial list, one at once after the first 410, then one after each wait
    assert lists - 2 <= len(sleeps) <= lists - 1
    assert len(sleeps) >= 5
    for index, seconds in enumerate(sleeps):
        ceiling = min(0.5 * 2**index, 4.0)
        assert ceiling / 2 <= seconds <= ceiling


async def test_a_watch_that_expires_after_events_relists_at_once() -> None:
    """A 410 after a watch that delivered events is the normal end of a long watch: no wait."""
    sleeps: list[float] = []
    lists = 0
    done = asyncio.Event()

    async def record(seconds: float) -> None:
        sleeps.append(seconds)

    async def list_fn() -> tuple[list[Obj], str]:
        nonlocal lists
        lists += 1
        if lists == 5:
            done.set()
        await asyncio.sleep(0)  # a real list suspends: let the test see ``done``
        return [obj("a", "1")], f"list{lists}"

    async def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        yield "BOOKMARK", {"metadata": {"resourceVersion": f"{version}-bm"}}
        raise WatchExpiredError("410 Gone")

    informer = Informer("things", list_fn, watch_fn, lambda event: None, sleep=record)
    await informer.initial_list()
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(done.wait(), 5)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert sleeps == []


async def test_a_watch_backing_off_reconnects_within_a_second_of_the_api_answering() -> None:
    """Issue 30 (7): after a 30 s outage the watches came back 16-17 s after the API server
    was ready, their backoff having grown to ~27 s. Now the backoff is capped and, while
    waiting, a cheap probe (``GET /version``) cuts it short as soon as the server answers.
    Fake time: the informer's sleeps advance it."""
    from agent.core.kube.errors import TransportError
    from agent.core.store.informer import MAX_WATCH_BACKOFF, PROBE_INTERVAL

    now = 0.0
    back_at = 30.0  # the API server answers again from here
    watches: list[float] = []
    delays: list[float] = []
    reconnected = asyncio.Event()

    async def sleep(seconds: float) -> None:
        nonlocal now
        delays.append(seconds)
        now += seconds
        await asyncio.sleep(0)

    async def list_fn() -> tuple[list[Obj], str]:
        return [], "1"

    async def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        watches.append(now)
        if now < back_at:
            raise TransportError("connection refused")
        reconnected.set()
        await asyncio.Future()  # a healthy watch: no events
        yield "BOOKMARK", {}

    async def probe() -> None:
        if now < back_at:
            raise TransportError("connection refused")

    informer = Informer("instances", list_fn, watch_fn, lambda e: None, sleep=sleep, probe=probe)
    await informer.initial_list()
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(reconnected.wait(), 10)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert watches[-1] - back_at <= PROBE_INTERVAL
    assert max(delays) <= MAX_WATCH_BACKOFF
    assert informer.probes > 0


# -- issue 33.1 / 36: the watch may deliver our own write before its answer ----------------
# A real API server gives no order between a write's answer and its watch event (the answer
# leaves the handler, the event the watch cache, on other goroutines), and a GET that
# refreshes the cache after a conflict usually reads a version the watch brought already.
# Versions of one resource compare as integers (KEP-5504, apimachinery's
# CompareResourceVersion): with them, nothing the watch already delivered can be undone and
# no later event skipped.


def test_an_own_write_the_watch_delivered_first_does_not_freeze_the_object() -> None:
    """The watch brings our write (5) and another node's newer one (6) before our write's
    answer is applied: the cache keeps 6, and the next event (7) is applied at once (before,
    5 overwrote 6 and every event of the object was skipped for 30 s)."""
    seen: list[RawEvent] = []
    informer = Informer("things", _no_list, _no_watch, seen.append)
    informer._from_watch(RawEvent("ADDED", obj("a", "4")))
    informer._from_watch(RawEvent("MODIFIED", obj("a", "5")))  # ours, echoed early
    informer._from_watch(RawEvent("MODIFIED", obj("a", "6")))  # someone else's
    informer.apply_local(RawEvent("MODIFIED", obj("a", "5")))  # our answer, late
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "6"
    informer._from_watch(RawEvent("MODIFIED", obj("a", "7")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "7"
    assert versions(seen) == [
        ("ADDED", "4"),
        ("MODIFIED", "5"),
        ("MODIFIED", "6"),
        ("MODIFIED", "7"),
    ]


def test_a_refresh_of_a_version_the_watch_brought_hides_no_later_event() -> None:
    """A GET after a conflict reads version 6, which the watch delivered already: the next
    event (7) is still applied (before: skipped for 30 s, as older than "our" 6)."""
    informer = Informer("things", _no_list, _no_watch, lambda _e: None)
    informer._from_watch(RawEvent("ADDED", obj("a", "6")))
    informer.apply_local(RawEvent("MODIFIED", obj("a", "6")))
    informer._from_watch(RawEvent("MODIFIED", obj("a", "7")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "7"


def test_an_own_write_answered_first_still_skips_the_older_events_in_flight() -> None:
    """The usual order: our answer (6) first, then the watch's older event (5) that was in
    flight (skipped: it would move the object back), our own echo (6), then news (7)."""
    informer = Informer("things", _no_list, _no_watch, lambda _e: None)
    informer._from_watch(RawEvent("ADDED", obj("a", "4")))
    informer.apply_local(RawEvent("MODIFIED", obj("a", "6")))
    informer._from_watch(RawEvent("MODIFIED", obj("a", "5")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "6"
    informer._from_watch(RawEvent("MODIFIED", obj("a", "6")))
    informer._from_watch(RawEvent("MODIFIED", obj("a", "7")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "7"


def test_a_name_deleted_and_created_again_is_seen_at_once() -> None:
    """We delete the object at 5; the watch then brings its last change (5: skipped), the
    deletion (6) and a new object of the same name (7, e.g. another node's create of a slice
    with a fixed name): the new object is in the cache at once (before: 30 s later)."""
    informer = Informer("things", _no_list, _no_watch, lambda _e: None)
    informer._from_watch(RawEvent("ADDED", obj("a", "5")))
    informer.apply_local(RawEvent("DELETED", obj("a", "5")))
    assert "default/a" not in informer.cache
    informer._from_watch(RawEvent("MODIFIED", obj("a", "5")))
    assert "default/a" not in informer.cache
    informer._from_watch(RawEvent("DELETED", obj("a", "6")))
    informer._from_watch(RawEvent("ADDED", obj("a", "7")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "7"


def test_a_late_local_delete_does_not_remove_a_newer_object_of_the_name() -> None:
    """The watch brought the deletion (6) and a re-creation (7) before our delete's answer
    (of version 5) is applied: the new object stays."""
    informer = Informer("things", _no_list, _no_watch, lambda _e: None)
    informer._from_watch(RawEvent("ADDED", obj("a", "5")))
    informer._from_watch(RawEvent("DELETED", obj("a", "6")))
    informer._from_watch(RawEvent("ADDED", obj("a", "7")))
    informer.apply_local(RawEvent("DELETED", obj("a", "5")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "7"
    informer._from_watch(RawEvent("MODIFIED", obj("a", "8")))
    assert informer.cache["default/a"]["metadata"]["resourceVersion"] == "8"
