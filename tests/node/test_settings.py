"""Settings: flags win over AKRI_* env, env over defaults; Akri fallbacks; clear errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent.node.settings import AGENT_OPTIONS, AgentSettings, SettingsError, add_options, resolve
from tests.paths import REPO


def settings(argv: list[str], env: dict[str, str]) -> AgentSettings:
    parser = argparse.ArgumentParser()
    add_options(parser, AGENT_OPTIONS)
    return AgentSettings.from_values(resolve(parser.parse_args(argv), AGENT_OPTIONS, env))


def test_defaults() -> None:
    s = settings([], {})
    assert s.local is False and s.debug_echo is False
    assert s.shared_offline_grace == 300 and s.local_offline_grace == 0
    assert s.node_name  # host name


def test_env_and_flags() -> None:
    env = {
        "AKRI_LOCAL": "true",
        "AKRI_NODE_NAME": "env-node",
        "AKRI_CONFIG": "/a.yaml:/b.yaml",
        "AKRI_SHARED_OFFLINE_GRACE": "5",
    }
    s = settings([], env)
    assert s.local and s.debug_echo  # debugEcho is on by default in local mode
    assert s.node_name == "env-node"
    assert s.config == [Path("/a.yaml"), Path("/b.yaml")]
    assert s.shared_offline_grace == 5
    s = settings(["--node-name", "flag-node", "--no-local", "--config", "/c.yaml"], env)
    assert s.node_name == "flag-node" and not s.local and s.config == [Path("/c.yaml")]


def test_akri_variable_fallbacks() -> None:
    s = settings([], {"AGENT_NODE_NAME": "akri-node", "DEBUG_ECHO_INSTANCES_SHARED": "false"})
    assert s.node_name == "akri-node" and s.debug_echo_shared is False
    s = settings([], {"AGENT_NODE_NAME": "akri-node", "AKRI_NODE_NAME": "ours"})
    assert s.node_name == "ours"


def test_the_handler_directory_falls_back_to_akri_s_variable() -> None:
    """--discovery-handlers-dir, then AKRI_DISCOVERY_HANDLERS_DIR, then Akri's
    DISCOVERY_HANDLERS_DIRECTORY, then /var/lib/akri."""
    assert settings([], {}).discovery_handlers_dir == Path("/var/lib/akri")
    akri = {"DISCOVERY_HANDLERS_DIRECTORY": "/akri/dh"}
    assert settings([], akri).discovery_handlers_dir == Path("/akri/dh")
    ours = {**akri, "AKRI_DISCOVERY_HANDLERS_DIR": "/ours/dh"}
    assert settings([], ours).discovery_handlers_dir == Path("/ours/dh")
    flag = ["--discovery-handlers-dir", "/flag/dh"]
    assert settings(flag, ours).discovery_handlers_dir == Path("/flag/dh")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"AKRI_SHARED_OFFLINE_GRACE": "abc"}, "AKRI_SHARED_OFFLINE_GRACE"),
        ({"AKRI_LOCAL_OFFLINE_GRACE": "-1"}, "AKRI_LOCAL_OFFLINE_GRACE"),
        ({"AKRI_LOCAL": "maybe"}, "AKRI_LOCAL"),
        ({"AKRI_LOG_LEVEL": "loud"}, "log-level"),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        settings([], env)


def test_every_setting_has_a_flag_and_env_var() -> None:
    import dataclasses

    fields = {f.name for f in dataclasses.fields(AgentSettings)}
    options = {option.dest for option in AGENT_OPTIONS}
    assert fields == options
    assert all(option.env.startswith("AKRI_") for option in AGENT_OPTIONS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reclaim-grace", "-5"], "akri agent: --reclaim-grace: must be ≥ 0, got -5"),
        (["--poll-interval", "0"], "akri agent: --poll-interval: must be ≥ 0.05 seconds, got 0"),
        (["--reclaim-interval", "0.001"], "akri agent: --reclaim-interval: must be ≥ 0.05"),
        (["--shared-offline-grace", "soon"], "must be a number of seconds, got 'soon'"),
        (["--local-offline-grace", "nan"], "must be a finite number of seconds"),
    ],
)
def test_bad_flags_say_what_is_allowed(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``--poll-interval 0`` was accepted (100 % CPU), and errors named an internal
    function (``invalid parse_seconds value``)."""
    from agent.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["agent", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "parse_" not in err


def test_bad_interval_in_the_environment_names_variable_and_flag() -> None:
    with pytest.raises(SettingsError, match=r"AKRI_POLL_INTERVAL \(--poll-interval\): must be ≥"):
        settings([], {"AKRI_POLL_INTERVAL": "0"})


_IMPORTS_SCRIPT = """
import argparse, json, sys
from agent.node.settings import AGENT_OPTIONS, AgentSettings, add_options, resolve
from agent.node.app import import_what_settings_need
parser = argparse.ArgumentParser()
add_options(parser, AGENT_OPTIONS)
settings = AgentSettings.from_values(resolve(parser.parse_args(sys.argv[1:]), AGENT_OPTIONS, {}))
import_what_settings_need(settings)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "agent"))))
"""


def _imported_by(argv: list[str]) -> set[str]:
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_SCRIPT, *argv],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return set(json.loads(done.stdout))


