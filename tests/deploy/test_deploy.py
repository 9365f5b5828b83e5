"""Issue 15: the Kustomize manifests render, validate offline against the Kubernetes schemas
(``kubernetes-validate``) and our CRDs, mount every path the agent's defaults use, bind the
RBAC to the agent, and run commands the image's entrypoint really has."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.node.settings import AGENT_OPTIONS, AgentSettings, resolve
from tests.doubles.crd_pipeline import (
    CONFIGURATION_CRD,
    cel_violations,
    load_crd,
    schema_errors,
    schema_of,
    spec_only,
    unknown_fields,
)
from tests.paths import REPO

ROOT = REPO
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
TREES = ["deploy", "deploy/overlays/debug-echo", "deploy/overlays/no-dra",
         "deploy/overlays/external-handlers"]  # fmt: skip
K8S_VERSION = "1.34"  # the oldest release with resource.k8s.io/v1 (DRA) that the base uses

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (kustomize) not installed")


@cache
def render(tree: str) -> tuple[dict[str, Any], ...]:
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / tree)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def of_kind(objects: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def agent_daemonset(objects: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (found,) = [o for o in of_kind(objects, "DaemonSet") if o["metadata"]["name"] == "akri-agent"]
    return found


def container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (only,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def cluster_defaults(environment: dict[str, str] | None = None) -> AgentSettings:
    class Args:
        pass

    return AgentSettings.from_values(resolve(Args(), AGENT_OPTIONS, environment or {}))  # type: ignore[arg-type]


def env_of(daemonset: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(daemonset).get("env", [])}


@needs_kubectl
@pytest.mark.parametrize("tree", TREES)
def test_every_rendered_object_validates(tree: str) -> None:
    objects = render(tree)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@needs_kubectl
def test_the_validation_can_fail() -> None:
    daemonset = agent_daemonset(render("deploy"))
    broken = yaml.safe_load(yaml.safe_dump(daemonset))
    broken["spec"]["template"]["spec"]["hostNetwork"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@needs_kubectl
def test_the_base_has_everything_an_install_needs() -> None:
    objects = render("deploy")
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole",
            "ClusterRoleBinding", "Role", "RoleBinding", "DeviceClass",
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
            "DaemonSet"} <= kinds  # fmt: skip
    crds = {o["metadata"]["name"] for o in of_kind(objects, "CustomResourceDefinition")}
    assert crds == {"configurations.akri.sh", "instances.akri.sh"}


@needs_kubectl
def test_the_daemonset_mounts_every_path_the_agent_uses_by_default() -> None:
    settings = cluster_defaults()
    assert settings.device_plugin_dir is not None
    used = {
        "--device-plugin-dir": settings.device_plugin_dir,
        "--pod-resources-socket": settings.pod_resources_socket.parent,
        "--plugins-registry-dir": settings.plugins_registry_dir,
        "--dra-plugin-dir": settings.dra_plugin_dir,
        "--cdi-dir": settings.cdi_dir,
        "--discovery-handlers-dir": settings.discovery_handlers_dir,
        "udev (pyudev's database)": Path("/run/udev"),
        "sysfs (udev devices)": Path("/sys"),
    }
    daemonset = agent_daemonset(render("deploy"))
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    mounts = container(daemonset)["volumeMounts"]
    for what, path in used.items():
        covering = [
            m for m in mounts
            if PurePosixPath(path).is_relative_to(m["mountPath"])
            and volumes[m["name"]].get("hostPath", {}).get("path") == m["mountPath"]
        ]  # fmt: skip
        assert covering, f"{what} ({path}) is not a hostPath mount of the same host path"
    read_only = {m["mountPath"] for m in mounts if m.get("readOnly")}
    assert {"/run/udev", "/sys"} <= read_only


@needs_kubectl
def test_the_daemonset_runs_as_the_issue_asks() -> None:
    daemonset = agent_daemonset(render("deploy"))
    spec = daemonset["spec"]
    pod = spec["template"]["spec"]
    assert spec["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    # the agent stops within STOP_DEADLINE of SIGTERM, or — uninstalled with DRA claims
    # prepared — after lingering up to LINGER_LIMIT and two bounded looks at the API
    from agent.node.app import STOP_DEADLINE
    from agent.node.leaving import LINGER_LIMIT, LOOK_TIMEOUT

    needed = LINGER_LIMIT + 2 * LOOK_TIMEOUT + STOP_DEADLINE
    assert needed < pod["terminationGracePeriodSeconds"] <= 90
    node_name = next(e for e in container(daemonset)["env"] if e["name"] == "AKRI_NODE_NAME")
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    port = container(daemonset)["ports"][0]["containerPort"]
    assert port == cluster_defaults().health_port  # probes hit the agent's default port
    probes = container(daemonset)
    assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # the health server starts before anything else (agent/node/app.py): the startup probe only
    # waits for the process to reach its event loop
    assert probes["startupProbe"]["httpGet"]["path"] == "/healthz"
    resources = probes["resources"]
    assert {"requests", "limits"} <= set(resources)


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    for suffix, factor in units.items():
        if quantity.endswith(suffix) and quantity[: -len(suffix)].isdigit():
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity) / 2**20


# docs/performance.md, "After a kubelet restart": RSS 217-239 MB at 1000 Instances after
# kubelet restarts (a one-off script, not in benchmarks/results-full.json)
RSS_AFTER_KUBELET_RESTARTS_MIB = 239


@needs_kubectl
def test_the_memory_figures_come_from_the_benchmarks() -> None:
    import json

    results = json.loads((ROOT / "benchmarks" / "results-full.json").read_text())
    steady = results["scale"]["rss_mb"]  # MiB (VmRSS), 1000 Instances
    typical = json.loads((ROOT / "benchmarks" / "results-typical-node.json").read_text())
    node = typical["typical_node"]  # benchmarks/typical_node.py: a typical node (issue 27)
    resources = container(agent_daemonset(render("deploy")))["resources"]
    request = mebibytes(resources["requests"]["memory"])
    limit = mebibytes(resources["limits"]["memory"])
    # the request is the typical node's figure rounded up (not a big node's: every node pays)
    assert node["instances"] <= 50 and node["rss_peak_mb"] <= request <= 1.5 * node["rss_peak_mb"]
    assert steady < limit
    assert limit >= 1.25 * RSS_AFTER_KUBELET_RESTARTS_MIB  # headroom over the measured peak


@needs_kubectl
def test_the_agent_s_service_account_is_bound_to_the_rbac() -> None:
    objects = render("deploy")
    daemonset = agent_daemonset(objects)
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    namespace = daemonset["metadata"]["namespace"]
    bindings = [*of_kind(objects, "ClusterRoleBinding"), *of_kind(objects, "RoleBinding")]
    for binding in bindings:
        if binding["roleRef"]["name"].startswith("akri-agent"):
            assert {"kind": "ServiceAccount", "name": account, "namespace": namespace} in binding[
                "subjects"
            ]
    assert account in {a["metadata"]["name"] for a in of_kind(objects, "ServiceAccount")}


@needs_kubectl
def test_every_env_var_of_the_manifests_is_one_the_agent_reads() -> None:
    from agent.node.leaving import POD_ENV  # the downward API's Pod name and namespace

    known = {o.env for o in AGENT_OPTIONS} | {f for o in AGENT_OPTIONS for f in o.fallbacks}
    known |= set(POD_ENV)
    for tree in TREES:
        for daemonset in of_kind(render(tree), "DaemonSet"):
            for name in env_of(daemonset):
                assert name in known, f"{tree}: {name} is not read by the agent"


@needs_kubectl
def test_no_dra_drops_the_dra_objects_and_turns_it_off() -> None:
    objects = render("deploy/overlays/no-dra")
    assert of_kind(objects, "DeviceClass") == []
    # the ResourceSlice policy goes; the Configuration policy (issue 40) is not about DRA
    policies = of_kind(objects, "ValidatingAdmissionPolicy")
    assert [p["metadata"]["name"] for p in policies] == ["akri-configuration-broker-fields"]
    bindings = of_kind(objects, "ValidatingAdmissionPolicyBinding")
    assert [b["metadata"]["name"] for b in bindings] == ["akri-configuration-broker-fields"]
    env = env_of(agent_daemonset(objects))
    assert cluster_defaults(env).dra is False
    assert cluster_defaults(env_of(agent_daemonset(render("deploy")))).dra is True


@needs_kubectl
def test_debug_echo_turns_the_handler_on() -> None:
    env = env_of(agent_daemonset(render("deploy/overlays/debug-echo")))
    assert cluster_defaults(env).debug_echo is True
    assert cluster_defaults(env_of(agent_daemonset(render("deploy")))).debug_echo is False


def _identity(obj: dict[str, Any]) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


@needs_kubectl
def test_the_example_device_class_comes_only_with_debug_echo() -> None:
    """A production install (``kubectl apply -k deploy/``) gets the generic class only; the
    class of examples/debug-echo.yaml's Configuration comes with the debugEcho overlay, which
    adds nothing else (so deleting that tree removes the base's objects and it: docs/install.md,
    Uninstall) (acceptance F4: the base installed the example's class)."""
    classes = {o["metadata"]["name"] for o in of_kind(render("deploy"), "DeviceClass")}
    assert classes == {"akri.sh"}
    base = {_identity(o) for o in render("deploy")}
    overlay = {_identity(o) for o in render("deploy/overlays/debug-echo")}
    assert overlay - base == {("DeviceClass", "", "akri-debug-echo-foo.akri.sh")}
    assert base <= overlay
    example = yaml.safe_load((ROOT / "examples/debug-echo.yaml").read_text())
    (added,) = [o for o in render("deploy/overlays/debug-echo") if _identity(o) not in base]
    assert f"configuration == '{example['metadata']['name']}'" in str(added["spec"])
    assert added["metadata"]["labels"] == {"app.kubernetes.io/part-of": "akri"}


@needs_kubectl
def test_the_external_handler_daemonset_shares_the_registration_directory() -> None:
    objects = render("deploy/overlays/external-handlers")
    handler = next(
        d for d in of_kind(objects, "DaemonSet") if d["metadata"]["name"] != "akri-agent"
    )
    spec = container(handler)
    assert spec["args"][:2] == ["handler", "udev"]
    # Akri's variable, which `akri handler` reads as its --discovery-handlers-dir
    directory = env_of(handler)["DISCOVERY_HANDLERS_DIRECTORY"]
    assert cluster_defaults(env_of(handler)).discovery_handlers_dir == Path(directory)
    assert directory == str(cluster_defaults().discovery_handlers_dir)
    assert directory in {m["mountPath"] for m in spec["volumeMounts"]}
    images = {container(d)["image"] for d in of_kind(objects, "DaemonSet")}
    assert len(images) == 1 and images.pop().startswith("ghcr.io/")


EXAMPLES = sorted(
    p for p in (ROOT / "examples").glob("*.yaml")
    if [d.get("kind") for d in yaml.safe_load_all(p.read_text()) if d] == ["Configuration"]
)  # fmt: skip


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_configurations_validate_against_our_crd(path: Path) -> None:
    schema = schema_of(load_crd(CONFIGURATION_CRD))
    obj = yaml.safe_load(path.read_text())
    assert schema_errors(obj, schema) == []
    assert unknown_fields(spec_only(obj), schema) == []
    assert cel_violations(obj, schema) == []


def test_there_is_an_example_per_handler() -> None:
    handlers = {yaml.safe_load(p.read_text())["spec"]["discoveryHandler"]["name"] for p in EXAMPLES}
    assert {"debugEcho", "udev", "onvif", "mqtt", "mdns", "opcua"} <= handlers


def _build_stage_sources() -> list[str]:
    """What the Dockerfile's build stage copies before ``pip wheel`` (the wheel's sources)."""
    sources: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["FROM"] and sources:
            break  # the final stage: its COPY --from takes the wheel, not sources
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += words[1:-1]
    return sources


@pytest.fixture(scope="module")
def wheel_akri(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``akri`` as the image has it: the wheel built from what the Dockerfile copies
    (``pip wheel --no-deps``, as its build stage does), installed in a fresh venv. Offline:
    the build uses this venv's setuptools (no build isolation), and the runtime dependencies
    come from this venv's site-packages through a ``.pth`` line (a plain path, so the
    editable install of the checkout there is not activated). About 3 s."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    source.mkdir()
    for name in _build_stage_sources():
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(tmp / "wheels"), str(source)],
        check=True, timeout=120,
    )  # fmt: skip
    (wheel,) = (tmp / "wheels").glob("akri_py_agent-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        check=True, timeout=120,
    )  # fmt: skip
    site = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    (venv / site / "akri-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    show = "import agent, discovery_handlers as d; print(agent.__file__, d.__file__)"
    where = subprocess.run(
        [str(python), "-c", show], capture_output=True, text=True, cwd=tmp, check=True
    )
    for module in where.stdout.split():
        assert Path(module).is_relative_to(venv), f"not the wheel's code: {where.stdout}"
    return venv / "bin" / "akri"


def _akri(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # the console script the wheel installs (the image's ENTRYPOINT ["akri"]), run outside
    # the checkout so that nothing but the installed wheel can be imported
    env = {k: v for k, v in os.environ.items() if not k.startswith("AKRI_")}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(script), *args], capture_output=True, text=True, env=env, timeout=60,
        cwd=script.parent,
    )  # fmt: skip


