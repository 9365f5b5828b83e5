"""What a command costs before it does anything (issue 27): `akri --version` imports nothing of
the agent, the version is a constant that matches the package's, and every way the agent is
installed has its bytecode (the wheel: tests/deploy/test_deploy.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import agent
from tests.paths import REPO

# modules whose import costs milliseconds and that printing a version does not need
HEAVY = ("asyncio", "grpc", "yaml", "importlib.metadata", "argparse", "logging", "pathlib")


def _modules_after(argv: list[str]) -> list[str]:
    """The agent's and the heavy modules imported by ``main(argv)`` in a fresh interpreter, as
    the console script calls it (``sys.argv``, no arguments)."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"  # the interpreter's and site's (an editable finder's)
        f"sys.argv = ['akri', *{argv!r}]\n"
        "from agent.cli import main\n"
        "assert main() == 0\n"
        f"heavy = {HEAVY!r}\n"
        "print(' '.join(sorted(m for m in set(sys.modules) - before if m.startswith('agent')"
        " or m.split('.')[0] in heavy or m in heavy)))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AKRI_")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, names = done.stdout.split("\n", 1)
    assert first == f"akri {agent.__version__}"
    return names.split()


def test_version_imports_nothing_but_the_cli() -> None:
    for argv in (["--version"], ["version"]):
        assert _modules_after(argv) == ["agent", "agent.cli"], argv


def test_the_version_constant_is_the_package_version() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert agent.__version__ == project["version"]


def test_every_install_path_compiles_bytecode() -> None:
    # the editable install of run-local.sh and the image both compile; a wheel installed by
    # pip compiles at install (checked for real in tests/deploy/test_deploy.py)
    script = (REPO / "scripts" / "run-local.sh").read_text()
    assert "-m compileall" in script and "agent discovery_handlers" in script
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "--no-compile" not in dockerfile and "-m compileall" in dockerfile


def test_only_akri_controller_imports_the_controller(tmp_path: Path) -> None:
    # its flags come from the controller's modules (brokers, Lease, Kubernetes client):
    # 20-70 ms that `akri agent` paid at every start when the parser built them for any command
    code = (
        "import sys\n"
        "from agent.cli import _parser, main\n"
        "_parser('agent').parse_args(['agent', '--local'])\n"
        f"main(['status', '--state-dir', {str(tmp_path / 'none')!r}])\n"
        "print(sorted(m for m in sys.modules if m.startswith('agent.controller')))\n"
        "_parser('controller').parse_args(['controller', '--lease-name', 'x'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
