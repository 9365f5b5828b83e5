"""End to end: ``akri agent --local`` as a real subprocess, observed through ``akri status``,
the state directory and its log lines.

Every wait is bounded (a few seconds); each agent polls its Configuration files and the
debugEcho availability file every 0.2 s.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harness.agent_process import (
    AgentProcess,
    describe_all,
    hold_for,
    instance_files,
    poll_until,
    run_status,
    status_by_name,
)
from tests.paths import FIXTURES

FIXTURES = FIXTURES / "local"
CONFIG = "akri-debug-echo-foo"
NODE = "test-node"
EXIT_USAGE = 2
EXIT_CORRUPT_STATE = 3
# How long a wait for the agents to reach a state may take: a check returns as soon as it
# holds, so the bound matters only on a loaded machine (four agents starting at once took
# over 5 s there).
WAIT = 30.0


def akri_name(configuration: str, device: str, node: str | None = None) -> str:
    """Akri's Instance name: 3-byte blake2b of the device id (+ node for unshared devices)."""
    key = device if node is None else device + node
    return f"{configuration}-{hashlib.blake2b(key.encode(), digest_size=3).hexdigest()}"


FOO0 = "akri-debug-echo-foo-8120fe"  # Akri's documented name for debugEcho "foo0"
FOO1 = akri_name(CONFIG, "foo1")
FOO2 = akri_name(CONFIG, "foo2")


def test_expected_names_match_akri() -> None:
    assert akri_name(CONFIG, "foo0") == FOO0
    assert len({FOO0, FOO1, FOO2}) == 3


def config_yaml(
    name: str = CONFIG,
    descriptions: Sequence[str] = ("foo0", "foo1"),
    capacity: int = 2,
    broker_properties: Mapping[str, str] | None = None,
) -> str:
    """A debugEcho Configuration as YAML text."""
    props = {"RESOLUTION_WIDTH": "800"} if broker_properties is None else broker_properties
    lines = [
        "apiVersion: akri.sh/v0",
        "kind: Configuration",
        "metadata:",
        f"  name: {name}",
        "spec:",
        "  discoveryHandler:",
        "    name: debugEcho",
        "    discoveryDetails: |+",
        "      descriptions:",
        *(f'      - "{d}"' for d in descriptions),
        f"  capacity: {capacity}",
    ]
    if props:
        lines.append("  brokerProperties:")
        lines.extend(f'    {key}: "{value}"' for key, value in props.items())
    return "\n".join(lines) + "\n"


def slots(name: str, capacity: int, used: Mapping[int, str] | None = None) -> dict[str, str]:
    """deviceUsage of Instance ``name`` with ``capacity`` slots (all free unless ``used``)."""
    return {f"{name}-{i}": (used or {}).get(i, "") for i in range(capacity)}


def nodes_are(
    names: set[str], nodes: list[str], capacity: int = 2
) -> Callable[[dict[str, dict[str, Any]]], bool]:
    """Status predicate: exactly ``names``, each on ``nodes`` (any order), all slots free."""
    return lambda items: (
        set(items) == names
        and all(
            sorted(item["spec"]["nodes"]) == sorted(nodes)
            and item["spec"]["deviceUsage"] == slots(name, capacity)
            for name, item in items.items()
        )
    )


