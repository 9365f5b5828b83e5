"""Issue 12, careless and hostile input: YAML alias bombs, oversized Configurations and
handler reports, SIGTERM while busy, unusable directories, ``akri status`` edge cases, and
unknown discoveryDetails fields."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from agent.core.store.base import ConfigurationEvent
from agent.core.store.config_files import MAX_FILE_BYTES, ConfigurationFiles
from agent.node.app import STOP_DEADLINE
from agent.node.discovery.limits import MAX_DEVICES, ReportRejectedError, check_report
from discovery_handlers.base import Device, InvalidDiscoveryDetailsError
from discovery_handlers.debug_echo import DebugEchoHandler
from discovery_handlers.details import load_details
from discovery_handlers.udev import UdevHandler
from tests.doubles.apiserver.threaded import ThreadedApiServer
from tests.harness.agent_process import (
    AgentProcess,
    akri_command,
    clean_env,
    poll_until,
    run_status,
)
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration

BOMB = textwrap.dedent(
    """\
    a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
    descriptions: *g
    """
)


def configuration(name: str, details: str, capacity: int = 1) -> str:
    indented = textwrap.indent(details, "      ")
    return (
        "apiVersion: akri.sh/v0\nkind: Configuration\n"
        f"metadata: {{name: {name}}}\n"
        "spec:\n  discoveryHandler:\n    name: debugEcho\n    discoveryDetails: |\n"
        f"{indented}\n  capacity: {capacity}\n"
    )


# -- YAML aliases and sizes ----------------------------------------------------------------------


def test_an_alias_bomb_is_refused_with_a_short_message() -> None:
    """Before: 504 bytes of nested anchors made an 80 MB error message (and 5.7 s on the loop);
    one level more exhausted memory."""
    with pytest.raises(InvalidDiscoveryDetailsError) as info:
        DebugEchoHandler().validate(BOMB)
    message = str(info.value)
    assert "too large" in message and "aliases" in message
    assert len(message) < 300


def test_quoted_values_in_messages_are_cut_short() -> None:
    details = "udevRules: ['" + "A" * 100_000 + "']\ngroupRecursive: [" + "1, " * 5000 + "1]"
    with pytest.raises(InvalidDiscoveryDetailsError) as info:
        UdevHandler().validate(details)
    assert len(str(info.value)) < 400


def test_an_alias_bomb_in_a_configuration_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(
        "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
        + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n"
            for i in range(6)
        )
    )
    events: list[ConfigurationEvent] = []
    files = ConfigurationFiles([path], events.append)
    files.scan()
    assert files.current() == []
    assert any("aliases" in (e.error or "") for e in events)
    assert files.unreadable()  # no Instance is taken for an orphan meanwhile


def test_an_oversized_configuration_file_is_refused(tmp_path: Path) -> None:
    """Before: a 10 MB file listing 550,000 devices was accepted and took the agent down."""
    path = tmp_path / "huge.yaml"
    names = ", ".join(f'"d{i}"' for i in range(550_000))
    path.write_text(configuration("huge", f"descriptions: [{names}]"))
    assert path.stat().st_size > MAX_FILE_BYTES
    events: list[ConfigurationEvent] = []
    files = ConfigurationFiles([path], events.append)
    files.scan()
    assert files.current() == []
    assert any("larger than" in (e.error or "") for e in events)


def test_oversized_discovery_details_are_refused() -> None:
    with pytest.raises(InvalidDiscoveryDetailsError, match="too large"):
        load_details("descriptions: [" + ", ".join(f'"d{i}"' for i in range(40_000)) + "]", "x")


def test_handler_reports_over_the_bounds_are_rejected() -> None:
    check_report([Device(f"d{i}") for i in range(100)])
    with pytest.raises(ReportRejectedError, match=f"limit of {MAX_DEVICES}"):
        check_report([Device(f"d{i}") for i in range(MAX_DEVICES + 1)])
    with pytest.raises(ReportRejectedError, match="device id"):
        check_report([Device("")])
    with pytest.raises(ReportRejectedError, match="properties have"):
        check_report([Device("d", {"P": "x" * 300_000})])
    with pytest.raises(ReportRejectedError, match="128"):
        check_report([Device("d", {f"P{i}": "" for i in range(129)})])


def test_unknown_discovery_details_fields_are_ignored_with_a_warning() -> None:
    """Akri's handlers ignore unknown fields; ours refused the whole Configuration."""
    warnings = DebugEchoHandler().validate('descriptions: ["a"]\nfrobnicate: true\n')
    assert warnings and "frobnicate" in warnings[0] and "ignoring" in warnings[0]
    assert UdevHandler().validate("udevRules: ['KERNEL==\"x\"']\nextra: 1\n")


# -- the process: SIGTERM, directories, akri status -------------------------------------------


# the promise (docs/commands.md, "Exit codes"): the agent stops within 2 s at any point; its
# own stop deadline is STOP_DEADLINE (1.5 s), the rest is the interpreter's exit
STOPPED_WITHIN = 2.0
assert STOP_DEADLINE < STOPPED_WITHIN


def sigterm_and_time_the_exit(agent: AgentProcess) -> float:
    """Seconds from SIGTERM to the process's exit (waits at most 10 s)."""
    assert agent.proc.poll() is None, agent.describe()
    agent.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    agent.wait_exit(10)
    return time.monotonic() - started


