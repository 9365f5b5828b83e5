"""Every request ``akri controller`` makes — brokers, Jobs, Services, a dead node, the
ResourceSlice hand-over, leader election — is allowed by deploy/base/controller-rbac.yaml,
and that RBAC grants nothing the controller does not use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.controller.conftest import (
    add_node,
    broker_pod_spec,
    broker_pods,
    configuration,
    eventually,
    instance,
    running_controller,
    set_phase,
    set_ready,
)
from tests.doubles.apiserver import ApiServerDouble
from tests.paths import REPO

RBAC = REPO / "deploy" / "base" / "controller-rbac.yaml"
# (group, resource, verb, namespace or None: cluster-wide, resource name or None: any)
Grant = tuple[str, str, str, str | None, str | None]


def grants() -> set[Grant]:
    result: set[Grant] = set()
    for document in yaml.safe_load_all(RBAC.read_text()):
        if document["kind"] not in ("ClusterRole", "Role"):
            continue
        namespace = document["metadata"].get("namespace") if document["kind"] == "Role" else None
        for rule in document["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [None]:
                            result.add((group, resource, verb, namespace, name))
    return result


def allowed(granted: set[Grant], group: str, resource: str, verb: str, ns: str | None,
            name: str) -> bool:  # fmt: skip
    return any(
        (group, resource, verb, where, which) in granted
        for where in {None, ns}
        for which in {None, name or None}
    )


async def test_every_controller_request_is_allowed_and_every_grant_is_used(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "akri"}})
    for name in ("node-a", "node-b"):
        add_node(api, name)
    ports = {"ports": [{"port": 80}]}
    job_spec = {"template": {"spec": {"restartPolicy": "Never", **broker_pod_spec()}}}
    config = api.create(
        configuration(
            pod_spec=broker_pod_spec(), instance_service=ports, configuration_service=ports
        )
    )
    api.create(configuration("jobs", job_spec=job_spec))
    instance(api, "cams-8120fe", ["node-a", "node-b"], capacity=3,
             usage={"cams-8120fe-2": "node-b"})  # fmt: skip
    instance(api, "cams-a19705", ["node-b"], capacity=1)
    instance(api, "jobs-000001", ["node-a"], configuration_name="jobs")
    requirement = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-b"]}
    api.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "cams-a19705"},
            "spec": {
                "driver": "akri.sh",
                "pool": {"name": "cams-a19705", "generation": 1, "resourceSliceCount": 1},
                "nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [requirement]}]},
                "devices": [],
            },
        }
    )
    api.clear_requests()
    async with running_controller(api, tmp_path, lease_namespace="akri", node_grace=0.2):
        await eventually(lambda: len(broker_pods(api, "cams-8120fe")) == 2, "brokers")
        await eventually(lambda: api.get("jobs.batch", "jobs-000001-1-job"), "job")
        set_phase(api, "node-a-cams-8120fe-pod", "Running")
        await eventually(lambda: len(api.list("services")) == 2, "services")
        config["spec"]["instanceServiceSpec"] = {"ports": [{"port": 81}]}
        api.apply(config)
        await eventually(
            lambda: (
                (api.get("services", "cams-8120fe-svc") or {}).get("spec", {}).get("ports")
                == [{"port": 81}]
            ),
            "service updated",
        )
        # the eviction's first write meets a conflict: re-read (get) and re-decided
        api.fail(409, verb="update", resource="instances.akri.sh", times=1)
        set_ready(api, "node-b", False)
        await eventually(lambda: api.get("instances.akri.sh", "cams-a19705") is None, "evicted")
        await eventually(lambda: api.list("resourceslices") == [], "slice handed over")
        await eventually(lambda: len(broker_pods(api, "cams-8120fe")) == 1, "b's broker gone")
        # no broker running any more: the Services go; an Instance deleted: its Job goes
        set_phase(api, "node-a-cams-8120fe-pod", "Failed")
        await eventually(lambda: api.list("services") == [], "services removed")
        # (without its owner reference, so that the controller, not owner GC, removes it)
        job = api.get("jobs.batch", "jobs-000001-1-job") or {}
        del job["metadata"]["ownerReferences"]
        api.apply(job)
        api.delete("instances.akri.sh", "jobs-000001")
        await eventually(lambda: api.list("jobs.batch") == [], "job removed")
    used = {
        (r.info.group or "", r.info.resource, r.info.verb, r.info.namespace, r.info.name)
        for r in api.requests
        if r.info.resource
    }
    granted = grants()
    denied = sorted(str(u) for u in used if not allowed(granted, *u))
    assert denied == []
    unused = sorted(
        str(g) for g in granted
        if not any(allowed({g}, *u) for u in used)
    )  # fmt: skip
    assert unused == [], unused


def test_rbac_document_shape() -> None:
    kinds: list[Any] = [d["kind"] for d in yaml.safe_load_all(RBAC.read_text())]
    assert kinds == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"]
