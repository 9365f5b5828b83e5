"""The README's commands are the ones CI and the scripts really run."""

from __future__ import annotations

import re

from tests.paths import REPO

ROOT = REPO


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Running the tests", 1)[1]
    command = _bash_blocks(section)[0].strip()
    assert command == "bash scripts/test.sh"
    ci_lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert command in ci_lines


def test_quick_start_runs_the_example_in_local_mode() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    command = _bash_blocks(section)[0].strip()
    script = command.split()[1]
    text = (ROOT / script).read_text()
    assert "akri agent --local" in text
    assert "examples/debug-echo.yaml" in text
    assert (ROOT / "examples" / "debug-echo.yaml").exists()
