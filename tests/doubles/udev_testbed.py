"""A ctypes wrapper around umockdev's ``UMockdevTestbed`` (libumockdev.so.0).

Works with any Python (no PyGObject). The process must run under ``umockdev-wrapper`` (which
sets ``LD_PRELOAD=libumockdev-preload.so.0``): the preload library redirects ``/sys``, ``/dev``
and the uevent netlink socket into the testbed. Without it, testbed calls fail ("parent device
does not exist"). ``umockdev_in_mock_environment()`` is not a reliable guard through ctypes, so
:func:`preloaded` checks ``LD_PRELOAD`` instead.

Usage::

    with Testbed() as testbed:
        testbed.add_from_string(RECORD)           # emits "add" uevents
        testbed.set_attribute(path, "idVendor", "0000")
        testbed.uevent(path, "change")
        testbed.remove(path)                      # "remove" uevent, then the device is gone
"""

from __future__ import annotations

import ctypes
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

LIBRARY = "libumockdev.so.0"
PRELOAD = "libumockdev-preload.so.0"
WRAPPER = "umockdev-wrapper"


class TestbedError(RuntimeError):
    """A umockdev call failed."""


class _GError(ctypes.Structure):
    _fields_ = [("domain", ctypes.c_uint32), ("code", ctypes.c_int), ("message", ctypes.c_char_p)]


def unavailable_reason() -> str | None:
    """None if umockdev can be used here, else why not (for pytest skip messages)."""
    if shutil.which(WRAPPER) is None:
        return f"umockdev is not installed ({WRAPPER} not found; apt-get install umockdev)"
    for library in (LIBRARY, PRELOAD):
        try:
            ctypes.CDLL(library)
        except OSError as error:
            return f"umockdev is not installed ({library}: {error}; apt-get install umockdev)"
    return None


def preloaded() -> bool:
    """True if this process runs under umockdev-wrapper."""
    return "libumockdev-preload" in os.environ.get("LD_PRELOAD", "")


def _strv(mapping: Mapping[str, str]) -> ctypes.Array[ctypes.c_char_p]:
    items: list[bytes | None] = []
    for key, value in mapping.items():
        items += [key.encode(), value.encode()]
    items.append(None)
    return (ctypes.c_char_p * len(items))(*items)


class Testbed:
    """One umockdev testbed; ``close()`` (or the context manager) removes it."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL(LIBRARY)
        self._glib = ctypes.CDLL("libglib-2.0.so.0")
        self._gobject = ctypes.CDLL("libgobject-2.0.so.0")
        lib = self._lib
        lib.umockdev_testbed_new.restype = ctypes.c_void_p
        lib.umockdev_testbed_get_root_dir.argtypes = [ctypes.c_void_p]
        lib.umockdev_testbed_get_root_dir.restype = ctypes.c_char_p
        lib.umockdev_testbed_add_from_string.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.POINTER(_GError)),
        ]
        lib.umockdev_testbed_add_from_string.restype = ctypes.c_int
        lib.umockdev_testbed_add_devicev.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_char_p),
        ]
        lib.umockdev_testbed_add_devicev.restype = ctypes.c_void_p
        for name in ("set_attribute", "set_property"):
            function = getattr(lib, f"umockdev_testbed_{name}")
            function.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
            function.restype = None
        lib.umockdev_testbed_uevent.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        lib.umockdev_testbed_uevent.restype = None
        lib.umockdev_testbed_remove_device.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.umockdev_testbed_remove_device.restype = None
        self._glib.g_free.argtypes = [ctypes.c_void_p]
        self._glib.g_error_free.argtypes = [ctypes.c_void_p]
        self._gobject.g_object_unref.argtypes = [ctypes.c_void_p]
        self._testbed: int | None = lib.umockdev_testbed_new()
        if not self._testbed:
            raise TestbedError("umockdev_testbed_new failed")

    @property
    def root_dir(self) -> str:
        return str(self._lib.umockdev_testbed_get_root_dir(self._handle()).decode())

    def _handle(self) -> int:
        if self._testbed is None:
            raise TestbedError("the testbed is closed")
        return self._testbed

    def add_from_string(self, record: str) -> None:
        """Add devices from an umockdev record (``P:``, ``N:``, ``E:``, ``A:`` lines)."""
        error = ctypes.POINTER(_GError)()
        ok = self._lib.umockdev_testbed_add_from_string(
            self._handle(), record.encode(), ctypes.byref(error)
        )
        if not ok:
            message = error.contents.message.decode() if error else "unknown error"
            if error:
                self._glib.g_error_free(error)
            raise TestbedError(f"umockdev_testbed_add_from_string: {message}")

    def add_device(
        self,
        subsystem: str,
        name: str,
        parent: str | None,
        attributes: Mapping[str, str],
        properties: Mapping[str, str],
    ) -> str:
        """Add one device (emits "add"); returns its sys path (``/sys/devices/...``)."""
        pointer = self._lib.umockdev_testbed_add_devicev(
            self._handle(),
            subsystem.encode(),
            name.encode(),
            parent.encode() if parent else None,
            _strv(attributes),
            _strv(properties),
        )
        if not pointer:
            raise TestbedError(f"umockdev_testbed_add_devicev({subsystem}, {name}) failed")
        try:
            return ctypes.string_at(pointer).decode()
        finally:
            self._glib.g_free(pointer)

    def set_attribute(self, syspath: str, name: str, value: str) -> None:
        self._lib.umockdev_testbed_set_attribute(
            self._handle(), syspath.encode(), name.encode(), value.encode()
        )

    def set_property(self, syspath: str, name: str, value: str) -> None:
        self._lib.umockdev_testbed_set_property(
            self._handle(), syspath.encode(), name.encode(), value.encode()
        )

    def uevent(self, syspath: str, action: str) -> None:
        """Send a uevent (``add``, ``change``, ``remove``, ``bind``…) for ``syspath``."""
        self._lib.umockdev_testbed_uevent(self._handle(), syspath.encode(), action.encode())

    def remove(self, syspath: str) -> None:
        """Send ``remove`` for the device, then delete it and its ``/dev`` node, as the kernel
        and devtmpfs do (umockdev leaves the node behind, so a re-add would fail).
        Children must be removed first."""
        root = Path(self.root_dir)
        devname = None
        try:
            for line in (root / syspath.lstrip("/") / "uevent").read_text().splitlines():
                if line.startswith("DEVNAME="):
                    devname = line.removeprefix("DEVNAME=").removeprefix("/dev/").lstrip("/")
        except OSError:
            pass
        self.uevent(syspath, "remove")
        self._lib.umockdev_testbed_remove_device(self._handle(), syspath.encode())
        if devname:
            node = root / "dev" / devname
            if node.is_symlink() or node.exists():
                node.unlink()

    def close(self) -> None:
        if self._testbed is not None:
            self._gobject.g_object_unref(self._testbed)
            self._testbed = None

    def __enter__(self) -> Testbed:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
