"""The onvif handler's ``discoveryDetails`` (Akri-compatible YAML, unchanged)::

    ipAddresses:  {action: Exclude, items: []}      # each filter optional
    macAddresses: {action: Exclude, items: []}
    scopes:       {action: Include, items: ["onvif://www.onvif.org/name/GreatCam"]}
    uuids:        {action: Exclude, items: ["3fa1fe68-b915-4053-a3e1-ac15a21f5f91"]}
    discoveryTimeoutSeconds: 1                      # default 1: how long a Probe collects answers
    # ours (Akri ignores them):
    probeIntervalSeconds: 10                        # default 10: time between Probes
    interfaces: [eth0]                              # default: all multicast-capable

``action`` defaults to ``Include``. ``interfaces`` names network interfaces (or their IPv4
addresses) on which to send Probes and listen for Hello/Bye.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.details import brief, load_details, unknown_fields
from discovery_handlers.filters import FilterList, parse_filter

NAME = "onvif"
FILTER_FIELDS = ("ipAddresses", "macAddresses", "scopes", "uuids")
FIELDS = (*FILTER_FIELDS, "discoveryTimeoutSeconds", "probeIntervalSeconds", "interfaces")
DEFAULT_DISCOVERY_TIMEOUT = 1.0
DEFAULT_PROBE_INTERVAL = 10.0
MAX_SECONDS = 3600.0
MAX_FILTER_ITEMS = 10_000
MAX_INTERFACES = 64


@dataclass(frozen=True)
class OnvifDetails:
    """Parsed ``discoveryDetails``."""

    ip_addresses: FilterList | None = None
    mac_addresses: FilterList | None = None
    scopes: FilterList | None = None
    uuids: FilterList | None = None
    discovery_timeout: float = DEFAULT_DISCOVERY_TIMEOUT
    probe_interval: float = DEFAULT_PROBE_INTERVAL
    interfaces: tuple[str, ...] = ()


def _fail(message: str) -> InvalidDiscoveryDetailsError:
    return InvalidDiscoveryDetailsError(f"{NAME}: discoveryDetails.{message}")


def _filter(parsed: dict[str, Any], field: str) -> FilterList | None:
    return parse_filter(parsed.get(field), field, _fail, MAX_FILTER_ITEMS)


def _seconds(parsed: dict[str, Any], field: str, default: float, minimum: float) -> float:
    raw = parsed.get(field, default)
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise _fail(f"{field} must be a number of seconds, got {brief(raw)}")
    if not minimum <= raw <= MAX_SECONDS:
        raise _fail(f"{field} must be between {minimum:g} and {MAX_SECONDS:g}, got {raw}")
    return float(raw)


def _interfaces(parsed: dict[str, Any]) -> tuple[str, ...]:
    raw = parsed.get("interfaces", [])
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _fail(f"interfaces must be a list of interface names, got {brief(raw)}")
    if len(raw) > MAX_INTERFACES:
        raise _fail(f"interfaces has {len(raw)} entries, more than {MAX_INTERFACES}")
    result: list[str] = []
    for index, item in enumerate(raw):
        if not isinstance(item, str) or not item or len(item) > 64 or "\x00" in item:
            raise _fail(
                f"interfaces[{index}] must be an interface name or IPv4 address, got {brief(item)}"
            )
        if any(ch in item for ch in "./") and not _is_ipv4(item):
            raise _fail(f"interfaces[{index}] is neither an interface name nor an IPv4 address")
        result.append(item)
    return tuple(dict.fromkeys(result))


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def parse_details(text: str) -> OnvifDetails:
    """Parse and validate ``discoveryDetails``; the message names the field."""
    parsed = load_details(text, NAME)
    timeout_raw = parsed.get("discoveryTimeoutSeconds", DEFAULT_DISCOVERY_TIMEOUT)
    if timeout_raw is None:
        timeout_raw = DEFAULT_DISCOVERY_TIMEOUT
    parsed = {**parsed, "discoveryTimeoutSeconds": timeout_raw}
    return OnvifDetails(
        ip_addresses=_filter(parsed, "ipAddresses"),
        mac_addresses=_filter(parsed, "macAddresses"),
        scopes=_filter(parsed, "scopes"),
        uuids=_filter(parsed, "uuids"),
        discovery_timeout=_seconds(
            parsed, "discoveryTimeoutSeconds", DEFAULT_DISCOVERY_TIMEOUT, 0.0
        ),
        probe_interval=_seconds(parsed, "probeIntervalSeconds", DEFAULT_PROBE_INTERVAL, 0.5),
        interfaces=_interfaces(parsed),
    )


def warnings(text: str) -> list[str]:
    """Warnings about usable ``discoveryDetails`` (unknown fields are ignored, like Akri)."""
    return unknown_fields(load_details(text, NAME), FIELDS, NAME)