def test_the_wheel_s_entrypoint_runs(wheel_akri: Path) -> None:
    done = _akri(wheel_akri, "version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert done.returncode == 0 and done.stdout == f"akri {version}\n", done
    done = _akri(wheel_akri, "agent", "--help")
    assert done.returncode == 0 and "--health-port" in done.stdout, done.stderr


def test_the_wheel_installs_with_bytecode(wheel_akri: Path) -> None:
    # issue 27: pip compiles at install (even with PYTHONDONTWRITEBYTECODE), so the image's
    # agent and a `pip install` start from bytecode; the Dockerfile compiles again anyway
    site = next((wheel_akri.parent.parent / "lib").glob("python3*/site-packages"))
    tag = sys.implementation.cache_tag
    for module in ("agent/cli", "agent/node/app", "agent/core/store/local"):
        source = site / f"{module}.py"
        compiled = source.parent / "__pycache__" / f"{source.stem}.{tag}.pyc"
        assert compiled.is_file(), f"{compiled} missing: the wheel's install did not compile"


@needs_kubectl
def test_the_entrypoint_runs_what_the_manifests_ask(wheel_akri: Path) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["akri"]' in dockerfile and 'CMD ["agent"]' in dockerfile
    for tree in TREES:
        objects = render(tree)
        for daemonset in [*of_kind(objects, "DaemonSet"), *of_kind(objects, "Deployment")]:
            args = container(daemonset)["args"]
            done = _akri(wheel_akri, *args, "--help")
            assert done.returncode == 0, done.stderr
            for flag in [a for a in args if a.startswith("--")]:
                assert flag in done.stdout, f"{tree}: {flag} unknown to akri {args[0]}"


# -- the controller (issue 25) ---------------------------------------------------------------
def controller_deployment(objects: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (found,) = [
        o for o in of_kind(objects, "Deployment") if o["metadata"]["name"] == "akri-controller"
    ]
    return found


@needs_kubectl
def test_the_controller_runs_as_the_issue_asks() -> None:
    from agent.controller.settings import CONTROLLER_FLAGS, HEALTH_PORT

    for tree in TREES:
        deployment = controller_deployment(render(tree))
        assert deployment["spec"]["replicas"] == 2
        template = deployment["spec"]["template"]
        labels = template["metadata"]["labels"]
        # the PodMonitor of deploy/components/monitoring selects these, port "health"
        assert labels["app.kubernetes.io/name"] == "akri-controller"
        spec = template["spec"]
        assert spec["serviceAccountName"] == "akri-controller"
        (only,) = spec["containers"]
        assert only["args"] == ["controller"]
        assert {"name": "health", "containerPort": HEALTH_PORT} in only["ports"]
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            assert only[probe]["httpGet"] == {"path": path, "port": "health"}
        assert only["resources"]["requests"] and only["resources"]["limits"]
        assert only["securityContext"]["readOnlyRootFilesystem"] is True
        assert spec["securityContext"]["runAsNonRoot"] is True
        known = {f.env for f in CONTROLLER_FLAGS} | {
            n for f in CONTROLLER_FLAGS for n in f.fallbacks
        }
        for variable in only["env"]:
            assert variable["name"] in known, f"{tree}: {variable['name']} is not read"


@needs_kubectl
def test_the_controller_s_memory_comes_from_its_benchmark() -> None:
    import json

    results = json.loads((ROOT / "benchmarks" / "results-controller.json").read_text())
    scale = results["controller"]["controller_scale"]
    assert (scale["instances"], scale["nodes"]) == (1000, 10)
    (only,) = controller_deployment(render("deploy"))["spec"]["template"]["spec"]["containers"]
    request = mebibytes(only["resources"]["requests"]["memory"])
    limit = mebibytes(only["resources"]["limits"]["memory"])
    assert scale["rss_peak_mb"] <= request and limit >= 2 * scale["rss_peak_mb"]


@needs_kubectl
def test_the_controller_s_rbac_is_its_own_and_least_privilege() -> None:
    objects = render("deploy")
    roles = {
        o["metadata"]["name"]: o
        for o in [*of_kind(objects, "ClusterRole"), *of_kind(objects, "Role")]
    }
    bindings = [*of_kind(objects, "ClusterRoleBinding"), *of_kind(objects, "RoleBinding")]
    mine = [b for b in bindings if b["roleRef"]["name"].startswith("akri-controller")]
    assert {b["roleRef"]["name"] for b in mine} == {"akri-controller", "akri-controller-lease"}
    for binding in mine:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "akri-controller", "namespace": "akri"}
        ]
    for binding in bindings:
        if binding not in mine:
            assert all(s["name"] != "akri-controller" for s in binding["subjects"])
    for name in ("akri-controller", "akri-controller-lease"):
        for rule in roles[name]["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
    lease = roles["akri-controller-lease"]
    assert lease["metadata"]["namespace"] == "akri"
    named = [r for r in lease["rules"] if r.get("resourceNames")]
    assert named == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["akri-controller"],
            "verbs": ["get", "update"],
        }
    ]
