"""The mdns handler's ``discoveryDetails``::

serviceTypes: ["_http._tcp.local.", "_ipp._tcp.local."]   # required
instanceNames: {action: Include, items: ["Printer *"]}     # filters: exact or glob
hostNames: {action: Exclude, items: ["*.lab.local."]}
ports: {action: Include, items: ["631", "80*"]}
txtRecords: {action: Include, items: ["ty=Acme*", "secure"]}  # key, or key=value
interfaces: [eth0]            # default: every interface (names or IPv4 addresses)
maxDevices: 1000              # per Configuration (1 to 10000)
resolveTimeoutSeconds: 3      # per service instance

Filters follow Akri's semantics (:mod:`discovery_handlers.filters`); items are compared with
udev's glob (``*``, ``?``, ``[...]``), so a plain item is an exact match.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any

from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.details import brief, load_details, unknown_fields
from discovery_handlers.filters import FilterList, parse_filter

NAME = "mdns"
FIELDS = (
    "serviceTypes",
    "instanceNames",
    "hostNames",
    "ports",
    "txtRecords",
    "interfaces",
    "maxDevices",
    "resolveTimeoutSeconds",
)
# RFC 6763 §7: _<service>._tcp|_udp, service names 1-15 letters/digits/hyphens
_SERVICE_TYPE = re.compile(r"^_[A-Za-z0-9](?:[A-Za-z0-9-]{0,13}[A-Za-z0-9])?\._(tcp|udp)\.local\.$")
MAX_TYPES = 32
MAX_DEVICES_LIMIT = 10_000


@dataclass(frozen=True)
class MdnsDetails:
    service_types: tuple[str, ...]
    instance_names: FilterList | None = None
    host_names: FilterList | None = None
    ports: FilterList | None = None
    txt_records: FilterList | None = None
    interfaces: tuple[str, ...] = ()
    max_devices: int = 1000
    resolve_timeout: float = 3.0


def _fail(message: str) -> InvalidDiscoveryDetailsError:
    return InvalidDiscoveryDetailsError(f"{NAME}: discoveryDetails.{message}")


def _service_types(parsed: dict[str, Any]) -> tuple[str, ...]:
    raw = parsed.get("serviceTypes")
    if not isinstance(raw, list) or not raw:
        raise _fail("serviceTypes is required: a list like ['_http._tcp.local.']")
    if len(raw) > MAX_TYPES:
        raise _fail(f"serviceTypes has {len(raw)} entries, more than {MAX_TYPES}")
    result = []
    for index, item in enumerate(raw):
        text = item if isinstance(item, str) else ""
        if text and not text.endswith("."):
            text += "."
        if not _SERVICE_TYPE.match(text):
            raise _fail(
                f"serviceTypes[{index}] {brief(item)} must be a DNS-SD type like "
                "'_http._tcp.local.'"
            )
        result.append(text)
    return tuple(dict.fromkeys(result))


def _interfaces(parsed: dict[str, Any]) -> tuple[str, ...]:
    raw = parsed.get("interfaces", [])
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _fail(f"interfaces must be a list of interface names, got {brief(raw)}")
    for index, item in enumerate(raw):
        if not isinstance(item, str) or not item or len(item) > 64 or "\x00" in item:
            raise _fail(f"interfaces[{index}] must be an interface name or address")
        if "." in item or ":" in item:
            try:
                ipaddress.ip_address(item)
            except ValueError:
                raise _fail(f"interfaces[{index}] {brief(item)} is not an address") from None
    return tuple(raw)


def parse_details(text: str) -> MdnsDetails:
    """Parse and validate ``discoveryDetails``; the message names the field."""
    parsed = load_details(text, NAME)
    max_devices = parsed.get("maxDevices", 1000)
    if (
        not isinstance(max_devices, int)
        or isinstance(max_devices, bool)
        or not 1 <= max_devices <= MAX_DEVICES_LIMIT
    ):
        raise _fail(f"maxDevices must be 1 to {MAX_DEVICES_LIMIT}, got {brief(max_devices)}")
    timeout = parsed.get("resolveTimeoutSeconds", 3)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0.1 <= timeout <= 60
    ):
        raise _fail(f"resolveTimeoutSeconds must be 0.1 to 60, got {brief(timeout)}")
    return MdnsDetails(
        service_types=_service_types(parsed),
        instance_names=parse_filter(parsed.get("instanceNames"), "instanceNames", _fail),
        host_names=parse_filter(parsed.get("hostNames"), "hostNames", _fail),
        ports=parse_filter(parsed.get("ports"), "ports", _fail),
        txt_records=parse_filter(parsed.get("txtRecords"), "txtRecords", _fail),
        interfaces=_interfaces(parsed),
        max_devices=max_devices,
        resolve_timeout=float(timeout),
    )


def warnings(text: str) -> list[str]:
    """Unknown fields (ignored, like Akri's handlers do)."""
    return unknown_fields(load_details(text, NAME), FIELDS, NAME)
