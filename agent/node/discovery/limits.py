"""Bounds on what a discovery handler may report (pure checks).

Every full device list a handler reports is checked before the agent acts on it. A report over
a bound is refused as a whole — like a handler failure, the last accepted list stays in force
— with a message saying which bound and by how much, so a runaway handler (550,000 devices
from a 10 MB Configuration file took the agent down once) costs a log line, not the node.
The bounds are far above what a real device (or a real node) has, and keep every Instance
well inside the API server's 1.5 MiB object limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.core.bounded_yaml import brief
from discovery_handlers.base import Device

MAX_DEVICES = 10_000
MAX_ID_BYTES = 4096
MAX_PROPERTIES = 128
MAX_PROPERTY_NAME = 256
MAX_PROPERTIES_BYTES = 256 * 1024  # all of one device's names and values
MAX_MOUNTS = 64  # mounts and device nodes each


class ReportRejectedError(ValueError):
    """A device list over one of the bounds above."""


def check_report(devices: Sequence[Device]) -> None:
    """Raise :class:`ReportRejectedError` naming the first bound ``devices`` break."""
    if len(devices) > MAX_DEVICES:
        raise ReportRejectedError(
            f"{len(devices)} devices in one report, more than the limit of {MAX_DEVICES}"
        )
    for device in devices:
        size = len(device.id.encode("utf-8", "surrogatepass"))
        if not device.id or size > MAX_ID_BYTES:
            raise ReportRejectedError(
                f"device id {brief(device.id)} must have 1 to {MAX_ID_BYTES} bytes, has {size}"
            )
        if len(device.properties) > MAX_PROPERTIES:
            raise ReportRejectedError(
                f"device {brief(device.id)} has {len(device.properties)} properties, more "
                f"than the limit of {MAX_PROPERTIES}"
            )
        total = 0
        for name, value in device.properties.items():
            if not name or len(name) > MAX_PROPERTY_NAME:
                raise ReportRejectedError(
                    f"device {brief(device.id)}: property name {brief(name)} must have 1 to "
                    f"{MAX_PROPERTY_NAME} characters"
                )
            total += len(name.encode("utf-8", "surrogatepass"))
            total += len(value.encode("utf-8", "surrogatepass"))
        if total > MAX_PROPERTIES_BYTES:
            raise ReportRejectedError(
                f"device {brief(device.id)}: its properties have {total} bytes, more than the "
                f"limit of {MAX_PROPERTIES_BYTES}"
            )
        if len(device.mounts) > MAX_MOUNTS or len(device.device_specs) > MAX_MOUNTS:
            raise ReportRejectedError(
                f"device {brief(device.id)} has more than {MAX_MOUNTS} mounts or device nodes"
            )
