"""Issue 40, item 4: ``akri uninstall-cleanup`` (the chart's pre-delete hook) against the
API-server double, run as the hook runs it: the command as a process, with the ServiceAccount
the chart gives it (its ClusterRole's rules, rendered by helm) and nothing more.

It deletes every Configuration, then waits, saying what for, until the Instances (kept by
their finalizer until the agents free the last slot), the brokers and akri controller's
DeviceClasses are gone; then it deletes the release's DaemonSets and Deployment (the names the
chart passes) in the foreground and waits until their pods are gone, then the controller's
Lease; it gives up after ``--timeout`` naming what is left.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.controller.conftest import CRDS, configuration, instance
from tests.deploy.helm_chart import needs_helm, one, template
from tests.doubles.apiserver import ApiServerDouble

WITHIN = 60.0  # seconds: bound of every wait (a loaded CI machine)
FINALIZER = "akri.sh/slots"


def broker_pod(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"node-a-{meta['name']}-pod",
            "namespace": "default",
            "labels": {"controller": "akri.sh", "akri.sh/instance": meta["name"]},
            "ownerReferences": [
                {
                    "apiVersion": "akri.sh/v0",
                    "kind": "Instance",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": {"containers": [{"name": "broker", "image": "example/broker:1"}]},
    }


def managed_class() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {
            "name": "cams.configuration.akri.sh",
            "labels": {"app.kubernetes.io/managed-by": "akri-controller"},
        },
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'akri.sh'"}}]},
    }


async def start_cleanup(
    api: ApiServerDouble,
    tmp_path: Path,
    give_up_after: float,
    token: str | None,
    more: tuple[str, ...] = (),
) -> asyncio.subprocess.Process:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", token=token)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", "uninstall-cleanup", *more,
        "--timeout", str(give_up_after), "--kubeconfig", str(kubeconfig),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if "KUBE" not in k},
    )  # fmt: skip


def setup(api: ApiServerDouble) -> None:
    api.create(configuration("cams"))
    api.create(configuration("other"))
    owned = instance(api, "cams-8120fe", ["node-a"], finalizers=[FINALIZER])
    api.create(broker_pod(api.get("instances.akri.sh", owned["metadata"]["name"], "default") or {}))
    api.create(managed_class())


def hook_token(api: ApiServerDouble, *values: str) -> str:
    """The hook's ServiceAccount, allowed exactly what the chart's ClusterRole and Role grant
    (``values``: helm --set values; the release namespace is akri)."""
    objects = template(*values)
    rules = [
        *one(objects, "ClusterRole", "akri-cleanup-hook")["rules"],
        *one(objects, "Role", "akri-cleanup-hook")["rules"],
    ]
    api.add_user("hook-token", "system:serviceaccount:akri:akri-cleanup-hook", rules)
    return "hook-token"


@needs_helm
async def test_it_deletes_configurations_and_waits_until_instances_and_brokers_are_gone(
    tmp_path: Path,
) -> None:
    async with ApiServerDouble(crds=CRDS) as api:
        setup(api)
        process = await start_cleanup(api, tmp_path, give_up_after=WITHIN, token=hook_token(api))
        try:
            err = await let_the_agent_and_controller_finish(api, process)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    log = err.decode()
    assert process.returncode == 0, log
    assert "deleted 2 Configuration(s): default/cams, default/other" in log
    assert "waiting for 1 Instance(s) (default/cams-8120fe)" in log
    assert "the uninstall can go on" in log


async def let_the_agent_and_controller_finish(
    api: ApiServerDouble, process: asyncio.subprocess.Process
) -> bytes:
    """Once the command says it waits for the terminating Instance: the agent frees its last
    slot (the finalizer goes), the controller deletes its DeviceClass. The command's log."""
    assert process.stderr is not None
    log = b""
    async with asyncio.timeout(WITHIN):
        while b"waiting for" not in log:
            line = await process.stderr.readline()
            assert line, f"the command ended first: {log.decode()}"
            log += line
    assert not api.list("configurations.akri.sh")
    held = api.get("instances.akri.sh", "cams-8120fe", "default")
    assert held is not None and "deletionTimestamp" in held["metadata"]
    assert len(api.list("pods")) == 1  # its broker is there while it is
    held["metadata"]["finalizers"] = []
    api.store.update(api.resource("instances.akri.sh"), "v0", "default", "cams-8120fe", held)
    assert api.list("pods") == []  # the garbage collector took the broker with it
    api.delete("deviceclasses.resource.k8s.io", "cams.configuration.akri.sh")
    async with asyncio.timeout(WITHIN):
        _, rest = await process.communicate()
    return log + rest


