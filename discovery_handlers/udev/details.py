"""The udev handler's ``discoveryDetails`` (Akri-compatible YAML)::

udevRules:            # required: list of rules; a device matching ANY rule is discovered
  - 'KERNEL=="video[0-9]*", ENV{ID_V4L_CAPABILITIES}==":capture:"'
groupRecursive: false # optional: one device per topmost match, its matching descendants inside
permissions: rwm      # optional: cgroup permissions of the device nodes (r, w, m, rw, rm, rwm, wm)
"""

from __future__ import annotations

from dataclasses import dataclass

from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.details import brief, load_details, unknown_fields
from discovery_handlers.udev.rules import Rule, RuleSyntaxError, parse_rule

NAME = "udev"
PERMISSIONS = ("r", "w", "m", "rw", "rm", "rwm", "wm")
DEFAULT_PERMISSIONS = "rwm"
FIELDS = ("udevRules", "groupRecursive", "permissions")


@dataclass(frozen=True)
class UdevDetails:
    """Parsed ``discoveryDetails``."""

    rules: tuple[Rule, ...]
    group_recursive: bool = False
    permissions: str = DEFAULT_PERMISSIONS


def parse_details(text: str) -> UdevDetails:
    """Parse and validate ``discoveryDetails``; the message names the field, rule and token."""
    parsed = load_details(text, NAME)
    raw_rules = parsed.get("udevRules")
    if raw_rules is None:
        raise InvalidDiscoveryDetailsError(
            f"{NAME}: discoveryDetails.udevRules is required (a list of udev rules)"
        )
    if not isinstance(raw_rules, list):
        raise InvalidDiscoveryDetailsError(
            f"{NAME}: discoveryDetails.udevRules must be a list of strings, "
            f"got {type(raw_rules).__name__}"
        )
    rules: list[Rule] = []
    for index, item in enumerate(raw_rules):
        if not isinstance(item, str):
            raise InvalidDiscoveryDetailsError(
                f"{NAME}: discoveryDetails.udevRules[{index}] must be a string, "
                f"got {type(item).__name__}"
            )
        try:
            rules.append(parse_rule(item))
        except RuleSyntaxError as error:
            raise InvalidDiscoveryDetailsError(
                f"{NAME}: discoveryDetails.udevRules[{index}] {brief(item)}: {error}"
            ) from error
    group_recursive = parsed.get("groupRecursive", False)
    if not isinstance(group_recursive, bool):
        raise InvalidDiscoveryDetailsError(
            f"{NAME}: discoveryDetails.groupRecursive must be true or false, "
            f"got {brief(group_recursive)}"
        )
    permissions = parsed.get("permissions", DEFAULT_PERMISSIONS)
    if not isinstance(permissions, str) or permissions not in PERMISSIONS:
        raise InvalidDiscoveryDetailsError(
            f"{NAME}: discoveryDetails.permissions must be one of {', '.join(PERMISSIONS)}, "
            f"got {brief(permissions)}"
        )
    return UdevDetails(rules=tuple(rules), group_recursive=group_recursive, permissions=permissions)


def warnings(text: str) -> list[str]:
    """Warnings about usable ``discoveryDetails`` (unknown fields are ignored, like Akri)."""
    return unknown_fields(load_details(text, NAME), FIELDS, NAME)
