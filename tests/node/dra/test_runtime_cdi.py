"""Deliver where it works (DESIGN.md invariant 9, issue 33.4): ``--extended-resources auto``
serves ``akri.sh/*`` through DRA only on a node whose runtime is known to inject CDI, says which
path and why (log, Event on the Node, metric, ``akri status``), lets the operator say otherwise
(the Node label ``akri.sh/runtime-cdi``), warns for explicit claims prepared on a runtime
without CDI, and keeps a device-plugin node's slots out of the extended-resource DeviceClasses
(the window before kubelet posts a freshly registered plugin's resource)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from agent.core.deviceclasses import configuration_class, instance_class
from agent.core.kube import KubeClient
from agent.core.model.keys import ObjectKey
from agent.node.dra.extended import (
    DEVICE_PLUGINS,
    DRA,
    CdiNotice,
    choose_path,
    observed_paths,
    paths_table,
    runtime_cdi,
)
from agent.node.dra.slices import (
    PATH_LABEL,
    USABLE,
    SlotState,
    desired_pools,
    extended_eligibility,
    instance_devices,
)
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import (
    AllocationError,
    allocate_claim,
    class_selector,
    create_claim,
    schedule_extended_resources,
)
from tests.harness.dp_nodes import api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.dra.test_dra_extended_resources import create_pod
from tests.node.dra.test_dra_units import inst
from tests.node.dra.test_extended_path import KEPT, node_object

CAM = ObjectKey("default", "cam")
SLICES = "resourceslices.resource.k8s.io"


# --------------------------------------------------------------------------- the runtimes


@pytest.mark.parametrize(
    ("runtime", "applies", "why"),
    [
        ("containerd://1.6.20", False, "containerd 1.6.20 has no CDI support"),
        ("containerd://1.7.1", False, "only from annotations"),
        ("containerd://1.7.24", None, "only with enable_cdi = true, off by default"),
        ("containerd://1.7.27-k3s1", None, "enable_cdi"),
        ("containerd://2.1.0", True, "injects CDI (enable_cdi is on by default)"),
        ("containerd://v2.0.5", True, "containerd 2.0.5 injects CDI"),
        ("cri-o://1.31.0", True, "cri-o 1.31.0 injects CDI (always on)"),
        ("cri-o://1.27.4", False, "1.28 is needed"),
        ("docker://28.2.0", None, "docker 28.2.0 is not known to inject CDI"),
        ("", None, "not known"),
        (None, None, "not known"),
    ],
)
def test_which_runtimes_inject_cdi(runtime: str | None, applies: bool | None, why: str) -> None:
    found = runtime_cdi(runtime)
    assert found.applies is applies and why in found.why, found


def test_the_operators_label_wins() -> None:
    yes = runtime_cdi("containerd://1.7.24", {"akri.sh/runtime-cdi": "true"})
    assert yes.applies is True and "labelled akri.sh/runtime-cdi=true" in yes.why
    no = runtime_cdi("containerd://2.1.0", {"akri.sh/runtime-cdi": "False"})
    assert no.applies is False
    assert runtime_cdi("containerd://1.7.24", {"akri.sh/runtime-cdi": "maybe"}).applies is None


UPGRADE = "upgrade the runtime (containerd ≥ 1.7.2 with enable_cdi = true"
TURN_ON = "turn CDI on in the runtime and label the Node akri.sh/runtime-cdi=true"


@pytest.mark.parametrize(
    ("runtime", "labels", "advice"),
    [
        # no CDI however configured: only an upgrade helps (acceptance F3: told to turn it on)
        ("containerd://1.6.20", {}, UPGRADE),
        ("containerd://1.7.1", {}, UPGRADE),
        ("containerd://1.7.0", {"akri.sh/runtime-cdi": "false"}, UPGRADE),
        ("cri-o://1.27.4", {}, UPGRADE),
        # CDI is there, off by default, or the runtime is not known: the setting and the label
        ("containerd://1.7.24", {}, TURN_ON),
        ("containerd://2.1.0", {"akri.sh/runtime-cdi": "false"}, TURN_ON),
        ("docker://28.2.0", {}, TURN_ON),
        ("", {}, TURN_ON),
    ],
)
def test_the_runtime_without_cdi_warning_advises_what_the_runtime_can_do(
    runtime: str, labels: dict[str, str], advice: str
) -> None:
    message = CdiNotice(cast(KubeClient, None), "node-a", runtime_cdi(runtime, labels)).message()
    assert message.startswith("node node-a: ") and advice in message, message
    assert "Use the device plugins' limits akri.sh/<name> on this node, or " in message
    other = TURN_ON if advice == UPGRADE else UPGRADE
    assert other not in message, message


@pytest.mark.parametrize(
    ("mode", "runtime", "path", "why", "warned"),
    [
        ("auto", "containerd://1.6.20", DEVICE_PLUGINS, "no CDI support", False),
        ("auto", "containerd://1.7.24", DEVICE_PLUGINS, "enable_cdi = true", False),
        ("auto", "containerd://2.1.0", DRA, "injects CDI", False),
        ("auto", "cri-o://1.31.0", DRA, "injects CDI", False),
        ("auto", None, DEVICE_PLUGINS, "container runtime is unknown", False),
        ("dra", "containerd://1.6.20", DRA, "forced", True),
        ("dra", "containerd://2.1.0", DRA, "forced", False),
        ("device-plugins", "containerd://2.1.0", DEVICE_PLUGINS, "forced", False),
    ],
)
def test_the_path_follows_the_runtime(
    mode: str, runtime: str | None, path: str, why: str, warned: bool
) -> None:
    found = runtime_cdi(runtime) if runtime is not None else None
    decision = choose_path(mode, dra_enabled=True, kubelet="v1.36.2", classes=KEPT, runtime=found)
    assert decision.path == path and why in decision.reason, decision
    assert bool(decision.warning) is warned
    if warned:
        assert "may start without their device" in decision.warning


# --------------------------------------------------------------------------- slots and classes


def test_slots_carry_their_eligibility_and_the_classes_require_it() -> None:
    local = inst("cam-aaaaaa", False, ("n1",), 1).evolve(configuration_name="cam")
    by_config = class_selector(configuration_class(CAM))
    by_instance = class_selector(instance_class(CAM, "cam-aaaaaa"))
    slice_ = {"spec": {"driver": "akri.sh"}}
    (eligible,) = instance_devices(local, SlotState(USABLE, extended=True))
    (excluded,) = instance_devices(
        local, SlotState(USABLE, extended=False, configuration_extended=False)
    )
    (instance_only,) = instance_devices(
        local, SlotState(USABLE, extended=True, configuration_extended=False)
    )
    attributes = eligible["attributes"]
    assert attributes["extendedResources"] == {"bool": True}
    assert attributes["configurationExtendedResources"] == {"bool": True}
    assert excluded["attributes"]["extendedResources"] == {"bool": False}
    assert excluded["attributes"]["configurationExtendedResources"] == {"bool": False}
    for select in (by_config, by_instance):
        assert select(eligible, slice_) and not select(excluded, slice_)
    # each class asks for its own name's attribute
    assert by_instance(instance_only, slice_) and not by_config(instance_only, slice_)
    # a slot of an older agent, without the attributes: no match, and no CEL runtime error
    older = {**eligible, "attributes": {
        k: v for k, v in attributes.items() if "xtendedResources" not in k}}  # fmt: skip
    assert not by_config(older, slice_) and not by_instance(older, slice_)


def test_a_shared_pool_serves_extended_resources_only_if_all_its_nodes_do() -> None:
    shared = inst("cam-bbbbbb", True, ("n1", "n2"), 1)
    local = inst("cam-aaaaaa", False, ("n1",), 1)

    def extended(paths: dict[str, str]) -> dict[str, bool]:
        pools = desired_pools(
            [shared, local], "n1", (), extended_of=extended_eligibility([shared, local], paths)
        )
        return {p.name: p.devices[0]["attributes"]["extendedResources"]["bool"] for p in pools}

    assert extended({"n1": DRA, "n2": DRA}) == {"n1": True, "cam-bbbbbb": True}
    # n2 serves akri.sh/* through device plugins: the shared slot would reach it through DRA
    assert extended({"n1": DRA, "n2": DEVICE_PLUGINS}) == {"n1": True, "cam-bbbbbb": False}
    # n2 has said nothing (no agent, DRA off, not started): not eligible
    assert extended({"n1": DRA}) == {"n1": True, "cam-bbbbbb": False}
    assert extended({"n1": DEVICE_PLUGINS, "n2": DRA}) == {"n1": False, "cam-bbbbbb": False}


# --------------------------------------------------------------------------- against the doubles


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def install_classes(api: ApiServerDouble) -> None:
    api.create(configuration_class(CAM))
    api.create(instance_class(CAM, "cam-8120fe"))


def node_events(api: ApiServerDouble, kind: str) -> list[dict[str, Any]]:
    return [e for e in api.list("events") if e["involvedObject"].get("kind") == kind]


async def test_containerd_1_7_keeps_device_plugins_and_says_why(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    node_object(api, "v1.36.2", "containerd://1.7.24")
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        await node.kubelet.wait_registered("akri.sh/cam-8120fe")
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        assert "enable_cdi = true, off by default" in node.agent.extended_resource_reason
        assert "on node node-a: device plugins — containerd 1.7.24" in caplog.text
        (event,) = node_events(api, "Node")
        assert event["reason"] == "ExtendedResourcePath" and event["type"] == "Normal"
        assert "containerd 1.7.24 injects CDI only with enable_cdi = true" in event["message"]
        metrics = node.agent.metrics_text().decode()
        assert 'akri_runtime_cdi{cdi="unknown",runtime="containerd://1.7.24"} 1.0' in metrics

        # its local slices say so, and its slots are out of the extended-resource classes
        def local_slices() -> list[dict[str, Any]]:
            return [s for s in api.list(SLICES) if s["spec"].get("nodeName") == "node-a"]

        await eventually(lambda: local_slices() != [], within=10, what="local slice")
        assert {s["metadata"]["labels"][PATH_LABEL] for s in local_slices()} == {DEVICE_PLUGINS}
        paths = observed_paths(api.list("nodes"), api.list(SLICES))
        assert paths == {"node-a": DEVICE_PLUGINS}
        assert "containerd://1.7.24 (unknown)" in paths_table(paths)
    finally:
        await node.stop()


async def test_the_window_before_kubelet_posts_the_resource_goes_to_no_one_but_the_plugin(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """The real cluster's window: a DeviceClass carries extendedResourceName and the node's
    kubelet has not yet posted the freshly registered device plugin's resource (allocatable
    absent). The scheduler would satisfy the pod's limit through DRA from this node's slices
    and the plugin's Allocate would never be called. Its slots no longer match the classes."""
    node_object(api, "v1.36.2", "containerd://1.6.20")
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        await node.kubelet.wait_registered("akri.sh/cam-8120fe")
        assert node.agent.extended_resource_path == DEVICE_PLUGINS
        await eventually(lambda: any(s["spec"].get("devices") for s in api.list(SLICES)), within=10)
        create_pod(api, "p1", {"akri.sh/cam-8120fe": "1"})
        # the Node object has no allocatable yet (kubelet has not posted it)
        with pytest.raises(AllocationError, match="rejected by the selector"):
            schedule_extended_resources(api, "default", "p1", "node-a")
        # an explicit claim of the generic class still gets the slot
        create_claim(api, "default", "explicit")
        allocate_claim(api, "default", "explicit", "node-a")
    finally:
        await node.stop()


