"""Helpers for parsing ``discoveryDetails`` YAML with messages that name the field.

The bounded loading itself (size and alias-expansion limits, :func:`brief` for values quoted in
messages) is the agent core's, ``agent/core/bounded_yaml.py``, which Configuration files and
kubeconfigs go through as well; the names are re-exported here for the handlers.
"""

from __future__ import annotations

from typing import Any

import yaml

from agent.core.bounded_yaml import MAX_DETAILS_BYTES as MAX_DETAILS_BYTES
from agent.core.bounded_yaml import MAX_EXPANDED_NODES as MAX_EXPANDED_NODES
from agent.core.bounded_yaml import YamlLimitError as YamlLimitError
from agent.core.bounded_yaml import brief as brief
from agent.core.bounded_yaml import safe_load_all_limited as safe_load_all_limited
from agent.core.bounded_yaml import yaml_problem as yaml_problem
from discovery_handlers.base import InvalidDiscoveryDetailsError


def load_details(text: str, handler: str) -> dict[str, Any]:
    """Parse ``discoveryDetails`` as a YAML mapping (empty text = empty mapping)."""
    try:
        documents = list(safe_load_all_limited(text)) if text.strip() else []
    except YamlLimitError as error:
        raise InvalidDiscoveryDetailsError(
            f"{handler}: discoveryDetails is too large: {error}"
        ) from error
    except yaml.YAMLError as error:
        raise InvalidDiscoveryDetailsError(
            f"{handler}: discoveryDetails is not valid YAML: {yaml_problem(error)}"
        ) from error
    if len(documents) > 1:
        raise InvalidDiscoveryDetailsError(
            f"{handler}: discoveryDetails must be one YAML document, got {len(documents)}"
        )
    value = documents[0] if documents else None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidDiscoveryDetailsError(
            f"{handler}: discoveryDetails must be a YAML mapping, got {type(value).__name__}"
        )
    return value


def unknown_fields(parsed: dict[str, Any], known: tuple[str, ...], handler: str) -> list[str]:
    """Warnings for fields of ``parsed`` this handler does not know. Akri's handlers ignore
    them, so ours do too (a Configuration written for Akri keeps working); the agent reports
    the warnings (log line + Event)."""
    unknown = sorted(
        key if isinstance(key, str) else brief(key) for key in parsed if key not in known
    )
    if not unknown:
        return []
    return [
        f"{handler}: ignoring unknown field(s) {', '.join(unknown)} in discoveryDetails "
        f"(known: {', '.join(known)})"
    ]
