"""Typed ``Configuration`` (``akri.sh/v0``) with validation that names the failing field."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.core.bounded_yaml import brief, did_you_mean
from agent.core.model.keys import DEFAULT_NAMESPACE, ObjectKey
from agent.core.model.naming import MAX_CAPACITY, is_dns_subdomain

API_VERSION = "akri.sh/v0"
KIND = "Configuration"
PROPERTY_NAME_RE = re.compile(r"^[_A-Za-z][_A-Za-z0-9]*$")
MAX_HANDLER_NAME_LENGTH = 253


# The fields a Configuration may have: what crds/akri-configuration-crd.yaml's schema allows
# (tests/core/test_configuration_model.py compares the two), plus what the API server allows
# on every object (apiVersion, kind, ObjectMeta). A dict lists the known fields of an object;
# a one-item list is a list of such objects; None is anything (a string, a map of strings, or
# a part the CRD keeps as it is: x-kubernetes-preserve-unknown-fields, as the broker specs).
FieldTree = dict[str, "FieldTree"] | list["FieldTree"] | None
OBJECT_META_FIELDS: dict[str, FieldTree] = {
    name: None
    for name in (
        "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
        "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
        "annotations", "ownerReferences", "finalizers", "managedFields",
    )
}  # fmt: skip
_KEY_REF: FieldTree = {"name": None, "key": None, "namespace": None, "optional": None}
CONFIGURATION_FIELDS: dict[str, FieldTree] = {
    "apiVersion": None,
    "kind": None,
    "metadata": OBJECT_META_FIELDS,
    "spec": {
        "discoveryHandler": {
            "name": None,
            "discoveryDetails": None,
            "discoveryProperties": [
                {
                    "name": None,
                    "value": None,
                    "valueFrom": {"secretKeyRef": _KEY_REF, "configMapKeyRef": _KEY_REF},
                }
            ],
        },
        "capacity": None,
        "brokerSpec": {"brokerPodSpec": None, "brokerJobSpec": None},
        "instanceServiceSpec": None,
        "configurationServiceSpec": None,
        "brokerProperties": None,
    },
}


def unknown_fields(value: Any, tree: FieldTree = CONFIGURATION_FIELDS, path: str = "") -> list[str]:
    """``path: unknown field (did you mean 'x'?)`` for every field of ``value`` that ``tree``
    does not have, as a real API server's strict field validation (``kubectl apply``'s
    default) refuses them: a misspelt ``capacty`` would otherwise be dropped in silence."""
    found: list[str] = []
    if isinstance(tree, dict) and isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in tree:
                name = where if isinstance(key, str) else brief(where)
                hint = did_you_mean(key, tree).removeprefix("; ") if isinstance(key, str) else ""
                found.append(f"{name}: unknown field" + (f" ({hint})" if hint else ""))
            else:
                found += unknown_fields(item, tree[key], where)
    elif isinstance(tree, list) and isinstance(value, list):
        for index, item in enumerate(value):
            found += unknown_fields(item, tree[0], f"{path}[{index}]")
    return found


class ConfigurationError(ValueError):
    """A Configuration failed validation. ``problems`` lists ``field: message`` strings."""

    def __init__(self, name: str, problems: list[str]) -> None:
        self.name = name
        self.problems = problems
        super().__init__(f"invalid Configuration {brief(name)}: " + "; ".join(problems))


@dataclass(frozen=True)
class KeyRef:
    """``secretKeyRef`` / ``configMapKeyRef`` of a discovery property."""

    kind: str  # "secret" | "configMap"
    name: str
    key: str
    namespace: str = "default"
    optional: bool = False


@dataclass(frozen=True)
class DiscoveryProperty:
    """One ``discoveryProperties`` entry: a literal value, a reference, or neither (Akri: None)."""

    name: str
    value: str | None = None
    value_from: KeyRef | None = None


@dataclass(frozen=True)
class DiscoveryHandlerInfo:
    """``spec.discoveryHandler``."""

    name: str
    discovery_details: str = ""
    discovery_properties: tuple[DiscoveryProperty, ...] = ()


@dataclass(frozen=True)
class Configuration:
    """An Akri Configuration. ``raw`` keeps the full object (broker specs are passed through)."""

    name: str
    namespace: str
    discovery_handler: DiscoveryHandlerInfo
    capacity: int = 1
    broker_properties: Mapping[str, str] = field(default_factory=dict)
    broker_spec: Mapping[str, Any] | None = None
    instance_service_spec: Mapping[str, Any] | None = None
    configuration_service_spec: Mapping[str, Any] | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)
    creation_timestamp: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def key(self) -> ObjectKey:
        """``(namespace, name)``: the Configuration's identity."""
        return ObjectKey(self.namespace, self.name)

    @property
    def discovery_hash(self) -> str:
        """Hash of what the discovery handler sees; a change restarts discovery."""
        return _hash(self.raw.get("spec", {}).get("discoveryHandler", {}))

    @property
    def spec_hash(self) -> str:
        """Hash of the whole spec; a change re-reconciles Instances."""
        return _hash(self.raw.get("spec", {}))


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}")


