"""pyudev behind typed adapters: enumerate ``/sys``, follow the netlink monitor, keep the set
of devices that match the rules.

pyudev has no type annotations; everything it returns is converted here, so the rest of the
package (and mypy --strict) sees only :class:`PyudevDevice` (a
:class:`~discovery_handlers.udev.rules.UdevDevice`) and plain strings.

Thread use: :class:`UdevWatcher` is driven by one asyncio task. The netlink socket is read on
the event loop (:meth:`UdevWatcher.drain`, non-blocking); sysfs reads (:meth:`full_scan`,
:meth:`apply`) run in a worker thread, never concurrently with each other or with ``drain``.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from discovery_handlers.udev.devices import Found, is_ancestor
from discovery_handlers.udev.rules import Rule, UdevDevice

log = logging.getLogger("discovery_handlers.udev")

UDEVD_CONTROL = Path("/run/udev/control")
RECEIVE_BUFFER_BYTES = 8 * 1024 * 1024


class UdevUnavailableError(RuntimeError):
    """pyudev/libudev cannot be loaded or the uevent netlink socket cannot be opened."""


def _import_pyudev() -> Any:
    try:
        import pyudev  # type: ignore[import-untyped]
    except ImportError as error:  # pragma: no cover - depends on the installation
        raise UdevUnavailableError(
            f"udev: the pyudev package is not installed ({error}); pip install pyudev"
        ) from error
    return pyudev


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


class PyudevDevice:
    """A pyudev ``Device`` seen through the :class:`UdevDevice` protocol.

    Reads that fail (device gone, undecodable bytes) count as absent values.
    """

    __slots__ = ("_device", "_parent", "_parent_loaded", "_tags")

    def __init__(self, device: Any) -> None:
        self._device = device
        self._parent: PyudevDevice | None = None
        self._parent_loaded = False
        self._tags: frozenset[str] | None = None

    @property
    def devpath(self) -> str:
        return str(self._device.device_path)

    @property
    def kernel(self) -> str:
        return str(self._device.sys_name)

    @property
    def subsystem(self) -> str | None:
        try:
            return _opt_str(self._device.subsystem)
        except (OSError, ValueError):
            return None

    @property
    def driver(self) -> str | None:
        try:
            return _opt_str(self._device.driver)
        except (OSError, ValueError):
            return None

    @property
    def devnode(self) -> str | None:
        try:
            return _opt_str(self._device.device_node)
        except (OSError, ValueError):
            return None

    @property
    def tags(self) -> Collection[str]:
        if self._tags is None:
            try:
                self._tags = frozenset(str(tag) for tag in self._device.tags)
            except (OSError, ValueError):
                self._tags = frozenset()
        return self._tags

    @property
    def parent(self) -> UdevDevice | None:
        if not self._parent_loaded:
            self._parent_loaded = True
            try:
                parent = self._device.parent
            except (OSError, ValueError):
                parent = None
            self._parent = None if parent is None else PyudevDevice(parent)
        return self._parent

    def property(self, name: str) -> str | None:
        try:
            return _opt_str(self._device.properties.get(name))
        except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
            return None

    def attribute(self, name: str) -> bytes | None:
        try:
            value = self._device.attributes.get(name)
        except (OSError, ValueError):
            return None
        if value is None:
            return None
        return bytes(value)


@dataclass(frozen=True)
class Uevent:
    """One monitor event, reduced to what the watcher needs."""

    action: str
    devpath: str
    devpath_old: str | None = None


class UdevWatcher:
    """A pyudev context, a started netlink monitor and the devices that match ``rules``."""

    def __init__(self, rules: tuple[Rule, ...], source: str) -> None:
        pyudev = _import_pyudev()
        self._pyudev = pyudev
        self.rules = rules
        self.source = source
        try:
            self.context = pyudev.Context()
            self.monitor = pyudev.Monitor.from_netlink(self.context, source=source)
        except (OSError, ImportError) as error:
            raise UdevUnavailableError(
                f"udev: cannot open the {source} uevent netlink socket: {error}"
            ) from error
        try:
            self.monitor.set_receive_buffer_size(RECEIVE_BUFFER_BYTES)
        except (OSError, ValueError) as error:  # needs CAP_NET_ADMIN; the default is fine
            log.debug("udev: cannot enlarge the monitor receive buffer: %s", error)
        # started before the first scan, so no event between the scan and the loop is lost
        self.monitor.start()
        self.found: dict[str, Found] = {}

    def fileno(self) -> int:
        return int(self.monitor.fileno())

    def close(self) -> None:
        """Drop the monitor: libudev closes the netlink socket when it is released."""
        self.monitor = None

    # -- matching ------------------------------------------------------------------------

    def _consider(self, device: Any, found: dict[str, Found]) -> None:
        view = PyudevDevice(device)
        try:
            devpath = view.devpath
            matched = any(rule.matches_device(view) for rule in self.rules)
        except Exception:  # one broken device must not stop discovery
            log.debug("udev: cannot evaluate %r", device, exc_info=True)
            return
        if matched:
            found[devpath] = Found(devpath=devpath, devnode=view.devnode)
        else:
            found.pop(devpath, None)

    def _devices(self, parent: Any | None = None) -> Iterator[Any]:
        enumerator = self.context.list_devices()
        if parent is not None:
            enumerator = enumerator.match_parent(parent)
        yield from enumerator

    def full_scan(self) -> None:
        """Evaluate every device in sysfs (at start, and after lost events)."""
        found: dict[str, Found] = {}
        for device in self._devices():
            self._consider(device, found)
        self.found = found

    def _forget_subtree(self, devpath: str) -> None:
        for path in [p for p in self.found if p == devpath or is_ancestor(devpath, p)]:
            del self.found[path]

    def _rescan_subtree(self, devpath: str) -> None:
        """Re-evaluate ``devpath`` and everything below it (their ATTRS may have changed)."""
        try:
            device = self._pyudev.Devices.from_path(self.context, devpath)
        except self._pyudev.DeviceNotFoundError:
            self._forget_subtree(devpath)
            return
        seen: dict[str, Found] = {}
        for member in self._devices(parent=device):
            self._consider(member, seen)
        for path in [p for p in self.found if p == devpath or is_ancestor(devpath, p)]:
            if path not in seen:
                del self.found[path]
        self.found.update(seen)

    def apply(self, events: list[Uevent]) -> None:
        """Update the matching devices for a batch of events (reads sysfs).

        Events outside ``/devices`` (kernel modules, ``/bus``) are ignored: libudev's
        enumeration, and so the initial scan, only ever finds devices below ``/devices``.
        """
        for event in events:
            if not event.devpath.startswith("/devices/"):
                continue
            if event.action == "remove":
                self._forget_subtree(event.devpath)
                continue
            if event.action == "move" and event.devpath_old:
                self._forget_subtree(event.devpath_old)
            self._rescan_subtree(event.devpath)

    def drain(self) -> tuple[list[Uevent], bool]:
        """All pending events without blocking, and whether events were lost (ENOBUFS)."""
        events: list[Uevent] = []
        while True:
            try:
                device = self.monitor.poll(timeout=0)
            except OSError as error:
                if error.errno == errno.ENOBUFS:
                    log.warning("udev: uevents were lost (receive buffer full); rescanning")
                    return events, True
                raise
            if device is None:
                return events, False
            try:
                action = str(device.action or "")
                devpath = str(device.device_path)
                old = device.properties.get("DEVPATH_OLD")
            except (OSError, ValueError):
                log.debug("udev: unreadable uevent", exc_info=True)
                continue
            events.append(Uevent(action=action, devpath=devpath, devpath_old=_opt_str(old)))
