"""Tests for the Akri-compatible CRDs in ``crds/`` (see docs/crds.md).

No API server runs here: the API server's CRD pipeline is reproduced in pieces by
``tests/doubles/crd_pipeline.py`` (structural-schema checks, pruning and defaulting, OpenAPI
validation, CEL rules); these tests drive it over the manifests and the fixtures.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openapi_schema_validator import OAS30Validator

from tests.doubles.crd_pipeline import (  # noqa: F401 - re-exported for other test modules
    CEL_ENV,
    CONFIGURATION_CRD,
    CONFIGURATION_FIXTURES,
    CRD_DIR,
    FIXTURES,
    INSTANCE_CRD,
    INSTANCE_FIXTURES,
    JUNCTORS,
    ROOT,
    Path_,
    Schema,
    cel_eval,
    cel_rules,
    cel_violations,
    load_crd,
    load_yaml,
    node_at,
    prepare,
    schema_errors,
    schema_of,
    spec_only,
    unknown_fields,
    values_at,
    walk,
    walk_junctors,
)


@pytest.fixture(scope="module")
def configuration_crd() -> dict[str, Any]:
    return load_crd(CONFIGURATION_CRD)


@pytest.fixture(scope="module")
def instance_crd() -> dict[str, Any]:
    return load_crd(INSTANCE_CRD)


@pytest.fixture(scope="module")
def configuration_schema(configuration_crd: dict[str, Any]) -> Schema:
    return schema_of(configuration_crd)


@pytest.fixture(scope="module")
def instance_schema(instance_crd: dict[str, Any]) -> Schema:
    return schema_of(instance_crd)


@pytest.mark.parametrize(
    ("path", "kind", "plural", "singular", "short"),
    [
        (CONFIGURATION_CRD, "Configuration", "configurations", "configuration", "akric"),
        (INSTANCE_CRD, "Instance", "instances", "instance", "akrii"),
    ],
)
def test_crd_manifest(path: Path, kind: str, plural: str, singular: str, short: str) -> None:
    crd = load_crd(path)
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    spec = crd["spec"]
    assert spec["group"] == "akri.sh"
    assert crd["metadata"]["name"] == f"{plural}.akri.sh"  # must be <plural>.<group>
    assert spec["scope"] == "Namespaced"
    names = spec["names"]
    assert names["kind"] == kind
    assert names["plural"] == plural
    assert names["singular"] == singular
    assert names["shortNames"] == [short]
    assert names["categories"] == ["all"]
    assert names.get("listKind", f"{kind}List") == f"{kind}List"
    for value in (plural, singular, short):
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", value), value
    assert not spec.get("preserveUnknownFields", False), "v1 CRDs must be structural"
    versions = spec["versions"]
    assert [v["name"] for v in versions] == ["v0"]
    assert sum(1 for v in versions if v["storage"]) == 1, "exactly one storage version"
    assert all(v["served"] for v in versions)
    root = versions[0]["schema"]["openAPIV3Schema"]
    assert root["type"] == "object"
    assert "subresources" not in versions[0], "Akri's CRDs have no status subresource"
    OAS30Validator.check_schema(root)


@pytest.mark.parametrize("path", [CONFIGURATION_CRD, INSTANCE_CRD], ids=lambda p: p.name)
def test_schema_is_structural(path: Path) -> None:
    """The structural-schema rules of apiextensions.k8s.io/v1 that can be checked by hand."""
    root = schema_of(load_crd(path))
    problems: list[str] = []
    forbidden = {"$ref", "definitions", "dependencies", "patternProperties", "additionalItems"}
    for node_path, node in walk(root):
        where = ".".join(node_path) or "<root>"
        preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
        if "type" not in node and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{where}: no type")
        if node.get("type") == "object" and not (
            "properties" in node or "additionalProperties" in node or preserve
        ):
            problems.append(f"{where}: object without properties/additionalProperties/preserve")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: properties and additionalProperties are exclusive")
        if node.get("type") == "array" and not isinstance(node.get("items"), dict):
            problems.append(f"{where}: array without a single items schema")
        if node.get("uniqueItems"):
            problems.append(f"{where}: uniqueItems is forbidden, use x-kubernetes-list-type: set")
        if forbidden & node.keys():
            problems.append(f"{where}: forbidden keywords {sorted(forbidden & node.keys())}")
        if node_path and node_path[-1] == "metadata" and len(node_path) == 1:
            problems.append("metadata: must not be described (only name/generateName allowed)")
        for name in node.get("required", []):
            if name not in node.get("properties", {}):
                problems.append(f"{where}: required {name!r} is not a property")
        if "default" in node:
            errors = list(OAS30Validator(node).iter_errors(node["default"]))
            if errors:
                problems.append(
                    f"{where}: default {node['default']!r} invalid: {errors[0].message}"
                )
            parent_required = node_at(root, node_path[:-1]).get("required", []) if node_path else []
            if node_path and node_path[-1] in parent_required:
                problems.append(f"{where}: a required field must not have a default")
        list_type = node.get("x-kubernetes-list-type")
        if list_type is not None:
            if node.get("type") != "array" or list_type not in ("atomic", "set", "map"):
                problems.append(f"{where}: bad x-kubernetes-list-type {list_type!r}")
            if list_type == "set" and node["items"].get("type") in ("object", "array"):
                problems.append(f"{where}: a set must have scalar items")
        map_type = node.get("x-kubernetes-map-type")
        if map_type is not None and (
            node.get("type") != "object" or map_type not in ("granular", "atomic")
        ):
            problems.append(f"{where}: bad x-kubernetes-map-type {map_type!r}")
    allowed_in_junctor = {
        "required",
        "properties",
        "items",
        "enum",
        "pattern",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "oneOf",
        "anyOf",
        "allOf",
        "not",
        "format",
    }
    for node_path, node, sub in walk_junctors(root):
        where = ".".join(node_path) or "<root>"
        if set(sub) - allowed_in_junctor:
            problems.append(f"{where}: junctor uses {sorted(set(sub) - allowed_in_junctor)}")
        for name in sub.get("required", []) + list(sub.get("properties", {})):
            if name not in node.get("properties", {}):
                problems.append(f"{where}: junctor names {name!r}, not a property of the node")
    assert not problems, "\n".join(problems)


def test_structural_check_catches_problems() -> None:
    """The structural walker itself: a bare object and an untyped node are both found."""
    bad = {"type": "object", "properties": {"a": {"type": "object"}, "b": {}}}
    paths = {
        ".".join(p)
        for p, node in walk(bad)
        if node.get("type") == "object"
        and not ({"properties", "additionalProperties"} & node.keys())
    }
    assert paths == {"a"}
    assert [".".join(p) for p, node in walk(bad) if "type" not in node] == ["b"]


def schema_path_exists(root: Schema, json_path: str) -> bool:
    parts = json_path.lstrip(".").split(".")
    if parts[0] == "metadata":
        return parts[1:] in (["name"], ["namespace"], ["creationTimestamp"], ["generation"])
    try:
        node_at(root, tuple(parts))
    except KeyError:
        return False
    return True


@pytest.mark.parametrize(
    ("path", "columns"),
    [
        (CONFIGURATION_CRD, ["Capacity", "Handler", "Age"]),
        (INSTANCE_CRD, ["Config", "Shared", "Nodes", "Capacity", "Age"]),
    ],
    ids=["configuration", "instance"],
)
def test_printer_columns(path: Path, columns: list[str]) -> None:
    crd = load_crd(path)
    (version,) = crd["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    printed = version["additionalPrinterColumns"]
    assert [column["name"] for column in printed] == columns
    schema_types = {"integer": "integer", "boolean": "boolean", "number": "number"}
    for column in printed:
        json_path = column["jsonPath"]
        assert re.fullmatch(r"(\.[A-Za-z_][A-Za-z0-9_]*)+", json_path), json_path
        assert schema_path_exists(root, json_path), f"{column['name']}: {json_path} not in schema"
        assert column["type"] in ("integer", "number", "string", "boolean", "date")
        if column["type"] in schema_types and not json_path.startswith(".metadata"):
            node = node_at(root, tuple(json_path.lstrip(".").split(".")))
            assert node["type"] == schema_types[column["type"]], column["name"]
    assert printed[-1] == {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def test_printer_column_path_check_fails_on_unknown_field(configuration_schema: Schema) -> None:
    assert schema_path_exists(configuration_schema, ".spec.discoveryHandler.name")
    assert not schema_path_exists(configuration_schema, ".spec.discoveryHandler.nmae")
    assert not schema_path_exists(configuration_schema, ".metadata.uid")


# --------------------------------------------------------------------------------------------
# Configurations


def test_fixtures_present() -> None:
    names = {path.name for path in CONFIGURATION_FIXTURES}
    assert {
        "debug-echo.yaml",
        "onvif.yaml",
        "udev-video.yaml",
        "debug-echo-job.yaml",
        "opcua.yaml",
    } <= names
    assert {"onvif-v013.yaml", "legacy-v012.yaml"} <= {path.name for path in INSTANCE_FIXTURES}


@pytest.mark.parametrize("path", CONFIGURATION_FIXTURES, ids=lambda p: p.stem)
def test_akri_configurations_accepted(path: Path, configuration_schema: Schema) -> None:
    obj = load_yaml(path)
    assert obj["apiVersion"] == "akri.sh/v0" and obj["kind"] == "Configuration"
    assert schema_errors(obj, configuration_schema) == []
    assert unknown_fields(spec_only(obj), configuration_schema) == [], "fields would be pruned"
    assert cel_violations(obj, configuration_schema) == []
    assert cel_violations(obj, configuration_schema, old=obj) == []  # no-op update


def test_configuration_defaults(configuration_schema: Schema) -> None:
    spec = prepare(
        spec_only(load_yaml(FIXTURES / "configurations" / "minimal.yaml")), configuration_schema
    )["spec"]
    assert spec["capacity"] == 1
    assert spec["discoveryHandler"] == {"name": "debugEcho", "discoveryDetails": ""}
    assert spec["brokerProperties"] == {}
    assert "brokerSpec" not in spec and "instanceServiceSpec" not in spec
    onvif = prepare(
        spec_only(load_yaml(FIXTURES / "configurations" / "onvif.yaml")), configuration_schema
    )["spec"]
    ref = onvif["discoveryHandler"]["discoveryProperties"][1]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "cam-creds", "namespace": "default", "key": "pass", "optional": True}
    opcua = prepare(
        spec_only(load_yaml(FIXTURES / "configurations" / "opcua.yaml")), configuration_schema
    )["spec"]
    ref = opcua["discoveryHandler"]["discoveryProperties"][0]["valueFrom"]["configMapKeyRef"]
    assert ref["namespace"] == "default"


def mutate(obj: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    result = copy.deepcopy(obj)
    change(result)
    return result


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        parts = path.split(".")
        target: Any = obj
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target[int(parts[-1])] = value
        else:
            target[parts[-1]] = value

    return change


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        parts = path.split(".")
        target: Any = obj
        for part in parts[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        del target[parts[-1]]

    return change


PROPS = "spec.discoveryHandler.discoveryProperties"

CONFIGURATION_REJECTS = [
    ("capacity-0", _set("spec.capacity", 0), "spec.capacity", "0 is less than the minimum of 1"),
    (
        "capacity-negative",
        _set("spec.capacity", -1),
        "spec.capacity",
        "-1 is less than the minimum of 1",
    ),
    (
        "capacity-1001",
        _set("spec.capacity", 1001),
        "spec.capacity",
        "1001 is greater than the maximum of 1000",
    ),
    (
        "capacity-string",
        _set("spec.capacity", "2"),
        "spec.capacity",
        "'2' is not of type 'integer'",
    ),
    (
        "capacity-bool",
        _set("spec.capacity", True),
        "spec.capacity",
        "True is not of type 'integer'",
    ),
    (
        "no-handler-name",
        _delete("spec.discoveryHandler.name"),
        "spec.discoveryHandler",
        "'name' is a required property",
    ),
    (
        "empty-handler-name",
        _set("spec.discoveryHandler.name", ""),
        "spec.discoveryHandler.name",
        "should be non-empty",
    ),
    (
        "long-handler-name",
        _set("spec.discoveryHandler.name", "h" * 254),
        "spec.discoveryHandler.name",
        "is too long",
    ),
    (
        "no-handler",
        _delete("spec.discoveryHandler"),
        "spec",
        "'discoveryHandler' is a required property",
    ),
    (
        "details-not-string",
        _set("spec.discoveryHandler.discoveryDetails", {"udevRules": []}),
        "spec.discoveryHandler.discoveryDetails",
        "is not of type 'string'",
    ),
    (
        "property-name-digit",
        _set(f"{PROPS}.0.name", "9bad"),
        f"{PROPS}.0.name",
        "'9bad' does not match '^[_A-Za-z][_A-Za-z0-9]*$'",
    ),
    (
        "property-name-dash",
        _set(f"{PROPS}.0.name", "user-name"),
        f"{PROPS}.0.name",
        "'user-name' does not match",
    ),
    ("property-no-name", _delete(f"{PROPS}.0.name"), f"{PROPS}.0", "'name' is a required property"),
    (
        "secret-ref-no-key",
        _delete(f"{PROPS}.0.valueFrom.secretKeyRef.key"),
        f"{PROPS}.0.valueFrom.secretKeyRef",
        "'key' is a required property",
    ),
    (
        "value-from-empty",
        _set(f"{PROPS}.0.valueFrom", {}),
        f"{PROPS}.0.valueFrom",
        "is not valid under any of the given schemas",
    ),
    (
        "value-from-both-refs",
        _set(f"{PROPS}.0.valueFrom.configMapKeyRef", {"name": "cm", "key": "k"}),
        f"{PROPS}.0.valueFrom",
        "is valid under each of",
    ),
    (
        "optional-not-bool",
        _set(f"{PROPS}.1.valueFrom.secretKeyRef.optional", "yes"),
        f"{PROPS}.1.valueFrom.secretKeyRef.optional",
        "'yes' is not of type 'boolean'",
    ),
    (
        "broker-properties-int",
        _set("spec.brokerProperties.RESOLUTION_WIDTH", 800),
        "spec.brokerProperties.RESOLUTION_WIDTH",
        "800 is not of type 'string'",
    ),
    (
        "pod-spec-list",
        _set("spec.brokerSpec.brokerPodSpec", []),
        "spec.brokerSpec.brokerPodSpec",
        "[] is not of type 'object'",
    ),
    ("no-spec", _delete("spec"), "", "'spec' is a required property"),
]


@pytest.mark.parametrize(
    ("change", "where", "message"),
    [case[1:] for case in CONFIGURATION_REJECTS],
    ids=[case[0] for case in CONFIGURATION_REJECTS],
)
def test_invalid_configurations_rejected(
    change: Callable[[dict[str, Any]], None],
    where: str,
    message: str,
    configuration_schema: Schema,
) -> None:
    base = load_yaml(FIXTURES / "configurations" / "onvif.yaml")
    assert schema_errors(base, configuration_schema) == []
    errors = schema_errors(mutate(base, change), configuration_schema)
    assert any(path == where and message in text for path, text in errors), errors


def test_property_with_neither_value_nor_value_from_accepted(configuration_schema: Schema) -> None:
    """Akri passes such a property as ByteData None; it must stay valid."""
    obj = mutate(
        load_yaml(FIXTURES / "configurations" / "minimal.yaml"),
        _set("spec.discoveryHandler.discoveryProperties", [{"name": "FLAG"}]),
    )
    assert schema_errors(obj, configuration_schema) == []
    assert cel_violations(obj, configuration_schema) == []


def test_null_discovery_properties_accepted(configuration_schema: Schema) -> None:
    obj = mutate(
        load_yaml(FIXTURES / "configurations" / "minimal.yaml"),
        _set("spec.discoveryHandler.discoveryProperties", None),
    )
    assert schema_errors(obj, configuration_schema) == []


# --------------------------------------------------------------------------------------------
# CEL rules

EXPECTED_CONFIGURATION_RULES = {
    ("spec", "discoveryHandler", "name"): (
        "self == oldSelf",
        "discoveryHandler.name is immutable; delete and recreate the Configuration",
    ),
    ("spec", "discoveryHandler", "discoveryProperties", "[]"): (
        "!(has(self.value) && has(self.valueFrom))",
        "a discovery property sets either value or valueFrom, not both",
    ),
    ("spec", "brokerSpec"): (
        "!(has(self.brokerPodSpec) && has(self.brokerJobSpec))",
        "brokerSpec sets either brokerPodSpec or brokerJobSpec, not both",
    ),
}


def test_cel_rules_present(configuration_schema: Schema, instance_schema: Schema) -> None:
    rules = {path: (rule, message) for path, rule, message in cel_rules(configuration_schema)}
    assert rules == EXPECTED_CONFIGURATION_RULES
    assert cel_rules(instance_schema) == []


@pytest.mark.parametrize("path", [CONFIGURATION_CRD, INSTANCE_CRD], ids=lambda p: p.name)
def test_cel_rules_well_formed(path: Path) -> None:
    """Rules compile, messages are single-line, fields referenced exist, and transition rules
    are not under a list (the API server cannot correlate old and new items of atomic lists)."""
    root = schema_of(load_crd(path))
    for rule_path, rule, message in cel_rules(root):
        CEL_ENV.compile(rule)
        assert message and "\n" not in message and len(message) < 2048
        node = node_at(root, rule_path)
        for field in re.findall(r"self\.([A-Za-z_][A-Za-z0-9_]*)", rule):
            assert field in node.get("properties", {}), f"{rule!r} names unknown field {field}"
        if "oldSelf" in rule:
            assert "[]" not in rule_path and "{}" not in rule_path, rule_path
        if node.get("type") == "string":
            assert "maxLength" in node, "bound strings used in CEL (cost estimation)"


def test_cel_handler_name_immutable(configuration_schema: Schema) -> None:
    old = load_yaml(FIXTURES / "configurations" / "onvif.yaml")
    renamed = mutate(old, _set("spec.discoveryHandler.name", "udev"))
    message = "discoveryHandler.name is immutable; delete and recreate the Configuration"
    assert cel_violations(renamed, configuration_schema, old=old) == [message]
    # creating it is fine, and so is changing anything else
    assert cel_violations(renamed, configuration_schema) == []
    edited = mutate(old, _set("spec.discoveryHandler.discoveryDetails", "scopes: {}"))
    edited = mutate(edited, _set("spec.capacity", 5))
    assert cel_violations(edited, configuration_schema, old=old) == []


def test_cel_value_and_value_from_exclusive(configuration_schema: Schema) -> None:
    base = load_yaml(FIXTURES / "configurations" / "onvif.yaml")
    both = mutate(base, _set(f"{PROPS}.0.value", "admin"))
    assert schema_errors(both, configuration_schema) == []  # only CEL catches it
    assert cel_violations(both, configuration_schema) == [
        "a discovery property sets either value or valueFrom, not both"
    ]
    # value: null is pruned (not nullable) before CEL runs, like Akri reads it as None
    null_value = mutate(base, _set(f"{PROPS}.0.value", None))
    assert schema_errors(null_value, configuration_schema) == []
    assert cel_violations(null_value, configuration_schema) == []


def test_cel_broker_pod_and_job_exclusive(configuration_schema: Schema) -> None:
    job = load_yaml(FIXTURES / "configurations" / "debug-echo-job.yaml")
    pod = load_yaml(FIXTURES / "configurations" / "debug-echo.yaml")
    both = mutate(
        job, _set("spec.brokerSpec.brokerPodSpec", pod["spec"]["brokerSpec"]["brokerPodSpec"])
    )
    assert schema_errors(both, configuration_schema) == []  # only CEL catches it
    assert cel_violations(both, configuration_schema) == [
        "brokerSpec sets either brokerPodSpec or brokerJobSpec, not both"
    ]
    neither = mutate(job, _set("spec.brokerSpec", {}))
    assert cel_violations(neither, configuration_schema) == []


@pytest.mark.parametrize(
    ("rule", "value", "old", "expected"),
    [
        ("self == oldSelf", "onvif", "onvif", True),
        ("self == oldSelf", "udev", "onvif", False),
        ("!(has(self.value) && has(self.valueFrom))", {"name": "a"}, None, True),
        ("!(has(self.value) && has(self.valueFrom))", {"name": "a", "value": "x"}, None, True),
        (
            "!(has(self.value) && has(self.valueFrom))",
            {"name": "a", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            None,
            True,
        ),
        (
            "!(has(self.value) && has(self.valueFrom))",
            {"name": "a", "value": "x", "valueFrom": {}},
            None,
            False,
        ),
        ("!(has(self.brokerPodSpec) && has(self.brokerJobSpec))", {}, None, True),
        (
            "!(has(self.brokerPodSpec) && has(self.brokerJobSpec))",
            {"brokerPodSpec": {"containers": []}, "brokerJobSpec": {"template": {}}},
            None,
            False,
        ),
    ],
)
def test_cel_rule_semantics(rule: str, value: Any, old: Any, expected: bool) -> None:
    assert cel_eval(rule, value, old) is expected


# --------------------------------------------------------------------------------------------
# Instances


@pytest.mark.parametrize("path", INSTANCE_FIXTURES, ids=lambda p: p.stem)
def test_instances_accepted(path: Path, instance_schema: Schema) -> None:
    obj = load_yaml(path)
    assert obj["apiVersion"] == "akri.sh/v0" and obj["kind"] == "Instance"
    assert schema_errors(obj, instance_schema) == []
    assert unknown_fields(spec_only(obj), instance_schema) == [], "fields would be pruned"


def test_instance_defaults(instance_schema: Schema) -> None:
    obj = {"spec": {"configurationName": "cams"}}
    spec = prepare(obj, instance_schema)["spec"]
    assert spec == {
        "configurationName": "cams",
        "brokerProperties": {},
        "shared": False,
        "nodes": [],
        "deviceUsage": {},
    }
    assert "capacity" not in spec and "cdiName" not in spec  # optional, never invented
    assert schema_errors(obj, instance_schema) == []


def test_instance_list_and_map_types(instance_schema: Schema) -> None:
    spec = instance_schema["properties"]["spec"]["properties"]
    assert spec["nodes"]["x-kubernetes-list-type"] == "set"
    assert spec["deviceUsage"]["x-kubernetes-map-type"] == "granular"
    assert spec["deviceUsage"]["additionalProperties"] == {"type": "string"}
    assert instance_schema["properties"]["spec"]["required"] == ["configurationName"]


INSTANCE_REJECTS = [
    (
        "nodes-not-list",
        _set("spec.nodes", "node-a"),
        "spec.nodes",
        "'node-a' is not of type 'array'",
    ),
    (
        "nodes-item-not-string",
        _set("spec.nodes", ["node-a", 7]),
        "spec.nodes.1",
        "7 is not of type 'string'",
    ),
    (
        "device-usage-int",
        _set("spec.deviceUsage.cams-8120fe-0", 1),
        "spec.deviceUsage.cams-8120fe-0",
        "1 is not of type 'string'",
    ),
    (
        "device-usage-object",
        _set("spec.deviceUsage", {"cams-8120fe-0": {"node": "node-a"}}),
        "spec.deviceUsage.cams-8120fe-0",
        "is not of type 'string'",
    ),
    (
        "device-usage-list",
        _set("spec.deviceUsage", ["cams-8120fe-0"]),
        "spec.deviceUsage",
        "is not of type 'object'",
    ),
    (
        "no-configuration-name",
        _delete("spec.configurationName"),
        "spec",
        "'configurationName' is a required property",
    ),
    (
        "empty-configuration-name",
        _set("spec.configurationName", ""),
        "spec.configurationName",
        "should be non-empty",
    ),
    ("capacity-0", _set("spec.capacity", 0), "spec.capacity", "0 is less than the minimum of 1"),
    (
        "capacity-1001",
        _set("spec.capacity", 1001),
        "spec.capacity",
        "1001 is greater than the maximum of 1000",
    ),
    (
        "capacity-string",
        _set("spec.capacity", "2"),
        "spec.capacity",
        "'2' is not of type 'integer'",
    ),
    (
        "shared-string",
        _set("spec.shared", "true"),
        "spec.shared",
        "'true' is not of type 'boolean'",
    ),
    (
        "broker-properties-bool",
        _set("spec.brokerProperties.RESOLUTION_WIDTH", True),
        "spec.brokerProperties.RESOLUTION_WIDTH",
        "True is not of type 'string'",
    ),
    ("cdi-name-int", _set("spec.cdiName", 5), "spec.cdiName", "5 is not of type 'string'"),
]


@pytest.mark.parametrize(
    ("change", "where", "message"),
    [case[1:] for case in INSTANCE_REJECTS],
    ids=[case[0] for case in INSTANCE_REJECTS],
)
def test_invalid_instances_rejected(
    change: Callable[[dict[str, Any]], None], where: str, message: str, instance_schema: Schema
) -> None:
    base = load_yaml(FIXTURES / "instances" / "onvif-v013.yaml")
    assert schema_errors(base, instance_schema) == []
    errors = schema_errors(mutate(base, change), instance_schema)
    assert any(path == where and message in text for path, text in errors), errors


def test_configuration_rejects_instance_and_back(
    configuration_schema: Schema, instance_schema: Schema
) -> None:
    """The two schemas are not interchangeable (guards against copy-paste between files)."""
    instance = load_yaml(FIXTURES / "instances" / "onvif-v013.yaml")
    configuration = load_yaml(FIXTURES / "configurations" / "onvif.yaml")
    assert any(
        "'discoveryHandler' is a required property" in text
        for _, text in schema_errors(instance, configuration_schema)
    )
    assert any(
        "'configurationName' is a required property" in text
        for _, text in schema_errors(configuration, instance_schema)
    )
