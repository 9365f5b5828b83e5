"""Issue 23 item 8: the CRD install commands of README.md and docs/crds.md work as written.

``kubectl apply -f crds/`` sends every ``*.yaml``/``*.yml``/``*.json`` file of the directory to
the API server, so ``crds/`` must hold nothing else: its Kustomize file is named
``Kustomization`` (a name kustomize reads and ``kubectl apply -f`` skips). The commands are
taken from the documents themselves and run, exactly as written, from the repository root
with the venv's kubectl against the API-server double (no CRD preloaded).
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from tests.doubles.apiserver import ApiServerDouble
from tests.paths import REPO

KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
APPLY = "kubectl apply -f crds/"


def install_block() -> list[str]:
    """The commands of docs/crds.md's "Install" code block."""
    text = (REPO / "docs" / "crds.md").read_text()
    section = text.split("## Install", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "docs/crds.md: no sh block under ## Install"
    return [line for line in block.group(1).splitlines() if line.strip()]


async def run(api: ApiServerDouble, home: Path, command: str) -> tuple[int, str]:
    argv = shlex.split(command)
    assert argv[0] == "kubectl", command
    assert KUBECTL is not None
    env = {**os.environ, "KUBECONFIG": str(home / "empty-kubeconfig"), "HOME": str(home)}
    proc = await asyncio.create_subprocess_exec(
        KUBECTL,
        f"--server={api.url}",
        f"--cache-dir={home}/cache",
        *argv[1:],
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def test_the_documents_give_the_command() -> None:
    assert APPLY in (REPO / "README.md").read_text()
    assert install_block()[0] == APPLY


def test_crds_holds_only_custom_resource_definitions() -> None:
    applied = [p for p in (REPO / "crds").iterdir() if p.suffix in (".yaml", ".yml", ".json")]
    assert sorted(p.name for p in applied) == [
        "akri-configuration-crd.yaml",
        "akri-instance-crd.yaml",
    ]
    for path in applied:
        assert "kind: CustomResourceDefinition" in path.read_text(), path


@needs_kubectl
async def test_the_install_block_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "empty-kubeconfig").write_text("")
    async with ApiServerDouble() as api:  # no CRDs preloaded: the commands install them
        for command in install_block():
            code, out = await run(api, tmp_path, command)
            assert code == 0, f"{command!r} exited {code}:\n{out}"
            if command == APPLY:
                assert "configurations.akri.sh created" in out
                assert "instances.akri.sh created" in out
        # applying again (an upgrade) and the documented replace work too
        for command in (APPLY, "kubectl replace -f crds/", "kubectl apply -k crds/"):
            code, out = await run(api, tmp_path, command)
            assert code == 0, f"{command!r} exited {code}:\n{out}"