def test_what_a_mode_needs_is_imported_before_the_loop_and_nothing_more() -> None:
    """Imported before ``asyncio.run`` (an import on the running loop held it ~140 ms); a
    local debugEcho agent without device plugins still loads no gRPC, DRA or Kubernetes
    client."""
    plain = _imported_by(["--local", "--debug-echo"])
    assert "agent.core.store.local" in plain
    heavy = ("agent.node.dra", "agent.core.kube")
    assert not any(m == "grpc" or m.startswith(heavy) for m in plain)
    with_plugins = _imported_by(["--local", "--device-plugin-dir", "/tmp/unused-dp"])
    assert {"grpc", "agent.node.deviceplugin.manager"} <= with_plugins
    assert not any(m.startswith("agent.node.dra") for m in with_plugins)
    cluster = _imported_by(["--dra"])
    assert {"agent.core.kube", "agent.core.store.kubernetes", "agent.node.dra.driver"} <= cluster


_STARTED_SCRIPT = """
import argparse, asyncio, json, sys
from agent.core.store.local import LocalInstanceStore
from agent.node.app import Agent, import_what_settings_need
from agent.node.settings import AGENT_OPTIONS, AgentSettings, add_options, resolve

parser = argparse.ArgumentParser()
add_options(parser, AGENT_OPTIONS)
settings = AgentSettings.from_values(resolve(parser.parse_args(sys.argv[1:]), AGENT_OPTIONS, {}))
import_what_settings_need(settings)

async def main():
    store = LocalInstanceStore(settings.state_dir, settings.config, poll_interval=1.0)
    agent = Agent(settings, store, freeze_gc=False)
    await agent.start()
    try:
        assert agent.plugins is not None and agent.extended_resource_path == "device-plugins"
    finally:
        await agent.stop()

asyncio.run(main())
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "agent"))))
"""


def test_a_started_local_agent_with_device_plugins_imports_no_kubernetes_backend(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Deciding which path serves ``akri.sh/<name>`` limits (device plugins, in local mode)
    once imported the Kubernetes store (7 ms of a local start) for an ``isinstance``."""
    import json
    import subprocess
    import sys

    base = tmp_path_factory.mktemp("started")
    (base / "dp").mkdir()
    argv = ["--local", "--node-name", "n1", "--state-dir", str(base / "state")]
    argv += ["--device-plugin-dir", str(base / "dp"), "--health-port", "0"]
    argv += ["--pod-resources-socket", str(base / "pr.sock")]
    argv += ["--discovery-handlers-dir", str(base / "dh")]
    done = subprocess.run(
        [sys.executable, "-c", _STARTED_SCRIPT, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    started = set(json.loads(done.stdout.splitlines()[-1]))
    assert {"agent.node.deviceplugin.manager", "agent.core.store.local"} <= started
    kubernetes = ("agent.core.store.kubernetes", "agent.core.kube")
    assert not any(m.startswith(kubernetes) for m in started)
