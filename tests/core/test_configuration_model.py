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
