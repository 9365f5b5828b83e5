"""The API server's CRD pipeline, reproduced in pieces (no API server runs in these tests).

Stands for what kube-apiserver does with our CRDs and the custom resources they define:
the manifests' structural-schema rules that can be checked by hand; custom resources pruned
(nulls of non-nullable fields) and defaulted as the server does before validation, then
validated against ``openAPIV3Schema`` with ``openapi_schema_validator.OAS30Validator``; and the
CEL ``x-kubernetes-validations`` rules evaluated with cel-python, ``self``/``oldSelf`` bound as
the server binds them. Where it differs: no cost estimation of CEL rules, no ratcheting, and
formats are checked as OpenAPI 3.0 does, not with the server's Go format checkers.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy.adapter import json_to_cel
from openapi_schema_validator import OAS30Validator

from tests.paths import FIXTURES as TEST_FIXTURES
from tests.paths import REPO

ROOT = REPO
CRD_DIR = ROOT / "crds"
FIXTURES = TEST_FIXTURES / "crds"
CONFIGURATION_CRD = CRD_DIR / "akri-configuration-crd.yaml"
INSTANCE_CRD = CRD_DIR / "akri-instance-crd.yaml"

CONFIGURATION_FIXTURES = sorted((FIXTURES / "configurations").glob("*.yaml"))
INSTANCE_FIXTURES = sorted((FIXTURES / "instances").glob("*.yaml"))

Schema = dict[str, Any]
Path_ = tuple[str, ...]


# --------------------------------------------------------------------------------------------
# helpers


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def load_crd(path: Path) -> dict[str, Any]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]
    assert len(docs) == 1, f"{path.name}: expected exactly one YAML document, got {len(docs)}"
    crd: dict[str, Any] = docs[0]
    return crd


def schema_of(crd: dict[str, Any]) -> Schema:
    (version,) = crd["spec"]["versions"]
    root: Schema = version["schema"]["openAPIV3Schema"]
    return root


JUNCTORS = ("oneOf", "anyOf", "allOf")


def walk(schema: Schema, path: Path_ = ()) -> Iterator[tuple[Path_, Schema]]:
    """Every typed schema node with its path (``[]`` = list item, ``{}`` = map value).

    Logical junctors (oneOf/anyOf/allOf/not) are not descended into: their sub-schemas are
    value validations, checked separately by :func:`walk_junctors`.
    """
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from walk(child, (*path, name))
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], (*path, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], (*path, "{}"))


def walk_junctors(schema: Schema) -> Iterator[tuple[Path_, Schema, Schema]]:
    """(path, owning node, junctor sub-schema) for every oneOf/anyOf/allOf/not entry."""
    for path, node in walk(schema):
        for junctor in JUNCTORS:
            for sub in node.get(junctor, []):
                yield path, node, sub
        if "not" in node:
            yield path, node, node["not"]


def node_at(schema: Schema, path: Path_) -> Schema:
    node = schema
    for part in path:
        if part == "[]":
            node = node["items"]
        elif part == "{}":
            node = node["additionalProperties"]
        else:
            node = node["properties"][part]
    return node


def values_at(obj: Any, path: Path_) -> Iterator[Any]:
    """All values of ``obj`` found at a schema path (lists and maps fan out)."""
    if not path:
        yield obj
        return
    head, rest = path[0], path[1:]
    if head == "[]":
        if isinstance(obj, list):
            for item in obj:
                yield from values_at(item, rest)
    elif head == "{}":
        if isinstance(obj, dict):
            for item in obj.values():
                yield from values_at(item, rest)
    elif isinstance(obj, dict) and head in obj:
        yield from values_at(obj[head], rest)


def prepare(obj: Any, schema: Schema) -> Any:
    """What the API server does to a custom resource before validating it.

    Null values of fields that are not ``nullable`` are pruned, then ``default`` values are
    applied to absent fields (apiextensions "Defaulting and Nullable"). Unknown fields are left
    in place: :func:`unknown_fields` reports them instead, so a fixture cannot lose data to
    pruning without a test noticing.
    """
    if not isinstance(obj, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        if isinstance(obj, list) and isinstance(schema.get("items"), dict):
            return [prepare(item, schema["items"]) for item in obj]
        return obj
    result: dict[str, Any] = {}
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    for key, value in obj.items():
        child = properties.get(key) or (extra if isinstance(extra, dict) else None)
        if child is None:
            result[key] = value
            continue
        if value is None and not child.get("nullable", False):
            continue  # pruned
        if isinstance(value, list) and isinstance(child.get("items"), dict):
            result[key] = [prepare(item, child["items"]) for item in value]
        else:
            result[key] = prepare(value, child)
    for key, child in properties.items():
        if key not in result and "default" in child:
            result[key] = prepare(copy.deepcopy(child["default"]), child)
    return result


def unknown_fields(obj: Any, schema: Schema, path: str = "") -> list[str]:
    """Fields the API server would prune (or reject under strict field validation)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(obj, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if properties is not None and key in properties:
                found += unknown_fields(value, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, f"{path}.{key}")
            elif extra is not True:
                found.append(f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{path}[{index}]")
    return found


def spec_only(obj: dict[str, Any]) -> dict[str, Any]:
    """The part of a custom resource that openAPIV3Schema describes (metadata is built in)."""
    return {
        key: value for key, value in obj.items() if key not in ("apiVersion", "kind", "metadata")
    }


def schema_errors(obj: dict[str, Any], schema: Schema) -> list[tuple[str, str]]:
    """(dotted path, message) of every schema violation, after API-server preparation."""
    prepared = prepare(spec_only(obj), schema)
    validator = OAS30Validator(schema)
    return sorted(
        (".".join(str(part) for part in error.absolute_path), error.message)
        for error in validator.iter_errors(prepared)
    )


# --------------------------------------------------------------------------------------------
# CEL (x-kubernetes-validations) evaluation with cel-python

CEL_ENV = celpy.Environment()


def cel_rules(schema: Schema) -> list[tuple[Path_, str, str]]:
    return [
        (path, rule["rule"], rule["message"])
        for path, node in walk(schema)
        for rule in node.get("x-kubernetes-validations", [])
    ]


def cel_eval(rule: str, value: Any, old: Any = None) -> bool:
    program = CEL_ENV.program(CEL_ENV.compile(rule))
    activation = {"self": json_to_cel(value)}
    if old is not None:
        activation["oldSelf"] = json_to_cel(old)
    result = program.evaluate(activation)
    assert isinstance(result, celpy.celtypes.BoolType), f"{rule!r} returned {result!r}"
    return bool(result)


def cel_violations(
    new: dict[str, Any], schema: Schema, old: dict[str, Any] | None = None
) -> list[str]:
    """Messages of the CEL rules a create (``old`` None) or update would fail.

    Transition rules (those using ``oldSelf``) run only on update and only where the field
    exists in both objects, like in the API server. Rules are never placed under lists here
    (checked by a test), so old and new values correlate by path.
    """
    messages: list[str] = []
    new_spec = prepare(spec_only(new), schema)
    old_spec = prepare(spec_only(old), schema) if old is not None else None
    for path, rule, message in cel_rules(schema):
        transition = "oldSelf" in rule
        if transition:
            if old_spec is None:
                continue
            pairs = list(zip(values_at(new_spec, path), values_at(old_spec, path), strict=False))
            results = [cel_eval(rule, value, previous) for value, previous in pairs]
        else:
            results = [cel_eval(rule, value) for value in values_at(new_spec, path)]
        if not all(results):
            messages.append(message)
    return messages


# --------------------------------------------------------------------------------------------
# the CRD manifests
