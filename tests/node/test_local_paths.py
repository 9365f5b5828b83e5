"""Local mode keeps to its own paths unless told otherwise (issue 23, item 10).

The local quick start used to serve ``/var/lib/akri/agent-registration.sock``: a system path
that fails for a non-root user and collides between two local agents. In ``--local`` mode
every socket and directory shared with kubelet or external handlers now defaults to a place
under ``--state-dir``; cluster mode keeps the system paths, a flag or variable still wins,
and ``akri handler`` still joins the node agent's ``/var/lib/akri``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from agent import cli
from agent.node.settings import (
    AGENT_OPTIONS,
    LOCAL_PATHS,
    SYSTEM_PATHS,
    AgentSettings,
    add_options,
    resolve,
)
from tests.harness.agent_process import AgentProcess
from tests.paths import REPO


def settings(argv: list[str], env: dict[str, str] | None = None) -> AgentSettings:
    parser = argparse.ArgumentParser()
    add_options(parser, AGENT_OPTIONS)
    return AgentSettings.from_values(resolve(parser.parse_args(argv), AGENT_OPTIONS, env or {}))


def test_local_mode_defaults_every_shared_path_under_the_state_dir(tmp_path: Path) -> None:
    local = settings(["--local", "--state-dir", str(tmp_path)])
    for name in SYSTEM_PATHS:
        assert getattr(local, name) == tmp_path / LOCAL_PATHS[name], name
    assert local.discovery_handlers_dir == tmp_path  # the registration socket beside it
    assert local.device_plugin_dir is None  # device plugins only when a kubelet is named


def test_cluster_mode_keeps_the_system_paths() -> None:
    cluster = settings([])
    for name, path in SYSTEM_PATHS.items():
        assert getattr(cluster, name) == path, name
    assert cluster.discovery_handlers_dir == Path("/var/lib/akri")
    assert cluster.pod_resources_socket == Path("/var/lib/kubelet/pod-resources/kubelet.sock")


def test_a_flag_or_variable_still_wins_in_local_mode(tmp_path: Path) -> None:
    chosen = settings(
        ["--local", "--state-dir", str(tmp_path), "--cdi-dir", "/elsewhere/cdi"],
        {"AKRI_DISCOVERY_HANDLERS_DIR": "/shared/akri", "AKRI_DRA_PLUGIN_DIR": "/x/dra"},
    )
    assert chosen.cdi_dir == Path("/elsewhere/cdi")
    assert chosen.discovery_handlers_dir == Path("/shared/akri")
    assert chosen.dra_plugin_dir == Path("/x/dra")
    assert chosen.plugins_registry_dir == tmp_path / "kubelet/plugins_registry"
    akri = settings(["--local"], {"DISCOVERY_HANDLERS_DIRECTORY": "/akri/own"})
    assert akri.discovery_handlers_dir == Path("/akri/own")  # Akri's variable, as before


def test_akri_handler_still_defaults_to_the_system_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[AgentSettings] = []

    async def run_handler(settings: AgentSettings, name: str, port: int) -> int:
        seen.append(settings)
        return 0

    for variable in ("AKRI_DISCOVERY_HANDLERS_DIR", "DISCOVERY_HANDLERS_DIRECTORY"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(cli, "_run_handler", run_handler)
    assert cli.main(["handler", "debugEcho"]) == 0
    assert seen[0].discovery_handlers_dir == Path("/var/lib/akri")


def _socket_paths(pid: int) -> set[str]:
    """Paths of the unix sockets process ``pid`` has open (listening ones included)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    paths = set()
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
                paths.add("/" + fields[7].lstrip("/"))  # gRPC binds "///tmp/..."
    return paths


def test_the_local_quick_start_serves_nothing_outside_its_state_dir(tmp_path: Path) -> None:
    # like the quick start's /tmp/akri-state: unix socket paths are limited to 107 bytes
    state = Path(tempfile.mkdtemp(prefix="akri-state-", dir="/tmp"))
    agent = AgentProcess(
        [
            "--local",
            "--state-dir",
            str(state),
            "--config",
            str(REPO / "examples" / "debug-echo.yaml"),
            "--node-name",
            "n1",
            "--debug-echo-availability-file",
            str(tmp_path / "avail"),
        ]
    )
    try:
        served = agent.wait_for_log(r"discovery handler registration served on (\S+)")
        socket = Path(served.group(1))
        assert socket == state / "agent-registration.sock"
        assert socket.is_socket()
        agent.wait_for_log(r"instance akri-debug-echo-foo-\w+ added")
        paths = _socket_paths(agent.proc.pid)
        assert paths, "the agent serves its registration socket"
        assert all(path.startswith(str(state)) for path in paths), paths
        assert agent.stop() == 0
    finally:
        agent.cleanup()
        shutil.rmtree(state, ignore_errors=True)


def test_a_relative_state_dir_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    local = settings(["--local", "--state-dir", "state", "--cdi-dir", "cdi"])
    assert local.state_dir == tmp_path / "state"
    assert local.discovery_handlers_dir == tmp_path / "state"
    assert local.cdi_dir == tmp_path / "cdi"
    assert local.plugins_registry_dir == tmp_path / "state" / "kubelet/plugins_registry"


def test_a_relative_state_dir_keeps_external_handlers_on(tmp_path: Path) -> None:
    """Issue 39.5: ``--state-dir state`` had gRPC read ``unix://state/agent-registration.sock``
    as the host ``state``: "external discovery handlers off: cannot serve ...". The
    registration socket is served, under the state dir, and a handler process registers."""
    agent = AgentProcess(
        [
            "--local",
            "--state-dir",
            "state",
            "--config",
            str(REPO / "examples" / "debug-echo.yaml"),
            "--node-name",
            "n1",
            "--no-debug-echo",
        ],
        cwd=tmp_path,
    )
    handler: AgentProcess | None = None
    try:
        served = agent.wait_for_log(r"discovery handler registration served on (\S+)", timeout=30)
        assert Path(served.group(1)) == tmp_path / "state" / "agent-registration.sock"
        handler = AgentProcess(
            ["debugEcho", "--discovery-handlers-dir", "state"],
            command="handler",
            cwd=tmp_path,
            label="handler",
        )
        agent.wait_for_log(r"instance akri-debug-echo-foo-\w+ added", timeout=30)
        assert "external discovery handlers off" not in "\n".join(agent.lines)
        assert handler.stop() == 0
        assert agent.stop() == 0
    finally:
        if handler is not None:
            handler.cleanup()
        agent.cleanup()