async def test_it_gives_up_after_its_timeout_naming_what_is_left(tmp_path: Path) -> None:
    async with ApiServerDouble(crds=CRDS) as api:
        setup(api)
        process = await start_cleanup(api, tmp_path, give_up_after=1, token=None)
        async with asyncio.timeout(WITHIN):
            _, err = await process.communicate()
    log = err.decode()
    assert process.returncode == 1, log
    assert (
        "gave up after 1s: still there: 1 Instance(s) (default/cams-8120fe); 1 broker Pod(s) "
        "(default/node-a-cams-8120fe-pod); 1 DeviceClass(s) (cams.configuration.akri.sh)"
    ) in log
    assert "deviceUsage names the holders" in log


async def test_nothing_to_clean_ends_at_once(tmp_path: Path) -> None:
    async with ApiServerDouble(crds=CRDS) as api:
        process = await start_cleanup(api, tmp_path, give_up_after=WITHIN, token=None)
        async with asyncio.timeout(WITHIN):
            _, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    assert "deleted 0 Configuration(s)" in err.decode()


async def test_an_unreachable_api_server_is_exit_4(tmp_path: Path) -> None:
    async with ApiServerDouble(crds=CRDS) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", "uninstall-cleanup", "--kubeconfig", str(kubeconfig),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(WITHIN):
        _, err = await process.communicate()
    assert process.returncode == 4, err.decode()
    assert err.decode().startswith("akri uninstall-cleanup: ")


@pytest.mark.parametrize("forbidden", ["pods", "instances"])
async def test_missing_rbac_is_a_clear_error(tmp_path: Path, forbidden: str) -> None:
    """Without a permission it needs, it says which request was refused (exit 4)."""
    rules = [
        {"apiGroups": ["akri.sh"], "resources": ["configurations"], "verbs": ["list", "delete"]},
        *(
            [{"apiGroups": ["akri.sh"], "resources": ["instances"], "verbs": ["list"]}]
            if forbidden != "instances"
            else []
        ),
    ]
    async with ApiServerDouble(crds=CRDS) as api:
        api.add_user("t", "system:serviceaccount:akri:akri-cleanup-hook", rules)
        process = await start_cleanup(api, tmp_path, give_up_after=WITHIN, token="t")
        async with asyncio.timeout(WITHIN):
            _, err = await process.communicate()
    assert process.returncode == 4, err.decode()
    assert "403" in err.decode() or "forbidden" in err.decode().lower()


KUBELET = "tests.akri.sh/kubelet"  # keeps a deleted Pod until the test ends it, as kubelet


def workload(kind: str, name: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": name}
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": "akri", "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "main", "image": "ghcr.io/akri-py/akri-agent"}]},
            },
        },
    }


