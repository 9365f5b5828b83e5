"""Configuration validation: accepts Akri's shapes, rejects bad ones with field paths."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from agent.core.model.configuration import ConfigurationError, parse_configuration

ONVIF = yaml.safe_load(
    """
apiVersion: akri.sh/v0
kind: Configuration
metadata: {name: cams}
spec:
  discoveryHandler:
    name: onvif
    discoveryDetails: |
      ipAddresses: {action: Exclude, items: []}
      discoveryTimeoutSeconds: 2
    discoveryProperties:
      - name: username_default
        valueFrom: {secretKeyRef: {name: cam-creds, namespace: default, key: user}}
      - name: password_default
        valueFrom: {secretKeyRef: {name: cam-creds, key: pass, optional: true}}
      - name: literal
        value: "x"
      - name: empty
  capacity: 2
  brokerSpec:
    brokerPodSpec:
      containers:
      - name: broker
        image: example/frame-server
        resources:
          limits:   {"{{PLACEHOLDER}}": "1"}
  instanceServiceSpec:      {type: ClusterIP, ports: [{name: grpc, port: 80, targetPort: 8083}]}
  configurationServiceSpec: {type: ClusterIP, ports: [{name: grpc, port: 80, targetPort: 8083}]}
  brokerProperties: {RESOLUTION_WIDTH: "800"}
"""
)


def _problems(obj: Any) -> list[str]:
    with pytest.raises(ConfigurationError) as info:
        parse_configuration(obj)
    return info.value.problems


def test_akri_onvif_example_parses_fully() -> None:
    cfg = parse_configuration(ONVIF)
    assert cfg.name == "cams"
    assert cfg.namespace == "default"
    assert cfg.capacity == 2
    assert cfg.discovery_handler.name == "onvif"
    assert "discoveryTimeoutSeconds" in cfg.discovery_handler.discovery_details
    props = {p.name: p for p in cfg.discovery_handler.discovery_properties}
    assert props["username_default"].value_from is not None
    assert props["username_default"].value_from.kind == "secret"
    assert props["password_default"].value_from is not None
    assert props["password_default"].value_from.optional is True
    assert props["password_default"].value_from.namespace == "default"
    assert props["literal"].value == "x"
    assert props["empty"].value is None and props["empty"].value_from is None
    assert cfg.broker_properties == {"RESOLUTION_WIDTH": "800"}
    assert cfg.broker_spec is not None and "brokerPodSpec" in cfg.broker_spec
    assert cfg.instance_service_spec is not None


def test_capacity_defaults_to_one() -> None:
    obj = copy.deepcopy(ONVIF)
    del obj["spec"]["capacity"]
    assert parse_configuration(obj).capacity == 1


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda o: o["spec"].update(capacity=0), "spec.capacity"),
        (lambda o: o["spec"].update(capacity=-1), "spec.capacity"),
        (lambda o: o["spec"].update(capacity=100000), "spec.capacity"),
        (lambda o: o["spec"].update(capacity="2"), "spec.capacity"),
        (lambda o: o["spec"].update(capacity=True), "spec.capacity"),
        (lambda o: o["spec"]["discoveryHandler"].pop("name"), "spec.discoveryHandler.name"),
        (lambda o: o["spec"]["discoveryHandler"].update(name=""), "spec.discoveryHandler.name"),
        (lambda o: o["spec"].pop("discoveryHandler"), "spec.discoveryHandler"),
        (
            lambda o: o["spec"]["discoveryHandler"].update(discoveryDetails={"a": 1}),
            "spec.discoveryHandler.discoveryDetails",
        ),
        (
            lambda o: o["spec"]["discoveryHandler"]["discoveryProperties"][0].update(name="9bad"),
            "spec.discoveryHandler.discoveryProperties[0].name",
        ),
        (
            lambda o: o["spec"]["discoveryHandler"]["discoveryProperties"][2].update(
                valueFrom={"secretKeyRef": {"name": "s", "key": "k"}}
            ),
            "spec.discoveryHandler.discoveryProperties[2]",
        ),
        (lambda o: o["spec"].update(brokerProperties={"A": 1}), "spec.brokerProperties.A"),
        (
            lambda o: o["spec"]["brokerSpec"].update(brokerJobSpec={"template": {}}),
            "spec.brokerSpec",
        ),
        (lambda o: o.update(kind="Pod"), "kind"),
        (lambda o: o.update(apiVersion="akri.sh/v1"), "apiVersion"),
        (lambda o: o["metadata"].update(name="Bad_Name"), "metadata.name"),
        (lambda o: o.pop("spec"), "spec"),
    ],
)
def test_bad_configurations_name_the_field(mutate: Any, field: str) -> None:
    obj = copy.deepcopy(ONVIF)
    mutate(obj)
    problems = _problems(obj)
    assert any(p.startswith(field + ":") or p.startswith(field + " ") for p in problems), problems


def test_all_problems_are_reported_at_once() -> None:
    obj = copy.deepcopy(ONVIF)
    obj["spec"]["capacity"] = -5
    obj["kind"] = "Nope"
    problems = _problems(obj)
    assert len(problems) >= 2
    assert "must be between 1 and 1000" in str(problems)


@pytest.mark.parametrize("obj", [None, [], "text", 5])
def test_non_objects_are_rejected(obj: Any) -> None:
    assert _problems(obj)


def test_hash_changes_track_discovery_and_spec() -> None:
    base = parse_configuration(ONVIF)
    capacity = copy.deepcopy(ONVIF)
    capacity["spec"]["capacity"] = 3
    changed = parse_configuration(capacity)
    assert changed.discovery_hash == base.discovery_hash
    assert changed.spec_hash != base.spec_hash
    details = copy.deepcopy(ONVIF)
    details["spec"]["discoveryHandler"]["discoveryDetails"] = "scopes: {items: [x]}"
    assert parse_configuration(details).discovery_hash != base.discovery_hash


# -- unknown fields (issue 34.8) -------------------------------------------------------------
def with_typos() -> dict[str, Any]:
    doc = copy.deepcopy(ONVIF)
    doc["metadata"]["labls"] = {"a": "b"}
    doc["spec"]["capacty"] = 2
    doc["spec"]["brokerProperites"] = {"RESOLUTION": "800"}
    doc["spec"]["discoveryHandler"]["discoveryProperties"][2]["valu"] = "y"
    doc["spec"]["discoveryHandler"]["discoveryProperties"][0]["valueFrom"]["secretKeyRef"][
        "optinal"
    ] = True
    doc["status"] = {}
    return doc


def test_strict_parsing_names_every_unknown_field_and_what_was_meant() -> None:
    """Before: ``capacty: 2`` quietly gave capacity 1 and ``brokerProperites`` was dropped."""
    with pytest.raises(ConfigurationError) as error:
        parse_configuration(with_typos(), strict=True)
    assert error.value.problems == [
        "metadata.labls: unknown field (did you mean 'labels'?)",
        "spec.discoveryHandler.discoveryProperties[0].valueFrom.secretKeyRef.optinal: "
        "unknown field (did you mean 'optional'?)",
        "spec.discoveryHandler.discoveryProperties[2].valu: unknown field (did you mean 'value'?)",
        "spec.capacty: unknown field (did you mean 'capacity'?)",
        "spec.brokerProperites: unknown field (did you mean 'brokerProperties'?)",
        "status: unknown field",
    ]


def test_what_the_crd_keeps_as_it_is_may_hold_anything() -> None:
    """Broker Pod/Job and Service specs are preserved unchecked by the CRD; brokerProperties
    and labels are maps; the API server's own metadata fields are known."""
    doc = copy.deepcopy(ONVIF)
    doc["spec"]["brokerSpec"] = {"brokerPodSpec": {"containers": [{"name": "b", "anything": 1}]}}
    doc["spec"]["instanceServiceSpec"] = {"ports": [{"port": 80}], "whatever": True}
    doc["spec"]["brokerProperties"] = {"ANY_NAME": "v"}
    doc["metadata"].update(
        labels={"x": "y"}, uid="u", resourceVersion="1", generation=2, managedFields=[{}],
        creationTimestamp="2024-01-01T00:00:00Z", finalizers=["f"],
    )  # fmt: skip
    assert parse_configuration(doc, strict=True).name == "cams"


