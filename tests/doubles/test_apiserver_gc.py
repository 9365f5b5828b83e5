"""The API-server double's garbage collector and deletion finalizers (apiserver/gc.py),
driven over HTTP with the official ``kubernetes.aio`` client: background, foreground and orphan
propagation, owners that are gone or replaced, and what the real server refuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.aio import client, config

from tests.doubles.apiserver import ApiServerDouble

FIXTURES = Path(__file__).parent / "apiserver" / "fixtures"
CRDS = [FIXTURES / "instance-crd.yaml", FIXTURES / "configuration-crd.yaml"]
GROUP, VERSION, NS = "akri.sh", "v0", "default"
JSON = dict[str, Any]


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
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


def configuration(api: ApiServerDouble, name: str = "cam") -> JSON:
    return api.create(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Configuration",
            "metadata": {"name": name},
            "spec": {"discoveryHandler": {"name": "debugEcho"}, "capacity": 1},
        }
    )


def owner_ref(owner: JSON, *, block: bool | None = None) -> JSON:
    ref = {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    if block is not None:
        ref["blockOwnerDeletion"] = block
    return ref


def instance(
    api: ApiServerDouble, name: str, owners: list[JSON], finalizers: list[str] | None = None
) -> JSON:
    meta: JSON = {"name": name, "ownerReferences": owners}
    if finalizers:
        meta["finalizers"] = finalizers
    return api.create(
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Instance",
            "metadata": meta,
            "spec": {"configurationName": "cam", "nodes": ["node-a"], "capacity": 1},
        }
    )


def pod(api: ApiServerDouble, name: str, owners: list[JSON]) -> JSON:
    return api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "ownerReferences": owners},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        }
    )


async def delete_configuration(api_client: client.ApiClient, name: str, **options: Any) -> JSON:
    co = client.CustomObjectsApi(api_client)
    result: JSON = await co.delete_namespaced_custom_object(
        GROUP, VERSION, NS, "configurations", name, **options
    )
    return result


async def test_background_deletion_collects_dependents_and_honours_their_finalizers(
    api: ApiServerDouble, api_client: client.ApiClient
) -> None:
    config_obj = configuration(api)
    held = instance(api, "cam-held", [owner_ref(config_obj)], ["akri.sh/slots"])
    instance(api, "cam-free", [owner_ref(config_obj)])
    broker = pod(api, "broker", [owner_ref(held)])
    other_owner = pod(api, "keeper", [])
    instance(api, "cam-shared", [owner_ref(config_obj), owner_ref(other_owner)])

    await delete_configuration(api_client, "cam")  # default policy: Background

    assert api.get("configurations.akri.sh", "cam") is None
    assert api.get("instances.akri.sh", "cam-free") is None
    terminating = api.get("instances.akri.sh", "cam-held")
    assert terminating is not None and terminating["metadata"]["deletionTimestamp"]
    assert terminating["metadata"]["finalizers"] == ["akri.sh/slots"]
    # an owner that still exists keeps its dependent; the dangling reference is removed
    shared = api.get("instances.akri.sh", "cam-shared")
    assert shared is not None
    assert [r["name"] for r in shared["metadata"]["ownerReferences"]] == ["keeper"]
    # the terminating Instance's own dependents stay while it exists (it is a solid owner)
    assert api.get("pods", "broker") is not None

    co = client.CustomObjectsApi(api_client)
    with pytest.raises(client.ApiException) as err:  # no new finalizer while terminating
        await co.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            "instances",
            "cam-held",
            {"metadata": {"finalizers": ["akri.sh/slots", "more"]}},
        )
    assert err.value.status == 422
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, "instances", "cam-held", {"metadata": {"finalizers": None}}
    )
    assert api.get("instances.akri.sh", "cam-held") is None
    assert api.get("pods", broker["metadata"]["name"]) is None  # collected in turn


async def test_foreground_deletion_waits_for_blocking_dependents(
    api: ApiServerDouble, api_client: client.ApiClient
) -> None:
    config_obj = configuration(api)
    instance(api, "cam-blocking", [owner_ref(config_obj, block=True)], ["akri.sh/slots"])
    instance(api, "cam-plain", [owner_ref(config_obj)], ["akri.sh/slots"])

    marked = await delete_configuration(api_client, "cam", propagation_policy="Foreground")

    assert marked["metadata"]["deletionTimestamp"]
    assert marked["metadata"]["finalizers"] == ["foregroundDeletion"]
    for name in ("cam-blocking", "cam-plain"):  # every dependent is being deleted
        dependent = api.get("instances.akri.sh", name)
        assert dependent is not None and dependent["metadata"]["deletionTimestamp"]
    co = client.CustomObjectsApi(api_client)
    # the non-blocking dependent does not hold the owner ...
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, "instances", "cam-plain", {"metadata": {"finalizers": None}}
    )
    owner = api.get("configurations.akri.sh", "cam")
    assert owner is not None and owner["metadata"]["finalizers"] == ["foregroundDeletion"]
    # ... the blocking one does, until it is gone
    await co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, "instances", "cam-blocking", {"metadata": {"finalizers": None}}
    )
    assert api.get("configurations.akri.sh", "cam") is None


async def test_orphan_deletion_keeps_dependents_without_the_reference(
    api: ApiServerDouble, api_client: client.ApiClient
) -> None:
    config_obj = configuration(api)
    instance(api, "cam-1", [owner_ref(config_obj)])

    await delete_configuration(api_client, "cam", propagation_policy="Orphan")

    assert api.get("configurations.akri.sh", "cam") is None
    orphan = api.get("instances.akri.sh", "cam-1")
    assert orphan is not None and "ownerReferences" not in orphan["metadata"]
    assert not orphan["metadata"].get("deletionTimestamp")


async def test_deprecated_orphan_dependents_flag(
    api: ApiServerDouble, api_client: client.ApiClient
) -> None:
    config_obj = configuration(api)
    instance(api, "cam-1", [owner_ref(config_obj)])
    await delete_configuration(
        api_client, "cam", body=client.V1DeleteOptions(orphan_dependents=True)
    )
    assert api.get("instances.akri.sh", "cam-1") is not None


async def test_dependent_of_a_replaced_or_missing_owner_is_collected(
    api: ApiServerDouble,
) -> None:
    config_obj = configuration(api)
    stale = {**owner_ref(config_obj), "uid": "00000000-0000-0000-0000-000000000000"}
    instance(api, "cam-stale", [stale])  # the owner exists with another uid: dangling
    missing = {**owner_ref(config_obj), "name": "gone"}
    instance(api, "cam-missing", [missing])
    assert api.get("instances.akri.sh", "cam-stale") is None
    assert api.get("instances.akri.sh", "cam-missing") is None
    assert ("delete", api.resource("instances").gr, ("default", "cam-stale"), "Background") in (
        api.store.gc.actions
    )


async def test_cluster_scoped_dependent_of_a_namespaced_owner_is_never_collected(
    api: ApiServerDouble,
) -> None:
    config_obj = configuration(api)
    api.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "akri", "ownerReferences": [owner_ref(config_obj)]},
            "spec": {},
        }
    )
    api.delete("configurations.akri.sh", "cam")
    assert api.get("deviceclasses.resource.k8s.io", "akri") is not None


async def test_invalid_delete_options_are_refused(
    api: ApiServerDouble, api_client: client.ApiClient
) -> None:
    configuration(api)
    with pytest.raises(client.ApiException) as err:
        await delete_configuration(api_client, "cam", propagation_policy="Sideways")
    assert err.value.status == 422
    with pytest.raises(client.ApiException) as err:
        await delete_configuration(
            api_client,
            "cam",
            body=client.V1DeleteOptions(orphan_dependents=True, propagation_policy="Orphan"),
        )
    assert err.value.status == 422
    assert api.get("configurations.akri.sh", "cam") is not None


async def test_a_hung_write_lands_after_the_client_gave_up(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """``hang``: the API server holds a write past the client's deadline and applies it when
    released — the outcome a client that timed out cannot know without re-reading."""
    from agent.core.kube import make_kube_client
    from agent.core.kube.errors import TransportError

    config_obj = configuration(api)
    kube = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc")))
    path = "/apis/akri.sh/v0/namespaces/default/configurations/cam"
    try:
        fault = api.hang(verb="update", resource="configurations")
        edited = {**config_obj, "spec": {**config_obj["spec"], "capacity": 3}}
        with pytest.raises(TransportError):
            await kube.replace(path, edited, request_timeout=0.5)
        assert fault.held == 1
        stored = api.get("configurations.akri.sh", "cam")
        assert stored is not None and stored["spec"]["capacity"] == 1  # not applied yet
        landed = asyncio.Event()
        api.store.listeners.append(lambda event: landed.set())
        fault.release()
        await asyncio.wait_for(landed.wait(), 10)
        stored = api.get("configurations.akri.sh", "cam")
        assert stored is not None and stored["spec"]["capacity"] == 3
        assert fault.late == 1
        # released: the rule holds nothing any more
        assert (await kube.get(path))["spec"]["capacity"] == 3
    finally:
        await kube.close()
