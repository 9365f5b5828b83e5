"""The controller owns the DeviceClasses that serve ``akri.sh/<name>`` limits through DRA
(KEP-5004): created for Configurations holding their names and their Instances, removed with
them, a colliding Configuration (another namespace's of the same name, a name shaped like
another's Instances) gets none, so no two classes carry one extendedResourceName; an
operator's class is left alone."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from agent.core.model.keys import ObjectKey
from agent.core.name_claims import NameUser, decide_names
from tests.controller.conftest import (
    add_node,
    configuration,
    eventually,
    instance,
    running_controller,
)
from tests.doubles.apiserver import ApiServerDouble

CLASSES = "deviceclasses.resource.k8s.io"


def class_names(api: ApiServerDouble) -> list[str]:
    return sorted(c["metadata"]["name"] for c in api.list(CLASSES))


def test_owner_rule_instances_first_then_oldest() -> None:
    a, b = ObjectKey("a", "cam"), ObjectKey("b", "cam")
    users = [NameUser(a, "2026-01-02T00:00:00Z"), NameUser(b, "2026-01-01T00:00:00Z")]
    assert decide_names(users).holds(b)  # the oldest
    decision = decide_names([NameUser(a, "2026-01-02T00:00:00Z", has_instances=True), users[1]])
    assert decision.holds(a) and not decision.holds(b)  # the one serving keeps it


async def test_classes_follow_configurations_and_instances(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    add_node(api, "node-a")
    add_node(api, "node-b")
    api.create(configuration("cams"))
    instance(api, "cams-8120fe", ["node-a"])
    operator: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "gpu.example.com"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.example.com'"}}]},
    }
    api.create(operator)
    async with running_controller(api, tmp_path):
        await eventually(
            lambda: (
                class_names(api)
                == ["cams-8120fe.instance.akri.sh", "cams.configuration.akri.sh", "gpu.example.com"]
            ),
            "classes created",
        )
        created = api.get(CLASSES, "cams.configuration.akri.sh") or {}
        assert created["spec"]["extendedResourceName"] == "akri.sh/cams"
        # another namespace's Configuration of the same name: not its classes
        other = configuration("cams")
        other["metadata"]["namespace"] = "other"
        api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}})
        api.create(other)
        instance(api, "cams-222222", ["node-b"])  # default namespace: a second Instance
        await eventually(
            lambda: "cams-222222.instance.akri.sh" in class_names(api), "second instance"
        )
        labels = (api.get(CLASSES, "cams.configuration.akri.sh") or {})["metadata"]["labels"]
        assert labels["akri.sh/configuration-namespace"] == "default"
        # an Instance goes: its class goes; the Configuration goes: all go
        api.delete("instances.akri.sh", "cams-8120fe", "default")
        await eventually(
            lambda: "cams-8120fe.instance.akri.sh" not in class_names(api), "instance class gone"
        )
        api.delete("configurations.akri.sh", "cams", "default")  # its Instances go (owner GC)
        await eventually(
            lambda: class_names(api) == ["cams.configuration.akri.sh", "gpu.example.com"],
            "the other namespace now owns the name",
        )
        labels = (api.get(CLASSES, "cams.configuration.akri.sh") or {})["metadata"]["labels"]
        assert labels["akri.sh/configuration-namespace"] == "other"
    # the operator's own class was never touched
    kept = api.get(CLASSES, "gpu.example.com") or {}
    assert kept["spec"] == operator["spec"] and "labels" not in kept["metadata"]


async def test_a_dropped_extended_resource_name_is_reported(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An API server with DRAExtendedResource off stores the class without the field."""
    caplog.set_level(logging.WARNING)
    api.create(configuration("cams"))
    original = api.store.create

    def dropping(rt: Any, version: str, namespace: Any, obj: dict[str, Any], *a: Any, **k: Any):
        if rt.plural == "deviceclasses":
            obj = {
                **obj,
                "spec": {s: v for s, v in obj["spec"].items() if s != "extendedResourceName"},
            }
        return original(rt, version, namespace, obj, *a, **k)

    api.store.create = dropping  # type: ignore[method-assign]
    try:
        async with running_controller(api, tmp_path):
            await eventually(lambda: "DRAExtendedResource feature gate is off" in caplog.text,
                             "reported")  # fmt: skip
    finally:
        api.store.create = original  # type: ignore[method-assign]


def extended_names(api: ApiServerDouble) -> dict[str, list[str]]:
    """extendedResourceName -> the classes carrying it."""
    by_name: dict[str, list[str]] = {}
    for obj in api.list(CLASSES):
        name = obj["spec"].get("extendedResourceName")
        if name:
            by_name.setdefault(name, []).append(obj["metadata"]["name"])
    return by_name


async def test_one_class_per_extended_resource_name(api: ApiServerDouble, tmp_path: Path) -> None:
    """Issue 34.5: ``cam`` serves a device whose Instance is ``cam-202406``; a Configuration
    named ``cam-202406`` comes later (refused by every agent). Before, it got
    ``cam-202406.configuration.akri.sh`` with ``extendedResourceName: akri.sh/cam-202406``,
    the name of the Instance's class too: Kubernetes took the newer class, which selected no
    device, and pods asking for the camera could not be scheduled. Now the Instance's class is
    the only one; the newcomer gets its classes once the name is free."""
    add_node(api, "node-a")
    api.create(configuration("cam"))
    instance(api, "cam-202406", ["node-a"], configuration_name="cam")
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "tenant-b"}})
    newcomer = configuration("cam-202406")
    newcomer["metadata"]["namespace"] = "tenant-b"
    async with running_controller(api, tmp_path) as running:
        cams = ["cam-202406.instance.akri.sh", "cam.configuration.akri.sh"]
        await eventually(lambda: class_names(api) == cams, "cam's classes")
        api.create(newcomer)
        seen = ObjectKey("tenant-b", "cam-202406")
        store = running.controller.store
        await eventually(lambda: any(c.key == seen for c in store.configurations()), "seen")
        await running.controller.device_classes.sync()  # a pass that knows the newcomer
        assert class_names(api) == cams
        assert extended_names(api) == {
            "akri.sh/cam": ["cam.configuration.akri.sh"],
            "akri.sh/cam-202406": ["cam-202406.instance.akri.sh"],
        }
        # cam and its Instance go: the name is free, the newcomer gets its class
        api.delete("configurations.akri.sh", "cam", "default")
        await eventually(
            lambda: class_names(api) == ["cam-202406.configuration.akri.sh"], "the newcomer's"
        )
        assert extended_names(api) == {"akri.sh/cam-202406": ["cam-202406.configuration.akri.sh"]}
