"""The controller keeps every Instance's node labels equal to its content (issue 41): an
Instance that a writer without them (Akri's agent, an earlier version of ours) changed gets
them, so the node it added sees it; one whose labels are right is not written."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from agent.controller.node_labels import NodeLabelKeeper
from agent.core.kube import make_kube_client
from agent.core.model.node_labels import LABELLED, labels_current, node_label, with_node_labels
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from tests.controller.conftest import WITHIN
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import eventually

INSTANCES = "instances.akri.sh"


def instance(name: str, nodes: list[str], usage: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Instance",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "configurationName": "cam",
            "capacity": 2,
            "shared": True,
            "nodes": nodes,
            "deviceUsage": usage,
        },
    }


async def test_stale_node_labels_are_written_from_the_content(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc")))
    store = KubernetesInstanceStore(client, KubernetesSettings("ctl", all_instances=True))
    # written by Akri's agent: no labels at all
    api.create(instance("cam-aaaaaa", ["node-a"], {"cam-aaaaaa-0": "", "cam-aaaaaa-1": ""}))
    # ours, right: never written
    right = with_node_labels(instance("cam-bbbbbb", ["node-a"], {"cam-bbbbbb-0": "node-a"}))
    right_version = api.create(right)["metadata"]["resourceVersion"]
    await store.start()
    keeper = NodeLabelKeeper(store)
    task = asyncio.create_task(keeper.run())
    try:
        await eventually(
            lambda: labels_current(api.get(INSTANCES, "cam-aaaaaa", "default") or {}),
            WITHIN,
            "the Akri-written Instance labelled",
        )
        # an earlier agent on node-b joins with a plain write that keeps the labels as they
        # were: node-b's label is added, node-a's stays
        current = api.get(INSTANCES, "cam-aaaaaa", "default")
        assert current is not None
        current["spec"]["nodes"] = ["node-a", "node-b"]
        api.apply(current)
        await eventually(
            lambda: (
                node_label("node-b")
                in (api.get(INSTANCES, "cam-aaaaaa", "default") or {})["metadata"]["labels"]
            ),
            WITHIN,
            "node-b's label",
        )
        labels = api.get(INSTANCES, "cam-aaaaaa", "default")["metadata"]["labels"]  # type: ignore[index]
        assert {node_label("node-a"), node_label("node-b"), LABELLED} <= set(labels)
        assert keeper.relabelled == 2
        untouched = api.get(INSTANCES, "cam-bbbbbb", "default")
        assert untouched is not None
        assert untouched["metadata"]["resourceVersion"] == right_version  # never written
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await store.close()
