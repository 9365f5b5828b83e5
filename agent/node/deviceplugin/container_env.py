"""What a container gets for its devices: env vars, device nodes, mounts.

Env vars follow Akri (PR #709/#710): every property ``K=V`` of an Instance
(``brokerProperties``: device properties overlaid with the Configuration's) is set twice, as
``K`` and as ``K_<DIGEST>`` where DIGEST is the Instance's 6-hex digest upper-cased, so a
container with several devices can tell them apart.

Differences, documented in docs/device-plugins.md:

* names that are not valid environment variable names (``[A-Za-z_][A-Za-z0-9_]*``) are
  sanitised: every other character becomes ``_`` and a leading digit gets a ``_`` prefix
  (``USB_RESOURCE_AKRI_SH_UDEV-USB`` → ``USB_RESOURCE_AKRI_SH_UDEV_USB``);
* with several devices, the unsuffixed ``K`` is deterministic: the Instance whose name sorts
  first wins (Akri's is arbitrary).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agent.core.model.instance import Instance
from agent.core.model.naming import digest_of_instance
from discovery_handlers.base import Device, DeviceSpec, Mount

_INVALID = re.compile(r"[^A-Za-z0-9_]")


def env_name(name: str) -> str:
    """A valid environment variable name for ``name``."""
    cleaned = _INVALID.sub("_", name) or "_"
    return f"_{cleaned}" if cleaned[0].isdigit() else cleaned


@dataclass
class ContainerEdits:
    """Everything one container gets, merged over all its devices."""

    envs: dict[str, str] = field(default_factory=dict)
    device_specs: list[DeviceSpec] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)


def container_edits(
    instances: Sequence[Instance], devices: Mapping[str, Device | None]
) -> ContainerEdits:
    """Merge env vars, device nodes and mounts of ``instances`` (deduplicated, deterministic)."""
    edits = ContainerEdits()
    seen_specs: set[str] = set()
    seen_mounts: set[str] = set()
    for instance in sorted({i.name: i for i in instances}.values(), key=lambda i: i.name):
        suffix = digest_of_instance(instance.name).upper()
        for key, value in sorted(instance.broker_properties.items()):
            name = env_name(key)
            edits.envs.setdefault(name, value)
            edits.envs[f"{name}_{suffix}"] = value
        device = devices.get(instance.name)
        if device is None:
            continue
        for spec in device.device_specs:
            if spec.container_path not in seen_specs:
                seen_specs.add(spec.container_path)
                edits.device_specs.append(spec)
        for mount in device.mounts:
            if mount.container_path not in seen_mounts:
                seen_mounts.add(mount.container_path)
                edits.mounts.append(mount)
    return edits
