"""Helpers for parsing ``discoveryDetails`` YAML with messages that name the field."""

from __future__ import annotations

from typing import Any

import yaml

from discovery_handlers.base import InvalidDiscoveryDetailsError


def load_details(text: str, handler: str) -> dict[str, Any]:
    """Parse ``discoveryDetails`` as a YAML mapping (empty text = empty mapping)."""
    try:
        value = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as error:
        raise InvalidDiscoveryDetailsError(
            f"{handler}: discoveryDetails is not valid YAML: {error}"
        ) from error
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidDiscoveryDetailsError(
            f"{handler}: discoveryDetails must be a YAML mapping, got {type(value).__name__}"
        )
    return value
