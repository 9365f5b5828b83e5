"""Issue 23 item 3: the node's Instance budget (agent/node/discovery/budget.py).

Pure: which devices are admitted, the RLIMIT_NOFILE plan. End to end (API-server double,
kubelet double, the agent as ``akri agent`` wires it): devices over ``--max-instances`` are
left out deterministically (Configurations by namespace and name, devices by id) with an
Event, the metrics and a log line, and come back when room is made. The flag and
``AKRI_MAX_INSTANCES``; raising the soft open-file limit in a real process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.node.discovery.budget import (
    BASE_FDS,
    DEFAULT_MAX_INSTANCES,
    FDS_PER_INSTANCE,
    InstanceBudget,
    admit,
    needed_fds,
    plan_fd_limit,
)
from agent.node.metrics import NodeCollector
from agent.node.settings import AGENT_OPTIONS, AgentSettings, SettingsError, resolve
from agent.node.status import budget_notes
from discovery_handlers.base import Device
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.agent_process import AgentProcess, poll_until, read_status, run_status
from tests.harness.dp_nodes import start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.paths import REPO

INSTANCES = "instances.akri.sh"
CONFIGURATIONS = "configurations.akri.sh"


def key(name: str, namespace: str = "default") -> ObjectKey:
    return ObjectKey(namespace, name)


# -- pure ---------------------------------------------------------------------------------------
def test_admission_is_by_configuration_then_device_id() -> None:
    reports = {
        key("b"): ["b2", "b0", "b1"],
        key("a", "z"): ["a9"],  # namespace z sorts after default
        key("a"): ["a1", "a0", "a1"],  # duplicates count once
    }
    assert admit(reports, 3) == {
        key("a"): frozenset({"a0", "a1"}),
        key("b"): frozenset({"b0"}),
        key("a", "z"): frozenset(),
    }
    assert admit(reports, None)[key("b")] == frozenset({"b0", "b1", "b2"})
    assert admit(reports, 0) == {k: frozenset() for k in reports}


def test_a_growing_configuration_pushes_a_later_one_out_and_wakes_it() -> None:
    notices: list[tuple[ObjectKey, int, int, int]] = []
    budget = InstanceBudget(3, lambda *notice: notices.append(notice))
    woken: list[str] = []
    budget.register(key("a"), lambda: woken.append("a"))
    budget.register(key("b"), lambda: woken.append("b"))
    devices = [Device(id=f"d{i}", properties={}) for i in range(3)]
    assert budget.filter(key("b"), devices[:2]) == devices[:2]
    assert budget.filter(key("a"), devices[:2]) == devices[:2]  # b loses one: woken
    assert woken == ["b"]
    assert budget.filter(key("b"), devices[:2]) == devices[:1]
    assert budget.left_out == {key("b"): 1} and budget.over == 1
    assert notices == [(key("b"), 1, 2, 3)]
    budget.forget(key("a"))
    assert woken == ["b", "b"]
    assert budget.filter(key("b"), devices[:2]) == devices[:2]
    assert budget.left_out == {} and notices[-1] == (key("b"), 0, 2, 3)


def test_open_file_limit_plan() -> None:
    need = needed_fds(1000)
    assert need == BASE_FDS + FDS_PER_INSTANCE * 1000
    assert plan_fd_limit(1024, 1048576, need) == (need, None)  # raised to the need
    assert plan_fd_limit(4096, 8192, need) == (4096, None)  # already enough
    assert plan_fd_limit(1024, -1, need) == (need, None)  # hard unlimited
    target, warning = plan_fd_limit(256, 1024, need)
    assert target == 1024 and warning is not None and "384 instances fit" in warning
    assert plan_fd_limit(1024, 4096, None) == (4096, None)  # no budget: as many as allowed


def test_the_flag_and_the_variable() -> None:
    class Args:
        pass

    def limit(argv: dict[str, Any], env: dict[str, str]) -> int | None:
        args = Args()
        for name, value in argv.items():
            setattr(args, name, value)
        values = resolve(args, AGENT_OPTIONS, env)  # type: ignore[arg-type]
        return AgentSettings.from_values(values).max_instances

    assert limit({}, {}) == DEFAULT_MAX_INSTANCES
    assert limit({}, {"AKRI_MAX_INSTANCES": "50"}) == 50
    assert limit({"max_instances": 7}, {"AKRI_MAX_INSTANCES": "50"}) == 7
    assert limit({}, {"AKRI_MAX_INSTANCES": "0"}) is None  # no limit
    for bad in ("-1", "lots"):
        with pytest.raises(SettingsError, match="AKRI_MAX_INSTANCES"):
            limit({}, {"AKRI_MAX_INSTANCES": bad})


def test_the_agent_raises_its_soft_open_file_limit() -> None:
    """In a process started with a soft limit of 256: raised to what the default budget
    needs (or to the hard limit, with a warning, where that is lower)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    expected, warning = plan_fd_limit(256, hard, needed_fds(DEFAULT_MAX_INSTANCES))
    code = (
        "import resource, logging; logging.basicConfig(level=logging.INFO);"
        "from agent.node.discovery.budget import ensure_fd_limit;"
        f"ensure_fd_limit({DEFAULT_MAX_INSTANCES});"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )
    assert done.returncode == 0, done.stderr
    assert expected > 256 and int(done.stdout) == expected
    assert "open-file limit raised from 256" in done.stderr
    if warning is not None:
        assert "instances fit" in done.stderr


