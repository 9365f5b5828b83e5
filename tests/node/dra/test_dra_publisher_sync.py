"""SlicePublisher.sync against a recording client: no writes when nothing changed (whatever
the slices' generated names), and slice devices computed once per Instance version; one
publisher per shared pool, conflicts that back off, orphans deleted by one node (issue 36)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from pathlib import Path
from typing import Any

from agent.core.kube import ApiError, make_kube_client
from agent.core.model.instance import Instance
from agent.core.store.informer import RawEvent
from agent.node.dra import publisher as publisher_module
from agent.node.dra.publisher import (
    CONFLICT_BACKOFF,
    ORPHAN_GRACE,
    SlicePublisher,
    _pool_of,
    _selected_nodes,
)
from agent.node.dra.slices import Pool, instance_devices
from tests.doubles.admission_policy import admit
from tests.doubles.apiserver import ApiServerDouble
from tests.node.dra.test_dra_e2e import SLICES
from tests.node.dra.test_dra_units import inst


class RecordingClient:
    """The three writes the publisher makes; created slices get random-looking names whose
    order is the reverse of their creation order (like generateName can give)."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []
        self._names = itertools.count(999, -1)
        self._versions = itertools.count(1000)  # newer than any test slice

    async def create(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        name = f"akri.sh-n1-{next(self._names):04d}"
        self.writes.append(("create", name))
        return {**body, "metadata": {"name": name, "resourceVersion": str(next(self._versions))}}

    async def replace(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.writes.append(("replace", body["metadata"]["name"]))
        meta = {**body["metadata"], "resourceVersion": str(next(self._versions))}
        return {**body, "metadata": meta}

    async def delete(self, path: str, body: dict[str, Any], **_: Any) -> None:
        self.writes.append(("delete", path.rsplit("/", 1)[-1]))


def versioned(instance: Instance, version: int) -> Instance:
    return dataclasses.replace(instance, resource_version=str(version))


def publisher(instances: list[Instance], client: RecordingClient) -> SlicePublisher:
    return SlicePublisher(client, "n1", lambda: instances, lambda: ())  # type: ignore[arg-type]


async def test_second_sync_of_a_multi_slice_pool_writes_nothing() -> None:
    # 40 local Instances x 4 slots = 160 devices: two slices in the node's pool
    instances = [versioned(inst(f"cam-{i:02d}", False, ("n1",), 4), i + 1) for i in range(40)]
    client = RecordingClient()
    pub = publisher(instances, client)
    await pub.sync()
    assert [w[0] for w in client.writes] == ["create", "create"]
    client.writes.clear()
    await pub.sync()
    assert client.writes == []  # the names sort opposite to the chunks: still unchanged


async def test_a_changed_pool_is_rewritten_at_a_new_generation() -> None:
    instances = [versioned(inst("cam-a", False, ("n1",), 2), 1)]
    client = RecordingClient()
    pub = publisher(instances, client)
    await pub.sync()
    instances[0] = versioned(inst("cam-a", False, ("n1",), 2, _0="n1"), 2)  # slot 0 taken (IL)
    client.writes.clear()
    await pub.sync()
    assert [w[0] for w in client.writes] == ["replace"]
    (stored,) = pub._informer.cache.values()
    assert stored["spec"]["pool"]["generation"] == 2
    assert [d["name"] for d in stored["spec"]["devices"]] == ["cam-a-1"]


async def test_devices_are_computed_once_per_instance_version(monkeypatch: Any) -> None:
    calls: list[str] = []
    real = instance_devices

    def counting(instance: Instance, offline: bool, **options: Any) -> Any:
        calls.append(instance.name)
        return real(instance, offline, **options)

    monkeypatch.setattr(publisher_module, "instance_devices", counting)
    instances = [versioned(inst(f"cam-{i}", i % 2 == 0, ("n1",), 2), i + 1) for i in range(10)]
    pub = publisher(instances, RecordingClient())
    await pub.sync()
    await pub.sync()
    assert sorted(calls) == sorted(i.name for i in instances)
    calls.clear()
    instances[3] = versioned(instances[3], 100)  # a new version of one Instance
    del instances[5]  # and one gone: its memo entry is dropped
    await pub.sync()
    assert calls == ["cam-3"]
    assert "cam-5" not in pub._devices


class PolicyClient(RecordingClient):
    """A RecordingClient whose writes pass deploy/base/resourceslice-policy.yaml as the agent
    on ``node`` (a refusal is the API server's 403), and which refuses every write of the
    pools in ``forbidden`` (as RBAC or another admission check might)."""

    def __init__(self, node: str, stored: dict[str, dict[str, Any]], forbidden: set[str]) -> None:
        super().__init__()
        self.node = node
        self.stored = stored  # name -> the slice as the API server holds it
        self.forbidden = forbidden

    def _admit(self, operation: str, new: dict[str, Any], old: dict[str, Any] | None) -> None:
        pool = (new.get("spec") or {}).get("pool", {}).get("name")
        allowed, message = admit(operation, new, old=old, node=self.node)
        if not allowed or pool in self.forbidden:
            raise ApiError(403, "Forbidden", message or "forbidden by the test")

    async def create(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self._admit("CREATE", body, None)
        created = await super().create(path, body)
        self.stored[created["metadata"]["name"]] = created
        return created

    async def replace(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self._admit("UPDATE", body, self.stored[body["metadata"]["name"]])
        updated = await super().replace(path, body)
        self.stored[body["metadata"]["name"]] = updated
        return updated

    async def delete(self, path: str, body: dict[str, Any], **_: Any) -> None:
        name = path.rsplit("/", 1)[-1]
        self._admit("DELETE", self.stored[name], None)
        del self.stored[name]
        await super().delete(path, body)


def published_by(
    publisher_node: str, nodes: tuple[str, ...], names: list[str]
) -> list[dict[str, Any]]:
    """The slices ``publisher_node`` wrote for shared Instance cam-s over ``nodes``: one
    slice per name (the pool's size then), generation 1."""
    pool = Pool(name="cam-s", node_name=None, nodes=nodes, devices=())
    (spec,) = pool.slice_specs()
    return [
        {
            "metadata": {"name": name, "resourceVersion": f"{100 + i}"},
            "spec": {
                **spec,
                "pool": {"name": "cam-s", "generation": 1, "resourceSliceCount": len(names)},
            },
        }
        for i, name in enumerate(names)
    ]


async def test_a_new_publisher_adopts_a_shared_pool_within_the_admission_policy() -> None:
    """Instance nodes [node-b, node-c]: node-b published its pool in two slices. node-a finds
    the device too and becomes the publisher (the smallest name): it rewrites one slice and
    deletes the other, every write admitted by the policy. Before: the policy refused the
    UPDATE (the old slice does not list node-a), and the DELETE of the surplus slice, and the
    403 aborted the sync."""
    old = published_by("node-b", ("node-b", "node-c"), ["akri.sh-cam-s-x", "akri.sh-cam-s-y"])
    stored = {o["metadata"]["name"]: o for o in old}
    client = PolicyClient("node-a", stored, set())
    instances = [inst("cam-s", True, ("node-a", "node-b", "node-c"), 2)]
    pub = SlicePublisher(client, "node-a", lambda: instances, lambda: ())  # type: ignore[arg-type]
    for obj in old:
        pub._informer.apply_local(RawEvent("ADDED", obj))
    await pub.sync()
    assert client.writes[1:] == [
        ("replace", "akri.sh-cam-s-y"),  # adopted (the new nodeSelector), so that it may go
        ("delete", "akri.sh-cam-s-y"),
        ("replace", "akri.sh-cam-s-x"),
    ]
    assert client.writes[0][0] == "create"  # node-a's own (empty) pool
    (kept,) = [o for o in pub._informer.cache.values() if _pool_of(o) == "cam-s"]
    assert kept["metadata"]["name"] == "akri.sh-cam-s-x"
    assert kept["spec"]["pool"] == {"name": "cam-s", "generation": 2, "resourceSliceCount": 1}
    assert _selected_nodes(kept) == {"node-a", "node-b", "node-c"}
    assert pub.refused_writes == 0


async def test_a_refused_pool_does_not_stop_the_others(caplog: Any) -> None:
    """A 403 (or 422) on one pool's write is logged and skipped; the pools after it are still
    published. Before: the error aborted sync() at that pool, for every sync."""
    client = PolicyClient("n1", {}, forbidden={"cam-a"})
    instances = [
        inst("cam-a", True, ("n1",), 2),
        inst("cam-b", True, ("n1",), 2),
        inst("cam-l", False, ("n1",), 2),
    ]
    pub = SlicePublisher(client, "n1", lambda: instances, lambda: ())  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="agent.node.dra.publisher"):
        await pub.sync()
        await pub.sync()
    assert sorted(_pool_of(o) for o in pub._informer.cache.values()) == ["cam-b", "n1"]
    assert pub.refused_writes == 2
    refusals = [
        r for r in caplog.records if "refused writing ResourceSlice pool cam-a" in r.message
    ]
    assert len(refusals) == 1  # once per pool and reason, not once per sync


async def test_a_shared_slice_in_a_pool_named_like_this_node_is_not_adopted() -> None:
    """A shared Instance named like node-a, published by node-b in two slices; node-a's own
    (node-local) pool has that name too. Before: _adopt read the node-local spec's missing
    nodeSelector (a KeyError, not an ApiError), and every sync failed."""
    pool = Pool(name="node-a", node_name=None, nodes=("node-b", "node-c"), devices=())
    (spec,) = pool.slice_specs()
    old = [
        {
            "metadata": {"name": name, "resourceVersion": f"{100 + i}"},
            "spec": {**spec, "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 2}},
        }
        for i, name in enumerate(["akri.sh-node-a-x", "akri.sh-node-a-y"])
    ]
    stored = {o["metadata"]["name"]: o for o in old}
    client = PolicyClient("node-a", stored, set())
    instances = [inst("cam-b", True, ("node-a",), 2)]
    pub = SlicePublisher(client, "node-a", lambda: instances, lambda: ())  # type: ignore[arg-type]
    for obj in old:
        pub._informer.apply_local(RawEvent("ADDED", obj))
    await pub.sync()
    assert ("delete", "akri.sh-node-a-y") not in client.writes
    assert stored["akri.sh-node-a-y"] == old[1]  # left alone
    assert "cam-b" in {_pool_of(o) for o in pub._informer.cache.values()}  # the others go on


# -- one publisher per shared pool, conflicts that back off (issue 36) -----------------------


def shared_instance(version: int, nodes: tuple[str, ...], uid: str = "u-1") -> Instance:
    return dataclasses.replace(
        inst("cam-s", True, nodes, 2), uid=uid, resource_version=str(version)
    )


def stored_shared_slice(
    nodes: tuple[str, ...], version: int, written_from: tuple[str, int] | None
) -> dict[str, Any]:
    """A shared slice of cam-s as the API server holds it (``written_from``: the Instance
    uid and version its publisher recorded)."""
    pool = Pool(name="cam-s", node_name=None, nodes=nodes, devices=())
    (spec,) = pool.slice_specs()
    metadata: dict[str, Any] = {"name": "akri.sh-cam-s-0", "resourceVersion": str(version)}
    if written_from is not None:
        metadata["annotations"] = {
            "akri.sh/instance-uid": written_from[0],
            "akri.sh/instance-version": str(written_from[1]),
        }
    return {
        "metadata": metadata,
        "spec": {**spec, "pool": {"name": "cam-s", "generation": 3, "resourceSliceCount": 1}},
    }


class ConflictingClient(RecordingClient):
    """Every write of an existing slice meets a newer version (409); GET returns it."""

    def __init__(self, current: dict[str, Any]) -> None:
        super().__init__()
        self.current = current
        self.reads = 0

    async def replace(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.writes.append(("replace", body["metadata"]["name"]))
        raise ApiError(409, "Conflict", "the object has been modified")

    async def get(self, path: str, **_: Any) -> dict[str, Any]:
        self.reads += 1
        return self.current


async def test_a_conflict_rereads_the_slice_and_backs_the_pool_off() -> None:
    """A PUT that meets a newer version reads the slice again and leaves the pool alone for
    a while: the syncs right after it (any event wakes the publisher) write nothing. Before:
    each sync 20 ms later PUT the same stale version again (hundreds of 409s a phase)."""
    cached = stored_shared_slice(("n1",), 100, None)
    newer = stored_shared_slice(("n1", "n3"), 150, None)
    client = ConflictingClient(newer)
    instances = [shared_instance(7, ("n1", "n2"))]
    pub = SlicePublisher(client, "n1", lambda: instances, lambda: ())  # type: ignore[arg-type]
    pub._informer.apply_local(RawEvent("ADDED", cached))
    await pub.sync()
    assert [w for w in client.writes if w[0] == "replace"] == [("replace", "akri.sh-cam-s-0")]
    assert client.reads == 1
    assert pub._informer.cache["/akri.sh-cam-s-0"]["metadata"]["resourceVersion"] == "150"
    for _ in range(5):
        await pub.sync()
    assert [w for w in client.writes if w[0] == "replace"] == [("replace", "akri.sh-cam-s-0")]
    assert pub.conflicts == 1


async def test_a_node_behind_the_slice_leaves_it_alone() -> None:
    """n1's view of the Instance is version 5, where it publishes the pool for n1 and n2;
    the slice was written from version 7 (n2 publishes it for n2 alone there): n1 is
    behind and writes nothing until its view catches up. Before: it rewrote the slice, the
    node with the newer view rewrote it back, and so on, until n1's cache caught up."""
    client = RecordingClient()
    instances = [shared_instance(5, ("n1", "n2"))]
    pub = SlicePublisher(client, "n1", lambda: instances, lambda: ())  # type: ignore[arg-type]
    pub._informer.apply_local(RawEvent("ADDED", stored_shared_slice(("n2",), 100, ("u-1", 7))))
    await pub.sync()
    assert [w for w in client.writes if w[1] == "akri.sh-cam-s-0"] == []
    assert pub.deferred == 1
    # its view catches up (version 8: n1 serves the device again): it publishes, recording 8
    instances[0] = shared_instance(8, ("n1", "n2"))
    await pub.sync()
    assert [w for w in client.writes if w[1] == "akri.sh-cam-s-0"] == [
        ("replace", "akri.sh-cam-s-0")
    ]
    stored = pub._informer.cache["/akri.sh-cam-s-0"]
    assert stored["metadata"]["annotations"]["akri.sh/instance-version"] == "8"
    assert _selected_nodes(stored) == {"n1", "n2"}


async def test_a_slice_of_another_instance_of_the_name_is_taken_over() -> None:
    """The slice records another Instance's uid (the Instance was deleted and created again
    under its name) or nothing (an agent before this rule): the publisher writes it."""
    instances = [shared_instance(5, ("n1", "n2"))]
    for written in (("u-0", 99), None):
        client = RecordingClient()
        pub = SlicePublisher(client, "n1", lambda: instances, lambda: ())  # type: ignore[arg-type]
        pub._informer.apply_local(RawEvent("ADDED", stored_shared_slice(("n2",), 100, written)))
        await pub.sync()
        assert ("replace", "akri.sh-cam-s-0") in client.writes, written


async def test_two_nodes_creating_one_shared_pool_make_one_slice(tmp_path: Path) -> None:
    """Two nodes believe they publish the same new pool (node-b's view is older: it still
    sees itself alone) and create it at once on the API-server double: the slice has a fixed
    name, so one create wins and the other re-reads it; the pool ends up in one slice, as
    the newer view has it. Before: two slices of one pool (generated names), each with
    generation 1 and resourceSliceCount 1."""
    async with ApiServerDouble() as api:
        views = {
            "node-a": [shared_instance(12, ("node-a", "node-b"))],
            "node-b": [shared_instance(11, ("node-b",))],
        }
        publishers = {
            node: SlicePublisher(
                make_kube_client(str(api.write_kubeconfig(tmp_path / f"{node}.kubeconfig"))),
                node,
                lambda node=node: views[node],  # type: ignore[misc]
                lambda: (),
            )
            for node in views
        }
        await asyncio.gather(*(p.sync() for p in publishers.values()))
        for _ in range(3):  # after the conflict's pause, each decides again
            await asyncio.sleep(CONFLICT_BACKOFF[0] * 4)
            for publisher in publishers.values():
                for obj in api.list(SLICES):  # what their watches would bring
                    publisher._informer.apply_local(RawEvent("MODIFIED", obj))
                await publisher.sync()
        pool = [o for o in api.list(SLICES) if o["spec"]["pool"]["name"] == "cam-s"]
        assert [o["metadata"]["name"] for o in pool] == ["akri.sh-cam-s-0"]
        assert _selected_nodes(pool[0]) == {"node-a", "node-b"}
        assert pool[0]["metadata"]["annotations"]["akri.sh/instance-version"] == "12"


async def test_an_orphaned_shared_pool_is_deleted_by_the_first_node_it_lists(
    monkeypatch: Any,
) -> None:
    """The Instance is gone: the first node the slice lists deletes it at once; another
    listed node waits ORPHAN_GRACE (the first may be gone too), then deletes it. Before:
    every listed node deleted it at once (N-1 of them conflicting)."""
    orphan = stored_shared_slice(("n1", "n2"), 100, ("u-1", 7))
    first, second = RecordingClient(), RecordingClient()
    pubs = [
        SlicePublisher(client, node, lambda: [], lambda: ())  # type: ignore[arg-type]
        for client, node in ((first, "n1"), (second, "n2"))
    ]
    for pub in pubs:
        pub._informer.apply_local(RawEvent("ADDED", orphan))
        await pub.sync()
    assert ("delete", "akri.sh-cam-s-0") in first.writes
    assert ("delete", "akri.sh-cam-s-0") not in second.writes
    now = time.monotonic()
    monkeypatch.setattr(publisher_module.time, "monotonic", lambda: now + ORPHAN_GRACE + 1)
    await pubs[1].sync()
    assert ("delete", "akri.sh-cam-s-0") in second.writes
