"""Issue 23 item 2, the device plugin manager's last guard: even when the ownership rules let
both through (here forced: an Instance written by another agent before this one saw the
Configuration, say), no configuration-level plugin registers a resource name an Instance of
this node has — instance names win — and it comes back once that Instance is gone."""

from __future__ import annotations

import pytest

from agent.core.model.instance import Instance
from agent.node.discovery.ownership import Ownership
from tests.doubles.kubelet_double import KubeletDouble
from tests.doubles.memory_store import MemoryStore
from tests.node.deviceplugin.support import NODE, Factory

NAME = "akri.sh/cam-17ff2a"


def instance(name: str, configuration: str) -> Instance:
    return Instance(
        name=name,
        configuration_name=configuration,
        capacity=2,
        nodes=(NODE,),
        device_usage={f"{name}-0": "", f"{name}-1": ""},
    )


async def test_no_configuration_level_plugin_takes_an_instance_s_name(
    store: MemoryStore,
    kubelet: KubeletDouble,
    make_manager: Factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the rules of ownership.py would refuse Configuration cam-17ff2a; force them open
    monkeypatch.setattr(Ownership, "owns", lambda self, key: True)
    manager = await make_manager()
    store.put(instance("cam-17ff2a", "cam"))  # cam's Instance: akri.sh/cam-17ff2a
    store.put(instance("cam-17ff2a-abcdef", "cam-17ff2a"))  # its CL: akri.sh/cam-17ff2a
    await kubelet.wait_registered(NAME, timeout=20)
    await kubelet.wait_registered("akri.sh/cam", timeout=20)
    await kubelet.wait_registered("akri.sh/cam-17ff2a-abcdef", timeout=20)
    # the sync that started cam-17ff2a-abcdef's plugin decided about its CL plugin too
    assert "cam-17ff2a" not in manager.configuration_plugins
    assert manager.refused_names == {NAME: "cam-17ff2a"}
    assert len([r for r in kubelet.all_registrations if r.resource_name == NAME]) == 1
    await kubelet.wait_for(
        lambda: set(kubelet.devices(NAME)) == {"cam-17ff2a-0", "cam-17ff2a-1"},
        20,
        "the Instance's two slots listed under the name",
    )
    # the Instance goes: now the configuration-level plugin may have the name
    before = kubelet.all_registrations[-1].time
    store.remove("cam-17ff2a")
    await kubelet.wait_registered(NAME, timeout=20, after=before)
    assert "cam-17ff2a" in manager.configuration_plugins
    assert manager.refused_names == {}
