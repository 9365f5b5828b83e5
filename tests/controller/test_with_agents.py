"""The controller with real (simulated-node) agents against the API-server double: a node
whose agent dies and whose Node turns NotReady loses its slots and its place after the grace;
the live node keeps everything; when the node comes back its agent re-joins by itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.controller.conftest import add_node, eventually, running_controller, set_ready
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import debug_echo_configuration, instances, start_node


def _only(api: ApiServerDouble) -> dict[str, Any]:
    found = instances(api)
    return found[0] if len(found) == 1 else {}


async def test_dead_node_cleaned_then_rejoins_with_its_agent(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    for name in ("node-a", "node-b"):
        add_node(api, name)
    api.create(debug_echo_configuration("echo", ("foo0",), capacity=3))
    node_a = await start_node(api, "node-a", tmp_path)
    node_b = await start_node(api, "node-b", tmp_path)
    try:
        await eventually(
            lambda: sorted(_only(api).get("spec", {}).get("nodes", [])) == ["node-a", "node-b"],
            "one shared Instance on both nodes",
        )
        obj = _only(api)
        name = obj["metadata"]["name"]
        # containers on both nodes hold slots (what their device plugins would have written)
        obj["spec"]["deviceUsage"].update(
            {f"{name}-0": "node-a", f"{name}-1": "C:echo-0:node-b", f"{name}-2": "D:c-1:node-b"}
        )
        obj["metadata"].pop("resourceVersion", None)
        api.apply(obj)
        async with running_controller(api, tmp_path, node_grace=0.3):
            await node_b.stop()  # node-b dies: its agent stops, its Node turns NotReady
            set_ready(api, "node-b", False)
            await eventually(
                lambda: _only(api).get("spec", {}).get("nodes") == ["node-a"], "node-b removed"
            )
            usage = _only(api)["spec"]["deviceUsage"]
            assert usage == {f"{name}-0": "node-a", f"{name}-1": "", f"{name}-2": ""}
            # node-b comes back: Ready again, its agent re-joins the Instance by itself
            set_ready(api, "node-b", True)
            node_b = await start_node(api, "node-b", tmp_path)
            await eventually(
                lambda: sorted(_only(api).get("spec", {}).get("nodes", [])) == ["node-a", "node-b"],
                "node-b re-joined",
            )
            assert _only(api)["spec"]["deviceUsage"][f"{name}-0"] == "node-a"
    finally:
        await node_a.stop()
        await node_b.stop()
