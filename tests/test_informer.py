"""Informer: the cache never keeps managedFields (from the list, the watch, our own writes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from agent.store.informer import Informer, Obj, RawEvent

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
