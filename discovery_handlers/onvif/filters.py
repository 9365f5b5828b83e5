"""ONVIF's filters: Akri's generic semantics (:mod:`discovery_handlers.filters`) plus the
MAC address comparison."""

from __future__ import annotations

from discovery_handlers.filters import (
    Action,
    FilterList,
    Match,
    equal,
    equal_ignoring_case,
    passes,
)

__all__ = [
    "Action",
    "FilterList",
    "Match",
    "equal",
    "equal_ignoring_case",
    "mac_matches",
    "normalize_mac",
    "passes",
]


def normalize_mac(mac: str) -> str:
    """A MAC address for comparison: lower case, ``-`` as ``:`` (``AA-BB-..`` = ``aa:bb:..``)."""
    return mac.strip().lower().replace("-", ":")


def mac_matches(value: str, item: str) -> bool:
    """MAC addresses match ignoring case and the ``:``/``-`` separator."""
    return normalize_mac(value) == normalize_mac(item)
