"""A ``--state-dir`` with a file in the way (issue 34.15a): the agent says "Not a directory" and
names the path, where ``mkdir`` said "File exists" (true, but not what is wrong)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.harness.agent_process import akri_command, clean_env


def start_local_agent(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        akri_command("agent", "--local", "--state-dir", str(state), "--node-name", "n1"),
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("where", ["state-dir", "its-parent", "its-instances"])
def test_a_file_in_the_way_of_the_state_dir_is_not_a_directory(tmp_path: Path, where: str) -> None:
    state = tmp_path / "state"
    if where == "state-dir":
        state.write_text("a file")
        named = state
    elif where == "its-parent":
        (tmp_path / "parent").write_text("a file")
        state = named = tmp_path / "parent" / "state"
    else:
        state.mkdir()
        named = state / "instances"
        named.write_text("a file")
    result = start_local_agent(state)
    assert result.returncode == 5, result.stderr
    assert f"{named}: Not a directory" in result.stderr, result.stderr
    assert "File exists" not in result.stderr and "Traceback" not in result.stderr