def test_sigterm_while_creating_thousands_of_instances_stops_promptly(tmp_path: Path) -> None:
    """Before: with 5,000 devices SIGTERM took 23.8 s (with more it was ignored until
    SIGKILL, leaving a temp file): creating Instances never let the loop run the handler."""
    config = tmp_path / "many.yaml"
    names = ", ".join(f'"d{i}"' for i in range(5000))
    config.write_text(configuration("many", f"descriptions: [{names}]"))
    state = tmp_path / "state"
    agent = AgentProcess(
        [
            "--local",
            "--state-dir",
            str(state),
            "--config",
            str(config),
            "--node-name",
            "n1",
            "--debug-echo-availability-file",
            str(tmp_path / "avail"),
        ],
    )
    try:
        agent.wait_for_log(r"instance many-[0-9a-f]{6} added", timeout=30)
        stopped_after = sigterm_and_time_the_exit(agent)
    finally:
        agent.cleanup()
    assert agent.proc.returncode == 0, agent.describe()
    assert agent.matching("agent stopped"), agent.describe()
    # measured from the signal, so the process start does not count (typically ~0.1 s)
    assert stopped_after < STOPPED_WITHIN, agent.describe()
    created = list((state / "instances").glob("*.json"))
    assert 0 < len(created) < 5000  # really interrupted mid-way
    assert list((state / "instances").glob(".tmp-*")) == []  # nothing half-written


def test_sigterm_in_cluster_mode_with_writes_hanging_stops_within_the_deadline(
    tmp_path: Path,
) -> None:
    """Cluster mode: SIGTERM while Instance creates hang in the API server (answered only
    after 6 s). Without the agent's own stop deadline the stop waits for them."""
    descriptions = tuple(f"d{i}" for i in range(2000))
    with ThreadedApiServer(crds=CRDS) as api:
        api.create(debug_echo_configuration("many", descriptions=descriptions, capacity=1))
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        agent = AgentProcess(
            [
                "--kubeconfig",
                str(kubeconfig),
                "--node-name",
                "n1",
                "--no-dra",
                "--debug-echo",
                "--debug-echo-availability-file",
                str(tmp_path / "avail"),
                "--device-plugin-dir",
                str(tmp_path / "device-plugins"),
                "--pod-resources-socket",
                str(tmp_path / "pod-resources" / "kubelet.sock"),
                "--health-port",
                "0",
            ]
        )
        try:
            agent.wait_for_log(r"instance many-[0-9a-f]{6} added", timeout=30)
            api.delay(6.0, verb="create", resource="instances", times=None)
            poll_until(
                lambda: any(r.status is None for r in api.requests_for("create", "instances")),
                timeout=10,
                message=agent.describe,
            )  # a create is in flight, hanging
            stopped_after = sigterm_and_time_the_exit(agent)
        finally:
            agent.cleanup()
    assert agent.proc.returncode == 0, agent.describe()
    assert agent.matching("agent stopped"), agent.describe()
    assert stopped_after < STOPPED_WITHIN, agent.describe()
    assert len(api.list("instances.akri.sh")) < len(descriptions)  # really interrupted


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_an_unusable_state_dir_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    if kind == "file":
        state = tmp_path / "plain-file"
        state.write_text("not a directory")
    else:
        state = Path("/proc/akri-state")  # even root cannot create it
    result = subprocess.run(
        akri_command("agent", "--local", "--state-dir", str(state), "--node-name", "n1"),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
        check=False,
    )
    assert result.returncode == 5, result.stderr
    assert "cannot use the state directory (--state-dir)" in result.stderr
    assert str(state) in result.stderr and "Traceback" not in result.stderr


def test_status_of_a_missing_directory_says_so(tmp_path: Path) -> None:
    """Before: ``(no instances)`` and exit 0."""
    result = run_status(tmp_path / "no" / "such", output="table")
    assert result.returncode == 1
    assert "does not exist" in result.stderr


def test_status_into_a_closed_pipe_prints_no_traceback(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "instances").mkdir(parents=True)
    for i in range(300):
        (state / "instances" / f"cfg-{i:06x}.json").write_text(
            '{"apiVersion": "akri.sh/v0", "kind": "Instance", "metadata": {"name": '
            f'"cfg-{i:06x}", "resourceVersion": "1"}}, "spec": {{"configurationName": "cfg", '
            '"capacity": 1, "nodes": ["n1"], "deviceUsage": {}}}'
        )
    command = " ".join(akri_command("status", "--state-dir", str(state), "-o", "json"))
    result = subprocess.run(
        f"{command} | head -c 100 >/dev/null",
        shell=True,
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
        check=False,
    )
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


def test_poll_interval_zero_is_refused() -> None:
    result = subprocess.run(
        akri_command("agent", "--local", "--poll-interval", "0"),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "--poll-interval: must be ≥ 0.05 seconds, got 0" in result.stderr


def test_unknown_fields_keep_the_configuration_running(tmp_path: Path) -> None:
    config = tmp_path / "extra.yaml"
    config.write_text(configuration("extra", 'descriptions: ["a"]\nfrobnicate: true'))
    agent = AgentProcess(
        [
            "--local",
            "--state-dir",
            str(tmp_path / "state"),
            "--config",
            str(config),
            "--node-name",
            "n1",
            "--debug-echo-availability-file",
            str(tmp_path / "avail"),
        ],
    )
    try:
        agent.wait_for_log(r"WARNING .*ignoring unknown field\(s\) frobnicate", timeout=15)
        agent.wait_for_log(r"instance extra-[0-9a-f]{6} added", timeout=15)
    finally:
        agent.cleanup()
