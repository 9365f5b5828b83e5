"""Turn matched udev devices into Akri devices (pure).

Without ``groupRecursive`` every matched device is one Akri device. With it, a matched device
whose ancestor also matched joins that ancestor's group, so a group is the topmost matched
device plus all its matched descendants (Akri PR #564).

Per device (Akri-compatible): id = devpath (of the topmost device when grouped); properties
``UDEV_DEVPATH`` and ``UDEV_DEVNODE`` (only if the device has a node) — or, grouped,
``UDEV_DEVNODE_<i>`` for each member with a node; one :class:`DeviceSpec` per device node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from discovery_handlers.base import Device, DeviceSpec

DEVPATH_PROPERTY = "UDEV_DEVPATH"
DEVNODE_PROPERTY = "UDEV_DEVNODE"


@dataclass(frozen=True, order=True)
class Found:
    """A udev device that matched a rule: its devpath and device node (if any)."""

    devpath: str
    devnode: str | None = None


def is_ancestor(ancestor: str, devpath: str) -> bool:
    """True if ``ancestor`` is a strict ancestor of ``devpath`` in the sysfs tree."""
    return devpath.startswith(ancestor.rstrip("/") + "/")


def group(found: Iterable[Found]) -> dict[str, list[Found]]:
    """Groups keyed by the devpath of their topmost matched device; members sorted."""
    groups: dict[str, list[Found]] = {}
    for item in sorted(set(found)):  # sorted: an ancestor comes before its descendants
        parts = item.devpath.rstrip("/").split("/")
        top = next(
            (
                prefix
                for prefix in ("/".join(parts[:length]) for length in range(1, len(parts)))
                if prefix in groups
            ),
            None,
        )
        if top is None:
            groups.setdefault(item.devpath, []).append(item)
        else:
            groups[top].append(item)
    return groups


def _spec(devnode: str, permissions: str) -> DeviceSpec:
    return DeviceSpec(container_path=devnode, host_path=devnode, permissions=permissions)


def build_devices(
    found: Iterable[Found], *, group_recursive: bool, permissions: str
) -> list[Device]:
    """The Akri device list for the matched devices, sorted by id."""
    devices: list[Device] = []
    if not group_recursive:
        for item in sorted(set(found)):
            properties = {DEVPATH_PROPERTY: item.devpath}
            specs: tuple[DeviceSpec, ...] = ()
            if item.devnode:
                properties[DEVNODE_PROPERTY] = item.devnode
                specs = (_spec(item.devnode, permissions),)
            devices.append(Device(id=item.devpath, properties=properties, device_specs=specs))
        return devices
    for top, members in sorted(group(found).items()):
        properties = {DEVPATH_PROPERTY: top}
        spec_list: list[DeviceSpec] = []
        nodes = [m.devnode for m in members if m.devnode]
        for index, node in enumerate(dict.fromkeys(nodes)):
            properties[f"{DEVNODE_PROPERTY}_{index}"] = node
            spec_list.append(_spec(node, permissions))
        devices.append(Device(id=top, properties=properties, device_specs=tuple(spec_list)))
    return devices
