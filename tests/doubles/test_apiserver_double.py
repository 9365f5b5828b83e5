"""The Kubernetes API-server double (tests/doubles/apiserver), exercised through real clients over
HTTP: the official asyncio client ``kubernetes.aio``, raw aiohttp, and ``kubectl``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes.aio import client, config, watch

from tests.doubles.apiserver import ApiServerDouble, ThreadedApiServer
from tests.doubles.apiserver.patches import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from tests.doubles.apiserver.selectors import FieldSelector, LabelSelector, SelectorError
from tests.doubles.apiserver.tables import human_duration, jsonpath
from tests.paths import REPO

FIXTURES = Path(__file__).parent / "apiserver" / "fixtures"
INSTANCE_CRD = FIXTURES / "instance-crd.yaml"
CONFIGURATION_CRD = FIXTURES / "configuration-crd.yaml"
REPO = REPO

GROUP, VERSION, PLURAL, NS = "akri.sh", "v0", "instances", "default"
JSON = dict[str, Any]


def instance(name: str, labels: dict[str, str] | None = None, **spec: Any) -> JSON:
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": {"name": name, **({"labels": labels} if labels else {})},
        "spec": {"configurationName": "onvif", "nodes": ["node-a"], "shared": True, **spec},
    }


def status_of(exc: client.ApiException) -> JSON:
    assert exc.body
    body: JSON = json.loads(exc.body)
    return body


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(
        crds=[INSTANCE_CRD, CONFIGURATION_CRD], bookmark_interval=0.2
    ) as server:
        yield server
    assert server.internal_errors == []


@pytest.fixture
async def api_client(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[client.ApiClient]:
    cfg = client.Configuration()
    await config.load_kube_config(
        config_file=str(api.write_kubeconfig(tmp_path / "kubeconfig")), client_configuration=cfg
    )
    async with client.ApiClient(cfg) as ac:
        yield ac


@pytest.fixture
def co(api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client)


@pytest.fixture
def core(api_client: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api_client)


async def create(co: client.CustomObjectsApi, body: JSON, ns: str = NS) -> JSON:
    result: JSON = await co.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    return result


async def get(co: client.CustomObjectsApi, name: str, ns: str = NS) -> JSON:
    result: JSON = await co.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    return result


async def collect_events(
    stream: AsyncIterator[dict[str, Any]], count: int, within: float = 5.0
) -> list[tuple[str, JSON]]:
    """The first ``count`` events of a kubernetes.aio watch stream as (type, raw_object)."""
    out: list[tuple[str, JSON]] = []

    async def run() -> None:
        async for event in stream:
            out.append((event["type"], event["raw_object"]))
            if len(out) >= count:
                return

    await asyncio.wait_for(run(), within)
    return out


# --- pure logic ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ("app=cam", {"app": "cam"}, True),
        ("app==cam", {"app": "usb"}, False),
        ("app!=cam", {}, True),
        ("app in (cam, usb)", {"app": "usb"}, True),
        ("app notin (cam,usb)", {"app": "usb"}, False),
        ("app notin (cam,usb)", {}, True),
        ("app", {"app": ""}, True),
        ("!app", {"app": "x"}, False),
        ("app=cam,tier in (edge),!legacy", {"app": "cam", "tier": "edge"}, True),
        ("gpu>2", {"gpu": "3"}, True),
    ],
)
def test_label_selector_semantics(selector: str, labels: dict[str, str], expected: bool) -> None:
    assert LabelSelector.parse(selector).matches(labels) is expected


def test_selector_parse_errors_and_field_paths() -> None:
    for bad in ("app in cam", "a=b,,", "(x"):
        with pytest.raises(SelectorError):
            LabelSelector.parse(bad)
    sel = FieldSelector.parse(r"spec.nodeName=n1,metadata.name!=x\,y,spec.shared==true")
    assert sel.matches({"metadata": {"name": "x"}, "spec": {"nodeName": "n1", "shared": True}})
    assert not sel.matches(
        {"metadata": {"name": "x,y"}, "spec": {"nodeName": "n1", "shared": True}}
    )
    assert FieldSelector.parse("spec.nodeName=").matches({"spec": {}})


def test_patch_algorithms() -> None:
    doc = {"a": {"b": 1, "c": [1, 2]}, "d": "x"}
    assert merge_patch(doc, {"a": {"b": None, "c": [3]}, "e": True}) == {
        "a": {"c": [3]},
        "d": "x",
        "e": True,
    }
    ops = [
        {"op": "test", "path": "/a/b", "value": 1},
        {"op": "add", "path": "/a/c/-", "value": 3},
        {"op": "move", "from": "/d", "path": "/f"},
        {"op": "copy", "from": "/a/b", "path": "/g"},
        {"op": "replace", "path": "/a/c/0", "value": 0},
        {"op": "remove", "path": "/a/b"},
    ]
    assert json_patch(doc, ops) == {"a": {"c": [0, 2, 3]}, "f": "x", "g": 1}
    with pytest.raises(PatchError, match="test failed"):
        json_patch(doc, [{"op": "test", "path": "/a/b", "value": True}])  # true is not 1
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "remove", "path": "/nope"}])
    pod = {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}}
    patched = strategic_merge_patch(
        pod,
        {"spec": {"containers": [{"name": "b", "image": "2"}, {"name": "a", "$patch": "delete"}]}},
    )
    assert patched == {"spec": {"containers": [{"name": "b", "image": "2"}]}}
    assert doc == {"a": {"b": 1, "c": [1, 2]}, "d": "x"}  # inputs untouched


def test_table_helpers() -> None:
    obj = {"spec": {"nodes": ["a", "b"], "conditions": [{"type": "Ready", "status": "True"}]}}
    assert jsonpath(obj, ".spec.nodes") == [["a", "b"]]
    assert jsonpath(obj, ".spec.nodes[1]") == ["b"]
    assert jsonpath(obj, '.spec.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath(obj, ".spec.missing") == []
    assert [human_duration(s) for s in (5, 150, 3600 * 5 + 60, 86400 * 3)] == [
        "5s",
        "2m30s",
        "5h1m",
        "3d",
    ]


# --- CRUD through kubernetes.aio ---------------------------------------------------------------


async def test_create_get_list_and_duplicate(co: client.CustomObjectsApi) -> None:
    resp = await co.create_namespaced_custom_object_with_http_info(
        GROUP, VERSION, NS, PLURAL, instance("cam-1", capacity=1)
    )
    assert resp.status_code == 201
    meta = resp.data["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1 and meta["namespace"] == NS
    assert int(meta["resourceVersion"]) > 0

    with pytest.raises(client.ApiException) as err:
        await create(co, instance("cam-1"))
    assert err.value.status == 409
    status = status_of(err.value)
    assert status["kind"] == "Status" and status["reason"] == "AlreadyExists"
    assert status["message"] == 'instances.akri.sh "cam-1" already exists'

    generated = await create(co, {**instance(""), "metadata": {"generateName": "cam-"}})
    assert (
        generated["metadata"]["name"].startswith("cam-") and len(generated["metadata"]["name"]) == 9
    )
    await create(co, instance("cam-2"), ns="other")

    got = await get(co, "cam-1")
    assert got["spec"]["capacity"] == 1 and got["apiVersion"] == "akri.sh/v0"
    listed = await co.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)
    assert listed["kind"] == "InstanceList" and listed["apiVersion"] == "akri.sh/v0"
    assert int(listed["metadata"]["resourceVersion"]) >= int(
        generated["metadata"]["resourceVersion"]
    )
    assert sorted(i["metadata"]["name"] for i in listed["items"]) == sorted(
        ["cam-1", generated["metadata"]["name"]]
    )
    everywhere = await co.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    assert len(everywhere["items"]) == 3


async def test_replace_with_current_and_stale_resource_version(co: client.CustomObjectsApi) -> None:
    created = await create(co, instance("cam-1", capacity=1))
    body = {**created, "spec": {**created["spec"], "capacity": 2}}
    updated = await co.replace_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "cam-1", body)
    assert updated["spec"]["capacity"] == 2
    assert int(updated["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])

    stale = {**created, "spec": {**created["spec"], "capacity": 3}}  # carries the old RV
    with pytest.raises(client.ApiException) as err:
        await co.replace_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "cam-1", stale)
    assert err.value.status == 409
    status = status_of(err.value)
    assert status["reason"] == "Conflict"
    assert status["message"] == (
        'Operation cannot be fulfilled on instances.akri.sh "cam-1": the object has been '
        "modified; please apply your changes to the latest version and try again"
    )
    assert status["details"] == {"name": "cam-1", "group": "akri.sh", "kind": "instances"}

    # Without a resourceVersion the update is unconditional.
    del stale["metadata"]["resourceVersion"]
    forced = await co.replace_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "cam-1", stale)
    assert forced["spec"]["capacity"] == 3

    with pytest.raises(client.ApiException) as err:
        await co.replace_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "nope", instance("nope")
        )
    assert err.value.status == 404


async def test_merge_patch_resource_version_precondition(co: client.CustomObjectsApi) -> None:
    created = await create(co, instance("cam-1", capacity=1))
    rv = created["metadata"]["resourceVersion"]
    ok = await co.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "cam-1",
        {"metadata": {"resourceVersion": rv}, "spec": {"capacity": 2, "shared": None}},
    )
    assert ok["spec"]["capacity"] == 2 and "shared" not in ok["spec"]
    with pytest.raises(client.ApiException) as err:
        await co.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            "cam-1",
            {"metadata": {"resourceVersion": rv}, "spec": {"capacity": 3}},
        )
    assert err.value.status == 409 and status_of(err.value)["reason"] == "Conflict"
    assert (await get(co, "cam-1"))["spec"]["capacity"] == 2


async def test_json_patch_including_test_op(co: client.CustomObjectsApi) -> None:
    await create(co, instance("cam-1", capacity=1))
    patched = await co.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "cam-1",
        [
            {"op": "test", "path": "/spec/capacity", "value": 1},
            {"op": "replace", "path": "/spec/capacity", "value": 5},
            {"op": "add", "path": "/spec/nodes/-", "value": "node-b"},
        ],
        _content_type="application/json-patch+json",
    )
    assert patched["spec"]["capacity"] == 5 and patched["spec"]["nodes"] == ["node-a", "node-b"]
    with pytest.raises(client.ApiException) as err:
        await co.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            "cam-1",
            [
                {"op": "test", "path": "/spec/capacity", "value": 1},
                {"op": "replace", "path": "/spec/capacity", "value": 9},
            ],
            _content_type="application/json-patch+json",
        )
    assert err.value.status == 422
    assert (await get(co, "cam-1"))["spec"]["capacity"] == 5


async def test_status_subresource_isolation_and_generation(co: client.CustomObjectsApi) -> None:
    created = await create(co, {**instance("cam-1", capacity=1), "status": {"ignored": True}})
    assert "status" not in created  # status is dropped on create with a status subresource
    assert created["metadata"]["generation"] == 1

    status_patch = await co.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "cam-1",
        {
            "status": {"phase": "Ready"},
            "spec": {"capacity": 99},
            "metadata": {"labels": {"x": "y"}},
        },
    )
    assert status_patch["status"] == {"phase": "Ready"}
    assert status_patch["spec"]["capacity"] == 1  # spec untouched through /status
    assert "labels" not in status_patch["metadata"]
    assert status_patch["metadata"]["generation"] == 1  # status changes don't bump generation

    main = await co.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "cam-1",
        {"status": {"phase": "Hacked"}, "metadata": {"labels": {"a": "b"}}},
    )
    assert main["status"] == {"phase": "Ready"}  # status ignored on the main endpoint
    assert main["metadata"]["labels"] == {"a": "b"}
    assert main["metadata"]["generation"] == 1  # metadata changes don't bump it either

    spec_change = await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "cam-1", {"spec": {"capacity": 2}}
    )
    assert spec_change["metadata"]["generation"] == 2

    # A no-op write keeps the resourceVersion (nothing is written, nobody is notified).
    same = await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "cam-1", {"spec": {"capacity": 2}}
    )
    assert same["metadata"]["resourceVersion"] == spec_change["metadata"]["resourceVersion"]

    # PUT on /status with a stale resourceVersion conflicts too.
    stale = {**created, "status": {"phase": "Old"}}
    with pytest.raises(client.ApiException) as err:
        await co.replace_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, "cam-1", stale)
    assert err.value.status == 409


async def test_status_without_subresource_is_part_of_the_object(
    co: client.CustomObjectsApi,
) -> None:
    cfg = {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": "c"},
        "spec": {"a": 1},
    }
    created = await co.create_namespaced_custom_object(
        GROUP, VERSION, NS, "configurations", {**cfg, "status": {"s": 1}}
    )
    assert created["status"] == {"s": 1}
    patched = await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, "configurations", "c", {"status": {"s": 2}}
    )
    assert patched["metadata"]["generation"] == 2  # no status subresource: status is content
    with pytest.raises(client.ApiException) as err:
        await co.patch_namespaced_custom_object_status(
            GROUP, VERSION, NS, "configurations", "c", {"status": {"s": 3}}
        )
    assert err.value.status == 404


async def test_delete_and_not_found_status(co: client.CustomObjectsApi) -> None:
    created = await create(co, instance("cam-1"))
    with pytest.raises(client.ApiException) as err:
        await co.delete_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            "cam-1",
            body={"preconditions": {"resourceVersion": "1"}},
        )
    assert err.value.status == 409 and "Precondition failed" in status_of(err.value)["message"]
    deleted = await co.delete_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "cam-1",
        body={"preconditions": {"uid": created["metadata"]["uid"]}},
    )
    assert deleted["metadata"]["name"] == "cam-1"
    with pytest.raises(client.ApiException) as err:
        await get(co, "cam-1")
    assert err.value.status == 404
    assert status_of(err.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'instances.akri.sh "cam-1" not found',
        "reason": "NotFound",
        "details": {"name": "cam-1", "group": "akri.sh", "kind": "instances"},
        "code": 404,
    }
    with pytest.raises(client.ApiException) as err:
        await co.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "cam-1")
    assert err.value.status == 404


async def test_finalizers_defer_deletion(api: ApiServerDouble, co: client.CustomObjectsApi) -> None:
    created = await create(
        co, {**instance("cam-1"), "metadata": {"name": "cam-1", "finalizers": ["akri.sh/cleanup"]}}
    )
    w = watch.Watch()
    stream = w.stream(
        co.list_namespaced_custom_object,
        GROUP,
        VERSION,
        NS,
        PLURAL,
        resource_version=created["metadata"]["resourceVersion"],
        timeout_seconds=5,
    )
    marked = await co.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "cam-1")
    assert marked["metadata"]["deletionTimestamp"]
    assert marked["metadata"]["generation"] == 2
    still = await get(co, "cam-1")
    assert still["metadata"]["deletionTimestamp"] == marked["metadata"]["deletionTimestamp"]
    with pytest.raises(client.ApiException) as err:  # no new finalizers while deleting
        await co.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            "cam-1",
            {"metadata": {"finalizers": ["akri.sh/cleanup", "other"]}},
        )
    assert err.value.status == 422
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "cam-1", {"metadata": {"finalizers": None}}
    )
    with pytest.raises(client.ApiException):
        await get(co, "cam-1")
    events = await collect_events(stream, 3)
    await w.close()
    assert [t for t, _ in events] == ["MODIFIED", "MODIFIED", "DELETED"]
    assert api.get("instances.akri.sh", "cam-1", NS) is None


async def test_names_labels_and_crd_schema_are_validated(co: client.CustomObjectsApi) -> None:
    for bad in (instance("Cam_1"), instance("ok", {"bad key!": "x"})):
        with pytest.raises(client.ApiException) as err:
            await create(co, bad)
        assert err.value.status == 422 and status_of(err.value)["reason"] == "Invalid"
    with pytest.raises(client.ApiException) as err:
        await create(co, instance("cam-1", capacity="two"))
    assert err.value.status == 422
    status = status_of(err.value)
    assert status["message"].startswith('Instance.akri.sh "cam-1" is invalid: spec.capacity: ')
    assert status["details"]["causes"][0]["field"] == "spec.capacity"

    # Unknown fields are pruned silently (fieldValidation Warn/Ignore) or rejected (Strict).
    created = await create(
        co, {**instance("cam-1"), "spec": {"configurationName": "c", "bogus": 1}}
    )
    assert created["spec"] == {"configurationName": "c"}
    with pytest.raises(client.ApiException) as err:
        await co.create_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            {**instance("cam-2"), "spec": {"bogus": 1}},
            field_validation="Strict",
        )
    assert err.value.status == 400
    assert 'strict decoding error: unknown field "spec.bogus"' in status_of(err.value)["message"]


@pytest.mark.skipif(not (REPO / "crds").is_dir(), reason="project CRDs not present")
async def test_project_crds_load_and_validate() -> None:
    crds = sorted((REPO / "crds").glob("*.yaml"))
    async with ApiServerDouble(crds=crds) as api:
        kinds = {rt.kind for rt in api.store.registry if rt.group == "akri.sh"}
        assert {"Instance", "Configuration"} <= kinds
        created = api.create(
            {
                "apiVersion": "akri.sh/v0",
                "kind": "Instance",
                "metadata": {"name": "cam-1"},
                "spec": {"configurationName": "onvif", "capacity": 1},
            }
        )
        assert created["spec"]["nodes"] == [] and created["spec"]["shared"] is False  # defaults
        with pytest.raises(Exception, match="is invalid"):
            api.create(
                {
                    "apiVersion": "akri.sh/v0",
                    "kind": "Instance",
                    "metadata": {"name": "cam-2"},
                    "spec": {"configurationName": "onvif", "capacity": 0},
                }
            )


# --- selectors ---------------------------------------------------------------------------------


async def test_label_and_field_selectors_on_list(
    co: client.CustomObjectsApi, core: client.CoreV1Api
) -> None:
    await create(co, instance("a", {"app": "cam", "tier": "edge"}, capacity=1))
    await create(co, instance("b", {"app": "usb"}, capacity=2))
    await create(co, instance("c", capacity=3))

    async def names(**kwargs: Any) -> list[str]:
        listed = await co.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, **kwargs)
        return [i["metadata"]["name"] for i in listed["items"]]

    assert await names(label_selector="app=cam") == ["a"]
    assert await names(label_selector="app==usb") == ["b"]
    assert await names(label_selector="app!=cam") == ["b", "c"]
    assert await names(label_selector="app in (cam,usb)") == ["a", "b"]
    assert await names(label_selector="app notin (cam)") == ["b", "c"]
    assert await names(label_selector="app") == ["a", "b"]
    assert await names(label_selector="!app") == ["c"]
    assert await names(label_selector="app=cam,tier=edge") == ["a"]
    assert await names(field_selector="metadata.name=b") == ["b"]
    assert await names(field_selector="metadata.name!=b") == ["a", "c"]
    assert await names(field_selector="metadata.namespace=default,spec.capacity=3") == ["c"]
    with pytest.raises(client.ApiException) as err:
        await names(label_selector="app in cam")
    assert err.value.status == 400

    for pod, node in (("p1", "n1"), ("p2", "n2"), ("p3", None)):
        spec: JSON = {"containers": [{"name": "c", "image": "busybox"}]}
        if node:
            spec["nodeName"] = node
        await core.create_namespaced_pod(
            NS, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod}, "spec": spec}
        )
    on_n1 = await core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert [p.metadata.name for p in on_n1.items] == ["p1"]
    unscheduled = await core.list_namespaced_pod(NS, field_selector="spec.nodeName=")
    assert [p.metadata.name for p in unscheduled.items] == ["p3"]
    not_n1 = await core.list_namespaced_pod(NS, field_selector="spec.nodeName!=n1")
    assert [p.metadata.name for p in not_n1.items] == ["p2", "p3"]


async def test_watch_selectors_follow_objects_in_and_out(co: client.CustomObjectsApi) -> None:
    await create(co, instance("a", {"app": "cam"}))
    await create(co, instance("b", {"app": "usb"}))
    w = watch.Watch()
    stream = w.stream(
        co.list_namespaced_custom_object,
        GROUP,
        VERSION,
        NS,
        PLURAL,
        label_selector="app=cam",
        timeout_seconds=5,
    )
    first = await collect_events(stream, 1)
    assert [(t, o["metadata"]["name"]) for t, o in first] == [("ADDED", "a")]
    moved = await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "a", {"metadata": {"labels": {"app": "x"}}}
    )
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "b", {"metadata": {"labels": {"app": "cam"}}}
    )
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "b", {"spec": {"capacity": 7}}
    )
    await co.delete_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "a"
    )  # not matching any more
    await co.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "b")
    rest = await collect_events(stream, 4)
    await w.close()
    assert [(t, o["metadata"]["name"]) for t, o in rest] == [
        ("DELETED", "a"),  # stopped matching
        ("ADDED", "b"),  # started matching
        ("MODIFIED", "b"),
        ("DELETED", "b"),
    ]
    # as kube-apiserver's watch cache: the DELETED of an object that stopped matching carries
    # its previous content (still labelled app=cam) at the version of the change
    left = rest[0][1]
    assert left["metadata"]["labels"] == {"app": "cam"}
    assert left["metadata"]["resourceVersion"] == moved["metadata"]["resourceVersion"]
    assert rest[1][1]["metadata"]["labels"] == {"app": "cam"}  # ADDED: the new content

    # a watch resumed from before the change replays the same translation
    resumed = w.stream(
        co.list_namespaced_custom_object,
        GROUP,
        VERSION,
        NS,
        PLURAL,
        label_selector="app=cam",
        resource_version=first[0][1]["metadata"]["resourceVersion"],
        timeout_seconds=5,
    )
    replayed = await collect_events(resumed, 1)
    await w.close()
    assert replayed[0][0] == "DELETED"
    assert replayed[0][1]["metadata"]["labels"] == {"app": "cam"}
    assert replayed[0][1]["metadata"]["resourceVersion"] == moved["metadata"]["resourceVersion"]


async def test_watch_field_selector_on_pods(core: client.CoreV1Api) -> None:
    def pod(name: str, node: str) -> JSON:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]},
        }

    w = watch.Watch()
    stream = w.stream(
        core.list_pod_for_all_namespaces, field_selector="spec.nodeName=n1", timeout_seconds=5
    )
    await core.create_namespaced_pod(NS, pod("other", "n2"))
    await core.create_namespaced_pod(NS, pod("mine", "n1"))
    events = await collect_events(stream, 1)
    await w.close()
    assert [(t, o["metadata"]["name"]) for t, o in events] == [("ADDED", "mine")]


# --- watch semantics -----------------------------------------------------------------------------


async def test_watch_from_resource_version_replays_only_later_events(
    co: client.CustomObjectsApi,
) -> None:
    await create(co, instance("old"))
    listed = await co.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)
    rv = listed["metadata"]["resourceVersion"]
    await create(co, instance("new"))
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "old", {"spec": {"capacity": 1}}
    )
    w = watch.Watch()
    events = await collect_events(
        w.stream(
            co.list_namespaced_custom_object,
            GROUP,
            VERSION,
            NS,
            PLURAL,
            resource_version=rv,
            timeout_seconds=5,
        ),
        2,
    )
    await w.close()
    assert [(t, o["metadata"]["name"]) for t, o in events] == [
        ("ADDED", "new"),
        ("MODIFIED", "old"),
    ]
    assert int(events[0][1]["metadata"]["resourceVersion"]) > int(rv)

    # RV "" / "0" / absent: synthetic ADDED for the current objects.
    w = watch.Watch()
    initial = await collect_events(
        w.stream(
            co.list_namespaced_custom_object,
            GROUP,
            VERSION,
            NS,
            PLURAL,
            resource_version="0",
            timeout_seconds=5,
        ),
        2,
    )
    await w.close()
    assert sorted((t, o["metadata"]["name"]) for t, o in initial) == [
        ("ADDED", "new"),
        ("ADDED", "old"),
    ]


async def test_watch_too_old_resource_version_gets_410(
    api: ApiServerDouble, co: client.CustomObjectsApi
) -> None:
    created = await create(co, instance("a"))
    old_rv = created["metadata"]["resourceVersion"]
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "a", {"spec": {"capacity": 1}}
    )
    api.compact_history()
    w = watch.Watch()
    with pytest.raises(client.ApiException) as err:
        await collect_events(
            w.stream(
                co.list_namespaced_custom_object,
                GROUP,
                VERSION,
                NS,
                PLURAL,
                resource_version=old_rv,
                timeout_seconds=2,
            ),
            1,
        )
    await w.close()
    assert err.value.status == 410

    # On the wire: HTTP 200 with a single ERROR event carrying a 410 Expired Status.
    url = f"{api.url}/apis/akri.sh/v0/namespaces/default/instances"
    url += f"?watch=true&resourceVersion={old_rv}"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 200
        lines = (await resp.text()).splitlines()
    event = json.loads(lines[0])
    assert len(lines) == 1 and event["type"] == "ERROR"
    assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"
    assert event["object"]["message"].startswith(f"too old resource version: {old_rv} (")


async def test_watch_history_is_bounded() -> None:
    async with ApiServerDouble(crds=[INSTANCE_CRD], history_size=3) as api:
        first = api.create(instance("a"), NS)
        for i in range(4):
            api.apply({**instance("a"), "spec": {"capacity": i}}, NS)
        first_rv = first["metadata"]["resourceVersion"]
        url = f"{api.url}/apis/akri.sh/v0/instances?watch=1&resourceVersion={first_rv}"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            event = json.loads((await resp.text()).splitlines()[0])
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        recent = api.resource_version - 2
        url = (
            f"{api.url}/apis/akri.sh/v0/instances?watch=1&resourceVersion={recent}&timeoutSeconds=1"
        )
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            types = [json.loads(line)["type"] for line in (await resp.text()).splitlines()]
        assert types == ["MODIFIED", "MODIFIED"]


async def test_watch_timeout_seconds_ends_stream(co: client.CustomObjectsApi) -> None:
    await create(co, instance("a"))
    w = watch.Watch()
    started = time.monotonic()
    seen = [
        e["type"]
        async for e in w.stream(
            co.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, timeout_seconds=1
        )
    ]
    elapsed = time.monotonic() - started
    await w.close()
    assert seen == ["ADDED"]
    assert 0.9 <= elapsed < 3


@pytest.mark.parametrize("flag", ["true", "True", "1"])
async def test_watch_flag_spellings_and_bookmarks(api: ApiServerDouble, flag: str) -> None:
    api.create(instance("a"), NS)
    url = f"{api.url}/apis/akri.sh/v0/namespaces/default/instances"
    params = {"watch": flag, "timeoutSeconds": "1", "allowWatchBookmarks": "true"}
    async with aiohttp.ClientSession() as http, http.get(url, params=params) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        assert resp.headers.get("Transfer-Encoding") == "chunked"
        events = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert events[0]["type"] == "ADDED"
    bookmarks = [e for e in events if e["type"] == "BOOKMARK"]
    assert bookmarks and bookmarks[-1]["object"]["metadata"]["resourceVersion"] == str(
        api.resource_version
    )
    assert bookmarks[0]["object"]["kind"] == "Instance"


async def test_a_writes_watch_event_goes_out_before_its_answer(api: ApiServerDouble) -> None:
    """A real API server gives no order between a write's answer and its watch event (the
    answer leaves the handler, the event the watch cache); the double writes the event
    first, so a client that assumed its own answer always comes first is caught (issue 33.1:
    the agent's informer then skipped other nodes' later writes for 30 s). With
    ``watch_events_first=False`` the answer may come first, as before."""
    api.create(instance("a"), NS)
    base = f"{api.url}/apis/akri.sh/v0/namespaces/default/instances"
    order: list[str] = []
    async with aiohttp.ClientSession() as http:
        listed = await (await http.get(base)).json()
        params = {"watch": "true", "resourceVersion": listed["metadata"]["resourceVersion"]}
        async with http.get(base, params=params) as stream:

            async def read_one() -> None:
                await stream.content.readline()
                order.append("event")

            reader = asyncio.create_task(read_one())
            await asyncio.sleep(0.05)  # the watch is registered
            patch = {"spec": {"capacity": 3}}
            headers = {"Content-Type": "application/merge-patch+json"}
            async with http.patch(f"{base}/a", json=patch, headers=headers) as answer:
                assert answer.status == 200
                order.append("answer")
            await asyncio.wait_for(reader, 5)
    assert order == ["event", "answer"]


async def test_watch_send_initial_events(api: ApiServerDouble) -> None:
    api.create(instance("a"), NS)
    url = f"{api.url}/apis/akri.sh/v0/namespaces/default/instances"
    params = {
        "watch": "1",
        "timeoutSeconds": "1",
        "sendInitialEvents": "true",
        "resourceVersionMatch": "NotOlderThan",
        "allowWatchBookmarks": "true",
    }
    async with aiohttp.ClientSession() as http, http.get(url, params=params) as resp:
        events = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert events[0]["type"] == "ADDED" and events[1]["type"] == "BOOKMARK"
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


# --- server-side apply, strategic merge, built-ins ------------------------------------------------


async def test_server_side_apply(co: client.CustomObjectsApi, api: ApiServerDouble) -> None:
    body = instance("cam-1", capacity=1)
    resp = await co.patch_namespaced_custom_object_with_http_info(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "cam-1",
        body,
        field_manager="akri-agent",
        force=True,
        _content_type="application/apply-patch+yaml",
    )
    assert resp.status_code == 201  # created by apply
    again = await co.patch_namespaced_custom_object_with_http_info(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "cam-1",
        instance("cam-1", capacity=4),
        field_manager="akri-agent",
        force=True,
        _content_type="application/apply-patch+yaml",
    )
    assert again.status_code == 200 and again.data["spec"]["capacity"] == 4
    assert again.data["metadata"]["generation"] == 2
    with pytest.raises(client.ApiException) as err:
        await co.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "cam-1", body, _content_type="application/apply-patch+yaml"
        )
    assert err.value.status == 422  # fieldManager is required
    sent = api.requests_for(verb="patch", resource="instances.akri.sh")[0]
    assert sent.content_type == "application/apply-patch+yaml"
    assert sent.query == {"fieldManager": "akri-agent", "force": "true"}


async def test_strict_strategic_merge_patch_on_custom_resources() -> None:
    async with ApiServerDouble(crds=[INSTANCE_CRD], strict_strategic_merge=True) as api:
        api.create(instance("cam-1"))
        url = f"{api.url}/apis/akri.sh/v0/namespaces/default/instances/cam-1"
        smp = {"Content-Type": "application/strategic-merge-patch+json"}
        async with aiohttp.ClientSession() as http:
            async with http.patch(url, data=b'{"spec":{"capacity":2}}', headers=smp) as resp:
                assert resp.status == 415
                assert (await resp.json())["reason"] == "UnsupportedMediaType"
            yaml_body = {"Content-Type": "application/yaml"}
            async with http.put(url, data=b"spec: {}", headers=yaml_body) as resp:
                assert resp.status == 200  # YAML bodies are accepted for PUT/POST


async def test_builtin_kinds(
    api: ApiServerDouble, api_client: client.ApiClient, core: client.CoreV1Api
) -> None:
    await core.create_namespace(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "akri"}}
    )
    await core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
    pod = await core.create_namespaced_pod(
        "akri",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]},
        },
    )
    assert pod.metadata.uid
    patched = await core.patch_namespaced_pod(
        "p", "akri", {"spec": {"containers": [{"name": "b", "image": "2"}]}}
    )
    assert [(c.name, c.image) for c in patched.spec.containers] == [
        ("a", "1"),
        ("b", "2"),
    ]  # merged by name
    assert api.requests[-1].content_type == "application/strategic-merge-patch+json"
    await core.create_namespaced_config_map(
        "akri", {"metadata": {"name": "cm"}, "data": {"k": "v"}}
    )
    assert (await core.read_namespaced_config_map("cm", "akri")).data == {"k": "v"}

    co = client.CustomObjectsApi(api_client)
    await co.create_cluster_custom_object(
        "resource.k8s.io",
        "v1",
        "resourceslices",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "s1"},
            "spec": {
                "driver": "akri.sh",
                "nodeName": "n1",
                "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1},
            },
        },
    )
    slices = await co.list_cluster_custom_object(
        "resource.k8s.io", "v1", "resourceslices", field_selector="spec.driver=akri.sh"
    )
    assert [s["metadata"]["name"] for s in slices["items"]] == ["s1"]
    claim = await co.create_namespaced_custom_object(
        "resource.k8s.io",
        "v1",
        "akri",
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c"},
            "spec": {},
        },
    )
    status = await co.patch_namespaced_custom_object_status(
        "resource.k8s.io",
        "v1",
        "akri",
        "resourceclaims",
        "c",
        {"status": {"allocation": {"devices": {}}}},
    )
    assert (
        status["status"] == {"allocation": {"devices": {}}} and claim["metadata"]["generation"] == 1
    )
    lease = await co.create_namespaced_custom_object(
        "coordination.k8s.io",
        "v1",
        "akri",
        "leases",
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "l"},
            "spec": {"holderIdentity": "me"},
        },
    )
    assert lease["spec"]["holderIdentity"] == "me"

    api.store.namespace_cleanup_delay = 0  # the namespace controller's next pass
    await core.delete_namespace("akri")  # takes its objects with it, then goes
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while api.get("namespaces", "akri") is not None:
        assert loop.time() < deadline, "the namespace controller never came"
        await asyncio.sleep(0.05)
    assert api.list("pods", "akri") == [] and api.get("configmaps", "cm", "akri") is None


async def test_crd_created_over_http_is_served_immediately(
    api: ApiServerDouble, api_client: client.ApiClient
) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Cluster",
            "names": {
                "plural": "widgets",
                "kind": "Widget",
                "shortNames": ["wd"],
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object"}},
                }
            ],
        },
    }
    ext = client.ApiextensionsV1Api(api_client)
    created = await ext.create_custom_resource_definition(crd)
    conditions = {c.type: c.status for c in created.status.conditions}
    assert conditions["Established"] == "True"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{api.url}/apis/example.com/v1") as resp:
            resources = (await resp.json())["resources"]
        assert resources == [
            {
                "name": "widgets",
                "singularName": "widget",
                "namespaced": False,
                "kind": "Widget",
                "verbs": [
                    "create",
                    "delete",
                    "deletecollection",
                    "get",
                    "list",
                    "patch",
                    "update",
                    "watch",
                ],
                "shortNames": ["wd"],
                "categories": ["all"],
                "storageVersionHash": resources[0]["storageVersionHash"],
            }
        ]
        async with http.get(f"{api.url}/apis") as resp:
            groups = {g["name"] for g in (await resp.json())["groups"]}
        assert {"example.com", "akri.sh", "resource.k8s.io"} <= groups
    co = client.CustomObjectsApi(api_client)
    await co.create_cluster_custom_object(
        "example.com",
        "v1",
        "widgets",
        {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}},
    )
    bad = {**crd, "metadata": {"name": "wrong.example.com"}}
    with pytest.raises(client.ApiException) as err:
        await ext.create_custom_resource_definition(bad)
    assert err.value.status == 422
    await ext.delete_custom_resource_definition("widgets.example.com")
    with pytest.raises(client.ApiException) as err:
        await co.list_cluster_custom_object("example.com", "v1", "widgets")
    assert err.value.status == 404


async def test_table_output_and_pagination(api: ApiServerDouble) -> None:
    for i in range(3):
        api.create(instance(f"cam-{i}", capacity=i, nodes=["n1", "n2"]), NS)
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    url = f"{api.url}/apis/akri.sh/v0/namespaces/default/instances"
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers={"Accept": accept}) as resp:
            doc = await resp.json()
        assert doc["kind"] == "Table" and doc["apiVersion"] == "meta.k8s.io/v1"
        assert [c["name"] for c in doc["columnDefinitions"]] == [
            "Name",
            "Config",
            "Shared",
            "Nodes",
            "Capacity",
            "Age",
        ]
        assert doc["rows"][1]["cells"][:5] == ["cam-1", "onvif", True, '["n1","n2"]', 1]
        assert doc["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
        async with http.get(f"{api.url}/api/v1/namespaces", headers={"Accept": accept}) as resp:
            ns_table = await resp.json()
        assert [c["name"] for c in ns_table["columnDefinitions"]] == ["Name", "Age"]
        async with http.get(url, params={"limit": "2"}) as resp:
            page = await resp.json()
        assert [i["metadata"]["name"] for i in page["items"]] == ["cam-0", "cam-1"]
        assert page["metadata"]["remainingItemCount"] == 1
        async with http.get(
            url, params={"limit": "2", "continue": page["metadata"]["continue"]}
        ) as resp:
            rest = await resp.json()
        assert [i["metadata"]["name"] for i in rest["items"]] == ["cam-2"]
        assert "continue" not in rest["metadata"]


# --- faults, restarts, request log ------------------------------------------------------------


async def test_fault_injection(api: ApiServerDouble, co: client.CustomObjectsApi) -> None:
    await create(co, instance("cam-1", capacity=1))
    fault = api.fail(503, verb="patch", resource="instances", name="cam-1", times=2, retry_after=1)
    for _ in range(2):
        with pytest.raises(client.ApiException) as err:
            await co.patch_namespaced_custom_object(
                GROUP, VERSION, NS, PLURAL, "cam-1", {"spec": {"capacity": 2}}
            )
        assert err.value.status == 503
        assert status_of(err.value)["reason"] == "ServiceUnavailable"
    assert fault.hits == 2 and (await get(co, "cam-1"))["spec"]["capacity"] == 1  # nothing applied
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "cam-1", {"spec": {"capacity": 2}}
    )

    # A lost reply: the write happens, the client sees an error.
    api.fail(500, verb="update", after=True)
    current = await get(co, "cam-1")
    with pytest.raises(client.ApiException):
        await co.replace_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            "cam-1",
            {**current, "spec": {**current["spec"], "capacity": 3}},
        )
    assert (await get(co, "cam-1"))["spec"]["capacity"] == 3

    # Dropped connections (aiohttp retries an idempotent request once, hence times=2).
    api.drop(verb="get", name="cam-1", times=2)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            await http.get(f"{api.url}/apis/akri.sh/v0/namespaces/default/instances/cam-1")
        async with http.get(
            f"{api.url}/apis/akri.sh/v0/namespaces/default/instances/cam-1"
        ) as resp:
            assert resp.status == 200
    api.drop(verb="create", resource="instances.akri.sh")
    with pytest.raises(aiohttp.ClientError):
        await create(co, instance("cam-2"))
    assert api.get("instances", "cam-2", NS) is None
    assert [r.status for r in api.requests_for(verb="create", name="")][-1] == 0

    api.fail(429, verb="list", duration=0.3, times=None)
    with pytest.raises(client.ApiException) as err:
        await co.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)
    assert err.value.status == 429
    await asyncio.sleep(0.35)
    await co.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)


async def test_unreachable_and_restart_keep_state(
    api: ApiServerDouble, co: client.CustomObjectsApi
) -> None:
    created = await create(co, instance("cam-1"))
    port = api.port
    task = api.go_offline_for(0.5)
    await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectorError):
            await http.get(f"{api.url}/version")
    await task
    assert api.port == port
    assert (await get(co, "cam-1"))["metadata"]["uid"] == created["metadata"]["uid"]

    # A watch broken by a restart resumes from its last resourceVersion without losses.
    w = watch.Watch()
    stream = w.stream(
        co.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, timeout_seconds=5
    )
    first = await collect_events(stream, 1)
    await api.restart()
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "cam-1", {"spec": {"capacity": 9}}
    )
    url = (
        f"{api.url}/apis/akri.sh/v0/namespaces/default/instances?watch=true&timeoutSeconds=1"
        f"&resourceVersion={first[0][1]['metadata']['resourceVersion']}"
    )
    await w.close()
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        events = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert [(e["type"], e["object"]["spec"]["capacity"]) for e in events] == [("MODIFIED", 9)]


async def test_request_log(api: ApiServerDouble, co: client.CustomObjectsApi) -> None:
    await create(co, instance("cam-1"))
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "cam-1", {"spec": {"capacity": 2}}
    )
    await co.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, label_selector="app=x")
    creates = api.requests_for(verb="create", resource="instances")
    assert (
        len(creates) == 1
        and creates[0].status == 201
        and creates[0].json()["metadata"]["name"] == "cam-1"
    )
    (patch,) = api.requests_for(verb="patch", name="cam-1")
    assert patch.method == "PATCH" and patch.content_type == "application/merge-patch+json"
    assert patch.json() == {"spec": {"capacity": 2}}
    assert patch.path == "/apis/akri.sh/v0/namespaces/default/instances/cam-1"
    (listing,) = api.requests_for(verb="list")
    assert listing.query == {"labelSelector": "app=x"}
    api.clear_requests()
    assert api.requests == []


async def test_concurrent_updates_have_one_winner_per_resource_version(
    co: client.CustomObjectsApi,
) -> None:
    current = await create(co, instance("hot", capacity=0))
    for round_ in range(5):

        async def attempt(i: int, base: JSON = current, r: int = round_) -> JSON | int:
            body = {**base, "spec": {**base["spec"], "capacity": r * 100 + i + 1}}  # never a no-op
            try:
                result: JSON = await co.replace_namespaced_custom_object(
                    GROUP, VERSION, NS, PLURAL, "hot", body
                )
                return result
            except client.ApiException as exc:
                return int(exc.status)

        results = await asyncio.gather(*(attempt(i) for i in range(16)))
        winners = [r for r in results if isinstance(r, dict)]
        assert len(winners) == 1
        assert sorted(r for r in results if isinstance(r, int)) == [409] * 15
        current = await get(co, "hot")
        assert current["spec"]["capacity"] == winners[0]["spec"]["capacity"]
        assert current["metadata"]["resourceVersion"] == winners[0]["metadata"]["resourceVersion"]


# --- kubectl -------------------------------------------------------------------------------------


def kubectl_binary() -> str:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    found = str(venv_kubectl) if venv_kubectl.exists() else shutil.which("kubectl")
    if not found:
        pytest.skip("kubectl not installed")
    return found


@pytest.fixture
def kubectl_env(tmp_path: Path) -> dict[str, str]:
    empty = tmp_path / "empty-kubeconfig"
    empty.write_text("")
    return {**os.environ, "KUBECONFIG": str(empty), "HOME": str(tmp_path)}


async def kubectl(api: ApiServerDouble, env: dict[str, str], *args: str, check: bool = True) -> str:
    proc = await asyncio.create_subprocess_exec(
        kubectl_binary(),
        f"--server={api.url}",
        f"--cache-dir={env['HOME']}/cache",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {err.decode()}")
    return out.decode() + (err.decode() if not check else "")


async def test_kubectl_apply_get_watch_delete(
    api: ApiServerDouble, kubectl_env: dict[str, str], tmp_path: Path
) -> None:
    fresh = ApiServerDouble()  # no CRDs preloaded: kubectl installs the CRD itself
    async with fresh:
        out = await kubectl(fresh, kubectl_env, "apply", "-f", str(INSTANCE_CRD))
        assert "customresourcedefinition.apiextensions.k8s.io/instances.akri.sh created" in out
        await kubectl(
            fresh,
            kubectl_env,
            "wait",
            "--for=condition=Established",
            "crd/instances.akri.sh",
            "--timeout=5s",
        )
        manifest = tmp_path / "cam.yaml"
        manifest.write_text(
            "apiVersion: akri.sh/v0\nkind: Instance\n"
            "metadata:\n  name: cam-1\n  labels: {app: cam}\n"
            "spec:\n  configurationName: onvif-cfg\n  shared: true\n"
            "  nodes: [node-a, node-b]\n  capacity: 2\n"
        )
        assert "instance.akri.sh/cam-1 created" in await kubectl(
            fresh, kubectl_env, "apply", "-f", str(manifest)
        )
        table = (await kubectl(fresh, kubectl_env, "get", "instances.akri.sh")).splitlines()
        assert table[0].split() == ["NAME", "CONFIG", "SHARED", "NODES", "CAPACITY", "AGE"]
        assert table[1].split()[:5] == ["cam-1", "onvif-cfg", "true", '["node-a","node-b"]', "2"]
        assert "cam-1" in await kubectl(fresh, kubectl_env, "get", "akri", "-l", "app=cam", "-A")
        assert "No resources found" in await kubectl(
            fresh, kubectl_env, "get", "akrii", "-l", "app=usb", check=False
        )

        watcher = await asyncio.create_subprocess_exec(
            kubectl_binary(),
            f"--server={fresh.url}",
            f"--cache-dir={kubectl_env['HOME']}/cache",
            "get",
            "instances.akri.sh",
            "-w",
            "--output-watch-events",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=kubectl_env,
        )
        assert watcher.stdout is not None
        try:
            lines: list[str] = []

            async def read_until(event: str) -> None:
                while not any(line.startswith(event) for line in lines):
                    line = await asyncio.wait_for(watcher.stdout.readline(), 10)  # type: ignore[union-attr]
                    assert line, "kubectl get -w ended early"
                    lines.append(line.decode())

            await read_until("ADDED")
            manifest.write_text(manifest.read_text().replace("capacity: 2", "capacity: 3"))
            assert "configured" in await kubectl(fresh, kubectl_env, "apply", "-f", str(manifest))
            await read_until("MODIFIED")
            assert "deleted" in await kubectl(fresh, kubectl_env, "delete", "instance", "cam-1")
            await read_until("DELETED")
        finally:
            watcher.kill()
            await watcher.wait()
        assert lines[0].split()[:2] == ["EVENT", "NAME"]
        modified = next(line for line in lines if line.startswith("MODIFIED")).split()
        assert modified[:2] == ["MODIFIED", "cam-1"] and modified[5] == "3"
        assert fresh.get("instances.akri.sh", "cam-1", NS) is None
        assert fresh.requests_for(verb="watch", resource="instances.akri.sh")


async def test_kubectl_patch_replace_conflict_and_server_side_apply(
    api: ApiServerDouble, kubectl_env: dict[str, str], tmp_path: Path
) -> None:
    api.create(instance("cam-1", capacity=1), NS)
    await kubectl(
        api,
        kubectl_env,
        "patch",
        "instance",
        "cam-1",
        "--type",
        "merge",
        "-p",
        '{"spec":{"capacity":2}}',
    )
    await kubectl(
        api,
        kubectl_env,
        "patch",
        "instance",
        "cam-1",
        "--type",
        "json",
        "-p",
        '[{"op":"replace","path":"/spec/capacity","value":3}]',
    )
    await kubectl(api, kubectl_env, "label", "instance", "cam-1", "x=y")
    obj = json.loads(await kubectl(api, kubectl_env, "get", "instance", "cam-1", "-o", "json"))
    assert obj["spec"]["capacity"] == 3 and obj["metadata"]["labels"] == {"x": "y"}
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**obj, "spec": {**obj["spec"], "capacity": 4}}))
    assert "replaced" in await kubectl(api, kubectl_env, "replace", "-f", str(edited))
    stale = tmp_path / "stale.json"  # still carries the resourceVersion read before
    stale.write_text(json.dumps({**obj, "spec": {**obj["spec"], "capacity": 5}}))
    out = await kubectl(api, kubectl_env, "replace", "-f", str(stale), check=False)
    assert "Error from server (Conflict)" in out and "the object has been modified" in out
    applied = tmp_path / "ssa.yaml"
    applied.write_text(json.dumps(instance("cam-2", capacity=7)))
    assert "serverside-applied" in await kubectl(
        api, kubectl_env, "apply", "--server-side", "-n", NS, "-f", str(applied)
    )
    assert api.get("instances.akri.sh", "cam-2", NS)["spec"]["capacity"] == 7  # type: ignore[index]
    resources = await kubectl(api, kubectl_env, "api-resources", "--api-group=akri.sh")
    assert "instances" in resources and "akrii" in resources

    # Imperative generators post protobuf for built-in kinds.
    await kubectl(api, kubectl_env, "create", "namespace", "akri")
    await kubectl(api, kubectl_env, "create", "configmap", "cm", "-n", "akri", "--from-literal=a=b")
    await kubectl(
        api, kubectl_env, "create", "secret", "generic", "s", "-n", "akri", "--from-literal=pw=x"
    )
    assert api.get("configmaps", "cm", "akri")["data"] == {"a": "b"}  # type: ignore[index]
    assert api.get("secrets", "s", "akri")["data"] == {"pw": "eA=="}  # type: ignore[index]
    assert api.requests_for(verb="create", resource="namespaces")[0].content_type == (
        "application/vnd.kubernetes.protobuf"
    )


def test_threaded_server_with_kubeconfig(tmp_path: Path) -> None:
    kubectl_path = kubectl_binary()
    with ThreadedApiServer(crds=[INSTANCE_CRD]) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        api.create(instance("cam-1"), NS)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)}
        out = subprocess.run(
            [kubectl_path, "get", "instances", "-o", "name"],
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        assert out.strip() == "instance.akri.sh/cam-1"
        subprocess.run(
            [kubectl_path, "delete", "instance", "cam-1"],
            env=env,
            capture_output=True,
            timeout=20,
            check=True,
        )
        assert api.get("instances", "cam-1", NS) is None


@pytest.fixture
def subprocess_server() -> Iterator[str]:
    command = [sys.executable, "-m", "tests.doubles.apiserver", "--port", "0"]
    proc = subprocess.Popen(
        [*command, "--crd", str(INSTANCE_CRD)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_subprocess_entry_point(subprocess_server: str) -> None:
    assert subprocess_server.startswith("http://127.0.0.1:")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{subprocess_server}/version") as resp:
            assert (await resp.json())["gitVersion"].startswith("v1.")
        async with http.get(f"{subprocess_server}/apis/akri.sh/v0/instances") as resp:
            assert (await resp.json())["kind"] == "InstanceList"


async def test_a_deleted_crd_waits_for_its_objects_finalizers_like_a_real_server(
    api: ApiServerDouble,
) -> None:
    """A real server keeps a deleted CRD (finalizer ``customresourcecleanup``, condition
    ``Terminating``) until every object is gone: an object with a finalizer keeps it served
    and terminating; creates are refused meanwhile (405)."""
    api.create({**instance("held"), "metadata": {"name": "held", "namespace": NS,
                                                  "finalizers": ["akri.sh/slots"]}})  # fmt: skip
    api.create({**instance("free"), "metadata": {"name": "free", "namespace": NS}})
    api.delete("customresourcedefinitions", "instances.akri.sh")
    crd = api.get("customresourcedefinitions", "instances.akri.sh")
    assert crd is not None and crd["metadata"]["deletionTimestamp"]
    assert crd["metadata"]["finalizers"] == ["customresourcecleanup.apiextensions.k8s.io"]
    terminating = [c for c in crd["status"]["conditions"] if c["type"] == "Terminating"]
    assert terminating[0]["status"] == "True"
    assert api.get("instances", "free") is None
    held = api.get("instances", "held")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    async with aiohttp.ClientSession() as session:
        url = f"{api.url}/apis/akri.sh/v0/namespaces/{NS}/instances"
        async with session.post(url, json=instance("new")) as response:
            assert response.status == 405
            body = await response.json()
            assert "while custom resource definition is terminating" in body["message"]
        async with session.get(url) as response:  # still served
            assert response.status == 200
    held["metadata"]["finalizers"] = []
    api.apply(held)  # the last finalizer goes: the object, then the CRD (no longer served)
    assert api.get("customresourcedefinitions", "instances.akri.sh") is None
    with pytest.raises(KeyError):
        api.resource("instances")


async def test_a_deleted_namespace_terminates_like_on_a_real_server(api: ApiServerDouble) -> None:
    """Its objects stay until the namespace controller's turn (kubectl delete -k still finds
    them), creates in it are refused, an object held by a finalizer keeps it Terminating."""
    api.store.namespace_cleanup_delay = 0.3
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "akri"}})
    api.create({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "c", "namespace": "akri"}})  # fmt: skip
    api.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "akri",
                "finalizers": ["tests.akri.sh/kubelet"]}, "spec": {}})  # fmt: skip
    api.delete("namespaces", "akri")
    namespace = api.get("namespaces", "akri")
    assert namespace is not None and namespace["status"]["phase"] == "Terminating"
    assert api.get("configmaps", "c", "akri") is not None  # not yet
    async with aiohttp.ClientSession() as session:
        url = f"{api.url}/api/v1/namespaces/akri/configmaps"
        async with session.post(url, json={"metadata": {"name": "d"}}) as response:
            assert response.status == 403
            assert "because it is being terminated" in (await response.json())["message"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while api.get("configmaps", "c", "akri") is not None:
        assert loop.time() < deadline, "the namespace controller never came"
        await asyncio.sleep(0.05)
    pod = api.get("pods", "p", "akri")
    assert pod is not None and pod["metadata"]["deletionTimestamp"]
    assert api.get("namespaces", "akri") is not None  # the pod keeps it
    pod["metadata"]["finalizers"] = []
    api.apply(pod)
    while api.get("namespaces", "akri") is not None:
        assert loop.time() < deadline, "the namespace stayed"
        await asyncio.sleep(0.05)
