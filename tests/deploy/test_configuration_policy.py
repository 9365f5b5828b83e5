"""Issue 40, item 3: the ValidatingAdmissionPolicy that refuses what Akri's webhook refuses — a
Configuration whose brokerPodSpec, brokerJobSpec, instanceServiceSpec or
configurationServiceSpec carries a field its Kubernetes type does not have — evaluated with
CEL (tests/doubles/admission_policy.py) against valid and invalid Configurations; the CRD keeps
such fields (they reach admission, not pruned); both installs carry the policy."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controller.conftest import CRDS, broker_pod_spec, configuration
from tests.deploy.helm_chart import KUBECTL, kustomize, needs_helm, template
from tests.doubles.admission_policy import CONFIGURATION_POLICY, admit_configuration, policy
from tests.doubles.apiserver import ApiServerDouble
from tests.paths import FIXTURES, REPO

NAME = "akri-configuration-broker-fields"


def generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "configuration_policy", REPO / "scripts" / "configuration_policy.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_policy_file_is_what_the_generator_writes() -> None:
    assert CONFIGURATION_POLICY.read_text() == generator().render(), (
        "deploy/base/configuration-policy.yaml is stale: .venv/bin/python "
        "scripts/configuration_policy.py > deploy/base/configuration-policy.yaml"
    )


def with_broker(**spec: Any) -> dict[str, Any]:
    found = configuration(
        pod_spec=broker_pod_spec(),
        instance_service={"type": "ClusterIP", "ports": [{"name": "grpc", "port": 80}]},
        configuration_service={"ports": [{"name": "grpc", "port": 80, "targetPort": 8083}]},
    )
    found["spec"].update(spec)
    return found


def with_job() -> dict[str, Any]:
    return configuration(
        job_spec={
            "backoffLimit": 2,
            "parallelism": 1,
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "containers": [{"name": "job", "image": "busybox", "command": ["true"]}],
                },
            },
        }
    )


def examples() -> list[dict[str, Any]]:
    """Every Configuration the project shows (examples/, Akri's chart's onvif render)."""
    found = []
    for path in [*sorted((REPO / "examples").glob("*.yaml")), *sorted(FIXTURES.rglob("*.yaml"))]:
        try:
            documents = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            continue  # a fixture of bad input
        found += [d for d in documents if isinstance(d, dict) and d.get("kind") == "Configuration"]
    return found


def test_valid_configurations_are_admitted() -> None:
    shown = examples()
    assert any("brokerSpec" in c.get("spec", {}) for c in shown)
    for found in [with_broker(), with_job(), configuration(), *shown]:
        for operation in ("CREATE", "UPDATE"):
            assert admit_configuration(operation, found, old=found) == (True, ""), found


def pod_specs_we_ship() -> list[dict[str, Any]]:
    """Real, rich pod specs (ours: probes, securityContext, hostPath volumes, env fieldRef)."""
    objects = template("debugEcho.discovery.enabled=true", "udev.discovery.enabled=true")
    return [
        o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("DaemonSet", "Deployment")
    ]


@needs_helm
def test_every_pod_spec_we_ship_would_be_admitted_as_a_broker() -> None:
    """The field names are complete enough for real pod specs: ours pass as brokerPodSpec and
    as a Job's template."""
    for pod in pod_specs_we_ship():
        found = configuration(pod_spec=pod)
        assert admit_configuration("CREATE", found) == (True, ""), pod
        job = configuration(
            job_spec={"template": {"metadata": {"labels": {"x": "y"}}, "spec": pod}}
        )
        assert admit_configuration("CREATE", job) == (True, "")


