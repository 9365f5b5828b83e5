"""Helpers the device-plugin manager tests share: a discovery source, Instances and resource
names of a test node, and a wait for kubelet registrations."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from agent.core.model.instance import Instance
from agent.node.deviceplugin.manager import DevicePluginManager
from discovery_handlers.base import Device
from tests.doubles.kubelet_double import KubeletDouble

NODE = "n1"
CL = "akri.sh/cam"
Factory = Callable[..., Awaitable[DevicePluginManager]]


class Source:
    def __init__(self) -> None:
        self.offline: set[str] = set()

    def offline_instances(self) -> frozenset[str]:
        return frozenset(self.offline)

    def device_for(self, instance: str) -> Device | None:
        return None


def instance(index: int, configuration: str = "cam", capacity: int = 2) -> Instance:
    name = f"{configuration}-{index:06d}"
    return Instance(
        name=name,
        configuration_name=configuration,
        capacity=capacity,
        nodes=(NODE,),
        device_usage={f"{name}-{s}": "" for s in range(capacity)},
    )


def il(index: int) -> str:
    return f"akri.sh/cam-{index:06d}"


async def registered(
    kubelet: KubeletDouble, resources: Sequence[str], after: float | None = None
) -> None:
    for resource in resources:
        # generous: a loaded machine may take seconds; an idle one returns in milliseconds
        await kubelet.wait_registered(resource, timeout=60, after=after)