def _expect_mapping(value: Any, path: str, problems: _Problems) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        problems.add(path, f"must be an object, got {type(value).__name__}")
        return None
    return value


def _string_map(value: Any, path: str, problems: _Problems) -> dict[str, str]:
    mapping = _expect_mapping(value, path, problems)
    if mapping is None:
        return {}
    result: dict[str, str] = {}
    for key, item in mapping.items():
        if not isinstance(key, str):
            problems.add(path, f"key {brief(key)} must be a string")
        elif not isinstance(item, str):
            problems.add(f"{path}.{key}", f"must be a string, got {type(item).__name__}")
        else:
            result[key] = item
    return result


def _parse_key_ref(value: Any, kind: str, path: str, problems: _Problems) -> KeyRef | None:
    mapping = _expect_mapping(value, path, problems)
    if mapping is None:
        return None
    name, key = mapping.get("name"), mapping.get("key")
    namespace = mapping.get("namespace", "default")
    optional = mapping.get("optional", False)
    ok = True
    for label, item in (("name", name), ("key", key), ("namespace", namespace)):
        if not isinstance(item, str) or not item:
            problems.add(f"{path}.{label}", "is required and must be a non-empty string")
            ok = False
    if not isinstance(optional, bool):
        problems.add(f"{path}.optional", "must be a boolean")
        ok = False
    if not ok:
        return None
    return KeyRef(kind, str(name), str(key), str(namespace), bool(optional))


def _parse_property(value: Any, path: str, problems: _Problems) -> DiscoveryProperty | None:
    mapping = _expect_mapping(value, path, problems)
    if mapping is None:
        problems.add(path, "must be an object with a name")
        return None
    name = mapping.get("name")
    if not isinstance(name, str) or not PROPERTY_NAME_RE.match(name):
        problems.add(f"{path}.name", f"must match {PROPERTY_NAME_RE.pattern}, got {brief(name)}")
        return None
    literal = mapping.get("value")
    value_from = _expect_mapping(mapping.get("valueFrom"), f"{path}.valueFrom", problems)
    if literal is not None and value_from is not None:
        problems.add(path, "set either value or valueFrom, not both")
        return None
    if literal is not None and not isinstance(literal, str):
        problems.add(f"{path}.value", f"must be a string, got {type(literal).__name__}")
        return None
    ref: KeyRef | None = None
    if value_from is not None:
        refs = [k for k in ("secretKeyRef", "configMapKeyRef") if k in value_from]
        if len(refs) != 1:
            problems.add(f"{path}.valueFrom", "needs exactly one of secretKeyRef, configMapKeyRef")
            return None
        kind = "secret" if refs[0] == "secretKeyRef" else "configMap"
        ref = _parse_key_ref(value_from[refs[0]], kind, f"{path}.valueFrom.{refs[0]}", problems)
        if ref is None:
            return None
    return DiscoveryProperty(name=name, value=literal, value_from=ref)


