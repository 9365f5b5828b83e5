"""Server-side printing: ``meta.k8s.io`` Tables (what ``kubectl get`` asks for) and
PartialObjectMetadata, plus the small JSONPath subset used by printer columns."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from tests.doubles.apiserver.resources import PrinterColumn, ResourceType

JSON = dict[str, Any]

NAME_DESCRIPTION = (
    "Name must be unique within a namespace. Is required when creating resources, although some "
    "resources may allow a client to request the generation of an appropriate name automatically."
)
AGE_DESCRIPTION = (
    "CreationTimestamp is a timestamp representing the server time when this object was created."
)


def negotiate(accept: str | None) -> tuple[str, str] | None:
    """The ``(as, version)`` of the first meta.k8s.io representation the client asks for
    (``("Table", "v1")``, ``("PartialObjectMetadata", "v1")``...), or None for plain JSON."""
    for part in (accept or "").split(","):
        media, *raw_params = [p.strip() for p in part.split(";")]
        params = dict(p.split("=", 1) for p in raw_params if "=" in p)
        if media not in ("application/json", "*/*", "application/*"):
            continue
        kind = params.get("as")
        if kind is None:
            return None
        if (
            params.get("g") == "meta.k8s.io"
            and params.get("v") in ("v1", "v1beta1")
            and kind
            in (
                "Table",
                "PartialObjectMetadata",
                "PartialObjectMetadataList",
            )
        ):
            return kind, params["v"]
    return None


def human_duration(seconds: float) -> str:
    """The short age format of ``kubectl get`` (``5s``, ``3m20s``, ``4h``, ``12d``...)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24 % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    try:
        then = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return "<invalid>"
    return human_duration((datetime.now(UTC) - then).total_seconds())


_TOKEN = re.compile(
    r"""\.(?P<field>[^.\[\]]+)
      | \[(?P<index>-?\d+|\*)\]
      | \[\?\(@\.(?P<fkey>[\w.-]+)\s*==\s*(?P<q>["'])(?P<fval>.*?)(?P=q)\)\]
      | \[(?P<bq>["'])(?P<bkey>.*?)(?P=bq)\]""",
    re.VERBOSE,
)


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Evaluate a simple JSONPath (``.a.b``, ``[0]``, ``[*]``, ``['k.e.y']``,
    ``[?(@.type=="Ready")]``); returns every match (missing keys give no match)."""
    expr = path.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    if expr.startswith("$"):
        expr = expr[1:]
    current = [obj]
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            return []
        pos = m.end()
        nxt: list[Any] = []
        for value in current:
            if m.group("field") is not None or m.group("bkey") is not None:
                key = m.group("field") if m.group("field") is not None else m.group("bkey")
                if isinstance(value, dict) and key in value:
                    nxt.append(value[key])
            elif m.group("index") is not None:
                if not isinstance(value, list):
                    continue
                if m.group("index") == "*":
                    nxt.extend(value)
                else:
                    i = int(m.group("index"))
                    if -len(value) <= i < len(value):
                        nxt.append(value[i])
            else:
                items = value if isinstance(value, list) else []
                for item in items:
                    if isinstance(item, dict):
                        got = jsonpath(item, "." + m.group("fkey"))
                        if got and _print(got[0]) == m.group("fval"):
                            nxt.append(item)
        current = nxt
    return current


def _print(value: Any) -> str:
    """How the JSONPath printer renders a value."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "<nil>"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def _cell(column: PrinterColumn, obj: JSON) -> Any:
    found = jsonpath(obj, column.json_path)
    if not found or found[0] is None:
        return None
    value = found[0]
    if column.type == "string":
        return _print(value)
    if column.type == "integer":
        return (
            int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        )
    if column.type == "number":
        return (
            float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        )
    if column.type == "boolean":
        return value if isinstance(value, bool) else None
    if column.type == "date":
        return age(value) if isinstance(value, str) else None
    return None


def column_definitions(rt: ResourceType, version: str) -> list[JSON]:
    name = {
        "name": "Name",
        "type": "string",
        "format": "name",
        "description": NAME_DESCRIPTION,
        "priority": 0,
    }
    columns = rt.columns(version)
    if columns is None:
        return [
            name,
            {
                "name": "Age",
                "type": "string",
                "format": "",
                "description": AGE_DESCRIPTION,
                "priority": 0,
            },
        ]
    return [name] + [
        {
            "name": c.name,
            "type": c.type,
            "format": c.format,
            "description": c.description
            or f"Custom resource definition column (in JSONPath format): {c.json_path}",
            "priority": c.priority,
        }
        for c in columns
    ]


def partial_metadata(obj: JSON, version: str = "v1") -> JSON:
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": f"meta.k8s.io/{version}",
        "metadata": obj.get("metadata", {}),
    }


def row(rt: ResourceType, version: str, obj: JSON, include_object: str, table_v: str) -> JSON:
    meta = obj.get("metadata") or {}
    columns = rt.columns(version)
    if columns is None:
        cells: list[Any] = [meta.get("name", ""), age(meta.get("creationTimestamp"))]
    else:
        cells = [meta.get("name", "")] + [_cell(c, obj) for c in columns]
    out: JSON = {"cells": cells}
    if include_object == "Object":
        out["object"] = obj
    elif include_object != "None":
        out["object"] = partial_metadata(obj, table_v)
    return out


def table(
    rt: ResourceType,
    version: str,
    objects: list[JSON],
    resource_version: str,
    *,
    include_object: str = "Metadata",
    table_version: str = "v1",
    no_headers: bool = False,
) -> JSON:
    out: JSON = {
        "kind": "Table",
        "apiVersion": f"meta.k8s.io/{table_version}",
        "metadata": {"resourceVersion": resource_version},
    }
    if not no_headers:
        out["columnDefinitions"] = column_definitions(rt, version)
    out["rows"] = [row(rt, version, o, include_object, table_version) for o in objects]
    return out