def owned_by(api: ApiServerDouble, owner: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """``child`` created with ``owner`` as its controller (blockOwnerDeletion, as the
    DaemonSet, Deployment and ReplicaSet controllers set it)."""
    meta = owner["metadata"]
    child["metadata"]["ownerReferences"] = [
        {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
         "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    return api.create(child)


def workload_pod(labels_of: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "akri",
            "labels": labels_of["spec"]["selector"]["matchLabels"],
            "finalizers": [KUBELET],
        },
        "spec": {"containers": [{"name": "main", "image": "ghcr.io/akri-py/akri-agent"}]},
    }


def install_workloads(api: ApiServerDouble) -> list[str]:
    """The release's agent and handler DaemonSets, its controller Deployment (a pod each; the
    double serves no ReplicaSets: the controller's pod is the Deployment's own) and the
    controller's Lease; the pods' names."""
    pods = []
    for kind, name in (("DaemonSet", "akri-agent"), ("DaemonSet", "akri-debug-echo-discovery"),
                       ("Deployment", "akri-controller")):  # fmt: skip
        owner = api.create(workload(kind, name))
        pod = owned_by(api, owner, workload_pod(owner, f"{name}-x1"))
        pods.append(pod["metadata"]["name"])
    api.create({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "akri-controller", "namespace": "akri"},
        "spec": {"holderIdentity": "", "leaseDurationSeconds": 15},
    })  # fmt: skip
    return pods


def end_pod(api: ApiServerDouble, name: str) -> None:
    """What kubelet does once the pod's containers have stopped: the deleted Pod goes."""
    pod = api.get("pods", name, "akri")
    assert pod is not None and "deletionTimestamp" in pod["metadata"], pod
    pod["metadata"]["finalizers"] = []
    api.store.update(api.resource("pods"), "v1", "akri", name, pod)


CHART_WORKLOADS = ("debugEcho.discovery.enabled=true",)


def chart_arguments() -> tuple[str, ...]:
    """The hook's arguments past ``uninstall-cleanup --timeout N``, as the chart renders them
    (release namespace akri, with the debugEcho discovery-handler DaemonSet)."""
    (container,) = one(template(*CHART_WORKLOADS), "Job", "akri-cleanup-hook")["spec"]["template"][
        "spec"
    ]["containers"]
    args = container["args"]
    assert args[:2] == ["uninstall-cleanup", "--timeout"]
    return tuple(args[3:])


@needs_helm
async def test_then_it_deletes_the_workloads_in_the_foreground_and_the_lease(
    tmp_path: Path,
) -> None:
    """Once no Instance is left, the DaemonSets and the Deployment the chart names are deleted
    in the foreground: each stays, being deleted, until its pods are gone (an agent's pod ends
    after its agent looked at its DaemonSet, RBAC still there: it knows it is uninstalled);
    only then is the Lease deleted and the command done."""
    async with ApiServerDouble(crds=CRDS) as api:
        pods = install_workloads(api)
        process = await start_cleanup(api, tmp_path, give_up_after=WITHIN,
                                      token=hook_token(api, *CHART_WORKLOADS),
                                      more=chart_arguments())  # fmt: skip
        try:
            assert process.stderr is not None
            log = b""
            async with asyncio.timeout(WITHIN):
                while b"waiting for DaemonSet" not in log:
                    line = await process.stderr.readline()
                    assert line, f"the command ended first: {log.decode()}"
                    log += line
            for name in ("akri-agent", "akri-debug-echo-discovery"):
                being_deleted = api.get("daemonsets.apps", name, "akri")
                assert being_deleted is not None, name
                assert being_deleted["metadata"]["finalizers"] == ["foregroundDeletion"]
            assert api.get("deployments.apps", "akri-controller", "akri") is not None
            assert api.get("leases.coordination.k8s.io", "akri-controller", "akri") is not None
            for pod in pods:
                end_pod(api, pod)
            async with asyncio.timeout(WITHIN):
                _, rest = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        text = (log + rest).decode()
        assert process.returncode == 0, text
        assert (
            "waiting for DaemonSet akri/akri-agent (1 pod(s)); DaemonSet "
            "akri/akri-debug-echo-discovery (1 pod(s)); Deployment akri/akri-controller "
            "(1 pod(s))"
        ) in text
        assert "deleted the controller's Lease akri/akri-controller" in text
        assert api.list("daemonsets.apps") == [] and api.list("deployments.apps") == []
        assert api.list("pods") == []
        assert api.list("leases.coordination.k8s.io") == []


async def test_a_pod_that_does_not_end_is_named_when_it_gives_up(tmp_path: Path) -> None:
    async with ApiServerDouble(crds=CRDS) as api:
        install_workloads(api)
        process = await start_cleanup(
            api, tmp_path, give_up_after=2, token=None,
            more=("--namespace", "akri", "--daemonset", "akri-agent", "--lease", "akri-controller"),
        )  # fmt: skip
        async with asyncio.timeout(WITHIN):
            _, err = await process.communicate()
    log = err.decode()
    assert process.returncode == 1, log
    assert "gave up after 2s: still there: DaemonSet akri/akri-agent (1 pod(s))" in log
    assert "deleted the controller's Lease" not in log  # the controller may still hold it
