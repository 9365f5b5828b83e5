"""Run ``akri agent`` / ``akri status`` as real subprocesses and observe them.

Every wait is bounded; every failure message carries the agent logs so a red test explains
itself. Used by ``tests/node/test_local_agent.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0
STATUS_TIMEOUT = 15.0

# Variables the agent reads; removed from the inherited environment so a developer's shell
# cannot change what a test sees.
AGENT_ENV_VARS = ("AGENT_NODE_NAME", "ENABLE_DEBUG_ECHO", "DEBUG_ECHO_INSTANCES_SHARED")


def akri_command(*args: str) -> list[str]:
    """``akri ARGS`` without relying on the console script."""
    return [sys.executable, "-m", "agent.cli", *args]


def clean_env(overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """The current environment without any ``AKRI_*``/Akri variable, plus ``overrides``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("AKRI_") and key not in AGENT_ENV_VARS
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(overrides or {})
    return env


class AgentProcess:
    """One ``akri agent`` subprocess; its stderr lines are collected by a reader thread."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        label: str = "agent",
        cwd: Path | None = None,
        command: str = "agent",
        program: Sequence[str] | None = None,
        session: bool = False,
    ) -> None:
        """``akri <command> ARGS``, or ``program`` + ARGS (another process to observe).
        ``session``: in a session (and process group) of its own, so that :meth:`signal_all`
        and :meth:`cleanup` reach what it starts in the background too (a shell's ``&`` jobs).
        """
        self.session = session
        self.args = list(args)
        self.label = label
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self.proc = subprocess.Popen(
            [*program, *self.args] if program is not None else akri_command(command, *self.args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=clean_env(env),
            cwd=cwd,
            text=True,
            bufsize=1,
            start_new_session=session,
        )
        self._reader = threading.Thread(target=self._read, name=f"{label}-stderr", daemon=True)
        self._reader.start()

    # -- output ------------------------------------------------------------------------------
    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def mark(self) -> int:
        """Number of lines so far: pass as ``since`` to look only at later lines."""
        with self._cond:
            return len(self.lines)

    def log_text(self, since: int = 0) -> str:
        with self._cond:
            return "\n".join(self.lines[since:])

    def matching(self, pattern: str, since: int = 0) -> list[str]:
        """Lines (from ``since``) in which ``pattern`` is found."""
        regex = re.compile(pattern)
        with self._cond:
            return [line for line in self.lines[since:] if regex.search(line)]

    def errors(self, since: int = 0) -> list[str]:
        """ERROR lines (and tracebacks' first lines) from ``since``."""
        return self.matching(r" ERROR |Traceback", since)

    def describe(self) -> str:
        """Exit status and full log, for assertion messages."""
        code = self.proc.poll()
        state = "running" if code is None else f"exited with {code}"
        return f"--- {self.label} ({state}): {' '.join(self.args)}\n{self.log_text()}"

    def wait_for_log(
        self, pattern: str, *, timeout: float = DEFAULT_TIMEOUT, since: int = 0
    ) -> re.Match[str]:
        """The first line from ``since`` matching ``pattern``; fails after ``timeout`` or if
        the process ends without printing it."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        index = since
        with self._cond:
            while True:
                while index < len(self.lines):
                    found = regex.search(self.lines[index])
                    if found:
                        return found
                    index += 1
                remaining = deadline - time.monotonic()
                if self._eof or remaining <= 0:
                    why = "process ended" if self._eof else f"{timeout:.1f}s passed"
                    raise AssertionError(
                        f"{why} without a log line matching {pattern!r}\n{self.describe()}"
                    )
                self._cond.wait(min(remaining, 0.1))

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """Exit code; fails if the process is still running after ``timeout``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.label} still running after {timeout:.1f}s\n{self.describe()}"
            ) from None
        # Its output is read until EOF, which a background child that inherited the pipe (a
        # shell's `akri agent &`) holds off for as long as it runs: what the process printed
        # before it exited is in the pipe already, so a short wait reads it all.
        self._reader.join(min(timeout, 5.0))
        return code

    def stop(self, timeout: float = DEFAULT_TIMEOUT) -> int:
        """SIGTERM and wait for a clean exit (fails if it takes longer than ``timeout``)."""
        if self.running:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> int:
        """SIGKILL (``kill -9``) and reap."""
        if self.running:
            self.proc.kill()
        return self.wait_exit(DEFAULT_TIMEOUT)

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to the whole process group (``session=True``): what Ctrl-C in a
        terminal does to the foreground job."""
        assert self.session, "signal_all needs AgentProcess(..., session=True)"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def cleanup(self) -> None:
        """Kill if still running (with ``session``, everything in its process group); never
        raises (for fixture teardown)."""
        if self.session:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.running:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(DEFAULT_TIMEOUT)
        self._reader.join(1.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def describe_all(agents: Iterable[AgentProcess]) -> str:
    return "\n".join(agent.describe() for agent in agents)


# -- polling ---------------------------------------------------------------------------------
def poll_until(
    predicate: Callable[[], T],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition not met",
) -> T:
    """Call ``predicate`` until it returns something truthy; return that value.

    Fails after ``timeout`` with ``message`` (a callable is evaluated only then, so it can
    include the latest state and logs). Exceptions from ``predicate`` propagate.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"not true after {timeout:.1f}s: {text}")
        time.sleep(interval)


def hold_for(
    predicate: Callable[[], object],
    duration: float,
    *,
    interval: float = 0.05,
    message: str | Callable[[], str] = "condition broke",
) -> None:
    """Fail as soon as ``predicate`` is falsy during the next ``duration`` seconds."""
    deadline = time.monotonic() + duration
    while True:
        if not predicate():
            text = message() if callable(message) else message
            raise AssertionError(f"stopped holding before {duration:.1f}s: {text}")
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


# -- akri status -----------------------------------------------------------------------------
def run_status(
    state_dir: Path, *, output: str = "json", env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``akri status --state-dir STATE_DIR -o OUTPUT`` (bounded)."""
    return subprocess.run(
        akri_command("status", "--state-dir", str(state_dir), "-o", output),
        capture_output=True,
        text=True,
        env=clean_env(env),
        timeout=STATUS_TIMEOUT,
        check=False,
    )


def read_status(state_dir: Path) -> list[dict[str, Any]]:
    """The parsed ``akri status -o json`` list (empty while the agent has not created the
    state directory yet); fails if the command fails."""
    result = run_status(state_dir)
    if result.returncode == 1 and "does not exist" in result.stderr:
        return []
    assert result.returncode == 0, (
        f"akri status exited {result.returncode}\nstdout:\n{result.stdout}\n"
        f"stderr:\n{result.stderr}"
    )
    items = json.loads(result.stdout)
    assert isinstance(items, list), result.stdout
    return items


def status_by_name(state_dir: Path) -> dict[str, dict[str, Any]]:
    """``akri status -o json`` keyed by ``metadata.name``."""
    return {item["metadata"]["name"]: item for item in read_status(state_dir)}


def instance_files(state_dir: Path) -> dict[str, dict[str, Any]]:
    """The raw Instance JSON files in STATE_DIR/instances (full metadata: uid, resourceVersion)."""
    directory = state_dir / "instances"
    if not directory.is_dir():
        return {}
    return {
        path.stem: json.loads(path.read_text())
        for path in sorted(directory.glob("*.json"))
        if not path.name.startswith(".")
    }
