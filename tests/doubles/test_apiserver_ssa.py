"""Server-side apply of set-typed lists in the API-server double, as the real server keeps field
ownership (``metadata.managedFields``) for ``x-kubernetes-list-type: set``: the Instance CRD's
``spec.nodes``. Clients: the agent's own (``KubeClient.apply``) over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.kube import ApiError, KubeClient, make_kube_client, resource_path
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.apiserver.managed_fields import set_list_paths
from tests.harness.k8s_nodes import CRDS

INSTANCES = "instances.akri.sh"
# a plain write without fieldManager is owned by the User-Agent's first part (upstream
# managerOrUserAgent): our client sends "akri-py-agent/<version> ..."
AGENT = "akri-py-agent"
PATH = resource_path("akri.sh", "v0", "instances", namespace="default", name="cam")


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


@pytest.fixture
async def client(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[KubeClient]:
    kube = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc")))
    yield kube
    await kube.close()


def membership(node: str | None, uid: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "cam", "namespace": "default"}
    if uid:
        metadata["uid"] = uid
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": metadata,
        "spec": {"nodes": [node] if node else []},
    }


async def created(client: KubeClient, nodes: list[str]) -> dict[str, Any]:
    return await client.create(
        resource_path("akri.sh", "v0", "instances", namespace="default"),
        {
            "apiVersion": "akri.sh/v0",
            "kind": "Instance",
            "metadata": {"name": "cam"},
            "spec": {"configurationName": "c", "capacity": 1, "shared": True, "nodes": nodes},
        },
        request_timeout=10,
    )


def owners(obj: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    found = {}
    for entry in obj["metadata"].get("managedFields") or []:
        nodes = entry["fieldsV1"].get("f:spec", {}).get("f:nodes", {})
        found[(entry["manager"], entry["operation"])] = sorted(
            k[3:-1] for k in nodes if k.startswith("v:")
        )
    return found


def test_the_instance_crd_declares_nodes_a_set() -> None:
    import yaml

    docs = [yaml.safe_load(Path(p).read_text()) for p in CRDS]
    crd = next(d for d in docs if d["spec"]["names"]["kind"] == "Instance")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert set_list_paths(schema) == [("spec", "nodes")]


async def test_concurrent_applies_of_different_elements_all_land(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """Thirty managers adding their own element at once: no conflict, no lost element, each
    element owned by its manager; the creator's element is owned by its plain write."""
    first = await created(client, ["node-00"])
    nodes = [f"node-{i:02d}" for i in range(1, 31)]
    results = await asyncio.gather(
        *(
            client.apply(PATH, membership(n, first["metadata"]["uid"]), field_manager=f"m/{n}")
            for n in nodes
        )
    )
    assert all(r["metadata"]["uid"] == first["metadata"]["uid"] for r in results)
    stored = api.get(INSTANCES, "cam", "default")
    assert sorted(stored["spec"]["nodes"]) == ["node-00", *nodes]
    found = owners(stored)
    assert found[(AGENT, "Update")] == ["node-00"]
    assert all(found[(f"m/{n}", "Apply")] == [n] for n in nodes)
    assert not [r for r in api.requests if r.status >= 400]


async def test_an_apply_removes_only_what_its_manager_alone_owned(
    api: ApiServerDouble, client: KubeClient
) -> None:
    await created(client, ["a"])
    await client.apply(PATH, membership("b"), field_manager="m/b")
    await client.apply(PATH, membership("c"), field_manager="m/c")
    again = await client.apply(PATH, membership("c"), field_manager="m/c")
    unchanged = api.get(INSTANCES, "cam", "default")
    # the same apply again changes nothing: no new resourceVersion
    assert again["metadata"]["resourceVersion"] == unchanged["metadata"]["resourceVersion"]
    left = await client.apply(PATH, membership(None), field_manager="m/b")
    assert left["spec"]["nodes"] == ["a", "c"]
    # "a" is owned by the create (operation Update): an apply that never applied it keeps it
    kept = await client.apply(PATH, membership(None), field_manager="m/a")
    assert kept["spec"]["nodes"] == ["a", "c"]
    # co-owned: c applied by two managers goes only when both have let go
    await client.apply(PATH, membership("c"), field_manager="m/x")
    still = await client.apply(PATH, membership(None), field_manager="m/c")
    assert still["spec"]["nodes"] == ["a", "c"]
    gone = await client.apply(PATH, membership(None), field_manager="m/x")
    assert gone["spec"]["nodes"] == ["a"]
    assert gone["spec"]["configurationName"] == "c"  # fields it never applied are untouched


