"""Akri's filter semantics (``discovery-utils`` ``FilterList`` + the ONVIF handler's
``execute_filter``), pure; used by the onvif and mdns handlers.

A filter is ``{action: Include|Exclude, items: [...]}`` (``action`` defaults to Include).
``values`` is what the device reported for the field, or None when it is unknown (e.g. a
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
from typing import Any

from discovery_handlers.details import brief


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


def parse_filter(
    raw: Any, field: str, fail: Callable[[str], Exception], max_items: int = 10_000
) -> FilterList | None:
    """``{action: Include|Exclude, items: [...]}`` from discoveryDetails (None if absent);
    ``fail(message)`` makes the handler's error, the message naming the field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail(
            f"{field} must be a mapping {{action: Include|Exclude, items: [...]}}, got {brief(raw)}"
        )
    unknown = sorted(str(key) for key in raw if key not in ("action", "items"))
    if unknown:
        raise fail(f"{field} has unknown field(s) {', '.join(unknown)} (known: action, items)")
    action_text = raw.get("action", Action.INCLUDE.value)
    try:
        action = Action(action_text)
    except ValueError:
        raise fail(f"{field}.action must be Include or Exclude, got {brief(action_text)}") from None
    items = raw.get("items")
    if items is None:
        raise fail(f"{field}.items is required (a list of strings)")
    if not isinstance(items, list):
        raise fail(f"{field}.items must be a list of strings, got {type(items).__name__}")
    if len(items) > max_items:
        raise fail(f"{field}.items has {len(items)} entries, more than {max_items}")
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise fail(f"{field}.items[{index}] must be a string, got {brief(item)}")
    return FilterList(action=action, items=tuple(items))