async def test_an_explicit_claim_on_a_runtime_without_cdi_is_warned_about(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node_object(api, "v1.36.2", "containerd://1.6.20")
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    try:
        await kubelet.start()
        await kubelet.wait_for_registration("akri.sh", timeout=10)
        await eventually(lambda: any(s["spec"].get("devices") for s in api.list(SLICES)), within=10)
        uids = {}
        for name in ("c1", "c2"):
            uids[name] = create_claim(api, "default", name)["metadata"]["uid"]
            allocate_claim(api, "default", name, "node-a", pod_name=f"p-{name}", pod_uid=name)
            await kubelet.prepare(name, [("default", uids[name], name)])

        def warnings() -> list[dict[str, Any]]:
            return [
                e for e in node_events(api, "ResourceClaim") if e["reason"] == "RuntimeWithoutCDI"
            ]

        await eventually(lambda: len(warnings()) == 2, within=10, what="one Event per claim")
        assert {e["involvedObject"]["name"] for e in warnings()} == {"c1", "c2"}
        assert all(e["type"] == "Warning" for e in warnings())
        assert "containerd 1.6.20 has no CDI support" in warnings()[0]["message"]
        assert caplog.text.count("prepared on a runtime without known CDI support") == 1
        # a prepare repeated (kubelet retries, a restart): no second Event for the claim
        assert node.agent.dra is not None and node.agent.dra.claim_status is not None
        (notice,) = node.agent.dra.claim_status.listeners
        assert node.agent.dra_state is not None
        notice(node.agent.dra_state.checkpoint.claims[uids["c1"]])
        await notice.__self__.wait()  # type: ignore[attr-defined]
        assert len(warnings()) == 2
        assert len(api_instances(api)) == 1  # prepared all the same: the slot is held
    finally:
        await kubelet.stop()
        await node.stop()


async def test_the_operators_label_puts_a_containerd_1_7_on_dra(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    node_object(api, "v1.36.2", "containerd://1.7.24", {"akri.sh/runtime-cdi": "true"})
    install_classes(api)
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    node = await start_dp_node(api, "node-a", tmp_path, dra=True)
    try:
        await eventually(lambda: "cam-8120fe" in api_instances(api))
        assert node.agent.extended_resource_path == DRA
        assert "labelled akri.sh/runtime-cdi=true" in node.agent.extended_resource_reason
        assert node.kubelet.resources() == []
    finally:
        await node.stop()
