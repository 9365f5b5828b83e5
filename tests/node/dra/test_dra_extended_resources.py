"""Extended resources through DRA (KEP-5004): the DeviceClasses for Configurations and
Instances (agent/core/deviceclasses.py), the scheduler emulator satisfying ``limits:
{akri.sh/<name>: 1}`` from the agent's ResourceSlices, and the DRA kubelet double preparing
the special claim the way kubelet does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.deviceclasses import (
    LABEL_SELECTOR,
    InstanceRef,
    class_changes,
    class_name,
    configuration_class,
    desired_device_classes,
    instance_class,
    keeps_extended_resource_name,
)
from agent.core.model.device_usage import ClaimUsage, parse_usage
from agent.core.model.keys import ObjectKey
from agent.node.dra.slices import device_attributes
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.apiserver.resource_validation import validate_resource
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import (
    AllocationError,
    class_selector,
    schedule_extended_resources,
)
from tests.harness.dp_nodes import api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_units import inst

CAM = ObjectKey("default", "cam")
SLICES = "resourceslices.resource.k8s.io"


# --------------------------------------------------------------------------- pure classes


def test_classes_of_a_configuration_and_its_instances() -> None:
    config = configuration_class(CAM)
    assert config["metadata"]["name"] == "cam.configuration.akri.sh"
    assert config["spec"]["extendedResourceName"] == "akri.sh/cam"
    assert config["spec"]["selectors"] == [
        {
            "cel": {
                "expression": "device.driver == 'akri.sh' && "
                "device.attributes['akri.sh'].configuration == 'cam' && "
                "'configurationExtendedResources' in device.attributes['akri.sh'] && "
                "device.attributes['akri.sh'].configurationExtendedResources"
            }
        }
    ]
    instance = instance_class(CAM, "cam-8120fe")
    assert instance["spec"]["selectors"][0]["cel"]["expression"].endswith(
        "'extendedResources' in device.attributes['akri.sh'] && "
        "device.attributes['akri.sh'].extendedResources"
    )
    assert instance["metadata"]["name"] == "cam-8120fe.instance.akri.sh"
    assert instance["spec"]["extendedResourceName"] == "akri.sh/cam-8120fe"
    assert instance["metadata"]["labels"]["akri.sh/configuration"] == "cam"
    for device_class in (config, instance):  # the API double's port of ValidateDeviceClass
        assert validate_resource("resource.k8s.io", "deviceclasses", device_class, None) == []


def test_selectors_pick_exactly_their_devices() -> None:
    mine = inst("cams-aaaaaa", False, ("n1",))
    other = inst("other-bbbbbb", False, ("n1",)).evolve(configuration_name="other")
    slice_ = {"spec": {"driver": "akri.sh"}}
    device = {"attributes": device_attributes(mine, 0)}
    stranger = {"attributes": device_attributes(other, 0)}
    by_config = class_selector(configuration_class(ObjectKey("default", "cams")))
    assert by_config(device, slice_) and not by_config(stranger, slice_)
    by_instance = class_selector(instance_class(ObjectKey("default", "cams"), "cams-aaaaaa"))
    assert by_instance(device, slice_) and not by_instance(stranger, slice_)
    assert not by_instance(device, {"spec": {"driver": "gpu.example.com"}})


def test_names_unique_by_construction_and_fit() -> None:
    long = "c" * 250
    fitted = class_name(long, ".configuration.akri.sh")
    assert len(fitted) <= 253 and fitted.endswith(".configuration.akri.sh")
    assert fitted != class_name("c" * 249, ".configuration.akri.sh")
    # a Configuration named like an Instance's class prefix cannot collide: the suffix differs
    assert class_name("x.instance.akri.sh", ".configuration.akri.sh") != class_name(
        "x", ".instance.akri.sh"
    )
    # a quote in a name cannot end the CEL string literal early
    expression = configuration_class(ObjectKey("d", "it's"))["spec"]["selectors"][0]["cel"]
    assert "configuration == 'it\\'s' &&" in expression["expression"]


def test_only_the_owner_namespace_gets_classes() -> None:
    owner, other = ObjectKey("a", "cam"), ObjectKey("b", "cam")
    classes = desired_device_classes(
        [owner, other],
        [InstanceRef("cam-111111", owner), InstanceRef("cam-222222", other)],
        owns=lambda key: key.namespace == "a",
    )
    assert sorted(classes) == ["cam-111111.instance.akri.sh", "cam.configuration.akri.sh"]
    assert (
        classes["cam.configuration.akri.sh"]["metadata"]["labels"][
            "akri.sh/configuration-namespace"
        ]
        == "a"
    )


def test_changes_create_update_delete_and_leave_foreign_classes() -> None:
    wanted = desired_device_classes([CAM], [InstanceRef("cam-8120fe", CAM)], lambda k: True)
    stale = {**configuration_class(CAM), "spec": {"selectors": [], "extendedResourceName": "x"}}
    stale["metadata"] = {**stale["metadata"], "resourceVersion": "7"}
    gone = instance_class(CAM, "cam-999999")
    foreign = {"metadata": {"name": "cam-8120fe.instance.akri.sh"}, "spec": {}}  # operator's
    changes = class_changes(wanted, [stale, gone, foreign])
    assert changes.create == ()
    assert [c["metadata"]["name"] for c in changes.update] == ["cam.configuration.akri.sh"]
    assert changes.update[0]["metadata"]["resourceVersion"] == "7"
    assert [c["metadata"]["name"] for c in changes.delete] == ["cam-999999.instance.akri.sh"]
    # an API server that dropped extendedResourceName (gate off): no endless rewrite
    dropped = {**configuration_class(CAM)}
    dropped["spec"] = {k: v for k, v in dropped["spec"].items() if k != "extendedResourceName"}
    assert class_changes({"cam.configuration.akri.sh": configuration_class(CAM)}, [dropped]) == (
        class_changes({}, [])
    )
    assert not keeps_extended_resource_name(configuration_class(CAM), dropped)
    assert keeps_extended_resource_name(configuration_class(CAM), configuration_class(CAM))
    assert LABEL_SELECTOR == "app.kubernetes.io/managed-by=akri-controller"


# --------------------------------------------------------------------------- end to end


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def create_pod(api: ApiServerDouble, name: str, limits: dict[str, str]) -> dict[str, Any]:
    return api.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeName": "node-a",
                "containers": [
                    {"name": "app", "image": "busybox", "resources": {"limits": limits}},
                    {"name": "side", "image": "busybox"},
                ],
            },
        }
    )


def install_classes(api: ApiServerDouble) -> None:
    for device_class in desired_device_classes(
        [CAM], [InstanceRef("cam-8120fe", CAM)], lambda k: True
    ).values():
        api.create(device_class)


async def test_limits_served_from_slices_and_prepared_like_kubelet(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    from tests.node.dra.test_extended_path import node_object

    node_object(api, "v1.36.2")  # kubelet 1.36, containerd 2.1: the DRA path
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    try:
        await kubelet.start()
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        await eventually(lambda: any(s["spec"].get("devices") for s in api.list(SLICES)), within=10)
        pod = create_pod(api, "p1", {"akri.sh/cam-8120fe": "1"})  # instance-level, unchanged
        claim = schedule_extended_resources(api, "default", "p1", "node-a")
        assert claim is not None
        meta = claim["metadata"]
        assert meta["name"].startswith("p1-extended-resources-")
        assert meta["annotations"] == {"resource.kubernetes.io/extended-resource-claim": "true"}
        assert meta["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
        (request,) = claim["spec"]["devices"]["requests"]
        assert request["name"] == "container-0-request-0"
        assert request["exactly"]["deviceClassName"] == "cam-8120fe.instance.akri.sh"
        pod = api.get("pods", "p1", "default") or {}
        assert pod["status"]["extendedResourceClaimStatus"] == {
            "resourceClaimName": meta["name"],
            "requestMappings": [
                {
                    "containerName": "app",
                    "resourceName": "akri.sh/cam-8120fe",
                    "requestName": "container-0-request-0",
                }
            ],
        }
        await kubelet.prepare_pod(pod)
        usage = api_instances(api)["cam-8120fe"].device_usage
        holders = [
            parsed.claim_uid
            for value in usage.values()
            if value and isinstance(parsed := parse_usage(value), ClaimUsage)
        ]
        assert holders == [meta["uid"]]  # one slot of the one pool, through the DRA ledger
        (cdi_id,) = kubelet.container_cdi_devices(pod, "app")
        assert kubelet.container_cdi_devices(pod, "side") == []
        # the env a device-plugin Allocate gives reaches the container through CDI
        (spec_file,) = node.cdi_dir.glob("*.json")
        cdi = json.loads(spec_file.read_text())
        device = next(d for d in cdi["devices"] if cdi_id.endswith("=" + d["name"]))
        assert "DEBUG_ECHO_DESCRIPTION=foo0" in device["containerEdits"]["env"]

        # configuration-level: any device of the Configuration (the other free slot)
        create_pod(api, "p2", {"akri.sh/cam": "1"})
        claim2 = schedule_extended_resources(api, "default", "p2", "node-a")
        assert claim2 is not None
        assert (
            claim2["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"]
            == "cam.configuration.akri.sh"
        )
        await kubelet.prepare_pod(api.get("pods", "p2", "default") or {})
        create_pod(api, "p3", {"akri.sh/cam": "1"})
        with pytest.raises(AllocationError):  # both slots are held
            schedule_extended_resources(api, "default", "p3", "node-a")
        assert len([c for c in api.list("resourceclaims.resource.k8s.io")]) == 2  # p3's removed
    finally:
        await kubelet.stop()
        await node.stop()


def test_a_node_advertising_the_resource_keeps_the_device_plugin(api: ApiServerDouble) -> None:
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "node-a"},
        }
    )
    node = api.get("nodes", "node-a") or {}
    api.store.update(
        api.resource("nodes"),
        "v1",
        None,
        "node-a",
        {
            **node,
            "status": {"allocatable": {"akri.sh/cam": "2"}, "capacity": {"akri.sh/cam": "2"}},
        },
        subresource="status",
    )
    install_classes(api)
    create_pod(api, "p1", {"akri.sh/cam": "1"})
    assert schedule_extended_resources(api, "default", "p1", "node-a") is None
    create_pod(api, "p2", {"example.com/unknown": "1"})
    with pytest.raises(AllocationError, match="no DeviceClass backs it"):
        schedule_extended_resources(api, "default", "p2", "node-a")
