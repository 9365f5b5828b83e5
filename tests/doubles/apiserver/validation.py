"""Admission-free validation the real API server does for every write: object names, label
syntax, and for custom resources the CRD's structural schema (defaulting, pruning of unknown
fields, OpenAPI v3 validation). No CEL rules, no ratcheting, no admission webhooks."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

JSON = dict[str, Any]
Cause = tuple[str, str, str]  # (reason, field, message)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

SUBDOMAIN_HINT = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character"
)
LABEL_HINT = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character"
)


def _invalid(field: str, value: Any, why: str) -> Cause:
    return ("FieldValueInvalid", field, f"Invalid value: {json.dumps(value)}: {why}")


def validate_metadata(obj: JSON, *, dns_label_name: bool = False) -> list[Cause]:
    """Name syntax (RFC 1123 subdomain, or label for namespaces) and label keys/values."""
    causes: list[Cause] = []
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    if dns_label_name:
        if len(name) > 63 or not _DNS_LABEL.match(name):
            causes.append(_invalid("metadata.name", name, LABEL_HINT))
    elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        causes.append(_invalid("metadata.name", name, SUBDOMAIN_HINT))
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        return [*causes, _invalid("metadata.labels", labels, "must be a map of strings")]
    for key, value in labels.items():
        prefix, _, label_name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or (
            len(label_name) > 63 or not _LABEL_NAME.match(label_name)
        ):
            causes.append(
                _invalid(
                    "metadata.labels",
                    key,
                    "name part must consist of alphanumeric characters, '-', '_' or '.', and "
                    "must start and end with an alphanumeric character",
                )
            )
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(
                _invalid(
                    "metadata.labels",
                    value,
                    "a valid label must be an empty string or consist of alphanumeric "
                    "characters, '-', '_' or '.', and must start and end with an alphanumeric "
                    "character",
                )
            )
    return causes


def prune_and_default(obj: JSON, schema: JSON) -> list[str]:
    """Apply ``default``s and drop fields the structural schema does not declare (in place,
    outside ``apiVersion``/``kind``/``metadata``). Returns the dropped field paths."""
    dropped: list[str] = []
    properties = schema.get("properties") or {}
    for key in list(obj):
        if key in ("apiVersion", "kind", "metadata"):
            continue
        if key in properties:
            obj[key] = _walk(obj[key], properties[key], key, dropped)
        elif not schema.get("x-kubernetes-preserve-unknown-fields"):
            dropped.append(key)
            del obj[key]
    _defaults(obj, properties, skip=("apiVersion", "kind", "metadata"))
    return dropped


def _defaults(value: JSON, properties: JSON, skip: tuple[str, ...] = ()) -> None:
    for key, sub in properties.items():
        if key not in value and key not in skip and isinstance(sub, dict) and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])


def _walk(value: Any, schema: Any, path: str, dropped: list[str]) -> Any:
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        embedded = bool(schema.get("x-kubernetes-embedded-resource"))
        for key in list(value):
            if properties is not None and key in properties:
                value[key] = _walk(value[key], properties[key], f"{path}.{key}", dropped)
            elif isinstance(additional, dict):
                value[key] = _walk(value[key], additional, f"{path}.{key}", dropped)
            elif (
                preserve
                or additional is True
                or (embedded and key in ("apiVersion", "kind", "metadata"))
            ):
                continue
            else:
                dropped.append(f"{path}.{key}")
                del value[key]
        if properties:
            _defaults(value, properties)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_walk(v, schema["items"], f"{path}[{i}]", dropped) for i, v in enumerate(value)]
    return value


def validate_schema(obj: JSON, schema: JSON) -> list[Cause]:
    """OpenAPI v3 validation errors as Kubernetes field causes (empty when the validator
    library is not installed)."""
    try:
        from openapi_schema_validator import OAS30Validator
    except ImportError:  # pragma: no cover - the test extras ship it
        return []
    # Metadata is validated by the server itself, not by the CRD schema.
    body = {k: v for k, v in obj.items() if k != "metadata"}
    root = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items()}}
    root["properties"].pop("metadata", None)
    causes: list[Cause] = []
    for error in OAS30Validator(root).iter_errors(body):
        field = ".".join(str(p) for p in error.absolute_path)
        if error.validator == "required":
            missing = re.match(r"'([^']*)' is a required property", error.message)
            name = missing.group(1) if missing else "?"
            causes.append(
                ("FieldValueRequired", f"{field}.{name}" if field else name, "Required value")
            )
        else:
            where = field or "<root>"
            causes.append(_invalid(where, error.instance, f"{where} in body: {error.message}"))
    return sorted(causes, key=lambda c: c[1])
