"""Issue 40, item 4: ``akri uninstall-cleanup`` (the chart's pre-delete hook) against the
API-server double, run as the hook runs it: the command as a process, with the ServiceAccount
the chart gives it (its ClusterRole's rules, rendered by helm) and nothing more.

It deletes every Configuration, then waits, saying what for, until the Instances (kept by
their finalizer until the agents free the last slot), the brokers and akri controller's
DeviceClasses are gone; it gives up after ``--timeout`` naming what is left.
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
    api: ApiServerDouble, tmp_path: Path, give_up_after: float, token: str | None
) -> asyncio.subprocess.Process:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", token=token)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent.cli", "uninstall-cleanup",
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


def hook_token(api: ApiServerDouble) -> str:
    """The hook's ServiceAccount, allowed exactly what the chart's ClusterRole grants."""
    role = one(template(), "ClusterRole", "akri-cleanup-hook")
    api.add_user("hook-token", "system:serviceaccount:akri:akri-cleanup-hook", role["rules"])
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
