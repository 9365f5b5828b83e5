"""Issue 40, items 1, 5 and 6: the Helm chart at deploy/helm/akri installs what ``kubectl
kustomize deploy/`` installs, into the release namespace, and the two cannot drift: the chart's
defaults are compared with the Kustomize render object by object (every field: kinds, names,
labels, RBAC rules, container args, env, mounts, probes, resources), and the files the chart
carries (CRDs, the ResourceSlice policy) are byte-identical copies of deploy/'s."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.helm_chart import (
    CHART,
    KUBECTL,
    Objects,
    by_key,
    helm,
    kustomize,
    needs_helm,
    one,
    template,
)
from tests.paths import REPO

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (kustomize) not installed")

# The chart does not create its namespace (helm install --create-namespace does, or it exists).
ONLY_IN_KUSTOMIZE = {("Namespace", "", "akri")}
# The uninstall hook (Kustomize has none: docs/install.md's uninstall runs the same steps with
# kubectl) and its RBAC.
ONLY_IN_HELM = {
    ("Job", "akri", "akri-cleanup-hook"),
    ("ServiceAccount", "akri", "akri-cleanup-hook"),
    ("ClusterRole", "", "akri-cleanup-hook"),
    ("ClusterRoleBinding", "", "akri-cleanup-hook"),
    ("Role", "akri", "akri-cleanup-hook"),
    ("RoleBinding", "akri", "akri-cleanup-hook"),
}
CEL_FIELDS = (".expression", ".messageExpression", ".message")
# The copies the chart carries (Helm reads nothing outside the chart directory).
COPIES = {
    "crds/akri-configuration-crd.yaml": "crds/akri-configuration-crd.yaml",
    "crds/akri-instance-crd.yaml": "crds/akri-instance-crd.yaml",
    "files/resourceslice-policy.yaml": "deploy/base/resourceslice-policy.yaml",
    "files/configuration-policy.yaml": "deploy/base/configuration-policy.yaml",
    **{
        f"files/{name}": f"deploy/components/monitoring/{name}"
        for name in ("podmonitors.yaml", "alerts.yaml", "prometheus-rbac.yaml", "dashboard.json")
    },
}


def differences(path: str, helm_side: Any, kustomize_side: Any) -> list[str]:
    """Every path where the two differ, with both values."""
    if isinstance(helm_side, dict) and isinstance(kustomize_side, dict):
        found = []
        for name in sorted(set(helm_side) | set(kustomize_side)):
            found += differences(
                f"{path}.{name}",
                helm_side.get(name, "<absent>"),
                kustomize_side.get(name, "<absent>"),
            )
        return found
    if (
        isinstance(helm_side, list)
        and isinstance(kustomize_side, list)
        and len(helm_side) == len(kustomize_side)
    ):
        found = []
        for index, (a, b) in enumerate(zip(helm_side, kustomize_side, strict=True)):
            found += differences(f"{path}[{index}]", a, b)
        return found
    if isinstance(helm_side, str) and isinstance(kustomize_side, str) and path.endswith(CEL_FIELDS):
        # kustomize re-folds a `>-` CEL block whose lines are more indented with an extra
        # line break; whitespace means nothing to CEL
        helm_side, kustomize_side = " ".join(helm_side.split()), " ".join(kustomize_side.split())
    return (
        []
        if helm_side == kustomize_side
        else [f"{path}: helm {helm_side!r} != kustomize {kustomize_side!r}"]
    )


def compare(rendered: Objects, expected: Objects) -> list[str]:
    charted, kustomized = by_key(rendered), by_key(expected)
    problems = [
        f"only in kustomize: {k}"
        for k in sorted(set(kustomized) - set(charted) - ONLY_IN_KUSTOMIZE)
    ]
    problems += [
        f"only in helm: {k}" for k in sorted(set(charted) - set(kustomized) - ONLY_IN_HELM)
    ]
    for k in sorted(set(charted) & set(kustomized)):
        problems += differences("/".join(k), charted[k], kustomized[k])
    return problems


@needs_helm
@needs_kubectl
@pytest.mark.parametrize(
    ("values", "tree"),
    [
        ((), "deploy"),
        (("dra.enabled=false",), "deploy/overlays/no-dra"),
        (("prometheus.enabled=true",), "deploy/overlays/monitoring"),
        (("udev.discovery.enabled=true",), "deploy/overlays/external-handlers"),
    ],
)
def test_chart_renders_what_kustomize_renders(values: tuple[str, ...], tree: str) -> None:
    """The drift test: ``helm template`` (defaults, release namespace akri) against ``kubectl
    kustomize deploy/``, and our dra.enabled=false against the no-dra overlay."""
    problems = compare(template(*values), kustomize(tree))
    assert not problems, "\n".join(problems)


def test_the_compare_finds_a_difference() -> None:
    """The drift test fails on a changed arg, a missing env entry, an extra object."""
    base = [{"kind": "DaemonSet", "metadata": {"name": "a", "namespace": "akri"},
             "spec": {"args": ["agent"], "env": [{"name": "X", "value": "1"}]}}]  # fmt: skip
    changed = [{"kind": "DaemonSet", "metadata": {"name": "a", "namespace": "akri"},
                "spec": {"args": ["agent", "--x"], "env": []}}]  # fmt: skip
    extra = [*base, {"kind": "Role", "metadata": {"name": "r", "namespace": "akri"}}]
    assert len(compare(changed, base)) == 2
    assert compare(extra, base) == ["only in helm: ('Role', 'akri', 'r')"]
    assert compare(base, base) == []


@needs_helm
def test_every_object_goes_to_the_release_namespace() -> None:
    """``helm install -n edge`` (or ``default``): no object and no RBAC subject names a fixed
    namespace."""
    for namespace in ("edge", "default"):
        rendered = template("debugEcho.discovery.enabled=true", namespace=namespace)
        for obj in rendered:
            assert obj["metadata"].get("namespace", namespace) == namespace, obj["metadata"]
            for subject in obj.get("subjects", []):
                assert subject["namespace"] == namespace, (obj["metadata"]["name"], subject)
        assert one(rendered, "DaemonSet", "akri-agent")["metadata"]["namespace"] == namespace


@pytest.mark.parametrize("copy", sorted(COPIES))
def test_the_chart_carries_identical_copies(copy: str) -> None:
    source = REPO / COPIES[copy]
    assert (CHART / copy).read_bytes() == source.read_bytes(), (
        f"deploy/helm/akri/{copy} differs: cp {COPIES[copy]} deploy/helm/akri/{copy}"
    )


@needs_helm
def test_helm_lint_strict() -> None:
    done = helm("lint", "--strict", str(CHART))
    assert done.returncode == 0, done.stdout + done.stderr


@needs_helm
def test_every_pod_carries_the_labels_akri_users_select_on() -> None:
    """Akri's labels on the pods themselves (``kubectl get pods -l app.kubernetes.io/part-of=
    akri``, ``-l app.kubernetes.io/name=akri-agent``), not only on their owners."""
    rendered = template(
        *(f"{h}.discovery.enabled=true" for h in ("debugEcho", "udev", "onvif", "opcua")),
    )
    workloads = [o for o in rendered if o["kind"] in ("DaemonSet", "Deployment", "Job")]
    assert len(workloads) == 7  # agent, controller, four handlers, the uninstall hook
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "akri", workload["metadata"]["name"]
        assert labels["app.kubernetes.io/name"] == workload["metadata"]["name"]


def test_the_chart_version_is_the_projects() -> None:
    """Chart version and appVersion (the default image tag) follow pyproject.toml."""
    import tomllib

    import yaml

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["name"], chart["version"], chart["appVersion"]) == ("akri", version, version)