@dataclass
class LocalEnv:
    """A scratch state dir, availability file and config dir, plus the agents started."""

    tmp: Path
    agents: list[AgentProcess] = field(default_factory=list)

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    @property
    def avail(self) -> Path:
        return self.tmp / "debug-echo-availability.txt"

    def config(self, fixture: str = "debug-echo.yaml", dest: str | None = None) -> Path:
        """Copy a fixture Configuration into tmp/configs (tests edit the copy)."""
        directory = self.tmp / "configs"
        directory.mkdir(exist_ok=True)
        target = directory / (dest or fixture)
        shutil.copyfile(FIXTURES / fixture, target)
        return target

    def start(
        self,
        *configs: Path,
        node: str | None = NODE,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        state_dir: Path | None = None,
        avail: Path | None = None,
        label: str | None = None,
    ) -> AgentProcess:
        args = [
            "--local",
            "--state-dir",
            str(state_dir or self.state_dir),
            "--debug-echo-availability-file",
            str(avail or self.avail),
            "--poll-interval",
            "0.2",
        ]
        if node is not None:
            args += ["--node-name", node]
        for path in configs:
            args += ["--config", str(path)]
        args += list(extra)
        agent = AgentProcess(args, env=env, label=label or f"agent {node or '(env)'}")
        self.agents.append(agent)
        return agent

    def logs(self) -> str:
        return describe_all(self.agents)

    def wait_status(
        self,
        predicate: Callable[[dict[str, dict[str, Any]]], object],
        *,
        timeout: float = WAIT,
        what: str = "expected status",
        state_dir: Path | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Poll ``akri status -o json`` until ``predicate(items by name)`` holds."""
        last: dict[str, dict[str, Any]] = {}

        def check() -> bool:
            nonlocal last
            last = status_by_name(state_dir or self.state_dir)
            return bool(predicate(last))

        poll_until(
            check,
            timeout=timeout,
            message=lambda: f"{what}\nlast status: {json.dumps(last, indent=1)}\n{self.logs()}",
        )
        return last

    def wait_names(
        self, names: set[str], *, timeout: float = WAIT, state_dir: Path | None = None
    ) -> dict[str, dict[str, Any]]:
        return self.wait_status(
            lambda items: set(items) == names,
            timeout=timeout,
            what=f"Instances {sorted(names)}",
            state_dir=state_dir,
        )

    def hold_names(self, names: set[str], duration: float) -> None:
        """Fail if the set of Instances differs from ``names`` at any time for ``duration``."""
        seen: list[set[str]] = []

        def check() -> bool:
            seen.append(set(status_by_name(self.state_dir)))
            return seen[-1] == names

        hold_for(
            check,
            duration,
            message=lambda: f"expected {sorted(names)}, saw {sorted(seen[-1])}\n{self.logs()}",
        )


@pytest.fixture
def env(tmp_path: Path) -> Iterator[LocalEnv]:
    local = LocalEnv(tmp_path)
    yield local
    for agent in local.agents:
        agent.cleanup()
    # Shown by pytest only when the test failed.
    print(local.logs())


def set_offline(path: Path) -> None:
    path.write_text("OFFLINE\n")


def set_online(path: Path) -> None:
    path.write_text("ONLINE\n")


# -- 1. devices appear -------------------------------------------------------------------------
def test_devices_appear_as_akri_instances(env: LocalEnv) -> None:
    agent = env.start(env.config())
    items = env.wait_names({FOO0, FOO1})
    for name, description in ((FOO0, "foo0"), (FOO1, "foo1")):
        digest = name.rsplit("-", 1)[1]
        assert items[name]["spec"] == {
            "configurationName": CONFIG,
            "cdiName": f"akri.sh/{CONFIG}={digest}",
            "capacity": 2,
            "nodes": [NODE],
            "shared": True,
            "deviceUsage": slots(name, 2),
            "brokerProperties": {
                "DEBUG_ECHO_DESCRIPTION": description,
                "RESOLUTION_WIDTH": "800",
            },
        }, env.logs()
    files = instance_files(env.state_dir)
    assert set(files) == {FOO0, FOO1}
    for name, obj in files.items():
        assert obj["apiVersion"] == "akri.sh/v0" and obj["kind"] == "Instance"
        assert obj["metadata"]["name"] == name
        assert obj["metadata"]["uid"]
        assert obj["metadata"]["resourceVersion"].isdigit()
        assert obj["metadata"]["labels"] == {"akri.sh/configuration": CONFIG}
    assert files[FOO0]["metadata"]["uid"] != files[FOO1]["metadata"]["uid"]
    agent.wait_for_log(rf"instance {FOO0} added: configuration={CONFIG} shared=true capacity=2")
    agent.wait_for_log(rf"instance {FOO1} added")
    assert agent.errors() == []
    assert agent.stop() == 0
    agent.wait_for_log("agent stopped")


# -- 2. offline and grace ----------------------------------------------------------------------
def test_offline_shared_without_grace_vanishes_promptly_and_returns(env: LocalEnv) -> None:
    agent = env.start(env.config(), extra=["--shared-offline-grace", "0"])
    env.wait_names({FOO0, FOO1})
    set_offline(env.avail)
    env.wait_names(set(), timeout=2.0)
    agent.wait_for_log(rf"instance {FOO0} deleted")
    set_online(env.avail)
    env.wait_names({FOO0, FOO1}, timeout=3.0)
    set_offline(env.avail)
    env.wait_names(set(), timeout=2.0)
    env.avail.unlink()  # no file = online
    items = env.wait_names({FOO0, FOO1}, timeout=3.0)
    assert all(item["spec"]["nodes"] == [NODE] for item in items.values())
    assert agent.errors() == []


def test_offline_shared_with_grace_keeps_instances_for_the_grace(env: LocalEnv) -> None:
    agent = env.start(env.config(), extra=["--shared-offline-grace", "2"])
    env.wait_names({FOO0, FOO1})
    uids = {name: obj["metadata"]["uid"] for name, obj in instance_files(env.state_dir).items()}

    # Back online within the grace: the very same Instances stay.
    since = agent.mark()
    set_offline(env.avail)
    agent.wait_for_log(
        rf"instance default/{FOO0}: device not seen by {NODE}", since=since, timeout=2
    )
    # the slots are Unhealthy on this node meanwhile, and the node records it once in each
    # shared Instance (its own annotation, applied without a resourceVersion precondition:
    # issue 33.1), then writes nothing more during the grace; the leave at its end takes the
    # mark with it in the same write
    mark = f"akri.sh/offline.{NODE}"
    poll_until(
        lambda: all(
            mark in (obj["metadata"].get("annotations") or {})
            for obj in instance_files(env.state_dir).values()
        ),
        timeout=5,
        message="the node's offline marks",
    )
    versions = {
        name: obj["metadata"]["resourceVersion"]
        for name, obj in instance_files(env.state_dir).items()
    }
    time.sleep(0.5)  # several reconcile passes (poll interval 0.2 s) inside the grace
    assert {
        name: obj["metadata"]["resourceVersion"]
        for name, obj in instance_files(env.state_dir).items()
    } == versions
    set_online(env.avail)
    env.hold_names({FOO0, FOO1}, 2.5)
    assert {n: o["metadata"]["uid"] for n, o in instance_files(env.state_dir).items()} == uids
    assert not any(  # seen again: the marks are gone
        mark in (obj["metadata"].get("annotations") or {})
        for obj in instance_files(env.state_dir).values()
    )

    # Offline for longer than the grace: kept ~2 s, then gone.
    since = agent.mark()
    set_offline(env.avail)
    started = time.monotonic()
    agent.wait_for_log(r"slots Unhealthy for up to 2s", since=since, timeout=2)
    env.hold_names({FOO0, FOO1}, max(0.0, started + 1.0 - time.monotonic()))
    env.wait_names(set(), timeout=max(0.1, started + 4.0 - time.monotonic()))
    assert time.monotonic() - started >= 1.8, "Instances vanished before the 2 s grace ended"

    set_online(env.avail)
    env.wait_names({FOO0, FOO1}, timeout=3.0)
    assert agent.errors() == []


def test_unshared_devices_have_node_specific_names_and_no_grace(env: LocalEnv) -> None:
    # Only the local grace (default 0) applies to unshared devices, not the shared one (300).
    agent = env.start(env.config(), extra=["--no-debug-echo-shared"])
    local0, local1 = akri_name(CONFIG, "foo0", NODE), akri_name(CONFIG, "foo1", NODE)
    assert not {local0, local1} & {FOO0, FOO1}
    items = env.wait_names({local0, local1})
    for name in (local0, local1):
        spec = items[name]["spec"]
        assert spec["shared"] is False
        assert spec["nodes"] == [NODE]
        assert spec["deviceUsage"] == slots(name, 2)
    set_offline(env.avail)
    env.wait_names(set(), timeout=2.0)
    set_online(env.avail)
    env.wait_names({local0, local1}, timeout=3.0)
    assert agent.errors() == []


# -- 3. live edits of the Configuration file ---------------------------------------------------
def test_live_configuration_edits(env: LocalEnv) -> None:
    config = env.config()
    # Grace 0: a description removed from the Configuration is a vanished device.
    agent = env.start(config, extra=["--shared-offline-grace", "0"])
    env.wait_names({FOO0, FOO1})
    uid1 = instance_files(env.state_dir)[FOO1]["metadata"]["uid"]

    config.write_text(config_yaml(capacity=3))
    env.wait_status(
        lambda items: (
            set(items) == {FOO0, FOO1}
            and all(
                item["spec"]["capacity"] == 3 and item["spec"]["deviceUsage"] == slots(name, 3)
                for name, item in items.items()
            )
        ),
        what="capacity 3 with slots -0..-2",
    )

    config.write_text(config_yaml(capacity=1))
    env.wait_status(
        lambda items: (
            set(items) == {FOO0, FOO1}
            and all(
                item["spec"]["capacity"] == 1 and item["spec"]["deviceUsage"] == slots(name, 1)
                for name, item in items.items()
            )
        ),
        what="capacity 1, free slots beyond it removed",
    )

    config.write_text(config_yaml(descriptions=("foo0", "foo1", "foo2"), capacity=1))
    items = env.wait_names({FOO0, FOO1, FOO2})
    assert items[FOO2]["spec"]["deviceUsage"] == slots(FOO2, 1)
    assert items[FOO2]["spec"]["brokerProperties"] == {
        "DEBUG_ECHO_DESCRIPTION": "foo2",
        "RESOLUTION_WIDTH": "800",
    }

    config.write_text(config_yaml(descriptions=("foo1", "foo2"), capacity=1))
    env.wait_names({FOO1, FOO2})

    props = {"RESOLUTION_WIDTH": "1024", "FORMAT": "MJPG"}
    config.write_text(
        config_yaml(descriptions=("foo1", "foo2"), capacity=1, broker_properties=props)
    )
    env.wait_status(
        lambda items: (
            set(items) == {FOO1, FOO2}
            and all(
                item["spec"]["brokerProperties"] == {"DEBUG_ECHO_DESCRIPTION": description, **props}
                for item, description in ((items[FOO1], "foo1"), (items[FOO2], "foo2"))
            )
        ),
        what="brokerProperties updated",
    )
    # Edited in place, never re-created.
    assert instance_files(env.state_dir)[FOO1]["metadata"]["uid"] == uid1
    assert agent.errors() == []

    since = agent.mark()
    config.unlink()
    env.wait_names(set(), timeout=3.0)
    agent.wait_for_log(rf"ERROR .*{config}: file not found", since=since)
    agent.wait_for_log(rf"configuration default/{CONFIG} deleted", since=since)
    time.sleep(0.6)  # three more polls of the missing file: still reported once
    assert len(agent.matching("file not found", since)) == 1, agent.describe()


# -- 4. restart survival -----------------------------------------------------------------------
def test_state_survives_kill_9_and_restart(env: LocalEnv) -> None:
    config = env.config()
    first = env.start(config)
    env.wait_names({FOO0, FOO1})
    before = instance_files(env.state_dir)
    assert first.kill() == -9

    # The state dir still parses; plant the leftovers of a write interrupted by kill -9 and
    # mark a slot used (as a device plugin would have), bumping nothing else.
    assert set(status_by_name(env.state_dir)) == {FOO0, FOO1}
    strays = [
        env.state_dir / "instances" / f".tmp-{FOO0}.json.99999",
        env.state_dir / ".tmp-resource-version.99999",
    ]
    for stray in strays:
        stray.write_text('{"half": ')
    path = env.state_dir / "instances" / f"{FOO0}.json"
    obj = json.loads(path.read_text())
    obj["spec"]["deviceUsage"][f"{FOO0}-0"] = NODE
    path.write_text(json.dumps(obj, indent=2))

    second = env.start(config, label="agent restarted")
    second.wait_for_log(r"agent started on node test-node")
    second.wait_for_log(r"debugEcho reports 2 device\(s\)")
    for stray in strays:
        second.wait_for_log(rf"removed {stray} left by an interrupted write")
        assert not stray.exists()
    # Discovery must not free the slot, and must not re-create the Instances.
    hold_for(
        lambda: (
            status_by_name(env.state_dir)[FOO0]["spec"]["deviceUsage"] == slots(FOO0, 2, {0: NODE})
        ),
        1.0,
        message=lambda: f"slot {FOO0}-0 lost its holder\n{env.logs()}",
    )
    after = instance_files(env.state_dir)
    assert set(after) == {FOO0, FOO1}
    for name in (FOO0, FOO1):
        assert after[name]["metadata"]["uid"] == before[name]["metadata"]["uid"]
        assert int(after[name]["metadata"]["resourceVersion"]) >= int(
            before[name]["metadata"]["resourceVersion"]
        )
        assert after[name]["spec"]["nodes"] == [NODE]
    assert second.errors() == []

    # Killed again; the Configuration changes while the agent is down: the restarted agent
    # must rewrite the Instances (capacity 3) and still keep the held slot.
    assert second.kill() == -9
    config.write_text(config_yaml(capacity=3))
    third = env.start(config, label="agent restarted twice")
    items = env.wait_status(
        lambda items: (
            set(items) == {FOO0, FOO1}
            and all(item["spec"]["capacity"] == 3 for item in items.values())
        ),
        what="capacity 3 after restart",
    )
    assert items[FOO0]["spec"]["deviceUsage"] == slots(FOO0, 3, {0: NODE})
    assert items[FOO1]["spec"]["deviceUsage"] == slots(FOO1, 3)
    final = instance_files(env.state_dir)
    counter = int((env.state_dir / "resource-version").read_text())
    for name in (FOO0, FOO1):
        assert final[name]["metadata"]["uid"] == before[name]["metadata"]["uid"]
        version = int(final[name]["metadata"]["resourceVersion"])
        assert version > int(after[name]["metadata"]["resourceVersion"])
        assert version <= counter
    assert third.stop() == 0
    assert not list(env.state_dir.rglob(".tmp-*"))
    assert third.errors() == []


# -- 5. bad input ------------------------------------------------------------------------------
FILE_ERRORS = {  # fixture -> field named in its error line
    "not-yaml.yaml": "not valid YAML",
    "capacity-negative.yaml": "spec.capacity",
    "capacity-huge.yaml": "spec.capacity",
    "kind-pod.yaml": "kind",
}
CONFIGURATION_ERRORS = {  # configuration -> field named in its error line
    "bad-handler": "spec.discoveryHandler.name",
    "bad-details": "descriptions",
}


def test_bad_configurations_are_reported_and_do_not_stop_good_ones(env: LocalEnv) -> None:
    good = env.config()
    for fixture in (
        *FILE_ERRORS,
        "unknown-handler.yaml",
        "details-wrong-shape.yaml",
    ):
        env.config(fixture)
    directory = good.parent
    agent = env.start(directory)
    env.wait_names({FOO0, FOO1})

    for fixture, field_name in FILE_ERRORS.items():
        agent.wait_for_log(rf"ERROR .*{directory / fixture}.*{field_name}")
    for name, field_name in CONFIGURATION_ERRORS.items():
        agent.wait_for_log(rf"ERROR .*configuration default/{name}: .*{field_name}")
    time.sleep(1.0)  # five more polls: each problem must still be reported exactly once
    errors = agent.errors()
    assert len(errors) == len(FILE_ERRORS) + len(CONFIGURATION_ERRORS), "\n".join(errors)
    for fixture, field_name in FILE_ERRORS.items():
        lines = [e for e in errors if str(directory / fixture) in e]
        assert len(lines) == 1 and field_name in lines[0], (fixture, errors)
    for name, field_name in CONFIGURATION_ERRORS.items():
        lines = [e for e in errors if f"configuration default/{name}:" in e]
        assert len(lines) == 1 and field_name in lines[0], (name, errors)
    assert any("100000" in e for e in errors), errors
    assert any("'Pod'" in e for e in errors), errors
    env.hold_names({FOO0, FOO1}, 0.3)

    # Fix broken files live: their Configurations start.
    (directory / "capacity-negative.yaml").write_text(
        config_yaml("bad-capacity-negative", ["neg0"], capacity=1)
    )
    (directory / "details-wrong-shape.yaml").write_text(
        config_yaml("bad-details", ["det0"], capacity=1)
    )
    (directory / "unknown-handler.yaml").write_text(
        config_yaml("bad-handler", ["hnd0"], capacity=1)
    )
    fixed = {
        akri_name("bad-capacity-negative", "neg0"),
        akri_name("bad-details", "det0"),
        akri_name("bad-handler", "hnd0"),
    }
    items = env.wait_names({FOO0, FOO1, *fixed})
    assert all(items[name]["spec"]["capacity"] == 1 for name in fixed)

    # The good file turned into invalid YAML: an error, and its last good version keeps running.
    since = agent.mark()
    good.write_text(": : :\n")
    agent.wait_for_log(rf"ERROR .*{good}: not valid YAML", since=since)
    env.hold_names({FOO0, FOO1, *fixed}, 1.0)
    assert len(agent.errors(since)) == 1, agent.errors(since)


def test_yaml_error_is_one_log_line(env: LocalEnv) -> None:
    bad = env.config("not-yaml.yaml")
    agent = env.start(env.config(), bad)
    env.wait_names({FOO0, FOO1})
    agent.wait_for_log(rf"ERROR .*{bad}: not valid YAML")
    assert agent.stop() == 0
    record = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) "
    strays = [line for line in agent.lines if not re.match(record, line)]
    assert strays == [], agent.describe()


# -- 6. corrupt state --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "content"),
    [
        (f"instances/{FOO0}.json", "{not json"),
        (f"instances/{FOO0}.json", '["not", "an", "instance"]'),
        ("resource-version", "twelve\n"),
    ],
    ids=["garbage-instance", "not-an-instance", "garbage-counter"],
)
def test_corrupt_state_refuses_to_start(env: LocalEnv, target: str, content: str) -> None:
    agent = env.start(env.config())
    env.wait_names({FOO0, FOO1})
    assert agent.stop() == 0
    corrupt = env.state_dir / target
    corrupt.write_text(content)

    restarted = env.start(env.config(), label="agent on corrupt state")
    assert restarted.wait_exit() == EXIT_CORRUPT_STATE, restarted.describe()
    assert str(corrupt) in restarted.log_text(), restarted.describe()
    assert corrupt.read_text() == content, "the agent must not touch a corrupt file"

    if target.startswith("instances/"):
        status = run_status(env.state_dir)
        assert status.returncode != 0, status.stdout
        assert str(corrupt) in status.stderr, status.stderr


# -- 7. akri status output ---------------------------------------------------------------------
def test_status_table_and_json(env: LocalEnv) -> None:
    missing = run_status(env.state_dir, output="table")
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    env.state_dir.mkdir()
    empty = run_status(env.state_dir, output="table")
    assert empty.returncode == 0, empty.stderr
    assert "(no instances)" in empty.stdout
    assert json.loads(run_status(env.state_dir).stdout) == []

    agent = env.start(env.config())
    env.wait_names({FOO0, FOO1})
    assert agent.stop() == 0

    table = run_status(env.state_dir, output="table")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    header = lines[0].split()
    columns = ["NAME", "CONFIGURATION", "NODES", "SHARED", "CAPACITY"]
    assert header[: len(columns)] == columns, table.stdout
    assert len(lines) == 3, table.stdout
    rows = sorted(line.split() for line in lines[1:])
    for row, name in zip(rows, sorted([FOO0, FOO1]), strict=True):
        assert row[:5] == [name, CONFIG, NODE, "true", "2"], table.stdout

    result = run_status(env.state_dir)
    assert result.returncode == 0, result.stderr
    items = json.loads(result.stdout)
    assert isinstance(items, list) and len(items) == 2
    for item in items:
        assert set(item) == {"metadata", "spec"}
        assert item["metadata"]["name"] in {FOO0, FOO1}
        assert {
            "configurationName",
            "capacity",
            "nodes",
            "shared",
            "deviceUsage",
            "brokerProperties",
            "cdiName",
        } <= set(item["spec"])
        assert item["spec"]["configurationName"] == CONFIG


# -- 8. environment variables ------------------------------------------------------------------
def test_node_name_from_environment_and_flag_precedence(env: LocalEnv) -> None:
    config = env.config()
    cases = {  # state dir -> (flag, environment, expected node)
        "from-env": (None, {"AKRI_NODE_NAME": "env-node"}, "env-node"),
        "flag-wins": ("flag-node", {"AKRI_NODE_NAME": "env-node"}, "flag-node"),
        "akri-fallback": (None, {"AGENT_NODE_NAME": "akri-node"}, "akri-node"),
        "ours-over-akri": (
            None,
            {"AKRI_NODE_NAME": "env-node", "AGENT_NODE_NAME": "akri-node"},
            "env-node",
        ),
    }
    for case, (flag, variables, _) in cases.items():
        env.start(config, node=flag, env=variables, state_dir=env.tmp / case, label=case)
    for case, (_, _, expected) in cases.items():
        env.wait_status(
            nodes_are({FOO0, FOO1}, [expected]),
            state_dir=env.tmp / case,
            what=f"{case}: nodes [{expected}]",
        )


def test_invalid_environment_value_exits_with_usage_error(env: LocalEnv) -> None:
    agent = env.start(env.config(), env={"AKRI_SHARED_OFFLINE_GRACE": "abc"})
    assert agent.wait_exit() == EXIT_USAGE, agent.describe()
    assert "AKRI_SHARED_OFFLINE_GRACE" in agent.log_text(), agent.describe()
    assert not (env.state_dir / "instances").exists()


# -- 9. two agents sharing a state dir ---------------------------------------------------------
def test_two_agents_share_instances(env: LocalEnv) -> None:
    config = env.config()
    avail_b = env.tmp / "availability-b.txt"
    grace0 = ["--shared-offline-grace", "0"]
    a = env.start(config, node="node-a", extra=grace0)
    b = env.start(config, node="node-b", extra=grace0, avail=avail_b)

    env.wait_status(nodes_are({FOO0, FOO1}, ["node-a", "node-b"]), what="both nodes")

    assert b.stop() == 0  # stopping is not leaving
    hold_for(
        lambda: nodes_are({FOO0, FOO1}, ["node-a", "node-b"])(status_by_name(env.state_dir)),
        1.0,
        message=lambda: f"a stopped agent left its Instances\n{env.logs()}",
    )

    b = env.start(config, node="node-b", extra=grace0, avail=avail_b, label="node-b again")
    b.wait_for_log(r"debugEcho reports 2 device\(s\)")
    set_offline(avail_b)
    env.wait_status(nodes_are({FOO0, FOO1}, ["node-a"]), what="node-b left")
    env.hold_names({FOO0, FOO1}, 0.5)
    set_online(avail_b)
    env.wait_status(nodes_are({FOO0, FOO1}, ["node-a", "node-b"]), what="node-b back")
    assert a.errors() == [] and b.errors() == [], env.logs()


def test_agent_sees_other_agents_writes_despite_its_own(env: LocalEnv) -> None:
    # Agent A polls the shared state dir every 4 s (debugEcho still every 0.5 s). Between two
    # of A's polls, agent B creates an Instance of another Configuration and then A writes
    # (its devices go offline). A's next poll must still pick up B's Instance.
    started = time.monotonic()
    a = env.start(
        env.config(),
        node="node-a",
        extra=["--shared-offline-grace", "0", "--poll-interval", "4"],
    )
    env.wait_names({FOO0, FOO1})
    other = env.tmp / "configs" / "other.yaml"
    other.write_text(config_yaml("other", ["bar0"], capacity=1))
    bar0 = akri_name("other", "bar0")
    env.start(other, node="node-b", avail=env.tmp / "availability-b.txt")
    env.wait_names({FOO0, FOO1, bar0})
    set_offline(env.avail)
    env.wait_names({bar0})
    a.wait_for_log(rf"instance {FOO1} deleted")
    if time.monotonic() - started > 3.0:
        pytest.skip("too slow to fit B's write and A's write between two polls of A")
    # A's first poll is ~4 s after its start; wait well past it.
    a.wait_for_log(rf"instance {bar0} added", timeout=max(0.1, started + 6.0 - time.monotonic()))


# -- akri status shows the offline grace (issue 34.9) ------------------------------------------
def test_status_shows_offline_instances_and_when_their_grace_ends(env: LocalEnv) -> None:
    """Before: STATE said ``ok`` while the device was gone and its slots Unhealthy (nothing
    is written to the Instance during the grace, and the state dir said nothing else)."""
    env.start(env.config(), extra=["--shared-offline-grace", "120"])
    env.wait_names({FOO0, FOO1}, timeout=30)

    def states() -> dict[str, str]:
        result = run_status(env.state_dir, output="table")
        assert result.returncode == 0, result.stderr
        rows = [re.split(r"\s{2,}", line) for line in result.stdout.splitlines()[1:]]
        return {row[0]: row[6] for row in rows if len(row) > 6}

    assert set(states().values()) == {"ok"}
    env.avail.write_text("OFFLINE")

    def all_offline() -> dict[str, str] | None:
        now = states()
        return now if all(v.startswith(f"offline ({NODE}, ") for v in now.values()) else None

    offline = poll_until(all_offline, timeout=30, message=lambda: f"{states()}\n{env.logs()}")
    assert len(offline) == 2
    for value in offline.values():
        left = re.search(r"(\d+) s left\)$", value)
        assert left is not None and 0 < int(left.group(1)) <= 120, value
    env.avail.write_text("ONLINE")
    poll_until(
        lambda: set(states().values()) == {"ok"},
        timeout=30,
        message=lambda: f"{states()}\n{env.logs()}",
    )
