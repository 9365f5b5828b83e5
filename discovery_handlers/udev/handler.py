"""``udev``: Akri's udev discovery handler, event-driven.

At start every device in sysfs is matched against the Configuration's ``udevRules``; then a
netlink uevent monitor (source ``udev`` when udevd runs, so its database is up to date;
source ``kernel`` when it does not) reports add/change/move/remove/bind/unbind, and only the
affected subtree of sysfs is re-evaluated. A new full device list is yielded whenever the
result changes — no polling. If the kernel drops events (receive buffer overflow) the whole of
sysfs is scanned again.

Devices are local to the node (``shared = False``). See ``docs/udev.md``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

from discovery_handlers.base import Device, DiscoveryHandler, DiscoveryProperties
from discovery_handlers.udev.details import NAME, UdevDetails, parse_details, warnings
from discovery_handlers.udev.devices import Found, build_devices

log = logging.getLogger("discovery_handlers.udev")

SOURCES = ("udev", "kernel")


class UdevHandler(DiscoveryHandler):
    """Discovers local devices that match udev rules.

    ``monitor_source`` forces the netlink source (``"udev"`` or ``"kernel"``); by default it is
    ``"udev"`` if ``udevd_control`` exists (udevd is running) and ``"kernel"`` otherwise.
    """

    name = NAME

    def __init__(
        self,
        *,
        monitor_source: str | None = None,
        udevd_control: Path = Path("/run/udev/control"),
    ) -> None:
        if monitor_source is not None and monitor_source not in SOURCES:
            raise ValueError(f"monitor_source must be one of {SOURCES}, got {monitor_source!r}")
        self.monitor_source = monitor_source
        self.udevd_control = udevd_control

    @property
    def shared(self) -> bool:
        return False

    def validate(self, discovery_details: str) -> Sequence[str]:
        parse_details(discovery_details)
        return warnings(discovery_details)

    def source(self) -> str:
        """The netlink source to use now."""
        if self.monitor_source is not None:
            return self.monitor_source
        return "udev" if self.udevd_control.exists() else "kernel"

    def _devices(self, details: UdevDetails, found: Mapping[str, Found]) -> list[Device]:
        return build_devices(
            found.values(),
            group_recursive=details.group_recursive,
            permissions=details.permissions,
        )

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        from discovery_handlers.udev.watcher import UdevWatcher

        details = parse_details(discovery_details)
        source = self.source()
        watcher = UdevWatcher(details.rules, source)
        loop = asyncio.get_running_loop()
        fd = watcher.fileno()
        readable = asyncio.Event()

        def on_readable() -> None:
            # one wake-up per batch: the reader is re-armed after the batch is processed
            loop.remove_reader(fd)
            readable.set()

        try:
            await asyncio.to_thread(watcher.full_scan)
            last = self._devices(details, watcher.found)
            log.info(
                "udev: %d matching device(s) at start; following %s uevents", len(last), source
            )
            yield last
            while True:
                loop.add_reader(fd, on_readable)
                await readable.wait()
                readable.clear()
                events, lost = watcher.drain()
                if lost:
                    await asyncio.to_thread(watcher.full_scan)
                elif events:
                    log.debug("udev: %s", [(e.action, e.devpath) for e in events])
                    await asyncio.to_thread(watcher.apply, events)
                else:
                    continue
                devices = self._devices(details, watcher.found)
                if devices != last:
                    last = devices
                    yield devices
        finally:
            loop.remove_reader(fd)
            watcher.close()