def parse_configuration(obj: Any, *, strict: bool = False) -> Configuration:
    """Validate a Configuration object (as read from YAML or the API) and return it typed.

    ``strict``: fields the CRD does not have are errors too (:func:`unknown_fields`), as the
    API server refuses them; for Configurations that never went through one (local files).
    Raises :class:`ConfigurationError` listing every problem with its field path.
    """
    problems = _Problems()
    if not isinstance(obj, Mapping):
        raise ConfigurationError("?", [f"<root>: must be an object, got {type(obj).__name__}"])
    if strict:
        problems.items += unknown_fields(obj)
    metadata = _expect_mapping(obj.get("metadata"), "metadata", problems) or {}
    name = metadata.get("name")
    display = name[:253] if isinstance(name, str) else "?"
    if obj.get("apiVersion") != API_VERSION:
        problems.add("apiVersion", f"must be {API_VERSION!r}, got {brief(obj.get('apiVersion'))}")
    if obj.get("kind") != KIND:
        problems.add("kind", f"must be {KIND!r}, got {brief(obj.get('kind'))}")
    if not isinstance(name, str) or not is_dns_subdomain(name):
        problems.add("metadata.name", f"must be a DNS-1123 subdomain, got {brief(name)}")
    namespace = metadata.get("namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace:
        problems.add("metadata.namespace", "must be a non-empty string")
        namespace = DEFAULT_NAMESPACE
    annotations = _string_map(metadata.get("annotations"), "metadata.annotations", problems)

    spec = _expect_mapping(obj.get("spec"), "spec", problems)
    if spec is None:
        if "spec" not in obj:
            problems.add("spec", "is required")
        raise ConfigurationError(display, problems.items)

    handler = _expect_mapping(spec.get("discoveryHandler"), "spec.discoveryHandler", problems)
    handler_info: DiscoveryHandlerInfo | None = None
    if handler is None:
        if "discoveryHandler" not in spec:
            problems.add("spec.discoveryHandler", "is required")
    else:
        handler_name = handler.get("name")
        if not isinstance(handler_name, str) or not handler_name.strip():
            problems.add("spec.discoveryHandler.name", "is required and must be a non-empty string")
        elif len(handler_name) > MAX_HANDLER_NAME_LENGTH:
            problems.add("spec.discoveryHandler.name", "is too long")
        details = handler.get("discoveryDetails", "")
        if details is None:
            details = ""
        if not isinstance(details, str):
            problems.add(
                "spec.discoveryHandler.discoveryDetails",
                f"must be a string (YAML text), got {type(details).__name__}",
            )
            details = ""
        raw_props = handler.get("discoveryProperties") or []
        props: list[DiscoveryProperty] = []
        if not isinstance(raw_props, list):
            problems.add("spec.discoveryHandler.discoveryProperties", "must be a list")
        else:
            for index, item in enumerate(raw_props):
                prop = _parse_property(
                    item, f"spec.discoveryHandler.discoveryProperties[{index}]", problems
                )
                if prop is not None:
                    props.append(prop)
        if isinstance(handler_name, str) and handler_name.strip():
            handler_info = DiscoveryHandlerInfo(handler_name, details, tuple(props))

    capacity = spec.get("capacity", 1)
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        problems.add("spec.capacity", f"must be an integer, got {brief(capacity)}")
        capacity = 1
    elif not 1 <= capacity <= MAX_CAPACITY:
        problems.add("spec.capacity", f"must be between 1 and {MAX_CAPACITY}, got {capacity}")

    broker_properties = _string_map(spec.get("brokerProperties"), "spec.brokerProperties", problems)
    broker_spec = _expect_mapping(spec.get("brokerSpec"), "spec.brokerSpec", problems)
    if broker_spec is not None:
        kinds = [k for k in ("brokerPodSpec", "brokerJobSpec") if broker_spec.get(k) is not None]
        if len(kinds) > 1:
            problems.add("spec.brokerSpec", "set brokerPodSpec or brokerJobSpec, not both")
        for key in kinds:
            _expect_mapping(broker_spec[key], f"spec.brokerSpec.{key}", problems)
    instance_service = _expect_mapping(
        spec.get("instanceServiceSpec"), "spec.instanceServiceSpec", problems
    )
    configuration_service = _expect_mapping(
        spec.get("configurationServiceSpec"), "spec.configurationServiceSpec", problems
    )
    if problems.items or handler_info is None or not isinstance(name, str):
        raise ConfigurationError(display, problems.items or ["spec.discoveryHandler: invalid"])
    generation = metadata.get("generation")
    return Configuration(
        name=name,
        namespace=namespace,
        discovery_handler=handler_info,
        capacity=capacity,
        broker_properties=broker_properties,
        broker_spec=broker_spec,
        instance_service_spec=instance_service,
        configuration_service_spec=configuration_service,
        uid=metadata.get("uid") if isinstance(metadata.get("uid"), str) else None,
        resource_version=(
            metadata.get("resourceVersion")
            if isinstance(metadata.get("resourceVersion"), str)
            else None
        ),
        generation=generation if isinstance(generation, int) else None,
        annotations=annotations,
        creation_timestamp=_opt_str(metadata.get("creationTimestamp")),
        raw=dict(obj),
    )


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def object_key(obj: Any) -> ObjectKey | None:
    """``(namespace, name)`` of a raw object (even an invalid one), None without a name."""
    if not isinstance(obj, Mapping):
        return None
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping):
        return None
    name = metadata.get("name")
    namespace = metadata.get("namespace") or DEFAULT_NAMESPACE
    if not isinstance(name, str) or not name or not isinstance(namespace, str):
        return None
    return ObjectKey(namespace, name)
