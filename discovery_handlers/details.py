"""Helpers for parsing ``discoveryDetails`` YAML with messages that name the field."""

from __future__ import annotations

from typing import Any

import yaml

from discovery_handlers.base import InvalidDiscoveryDetailsError


def yaml_problem(error: yaml.YAMLError) -> str:
    """One line: what is wrong and where (line/column), without PyYAML's multi-line dump."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def load_details(text: str, handler: str) -> dict[str, Any]:
    """Parse ``discoveryDetails`` as a YAML mapping (empty text = empty mapping)."""
    try:
        value = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as error:
        raise InvalidDiscoveryDetailsError(
            f"{handler}: discoveryDetails is not valid YAML: {yaml_problem(error)}"
        ) from error
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidDiscoveryDetailsError(
            f"{handler}: discoveryDetails must be a YAML mapping, got {type(value).__name__}"
        )
    return value
