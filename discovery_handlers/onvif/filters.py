"""Akri's ONVIF filter semantics (``discovery-utils`` ``FilterList`` + the ONVIF handler's
``execute_filter``), pure.

A filter is ``{action: Include|Exclude, items: [...]}`` (``action`` defaults to Include).
``values`` is what the camera reported for the field, or None when it is unknown (the SOAP
lookup failed). The rules, in Akri's order:

1. no filter → kept;
2. ``Exclude`` with no items → kept (even when the value is unknown);
3. value unknown → filtered out (an Include filter, or an Exclude filter with items);
4. ``Include`` → kept if any item matches any value (so ``Include []`` keeps nothing);
5. ``Exclude`` → kept if no item matches any value.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class Action(enum.Enum):
    """What a filter does with the items it lists."""

    INCLUDE = "Include"
    EXCLUDE = "Exclude"


@dataclass(frozen=True)
class FilterList:
    """One ``{action, items}`` filter."""

    action: Action
    items: tuple[str, ...]


Match = Callable[[str, str], bool]  # (value, item) -> matches


def equal_ignoring_case(value: str, item: str) -> bool:
    """Akri compares IP addresses, MAC addresses and uuids case-insensitively."""
    return value.casefold() == item.casefold()


def equal(value: str, item: str) -> bool:
    """Scopes are compared exactly (Akri: ``scope.split_whitespace().any(|s| s == pattern)``)."""
    return value == item


def passes(
    filter_list: FilterList | None,
    values: Sequence[str] | None,
    match: Match = equal_ignoring_case,
) -> bool:
    """True if a camera whose field has ``values`` (None = unknown) is kept by the filter."""
    if filter_list is None:
        return True
    if filter_list.action is Action.EXCLUDE and not filter_list.items:
        return True
    if values is None:
        return False
    matched = any(match(value, item) for item in filter_list.items for value in values)
    if filter_list.action is Action.INCLUDE:
        return matched
    return not matched


def normalize_mac(mac: str) -> str:
    """A MAC address for comparison: lower case, ``-`` as ``:`` (``AA-BB-..`` = ``aa:bb:..``)."""
    return mac.strip().lower().replace("-", ":")


def mac_matches(value: str, item: str) -> bool:
    """MAC addresses match ignoring case and the ``:``/``-`` separator."""
    return normalize_mac(value) == normalize_mac(item)
