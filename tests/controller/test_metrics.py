"""The controller's /metrics: every metric docs/metrics.md lists for the controller is
exported, with its counts following what the controller did."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest

from agent.controller.metrics import ControllerCollector
from agent.ops.metrics import registry_for
from tests.controller.conftest import (
    add_node,
    broker_pod_spec,
    broker_pods,
    configuration,
    eventually,
    instance,
    running_controller,
)
from tests.doubles.apiserver import ApiServerDouble
from tests.paths import REPO


def documented() -> set[str]:
    text = (REPO / "docs" / "metrics.md").read_text()
    section = text[text.index("### Controller") : text.index("## Logs")]
    return set(re.findall(r"^\| `(akri_[a-z_]+)` \|", section, re.MULTILINE))


async def test_every_documented_controller_metric_is_exported(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    add_node(api, "node-a")
    api.create(configuration(pod_spec=broker_pod_spec()))
    instance(api, "cams-8120fe", ["node-a"], shared=False)
    async with running_controller(api, tmp_path) as running:
        await eventually(lambda: broker_pods(api), "a broker")
        controller = running.controller
        registry = registry_for(ControllerCollector(controller.reconciler, controller.elector))
        await eventually(lambda: controller.reconciler.stats.pods_created["cams"] == 1, "counted")
        text = generate_latest(registry).decode()
    names = documented()
    assert len(names) >= 15
    exported = set(re.findall(r"^# TYPE (akri_[a-z_]+) ", text, re.MULTILINE))
    exported |= {name[: -len("_total")] for name in exported if name.endswith("_total")}
    missing = sorted(
        n for n in names if n not in exported and n.removesuffix("_total") not in exported
    )
    assert missing == []
    assert 'akri_broker_pod_count{configuration="cams",node="node-a"} 1.0' in text
    assert 'akri_broker_pods_created_total{configuration="cams"} 1.0' in text
    assert "akri_controller_leader 1.0" in text
