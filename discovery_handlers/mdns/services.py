"""Resolved mDNS services → devices, and the filters (pure: no network).

One device per resolved service instance: id = the full service name (instance + type, e.g.
``Printer A._ipp._tcp.local.``); properties ``MDNS_NAME`` (the instance label),
``MDNS_TYPE``, ``MDNS_HOST``, ``MDNS_ADDRESSES`` (comma-separated), ``MDNS_PORT`` and one
``MDNS_TXT_<KEY>`` per TXT entry (key upper-cased, other characters ``_``; a key without a
value gives an empty string). TXT keys or values that are not UTF-8 are dropped with a
reason; a service without a host or port is not a device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from discovery_handlers.base import Device
from discovery_handlers.filters import FilterList, passes
from discovery_handlers.mdns.details import MdnsDetails
from discovery_handlers.udev.glob import fnmatch

MAX_TXT_ENTRIES = 64
MAX_VALUE = 4096


@dataclass(frozen=True)
class Service:
    """A resolved service instance."""

    name: str  # full: "<instance>.<type>"
    type: str
    host: str
    port: int
    addresses: tuple[str, ...]
    txt: Mapping[str, str] = field(default_factory=dict)

    @property
    def instance(self) -> str:
        return (
            self.name[: -len(self.type) - 1] if self.name.endswith("." + self.type) else self.name
        )


def decode_txt(raw: Mapping[bytes, bytes | None]) -> tuple[dict[str, str], list[str]]:
    """TXT entries as text, and what was dropped (and why)."""
    entries: dict[str, str] = {}
    dropped: list[str] = []
    for key, value in raw.items():
        try:
            text_key = key.decode("utf-8")
            text_value = "" if value is None else value.decode("utf-8")
        except UnicodeDecodeError:
            dropped.append(f"TXT key {key[:40]!r}: not UTF-8")
            continue
        if not text_key or len(entries) >= MAX_TXT_ENTRIES:
            dropped.append(f"TXT key {text_key[:40]!r}: empty or over {MAX_TXT_ENTRIES} entries")
            continue
        entries[text_key] = text_value[:MAX_VALUE]
    return entries, dropped


def _glob(value: str, item: str) -> bool:
    return fnmatch(
        item.encode("utf-8", "surrogateescape"), value.encode("utf-8", "surrogateescape")
    )


def _txt_matches(value: str, item: str) -> bool:
    # values are "key=value" (or "key" for a key without value); an item "key" matches the key
    key = value.split("=", 1)[0]
    return _glob(value, item) if "=" in item else _glob(key, item)


def _passes(filter_list: FilterList | None, values: Sequence[str] | None) -> bool:
    return passes(filter_list, values, _glob)


def instance_of(name: str, service_type: str) -> str:
    """The instance label of a full service name (``<instance>.<type>``)."""
    suffix = "." + service_type
    return name[: -len(suffix)] if name.endswith(suffix) else name


def name_wanted(name: str, service_type: str, details: MdnsDetails) -> bool:
    """Does the service instance ``name`` pass the instance-name filter? The one filter
    that can be applied before resolving (host, port and TXT need the answer)."""
    return _passes(details.instance_names, [instance_of(name, service_type)])


def wanted(service: Service, details: MdnsDetails) -> bool:
    """Does ``service`` pass every filter of ``details``?"""
    txt = [f"{k}={v}" for k, v in service.txt.items()]
    return (
        _passes(details.instance_names, [service.instance])
        and _passes(details.host_names, [service.host] if service.host else None)
        and _passes(details.ports, [str(service.port)])
        and passes(details.txt_records, txt, _txt_matches)
    )


def env_key(text: str) -> str:
    return re.sub(r"[^A-Z0-9_]", "_", text.upper()) or "_"


def device_of(service: Service) -> Device:
    properties = {
        "MDNS_NAME": service.instance,
        "MDNS_TYPE": service.type,
        "MDNS_HOST": service.host,
        "MDNS_ADDRESSES": ",".join(service.addresses),
        "MDNS_PORT": str(service.port),
    }
    for key, value in service.txt.items():
        properties.setdefault(f"MDNS_TXT_{env_key(key)}", value)
    return Device(id=service.name, properties=properties)
