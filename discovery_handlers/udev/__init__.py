"""The ``udev`` discovery handler (Akri-compatible ``udevRules``), see ``docs/udev.md``.

``rules``, ``glob``, ``details`` and ``devices`` are pure; ``watcher`` wraps pyudev and is
imported only when discovery starts, so validating Configurations needs no libudev.
"""

from discovery_handlers.udev.details import UdevDetails, parse_details
from discovery_handlers.udev.handler import UdevHandler
from discovery_handlers.udev.rules import Rule, RuleSyntaxError, UdevDevice, parse_rule

__all__ = [
    "Rule",
    "RuleSyntaxError",
    "UdevDetails",
    "UdevDevice",
    "UdevHandler",
    "parse_details",
    "parse_rule",
]