async def test_a_plain_write_takes_ownership_of_what_it_adds_and_drops_what_it_removes(
    api: ApiServerDouble, client: KubeClient
) -> None:
    await created(client, ["a"])
    await client.apply(PATH, membership("b"), field_manager="m/b")
    current = api.get(INSTANCES, "cam", "default")
    current["spec"]["nodes"] = ["a", "d"]  # a PUT removes b, adds d
    current["metadata"]["managedFields"] = []  # ignored: the server keeps its own record
    put = await client.replace(PATH, current)
    found = owners(put)
    assert put["spec"]["nodes"] == ["a", "d"]
    assert found == {(AGENT, "Update"): ["a", "d"]}
    # b applying again re-adds it (its element was taken away by someone else's write)
    again = await client.apply(PATH, membership("b"), field_manager="m/b")
    assert again["spec"]["nodes"] == ["a", "d", "b"]
    # a stale PUT is still refused: the resourceVersion check of plain writes is unchanged
    with pytest.raises(ApiError) as stale:
        await client.replace(PATH, put)
    assert stale.value.status == 409


async def test_preconditions_and_a_missing_object(api: ApiServerDouble, client: KubeClient) -> None:
    first = await created(client, ["a"])
    stale = "not-" + first["metadata"]["uid"]
    # an apply (any patch) has no uid precondition on a real server: the stale uid is a change
    # of an immutable field, 422 (kubernetes/kubernetes#127625), not 409
    with pytest.raises(ApiError) as refused:
        await client.apply(PATH, membership("b", uid=stale), field_manager="m/b")
    assert refused.value.status == 422
    assert f'metadata.uid: Invalid value: "{stale}": field is immutable' in str(refused.value)
    causes = json.loads(refused.value.body)["details"]["causes"]
    # reported twice, as on a real server (generic ObjectMeta validation and the custom
    # resource strategy's); the message names it once
    assert [c["field"] for c in causes] == ["metadata.uid", "metadata.uid"]
    assert str(json.loads(refused.value.body)["message"]).count("metadata.uid") == 1
    # a PUT carrying the uid: a storage precondition, 409
    with pytest.raises(ApiError) as conflict:
        await client.replace(PATH, {**first, "metadata": {**first["metadata"], "uid": stale}})
    assert conflict.value.status == 409 and "Precondition failed: UID" in str(conflict.value)
    api.delete(INSTANCES, "cam", "default")
    # an apply naming a uid never creates: 409 "uid mismatch" when the object is missing
    with pytest.raises(ApiError) as missing:
        await client.apply(PATH, membership("b", uid=first["metadata"]["uid"]), field_manager="m/b")
    assert missing.value.status == 409 and "no existing object was found" in str(missing.value)
    # an apply creates a missing object; one with only spec.nodes is invalid (no
    # configurationName), as on a real server
    with pytest.raises(ApiError) as invalid:
        await client.apply(PATH, membership("b"), field_manager="m/b")
    assert invalid.value.status == 422 and "spec.configurationName" in str(invalid.value)
    assert api.get(INSTANCES, "cam", "default") is None


