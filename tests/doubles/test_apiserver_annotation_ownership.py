"""Server-side apply of ``metadata.annotations`` in the API-server double, as the real server
keeps it: a ``map[string]string`` is granular, each key a field with its own owners. What the
agent relies on for its nodes' offline marks (``akri.sh/offline.<node>``, issue 33.1): a key a
manager applied goes when the same manager applies without it (unless someone else owns it
too), managers applying different keys never conflict, and an apply that would change another
manager's value is refused (409, ``FieldManagerConflict``) as structured-merge-diff does
without ``force``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.kube import ApiError, KubeClient, make_kube_client
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.test_apiserver_ssa import AGENT, INSTANCES, PATH, created
from tests.harness.k8s_nodes import CRDS


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


@pytest.fixture
async def client(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[KubeClient]:
    kube = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc")))
    yield kube
    await kube.close()


def part(node: str, mark: str | None) -> dict[str, Any]:
    """A node's applied configuration: its ``spec.nodes`` entry and, maybe, its mark."""
    metadata: dict[str, Any] = {"name": "cam", "namespace": "default"}
    if mark is not None:
        metadata["annotations"] = {f"akri.sh/offline.{node}": mark}
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": metadata,
        "spec": {"nodes": [node]},
    }


def annotation_owners(obj: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    found = {}
    for entry in obj["metadata"].get("managedFields") or []:
        keys = entry["fieldsV1"].get("f:metadata", {}).get("f:annotations", {})
        if keys:
            found[(entry["manager"], entry["operation"])] = sorted(k[2:] for k in keys)
    return found


async def test_managers_applying_their_own_keys_never_conflict(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """Thirty nodes recording their mark at once: thirty writes, no 409, each key owned by
    its manager; applying without it again removes exactly that key."""
    await created(client, ["node-00"])
    nodes = [f"node-{i:02d}" for i in range(1, 31)]
    await asyncio.gather(
        *(client.apply(PATH, part(n, "t1"), field_manager=f"m/{n}") for n in nodes)
    )
    stored = api.get(INSTANCES, "cam", "default")
    assert sorted(stored["metadata"]["annotations"]) == [f"akri.sh/offline.{n}" for n in nodes]
    found = annotation_owners(stored)
    assert all(found[(f"m/{n}", "Apply")] == [f"akri.sh/offline.{n}"] for n in nodes)
    assert not [r for r in api.requests if r.status is not None and r.status >= 400]
    back = await client.apply(PATH, part("node-07", None), field_manager="m/node-07")
    assert "akri.sh/offline.node-07" not in back["metadata"]["annotations"]
    assert len(back["metadata"]["annotations"]) == 29
    assert "node-07" in back["spec"]["nodes"]  # still applied: the entry stays
    # the last key gone: the map is stored as absent, as a real server does (omitempty)
    await client.apply(PATH, part("a", "t"), field_manager="m/a")
    for n in [*nodes, "a"]:
        await client.apply(PATH, part(n, None), field_manager=f"m/{n}")
    assert "annotations" not in api.get(INSTANCES, "cam", "default")["metadata"]


async def test_a_key_another_writer_owns_too_stays(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """A plain write that changes a key takes it over (the applier no longer owns it), so the
    applier's apply without it leaves it; one that carries it unchanged takes nothing."""
    await created(client, ["a"])
    await client.apply(PATH, part("a", "t1"), field_manager="m/a")
    current = api.get(INSTANCES, "cam", "default")
    current["metadata"]["labels"] = {"x": "y"}  # a PUT that leaves the mark as it is
    put = await client.replace(PATH, current)
    assert annotation_owners(put) == {("m/a", "Apply"): ["akri.sh/offline.a"]}
    gone = await client.apply(PATH, part("a", None), field_manager="m/a")
    assert "annotations" not in gone["metadata"]
    await client.apply(PATH, part("a", "t2"), field_manager="m/a")
    current = api.get(INSTANCES, "cam", "default")
    current["metadata"]["annotations"]["akri.sh/offline.a"] = "t3"  # a PUT that changes it
    put = await client.replace(PATH, current)
    assert annotation_owners(put) == {(AGENT, "Update"): ["akri.sh/offline.a"]}
    kept = await client.apply(PATH, part("a", None), field_manager="m/a")
    assert kept["metadata"]["annotations"] == {"akri.sh/offline.a": "t3"}


async def test_an_apply_changing_another_managers_value_is_refused(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """409 Conflict with one FieldManagerConflict cause naming the owner and the field, in the
    real server's words (a plain write's owner is printed with its apiVersion and time)."""
    await created(client, ["a"])
    await client.apply(PATH, part("a", "t1"), field_manager="m/a")
    with pytest.raises(ApiError) as refused:
        await client.apply(PATH, part("a", "t2"), field_manager="m/other")
    assert refused.value.status == 409
    status = json.loads(refused.value.body)
    (cause,) = status["details"]["causes"]
    assert cause == {
        "reason": "FieldManagerConflict",
        "message": 'conflict with "m/a"',
        "field": ".metadata.annotations.akri.sh/offline.a",
    }
    assert status["message"] == (
        'Apply failed with 1 conflict: conflict with "m/a": .metadata.annotations.akri.sh/offline.a'
    )
    # the same value is no conflict: both own it then
    same = await client.apply(PATH, part("a", "t1"), field_manager="m/other")
    assert annotation_owners(same) == {
        ("m/a", "Apply"): ["akri.sh/offline.a"],
        ("m/other", "Apply"): ["akri.sh/offline.a"],
    }


async def test_labels_are_owned_per_key_like_annotations(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """``metadata.labels`` is a granular map too (issue 41: a node's label
    ``node.akri.sh/<hash>`` goes with its apply): a label a manager applied goes when it
    applies without it; one a plain write carries unchanged stays the applier's alone; one
    another writer owns too stays."""
    await created(client, ["a"])

    def labelled(node: str, label: bool) -> dict[str, Any]:
        body = part(node, None)  # its entry and its label: applied together, left together
        if label:
            body["metadata"]["labels"] = {f"node.example/{node}": ""}
        else:
            body["spec"]["nodes"] = []
        return body

    await client.apply(PATH, labelled("b", True), field_manager="m/b")
    await client.apply(PATH, labelled("c", True), field_manager="m/c")
    current = api.get(INSTANCES, "cam", "default")
    assert sorted(current["metadata"]["labels"]) == ["node.example/b", "node.example/c"]
    current["metadata"]["annotations"] = {"x": "y"}  # a PUT that leaves the labels as they are
    await client.replace(PATH, current)
    left = await client.apply(PATH, labelled("b", False), field_manager="m/b")
    assert left["metadata"]["labels"] == {"node.example/c": ""}
    assert left["spec"]["nodes"] == ["a", "c"]
    current = api.get(INSTANCES, "cam", "default")
    current["metadata"]["labels"]["other"] = "x"  # a PUT adding a label owns only that one
    put = await client.replace(PATH, current)
    owned = {
        (e["manager"], e["operation"]): sorted(e["fieldsV1"]["f:metadata"].get("f:labels", {}))
        for e in put["metadata"]["managedFields"]
        if "f:labels" in e["fieldsV1"].get("f:metadata", {})
    }
    assert owned == {("m/c", "Apply"): ["f:node.example/c"], (AGENT, "Update"): ["f:other"]}
    gone = await client.apply(PATH, labelled("c", False), field_manager="m/c")
    assert gone["metadata"]["labels"] == {"other": "x"}