def test_without_strict_an_api_server_s_object_is_read_as_before() -> None:
    """Cluster mode: the API server has pruned or refused unknown fields already; a field a
    newer API server adds to metadata must not make the agent refuse a Configuration."""
    assert parse_configuration(with_typos()).capacity == ONVIF["spec"].get("capacity", 1)


def crd_fields(schema: dict[str, Any]) -> Any:
    """The CRD schema as a field tree (the shape of CONFIGURATION_FIELDS)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema:
        return None
    if schema.get("type") == "array":
        return [crd_fields(schema["items"])]
    if "properties" in schema:
        return {name: crd_fields(sub) for name, sub in schema["properties"].items()}
    return None


def test_the_known_fields_are_the_crd_s() -> None:
    from agent.core.model.configuration import CONFIGURATION_FIELDS
    from tests.paths import REPO

    crd = yaml.safe_load((REPO / "crds" / "akri-configuration-crd.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    assert set(schema["properties"]) == {"spec"}  # apiVersion, kind, metadata: every object's
    assert CONFIGURATION_FIELDS["spec"] == crd_fields(schema["properties"]["spec"])


def test_every_example_and_fixture_parses_strictly() -> None:
    from tests.paths import REPO

    paths = [*(REPO / "examples").glob("*.yaml"),
             *(REPO / "tests" / "fixtures" / "crds" / "configurations").glob("*.yaml")]  # fmt: skip
    checked = 0
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Configuration":
                parse_configuration(doc, strict=True)
                checked += 1
    assert checked >= 10