def set_at(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    here: Any = changed
    *parents, last = path.split(".")
    for part in parents:
        here = here[int(part)] if isinstance(here, list) else here.setdefault(part, {})
    here[last] = value
    return changed


POD = "spec.brokerSpec.brokerPodSpec"
CONTAINER = f"{POD}.containers.0"
JOB = "spec.brokerSpec.brokerJobSpec"
PODS = "spec.brokerSpec.brokerPodSpec / brokerJobSpec.template.spec"
CONTAINERS = "a container of spec.brokerSpec"
SERVICES = "spec.instanceServiceSpec / configurationServiceSpec"
REFUSED = [
    # (Configuration, path of the typo, what the message says before "has unknown field(s)")
    ("pod", f"{POD}.nodeSelecter", f"{PODS} (PodSpec)"),
    ("pod", f"{POD}.securityContext.runAsUsr", ": securityContext (PodSecurityContext)"),
    ("pod", f"{POD}.tolerations", ": tolerations[*] (Toleration)"),
    ("pod", f"{POD}.volumes", ": volumes[*].hostPath (HostPathVolumeSource)"),
    ("pod", f"{POD}.affinity.nodeAffinity.required", ": affinity.nodeAffinity (NodeAffinity)"),
    ("pod", f"{CONTAINER}.imagePullPolcy", f"{CONTAINERS} (Container)"),
    ("pod", f"{CONTAINER}.securityContext.privilegd", ": securityContext (SecurityContext)"),
    ("pod", f"{CONTAINER}.securityContext.capabilities.ad",
     "securityContext.capabilities (Capabilities)"),
    ("pod", f"{CONTAINER}.env", ": env[*].valueFrom.secretKeyRef (SecretKeySelector)"),
    ("pod", f"{CONTAINER}.resources.limts", ": resources (ResourceRequirements)"),
    ("pod", f"{CONTAINER}.volumeMounts", ": volumeMounts[*] (VolumeMount)"),
    ("pod", f"{CONTAINER}.livenessProbe.httpGet.pth", ": livenessProbe.httpGet (HTTPGetAction)"),
    ("job", f"{JOB}.backofLimit", "spec.brokerSpec.brokerJobSpec (JobSpec)"),
    ("job", f"{JOB}.template.metadata.label", "brokerJobSpec: template.metadata (ObjectMeta)"),
    ("job", f"{JOB}.template.spec.restartPolicyy", "brokerJobSpec.template.spec (PodSpec)"),
    ("job", f"{JOB}.template.spec.containers.0.comand", f"{CONTAINERS} (Container)"),
    ("pod", "spec.instanceServiceSpec.typ", f"{SERVICES} (ServiceSpec)"),
    ("pod", "spec.configurationServiceSpec.ports", ": ports[*] (ServicePort)"),
]  # fmt: skip
# the value each typo gets (its last path part is the typo), or a list holding it for list paths
VALUES: dict[str, Any] = {
    f"{POD}.tolerations": [{"key": "a", "operater": "Exists"}],
    f"{POD}.volumes": [{"name": "dev", "hostPath": {"path": "/dev", "typ": "Directory"}}],
    f"{CONTAINER}.env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "kee": "k"}}}],
    f"{CONTAINER}.volumeMounts": [{"name": "dev", "mountpath": "/dev"}],
    "spec.configurationServiceSpec.ports": [{"name": "grpc", "port": 80, "targetport": 1}],
}
TYPO = {
    f"{POD}.tolerations": "operater",
    f"{POD}.volumes": "typ",
    f"{CONTAINER}.env": "kee",
    f"{CONTAINER}.volumeMounts": "mountpath",
    "spec.configurationServiceSpec.ports": "targetport",
}


@pytest.mark.parametrize(("base", "path", "where"), REFUSED, ids=[p for _, p, _ in REFUSED])
def test_a_field_its_type_does_not_have_is_refused_by_name(
    base: str, path: str, where: str
) -> None:
    start = with_broker() if base == "pod" else with_job()
    found = set_at(start, path, VALUES.get(path, {"x": 1} if path.endswith("required") else 1))
    typo = TYPO.get(path, path.rsplit(".", 1)[1])
    allowed, message = admit_configuration("UPDATE" if "Service" in where else "CREATE", found)
    assert not allowed, path
    assert where in message and message.endswith(f"has unknown field(s): {typo}"), message
    # and the same Configuration without the typo is admitted
    assert admit_configuration("CREATE", start) == (True, "")


def test_every_unknown_field_of_a_place_is_named() -> None:
    found = set_at(with_broker(), f"{POD}.nodeSelecter", {"a": "b"})
    found = set_at(found, f"{POD}.hostNetwrk", True)
    allowed, message = admit_configuration("CREATE", found)
    assert not allowed and message.endswith("has unknown field(s): nodeSelecter, hostNetwrk")


def test_the_check_can_fail_only_on_unknown_fields() -> None:
    """Known fields with odd values are the API server's business when it creates the broker
    (as Akri's webhook, which checks the field names against the types, not the values)."""
    found = set_at(with_broker(), f"{CONTAINER}.resources.limits", {"{{PLACEHOLDER}}": "1"})
    assert admit_configuration("CREATE", found) == (True, "")


async def test_the_crd_keeps_unknown_broker_fields_for_admission_to_see() -> None:
    """The API server prunes unknown fields before admission where a schema says so; the
    Configuration CRD keeps brokerPodSpec & co. whole (x-kubernetes-preserve-unknown-fields),
    so the policy sees a typo instead of the API server dropping it silently."""
    found = set_at(with_broker(), f"{POD}.nodeSelecter", {"a": "b"})
    found = set_at(found, "spec.instanceServiceSpec.typ", "x")
    found = set_at(found, f"{JOB}.backofLimit", 1)
    del found["spec"]["brokerSpec"]["brokerJobSpec"]
    async with ApiServerDouble(crds=CRDS) as api:
        stored = api.create(found)
    assert stored["spec"]["brokerSpec"]["brokerPodSpec"]["nodeSelecter"] == {"a": "b"}
    assert stored["spec"]["instanceServiceSpec"]["typ"] == "x"
    assert not admit_configuration("CREATE", stored)[0]


def named(obj: dict[str, Any]) -> bool:
    return bool(obj["metadata"]["name"] == NAME)


def names(objects: list[dict[str, Any]], kind: str) -> list[str]:
    return [o["metadata"]["name"] for o in objects if o["kind"] == kind]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (kustomize) not installed")
def test_the_kustomize_install_carries_the_policy() -> None:
    objects = kustomize("deploy")
    assert NAME in names(objects, "ValidatingAdmissionPolicy")
    (binding,) = [
        o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding" and named(o)
    ]
    assert binding["spec"] == {"policyName": NAME, "validationActions": ["Deny"]}


@needs_helm
def test_the_chart_carries_the_policy_unless_webhook_configuration_is_off() -> None:
    rendered = template()
    assert NAME in names(rendered, "ValidatingAdmissionPolicy")
    assert NAME in names(rendered, "ValidatingAdmissionPolicyBinding")
    charted = next(o for o in rendered if o["kind"] == "ValidatingAdmissionPolicy" and named(o))
    assert charted == policy(CONFIGURATION_POLICY)
    off = template("webhookConfiguration.enabled=false")
    assert NAME not in names(off, "ValidatingAdmissionPolicy") + names(
        off, "ValidatingAdmissionPolicyBinding"
    )


def test_the_policy_matches_configurations_only() -> None:
    spec = policy(Path(CONFIGURATION_POLICY))["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule == {
        "apiGroups": ["akri.sh"],
        "apiVersions": ["*"],
        "operations": ["CREATE", "UPDATE"],
        "resources": ["configurations"],
    }
