"""A local-mode ``akri agent`` subprocess for handler benchmarks, and a cheap way to see which
Instances it wrote (the state directory, each file read once)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import PROCESSES, ROOT
from benchmarks.local_mode import LAG_LINE, compiled_env


class InstanceFiles:
    """The values of one brokerProperty over the Instance files in the state directory."""

    def __init__(self, state: Path, key: str) -> None:
        self.directory = state / "instances"
        self.key = key
        self.values: dict[str, str] = {}  # file name -> the property

    def seen(self) -> set[str]:
        if self.directory.is_dir():
            for name in os.listdir(self.directory):
                if name.endswith(".json") and name not in self.values:
                    try:
                        item = json.loads((self.directory / name).read_text())
                    except (OSError, ValueError):
                        continue  # a partly visible write: read again next time
                    self.values[name] = item["spec"]["brokerProperties"].get(self.key, "")
        return set(self.values.values())


class LocalAgent:
    """``akri agent --local --no-debug-echo`` with one Configuration file."""

    def __init__(self, configuration: str, prefix: str, extra: Sequence[str] = ()) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.handlers_dir = self.base / "dh"
        self.handlers_dir.mkdir()
        self.state = self.base / "state"
        config = self.base / "c.yaml"
        config.write_text(configuration)
        self._log = (self.base / "agent.log").open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "agent.cli", "agent", "--local", "--no-debug-echo",
                "--state-dir", str(self.state), "--config", str(config),
                "--discovery-handlers-dir", str(self.handlers_dir), "--node-name", "bench",
                *extra,
            ],
            cwd=ROOT, env=compiled_env(), stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        PROCESSES.add(self.proc)

    def files(self, key: str) -> InstanceFiles:
        return InstanceFiles(self.state, key)

    def logs(self) -> str:
        return (self.base / "agent.log").read_text(errors="replace")[-3000:]

    def stop(self) -> float | None:
        """SIGTERM, wait, and the loop lag the agent reported when it stopped (ms)."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        PROCESSES.discard(self.proc)
        self._log.close()
        found = LAG_LINE.findall((self.base / "agent.log").read_text(errors="replace"))
        shutil.rmtree(self.base, ignore_errors=True)
        return float(found[-1]) if found else None


async def wait_for_instances(
    files: InstanceFiles, wanted: set[str], within: float, agent: LocalAgent
) -> float:
    """Poll (every 1 ms) until every value in ``wanted`` has an Instance file; returns when
    (``time.monotonic()``). Raises with the agent's log tail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not wanted <= files.seen():
        if time.monotonic() > deadline:
            missing = len(wanted - files.seen())
            raise RuntimeError(f"{missing} Instances missing after {within}s\n{agent.logs()}")
        await asyncio.sleep(0.001)
    return time.monotonic()
