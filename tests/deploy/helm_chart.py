"""Shared by the chart's tests: the Helm binary and ``helm template`` / ``kubectl kustomize``
renders of the chart at ``deploy/helm/akri``.

Helm is looked for beside the venv's python (``bash scripts/install-helm.sh`` puts it there),
then on PATH. Without it the chart tests skip, saying so — unless ``AKRI_REQUIRE_HELM=1``
(``.ci/run`` sets it): then they fail, so CI cannot pass without running them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.paths import REPO

CHART = REPO / "deploy" / "helm" / "akri"
HELM = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
REQUIRED = os.environ.get("AKRI_REQUIRE_HELM") == "1"

if HELM is None and REQUIRED:
    raise RuntimeError("AKRI_REQUIRE_HELM=1 but no helm: run bash scripts/install-helm.sh")

needs_helm = pytest.mark.skipif(
    HELM is None, reason="helm not installed (bash scripts/install-helm.sh installs .venv/bin/helm)"
)

Objects = list[dict[str, Any]]


def helm(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run helm with its own empty cache/config/data directories unless ``env`` gives them."""
    assert HELM is not None
    return subprocess.run(
        [HELM, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def template(
    *values: str, namespace: str = "akri", release: str = "akri", crds: bool = True
) -> Objects:
    """``helm template`` of the chart with ``--set`` values (each ``key=value``)."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if crds:
        args.append("--include-crds")
    for value in values:
        args += ["--set", value]
    done = helm(*args)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def template_error(*values: str) -> str:
    """The error of a ``helm template`` that must fail."""
    args = ["template", "akri", str(CHART), "--namespace", "akri"]
    for value in values:
        args += ["--set", value]
    done = helm(*args)
    assert done.returncode != 0, f"helm template {values} rendered:\n{done.stdout[:2000]}"
    return done.stderr


def kustomize(tree: str) -> Objects:
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(REPO / tree)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def by_key(objects: Objects) -> dict[tuple[str, str, str], dict[str, Any]]:
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for obj in objects:
        assert key(obj) not in found, f"{key(obj)} rendered twice"
        found[key(obj)] = obj
    return found


def one(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found