def finalizer_owners(obj: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    found = {}
    for entry in obj["metadata"].get("managedFields") or []:
        names = entry["fieldsV1"].get("f:metadata", {}).get("f:finalizers", {})
        if names:
            found[(entry["manager"], entry["operation"])] = sorted(
                k[3:-1] for k in names if k.startswith("v:")
            )
    return found


def finalizers(name: str | None = None, *names: str) -> dict[str, Any]:
    body = membership(None)
    del body["spec"]
    body["metadata"]["finalizers"] = [n for n in (name, *names) if n]
    return body


async def test_finalizers_are_a_set_whose_elements_have_owners(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """``metadata.finalizers`` is ``+listType=set`` in ObjectMeta: under server-side apply each
    finalizer is owned by the managers that applied it, and one a plain write added (the
    create) by that write's manager, as on a real server (structured-merge-diff's prune adds
    back every item any other manager owns, Update managers included). So an apply that omits
    a finalizer a create wrote never removes it; one only appliers own goes with the last of
    them; on a terminating object an apply may drop finalizers but not add one (422), and
    dropping the last one deletes the object."""
    body = {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": {"name": "cam", "finalizers": ["akri.sh/slots"]},
        "spec": {"configurationName": "c", "capacity": 1, "shared": True, "nodes": ["a"]},
    }
    await client.create(
        resource_path("akri.sh", "v0", "instances", namespace="default"), body, request_timeout=10
    )
    await client.apply(PATH, finalizers("akri.sh/slots"), field_manager="m/a")
    both = await client.apply(PATH, finalizers("akri.sh/slots", "x/y"), field_manager="m/b")
    assert both["metadata"]["finalizers"] == ["akri.sh/slots", "x/y"]  # merged, not replaced
    assert finalizer_owners(both) == {
        (AGENT, "Update"): ["akri.sh/slots"],
        ("m/a", "Apply"): ["akri.sh/slots"],
        ("m/b", "Apply"): ["akri.sh/slots", "x/y"],
    }
    await client.apply(PATH, finalizers(), field_manager="m/a")
    kept = await client.apply(PATH, finalizers("x/y"), field_manager="m/b")
    # every applier let akri.sh/slots go: the create's ownership keeps it
    assert kept["metadata"]["finalizers"] == ["akri.sh/slots", "x/y"]
    assert finalizer_owners(kept) == {
        (AGENT, "Update"): ["akri.sh/slots"],
        ("m/b", "Apply"): ["x/y"],
    }

    api.delete(INSTANCES, "cam", "default")
    with pytest.raises(ApiError) as added:
        await client.apply(PATH, finalizers("new/one"), field_manager="m/c")
    assert added.value.status == 422 and "no new finalizers" in str(added.value)
    # a finalizer already there may be re-applied on a terminating object
    await client.apply(PATH, finalizers("akri.sh/slots"), field_manager="m/c")
    dropped = await client.apply(PATH, finalizers(), field_manager="m/b")
    assert dropped["metadata"]["finalizers"] == ["akri.sh/slots"]
    assert api.get(INSTANCES, "cam", "default") is not None
    # a plain write removing the last finalizer ends it
    current = api.get(INSTANCES, "cam", "default")
    current["metadata"]["finalizers"] = []
    await client.replace(PATH, current)
    assert api.get(INSTANCES, "cam", "default") is None


async def test_an_apply_dropping_the_last_finalizer_deletes_a_terminating_object(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """No plain write ever owned the finalizer: the last applier's apply without it removes
    it, and the terminating object is deleted by that apply."""
    await created(client, ["a"])
    await client.apply(PATH, finalizers("akri.sh/slots"), field_manager="m/a")
    await client.apply(PATH, finalizers("akri.sh/slots"), field_manager="m/b")
    api.delete(INSTANCES, "cam", "default")
    still = await client.apply(PATH, finalizers(), field_manager="m/a")
    assert still["metadata"]["finalizers"] == ["akri.sh/slots"]
    await client.apply(PATH, finalizers(), field_manager="m/b")
    assert api.get(INSTANCES, "cam", "default") is None
