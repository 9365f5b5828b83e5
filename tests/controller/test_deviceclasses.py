"""The controller owns the DeviceClasses that serve ``akri.sh/<name>`` limits through DRA
(KEP-5004): created for owned Configurations and their Instances, removed with them, another
namespace's Configuration of the same name gets none, an operator's class is left alone."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from agent.core.deviceclasses import InstanceRef, name_owners
from agent.core.model.keys import ObjectKey
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
    configs = [(a, "2026-01-02T00:00:00Z"), (b, "2026-01-01T00:00:00Z")]
    assert name_owners(configs, [])(b)  # the oldest
    owns = name_owners(configs, [InstanceRef("cam-111111", a)])
    assert owns(a) and not owns(b)  # the only one with Instances keeps it


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
