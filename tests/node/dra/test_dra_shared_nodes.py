"""A shared device seen by three nodes is allocatable through DRA on every one of them (issue
28): its pool's ResourceSlice passes the API server's validation (one node-selector term,
``kubernetes.io/hostname In [nodes]``; the API-server double enforces resource.k8s.io/v1
validation), the scheduler emulator allocates its slots on each node, and each node's DRA
kubelet double prepares them. Before: ``metadata.name In [a, b, c]`` was refused (422) by a real
API server, so the pool was missing or frozen listing one node."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_scheduler import allocate_claim, create_claim
from tests.harness.dp_nodes import api_instances
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_e2e import SLICES, dra_node, published

NODES = ("node-a", "node-b", "node-c")
INSTANCE = "cam-8120fe"


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        for node in NODES:  # kubelet registers each Node with its hostname label
            server.create(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
                }
            )
        yield server


async def test_a_shared_device_is_allocatable_on_every_node_that_sees_it(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create(debug_echo_configuration("cam", ("foo0",), 3))
    started = [await dra_node(api, node, tmp_path) for node in NODES]
    try:
        await eventually(
            lambda: sorted(getattr(api_instances(api).get(INSTANCE), "nodes", ())) == list(NODES),
            what="every node joined",
        )
        await eventually(
            lambda: published(api).get(INSTANCE) == [f"{INSTANCE}-{i}" for i in range(3)],
            what="the shared pool published",
        )

        def shared_slices() -> list[dict]:  # type: ignore[type-arg]
            return [s for s in api.list(SLICES) if s["spec"]["pool"]["name"] == INSTANCE]

        await eventually(
            lambda: all(
                s["spec"]["nodeSelector"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
                == list(NODES)
                for s in shared_slices()
            ),
            what="the pool selects every node",
        )
        assert api.internal_errors == []
        for node, (_agent, kubelet) in zip(NODES, started, strict=True):
            name = f"claim-{node}"
            claim = create_claim(api, "default", name)
            uid = claim["metadata"]["uid"]
            allocate_claim(
                api, "default", name, node, pod_name=f"pod-{name}", pod_uid=f"pod-{name}"
            )
            stored = api.get("resourceclaims.resource.k8s.io", name, "default")
            assert stored is not None
            (result,) = stored["status"]["allocation"]["devices"]["results"]
            assert result["pool"] == INSTANCE
            results = await kubelet.prepare(f"pod-{name}", [("default", uid, name)])
            assert results[uid].devices, (node, results[uid])
        # each node holds one slot of the one device, through its own claim
        await eventually(
            lambda: (
                sorted(
                    value.rsplit(":", 1)[-1]
                    for value in api_instances(api)[INSTANCE].device_usage.values()
                    if value
                )
                == list(NODES)
            ),
            what="one slot per node",
        )
    finally:
        for agent, kubelet in started:
            await kubelet.stop()
            await agent.stop()