# -- end to end -----------------------------------------------------------------------------
@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def served(api: ApiServerDouble) -> dict[str, set[str]]:
    """Configuration -> the debugEcho descriptions of its Instances."""
    result: dict[str, set[str]] = {}
    for obj in api.list(INSTANCES):
        instance = Instance.from_dict(obj)
        description = instance.broker_properties.get("DEBUG_ECHO_DESCRIPTION", "?")
        result.setdefault(instance.configuration_name, set()).add(description)
    return result


async def akri_status(kubeconfig: Path) -> str:
    """``akri status --kubeconfig`` as a user runs it (a process: the API double serves on
    this loop)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", "status", "--kubeconfig", str(kubeconfig),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return out.decode()


def events(api: ApiServerDouble, reason: str, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.list("events")
        if e.get("reason") == reason and e.get("involvedObject", {}).get("name") == name
    ]


async def test_devices_over_the_budget_are_left_out_deterministically(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = await start_dp_node(api, "node-a", tmp_path)
    try:
        await node.restart_agent(dataclasses.replace(node.agent.settings, max_instances=6))
        caplog.set_level(logging.WARNING, logger="agent.discovery")
        api.create(debug_echo_configuration("cams", tuple(f"c{i}" for i in range(5)), 1))
        api.create(debug_echo_configuration("mics", ("m2", "m0", "m1"), 1))
        wanted = {"cams": {f"c{i}" for i in range(5)}, "mics": {"m0"}}
        await eventually(lambda: served(api) == wanted, within=15, what="6 instances")
        await eventually(lambda: bool(events(api, "OverBudget", "mics")), what="Event")
        (event,) = events(api, "OverBudget", "mics")
        assert "2 of its 3 devices are not served on node-a" in event["message"]
        assert "at most 6 instances" in event["message"]
        assert any("2 of its 3 devices are left out" in r.getMessage() for r in caplog.records)
        budget = node.discovery.budget
        assert budget.limit == 6 and budget.left_out == {key("mics"): 2}
        registry = CollectorRegistry()
        registry.register(NodeCollector(node.agent))
        text = generate_latest(registry).decode()
        assert "akri_instance_budget 6.0" in text
        assert 'akri_instances_over_budget{configuration="default/mics"} 2.0' in text
        # kubelet sees exactly the admitted Instances' plugins (+ the two CL plugins)
        await eventually(
            lambda: len([r for r in node.kubelet.resources() if r.startswith("akri.sh/")]) == 8,
            what="8 plugins",
        )
        # akri status (cluster) shows it on the Configuration's row
        kubeconfig = api.write_kubeconfig(tmp_path / "status-kubeconfig")
        status = await akri_status(kubeconfig)
        (row,) = [line for line in status.splitlines() if line.startswith("mics ")]
        assert "over budget on node-a: 2 of its 3 devices are not served on node-a" in row
        (cams,) = [line for line in status.splitlines() if line.startswith("cams ")]
        assert "over budget" not in cams
        # room made: the left-out devices come back, and the Event says so
        api.delete(CONFIGURATIONS, "cams", "default")
        await eventually(
            lambda: served(api) == {"mics": {"m0", "m1", "m2"}}, within=15, what="mics back"
        )
        await eventually(lambda: bool(events(api, "WithinBudget", "mics")), what="Event")
        assert node.discovery.budget.left_out == {}
        status = await akri_status(kubeconfig)
        assert "over budget" not in status
    finally:
        await node.stop()


def test_status_notes_come_from_each_node_s_latest_budget_event() -> None:
    def event(reason: str, node: str, when: str, name: str = "mics") -> dict[str, Any]:
        return {
            "reason": reason,
            "involvedObject": {"kind": "Configuration", "namespace": "default", "name": name},
            "reportingInstance": node,
            "lastTimestamp": when,
            "message": f"2 of its 3 devices are not served on {node}: the node serves ...",
        }

    notes = budget_notes(
        [
            event("OverBudget", "node-a", "2026-01-01T00:00:01Z"),
            event("WithinBudget", "node-a", "2026-01-01T00:00:02Z"),  # a: fine again
            event("WithinBudget", "node-b", "2026-01-01T00:00:01Z"),
            event("OverBudget", "node-b", "2026-01-01T00:00:03Z"),  # b: over now
            event("OverBudget", "node-c", "2026-01-01T00:00:01Z", name="cams"),
            {"reason": "OverBudget", "involvedObject": {"kind": "Instance", "name": "x"}},
            # one second, two Events: the later write (resourceVersion) counts
            {
                **event("WithinBudget", "node-d", "2026-01-01T00:00:05Z"),
                "metadata": {"resourceVersion": "12"},
            },
            {
                **event("OverBudget", "node-d", "2026-01-01T00:00:05Z"),
                "metadata": {"resourceVersion": "9"},
            },
        ]
    )
    assert notes == {
        key("mics"): "over budget on node-b: 2 of its 3 devices are not served on node-b",
        key("cams"): "over budget on node-c: 2 of its 3 devices are not served on node-c",
    }


def test_a_local_agent_shows_its_budget_in_akri_status(tmp_path: Path) -> None:
    """``akri agent --local`` with ``AKRI_MAX_INSTANCES=2`` and three devices: two
    Instances, and ``akri status --state-dir`` says what is left out (local mode has no
    Events); once there is room the line goes."""
    state = tmp_path / "state"
    config = tmp_path / "mics.yaml"
    body = (
        "apiVersion: akri.sh/v0\nkind: Configuration\nmetadata:\n  name: mics\nspec:\n"
        "  discoveryHandler:\n    name: debugEcho\n    discoveryDetails: |+\n"
        "      descriptions: [{}]\n  capacity: 1\n"
    )
    config.write_text(body.format('"m0", "m1", "m2"'))
    agent = AgentProcess(
        ["--local", "--state-dir", str(state), "--config", str(config), "--node-name", "lab",
         "--debug-echo-availability-file", str(tmp_path / "avail"), "--poll-interval", "0.2"],
        env={"AKRI_MAX_INSTANCES": "2"},
    )  # fmt: skip
    try:

        def table() -> str:
            done = run_status(state, output="table")
            assert done.returncode in (0, 1), done.stderr
            return done.stdout

        line = "over budget on lab: 1 of the 3 devices of default/mics are not served"
        poll_until(lambda: line in table(), timeout=60, message=lambda: table() + agent.log_text())
        assert len(read_status(state)) == 2
        config.write_text(body.format('"m0", "m1"'))
        poll_until(
            lambda: "over budget" not in table(),
            timeout=60,
            message=lambda: table() + agent.log_text(),
        )
    finally:
        agent.cleanup()
