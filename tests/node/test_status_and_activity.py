"""``akri status`` output and activity log lines."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agent.cli import main
from agent.core.model.instance import Instance
from agent.core.store.base import EventType, InstanceEvent
from agent.core.store.local import LocalInstanceStore
from agent.node.activity_log import describe
from agent.node.status import to_json, to_table
from tests.harness.agent_process import akri_command, clean_env

INST = Instance(
    name="cfg-abcdef",
    configuration_name="cfg",
    capacity=2,
    shared=True,
    nodes=("n1", "n2"),
    cdi_name="akri.sh/cfg=abcdef",
    broker_properties={"P": "v"},
    device_usage={"cfg-abcdef-0": "n1", "cfg-abcdef-1": ""},
)


def test_json_has_crd_shaped_objects() -> None:
    data = json.loads(to_json([INST]))
    assert data == [
        {
            "metadata": {"name": "cfg-abcdef"},
            "spec": {
                "configurationName": "cfg",
                "cdiName": "akri.sh/cfg=abcdef",
                "capacity": 2,
                "brokerProperties": {"P": "v"},
                "shared": True,
                "nodes": ["n1", "n2"],
                "deviceUsage": {"cfg-abcdef-0": "n1", "cfg-abcdef-1": ""},
            },
        }
    ]


def test_table() -> None:
    lines = to_table([INST]).splitlines()
    assert lines[0].split()[:6] == ["NAME", "CONFIGURATION", "NODES", "SHARED", "CAPACITY", "USED"]
    assert lines[1].split()[:7] == ["cfg-abcdef", "cfg", "n1,n2", "true", "2", "1", "ok"]
    assert "0=n1" in lines[1] and "1=-" in lines[1]
    assert "(no instances)" in to_table([])


def test_table_shows_draining_nodes_and_namespaces() -> None:
    draining = INST.evolve(namespace="cams", annotations={"akri.sh/draining": "n1"})
    line = to_table([draining]).splitlines()[1]
    assert line.startswith("cams/cfg-abcdef ")
    assert "draining: 1 slot in use (n1)" in line
    data = json.loads(to_json([draining]))
    assert data[0]["metadata"] == {
        "name": "cfg-abcdef",
        "namespace": "cams",
        "annotations": {"akri.sh/draining": "n1"},
    }


def test_activity_lines() -> None:
    assert describe(InstanceEvent(EventType.ADDED, INST))[0].startswith("instance cfg-abcdef added")
    changed = INST.evolve(nodes=("n1",), device_usage={"cfg-abcdef-0": "", "cfg-abcdef-1": "n1"})
    lines = describe(InstanceEvent(EventType.MODIFIED, changed, INST))
    assert "instance cfg-abcdef updated: nodes ['n1', 'n2'] -> ['n1']" in lines
    assert "slot cfg-abcdef-0: n1 -> free" in lines
    assert "slot cfg-abcdef-1: free -> n1" in lines
    assert describe(InstanceEvent(EventType.DELETED, INST, INST)) == ["instance cfg-abcdef deleted"]
    assert describe(InstanceEvent(EventType.MODIFIED, INST, INST)) == []


def test_status_wait_gives_up_with_exit_1_when_no_instance_comes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--wait`` (issue 34.10): a missing or empty state directory is waited on, then
    reported; without ``--wait`` the missing one is reported at once, as before."""
    missing = tmp_path / "not-yet"
    assert main(["status", "--state-dir", str(missing), "--wait", "0.3"]) == 1
    assert "does not exist after waiting 0.3 s" in capsys.readouterr().err
    missing.mkdir()
    assert main(["status", "--state-dir", str(missing), "--wait", "0.3"]) == 1
    assert f"no Instance in {missing} after waiting 0.3 s" in capsys.readouterr().err
    assert main(["status", "--state-dir", str(missing)]) == 0  # no --wait: an empty table


def test_status_wait_prints_once_the_first_instance_is_there(tmp_path: Path) -> None:
    """The directory and the Instance appear while ``akri status --wait`` waits."""
    state = tmp_path / "state"

    def agent_starts() -> None:
        time.sleep(0.5)

        async def create() -> None:
            store = LocalInstanceStore(state)
            await store.start()
            await store.create(INST)
            await store.close()

        asyncio.run(create())

    writer = threading.Thread(target=agent_starts)
    writer.start()
    try:
        done = subprocess.run(
            akri_command("status", "--state-dir", str(state), "--wait", "30"),
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=60,
            check=False,
        )
    finally:
        writer.join()
    assert done.returncode == 0, done.stderr
    assert "cfg-abcdef" in done.stdout
