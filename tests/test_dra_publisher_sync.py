"""SlicePublisher.sync against a recording client: no writes when nothing changed (whatever
the slices' generated names), and slice devices computed once per Instance version."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from agent.dra import publisher as publisher_module
from agent.dra.publisher import SlicePublisher
from agent.model.instance import Instance
from tests.test_dra_units import inst


class RecordingClient:
    """The three writes the publisher makes; created slices get random-looking names whose
    order is the reverse of their creation order (like generateName can give)."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []
        self._names = itertools.count(999, -1)
        self._versions = itertools.count(1)

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
    real = publisher_module.instance_devices

    def counting(instance: Instance, offline: bool) -> Any:
        calls.append(instance.name)
        return real(instance, offline)

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
