"""``resource.k8s.io/v1`` validation as the real API server does it for ResourceSlice,
DeviceClass and ResourceClaim, and ``v1.NodeSelector`` validation as ``pkg/apis/core/validation``
does it.

Ported rule by rule from kubernetes/kubernetes ``pkg/apis/resource/validation/validation.go``
(``ValidateResourceSlice[Update]``, ``ValidateDeviceClass``, ``ValidateResourceClaim[Update]``,
``ValidateResourceClaimStatusUpdate``) and ``pkg/apis/core/validation`` (``ValidateNodeSelector``,
``ValidateNodeSelectorRequirement``, ``ValidateNodeFieldSelectorRequirement``). Each rule is a
small function whose docstring names its upstream counterpart; the list is in
docs/testing-apiserver-double.md. Not ported: CEL compilation and cost (an expression is only
length-checked), consumable capacity request policies, counters beyond their shape, binding
conditions, feature-gate field dropping. Messages have the upstream shape
(``field.Error``): ``Required value: …``, ``Invalid value: <json>: …``, ``Too many: …``.
A ResourceClaim status update is also authorized here, as the status strategy does it
(:mod:`tests.doubles.apiserver.authz`): a refusal is a ``Forbidden`` cause of the same 422.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from tests.doubles.apiserver import authz

JSON = dict[str, Any]
Cause = tuple[str, str, str]  # (reason, field, message)

# pkg/apis/resource/types.go
RESOURCE_SLICE_MAX_DEVICES = 128
RESOURCE_SLICE_MAX_DEVICES_WITH_ADVANCED_FEATURES = 64
MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE = 32
DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH = 64
DEVICE_MAX_ID_LENGTH = 32
DEVICE_MAX_DOMAIN_LENGTH = 63
POOL_NAME_MAX_LENGTH = 253
DEVICE_TAINTS_MAX_LENGTH = 16
DEVICE_REQUESTS_MAX_SIZE = 32
FIRST_AVAILABLE_MAX_SIZE = 8
DEVICE_SELECTORS_MAX_SIZE = 32
DEVICE_CONSTRAINTS_MAX_SIZE = 32
DEVICE_CONFIG_MAX_SIZE = 32
CEL_EXPRESSION_MAX_LENGTH = 10 * 1024
OPAQUE_PARAMETERS_MAX_LENGTH = 10 * 1024
ALLOCATION_RESULTS_MAX_SIZE = 32
RESERVED_FOR_MAX_SIZE = 256

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$"
)
SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character"
)
C_IDENTIFIER_MSG = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string of "
    "alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used "
    "for validation is '[A-Za-z_][A-Za-z0-9_]*')"
)


# -- field.Error constructors (k8s.io/apimachinery/pkg/util/validation/field) ---------------


def required(path: str, detail: str = "") -> Cause:
    return ("FieldValueRequired", path, f"Required value{': ' + detail if detail else ''}")


def invalid(path: str, value: Any, detail: str) -> Cause:
    return ("FieldValueInvalid", path, f"Invalid value: {json.dumps(value)}: {detail}")


def forbidden(path: str, detail: str) -> Cause:
    return ("FieldValueForbidden", path, f"Forbidden: {detail}")


def too_many(path: str, actual: int, limit: int) -> Cause:
    return ("FieldValueTooMany", path, f"Too many: {actual}: must have at most {limit} items")


def too_long(path: str, limit: int) -> Cause:
    return ("FieldValueTooLong", path, f"Too long: may not be more than {limit} bytes")


def duplicate(path: str, value: Any) -> Cause:
    return ("FieldValueDuplicate", path, f"Duplicate value: {json.dumps(value)}")


def not_supported(path: str, value: Any, supported: Iterable[str]) -> Cause:
    options = ", ".join(json.dumps(s) for s in supported)
    return (
        "FieldValueNotSupported",
        path,
        f"Unsupported value: {json.dumps(value)}: supported values: {options}",
    )


def immutable(path: str, value: Any) -> Cause:
    return invalid(path, value, "field is immutable")


# -- names ------------------------------------------------------------------------------------


def dns_subdomain(value: str, path: str) -> list[Cause]:
    """``IsDNS1123Subdomain``."""
    causes = []
    if len(value) > 253:
        causes.append(invalid(path, value, "must be no more than 253 characters"))
    if not _DNS_SUBDOMAIN.match(value):
        causes.append(invalid(path, value, SUBDOMAIN_MSG))
    return causes


def dns_label(value: str, path: str) -> list[Cause]:
    """``IsDNS1123Label`` (device names, request names)."""
    causes = []
    if len(value) > 63:
        causes.append(invalid(path, value, "must be no more than 63 characters"))
    if not _DNS_LABEL.match(value):
        causes.append(invalid(path, value, LABEL_MSG))
    return causes


def driver_name(value: Any, path: str) -> list[Cause]:
    """``ValidateCSIDriverName`` (``validateDriverName``): required, ≤ 63, DNS subdomain."""
    if not value:
        return [required(path)]
    if not isinstance(value, str):
        return [invalid(path, value, "must be a string")]
    causes = []
    if len(value) > 63:
        causes.append(too_long(path, 63))
    return causes + dns_subdomain(value.lower(), path)


def pool_name(value: Any, path: str) -> list[Cause]:
    """``validatePoolName``: required, ≤ 253, each ``/``-separated part a DNS subdomain."""
    if not value:
        return [required(path)]
    causes = []
    if len(value) > POOL_NAME_MAX_LENGTH:
        causes.append(too_long(path, POOL_NAME_MAX_LENGTH))
    for part in str(value).split("/"):
        causes += dns_subdomain(part, path)
    return causes


def label_name(value: Any, path: str) -> list[Cause]:
    """``metav1validation.ValidateLabelName`` (qualified name: optional DNS prefix + name)."""
    if not isinstance(value, str) or not value:
        return [invalid(path, value, "name part must be non-empty")]
    prefix, _, name = value.rpartition("/")
    causes = []
    if "/" in prefix or (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))):
        causes.append(invalid(path, value, "prefix part " + SUBDOMAIN_MSG))
    if len(name) > 63 or not _QUALIFIED_NAME_PART.match(name):
        causes.append(
            invalid(
                path,
                value,
                "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
                "start and end with an alphanumeric character",
            )
        )
    return causes


def label_value(value: Any, path: str) -> list[Cause]:
    """``IsValidLabelValue``."""
    if not isinstance(value, str):
        return [invalid(path, value, "must be a string")]
    causes = []
    if len(value) > 63:
        causes.append(invalid(path, value, "must be no more than 63 characters"))
    if not _LABEL_VALUE.match(value):
        causes.append(invalid(path, value, LABEL_VALUE_MSG))
    return causes


def c_identifier(value: str, path: str) -> list[Cause]:
    """``validateCIdentifier``: ≤ 32 characters, a C identifier."""
    causes = []
    if len(value) > DEVICE_MAX_ID_LENGTH:
        causes.append(too_long(path, DEVICE_MAX_ID_LENGTH))
    if not _C_IDENTIFIER.match(value):
        causes.append(invalid(path, value, C_IDENTIFIER_MSG))
    return causes


def qualified_name(value: str, path: str) -> list[Cause]:
    """``validateQualifiedName``: ``<C identifier>`` or ``<driver name>/<C identifier>``."""
    parts = value.split("/")
    if len(parts) == 1:
        return c_identifier(parts[0], path)
    if len(parts) > 2:
        return [invalid(path, value, "must not contain more than one slash")]
    causes: list[Cause] = []
    if not parts[0]:
        causes.append(invalid(path, "", "the domain must not be empty"))
    else:
        causes += driver_name(parts[0], path)
    if not parts[1]:
        causes.append(invalid(path, "", "the name must not be empty"))
    else:
        causes += c_identifier(parts[1], path)
    return causes


def fully_qualified_name(value: Any, path: str) -> list[Cause]:
    """``validateFullyQualifiedName``: a qualified name that has a domain."""
    causes = qualified_name(str(value), path)
    if "/" not in str(value):
        causes.append(
            invalid(
                path,
                value,
                "a fully qualified name must be a domain and a name separated by a slash",
            )
        )
    return causes


# -- lists -------------------------------------------------------------------------------------


def validate_list(
    items: Any,
    limit: int,
    item_rule: Callable[[Any, str], list[Cause]],
    path: str,
    key: Callable[[Any], Any] | None = None,
) -> list[Cause]:
    """``validateSlice`` / ``validateSet``: too many items short-circuits (DoS protection);
    otherwise every item is validated and, for a set, duplicates of ``key`` reported."""
    if items is None:
        return []
    if not isinstance(items, list):
        return [invalid(path, items, "must be a list")]
    if limit >= 0 and len(items) > limit:
        return [too_many(path, len(items), limit)]
    causes: list[Cause] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        causes += item_rule(item, f"{path}[{index}]")
        if key is not None:
            k = json.dumps(key(item), sort_keys=True)
            if k in seen:
                causes.append(duplicate(f"{path}[{index}]", key(item)))
            seen.add(k)
    return causes


# -- core/v1 NodeSelector ----------------------------------------------------------------------

SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")


def node_selector(selector: Any, path: str) -> list[Cause]:
    """``ValidateNodeSelector`` (``allowInvalidLabelValueInRequiredNodeAffinity`` false, as
    resource validation calls it): at least one term, each term's requirements valid."""
    if not isinstance(selector, dict):
        return [invalid(path, selector, "must be an object")]
    terms = selector.get("nodeSelectorTerms") or []
    if not terms:
        return [required(f"{path}.nodeSelectorTerms", "must have at least one node selector term")]
    causes: list[Cause] = []
    for index, term in enumerate(terms):
        causes += node_selector_term(term or {}, f"{path}.nodeSelectorTerms[{index}]")
    return causes


def node_selector_term(term: JSON, path: str) -> list[Cause]:
    """``ValidateNodeSelectorTerm``."""
    causes: list[Cause] = []
    for index, requirement in enumerate(term.get("matchExpressions") or []):
        causes += node_selector_requirement(requirement, f"{path}.matchExpressions[{index}]")
    for index, requirement in enumerate(term.get("matchFields") or []):
        causes += node_field_selector_requirement(requirement, f"{path}.matchFields[{index}]")
    return causes


def node_selector_requirement(requirement: JSON, path: str) -> list[Cause]:
    """``ValidateNodeSelectorRequirement``: In/NotIn need values, Exists/DoesNotExist take
    none, Gt/Lt exactly one; the key is a label name, the values label values."""
    operator = requirement.get("operator")
    values = requirement.get("values") or []
    causes: list[Cause] = []
    if operator in ("In", "NotIn"):
        if not values:
            causes.append(
                required(f"{path}.values", "must be specified when `operator` is 'In' or 'NotIn'")
            )
    elif operator in ("Exists", "DoesNotExist"):
        if values:
            causes.append(
                forbidden(
                    f"{path}.values",
                    "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                )
            )
    elif operator in ("Gt", "Lt"):
        if len(values) != 1:
            causes.append(
                required(
                    f"{path}.values",
                    "must be specified single value when `operator` is 'Lt' or 'Gt'",
                )
            )
    else:
        causes.append(invalid(f"{path}.operator", operator, "not a valid selector operator"))
    causes += label_name(requirement.get("key"), f"{path}.key")
    for index, value in enumerate(values):
        causes += label_value(value, f"{path}.values[{index}]")
    return causes


def node_field_selector_requirement(requirement: JSON, path: str) -> list[Cause]:
    """``ValidateNodeFieldSelectorRequirement``: only In/NotIn, with exactly one value; only
    the key ``metadata.name``, whose values are node names (DNS subdomains)."""
    operator = requirement.get("operator")
    values = requirement.get("values") or []
    causes: list[Cause] = []
    if operator in ("In", "NotIn"):
        if len(values) != 1:
            causes.append(
                required(
                    f"{path}.values",
                    "must be only one value when `operator` is 'In' or 'NotIn' for node field "
                    "selector",
                )
            )
    else:
        causes.append(invalid(f"{path}.operator", operator, "not a valid selector operator"))
    if requirement.get("key") != "metadata.name":
        causes.append(
            invalid(f"{path}.key", requirement.get("key"), "not a valid field selector key")
        )
    else:
        for index, value in enumerate(values):
            causes += [
                invalid(f"{path}.values[{index}]", value, c[2].split(": ", 2)[-1])
                for c in dns_subdomain(str(value), "")
            ]
    return causes


# -- ResourceSlice ----------------------------------------------------------------------------


def resource_slice(new: JSON, old: JSON | None) -> list[Cause]:
    """``ValidateResourceSlice`` / ``ValidateResourceSliceUpdate`` (the spec part)."""
    spec = new.get("spec")
    if not isinstance(spec, dict):
        return [required("spec")]
    old_spec = (old or {}).get("spec") if old is not None else None
    path = "spec"
    causes = driver_name(spec.get("driver"), f"{path}.driver")
    causes += resource_pool(spec.get("pool"), f"{path}.pool")
    if isinstance(old_spec, dict):
        for key in ("pool.name", "driver", "nodeName"):
            now, before = _dig(spec, key), _dig(old_spec, key)
            if now != before:
                causes.append(immutable(f"{path}.{key}", now))
    causes += placement(spec, path, slice_level=True)
    if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        causes.append(invalid(path, "", "only one of `sharedCounters` or `devices` is allowed"))
    devices = spec.get("devices")
    limit = (
        RESOURCE_SLICE_MAX_DEVICES_WITH_ADVANCED_FEATURES
        if _advanced(devices)
        else RESOURCE_SLICE_MAX_DEVICES
    )
    per_device = bool(spec.get("perDeviceNodeSelection"))
    causes += validate_list(
        devices,
        limit,
        lambda device, p: resource_device(device, p, per_device),
        f"{path}.devices",
        key=lambda device: (device or {}).get("name"),
    )
    return causes


def _dig(obj: JSON, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)  # type: ignore[assignment]
    return obj


def _advanced(devices: Any) -> bool:
    """Taints, counter consumption or list attributes lower the device limit to 64."""
    for device in devices if isinstance(devices, list) else []:
        if not isinstance(device, dict):
            continue
        if device.get("taints") or device.get("consumesCounters"):
            return True
        for attribute in (device.get("attributes") or {}).values():
            if isinstance(attribute, dict) and {"ints", "bools", "strings", "versions"} & set(
                attribute
            ):
                return True
    return False


def resource_pool(pool: Any, path: str) -> list[Cause]:
    """``validateResourcePool``: name, ``resourceSliceCount > 0``, ``generation >= 0``."""
    pool = pool if isinstance(pool, dict) else {}
    causes = pool_name(pool.get("name"), f"{path}.name")
    count = pool.get("resourceSliceCount") or 0
    if count <= 0:
        causes.append(invalid(f"{path}.resourceSliceCount", count, "must be greater than zero"))
    generation = pool.get("generation") or 0
    if generation < 0:
        causes.append(
            invalid(f"{path}.generation", generation, "must be greater than or equal to zero")
        )
    return causes


def placement(spec: JSON, path: str, *, slice_level: bool) -> list[Cause]:
    """Exactly one of ``nodeName``/``nodeSelector``/``allNodes`` (and, on a slice,
    ``perDeviceNodeSelection``); a slice's ``nodeSelector`` has exactly one term."""
    chosen: list[str] = []
    causes: list[Cause] = []
    if "nodeName" in spec and spec["nodeName"] is not None:
        if spec["nodeName"] != "":
            chosen.append("`nodeName`")
            causes += dns_subdomain(str(spec["nodeName"]), f"{path}.nodeName")
        else:
            detail = (
                "must be either unset or set to a non-empty string"
                if slice_level
                else ("must not be empty")
            )
            causes.append(invalid(f"{path}.nodeName", "", detail))
    if spec.get("nodeSelector") is not None:
        chosen.append("`nodeSelector`")
        causes += node_selector(spec["nodeSelector"], f"{path}.nodeSelector")
        terms = (spec["nodeSelector"] or {}).get("nodeSelectorTerms") or []
        if slice_level and len(terms) != 1:
            # upstream: "This additional constraint simplifies merging of different selectors
            # when devices are allocated from different slices."
            causes.append(
                invalid(
                    f"{path}.nodeSelector.nodeSelectorTerms",
                    terms,
                    "must have exactly one node selector term",
                )
            )
    if spec.get("allNodes") is not None:
        if spec["allNodes"] is True:
            chosen.append("`allNodes`")
        else:
            causes.append(
                invalid(f"{path}.allNodes", spec["allNodes"], "must be either unset or set to true")
            )
    if slice_level and spec.get("perDeviceNodeSelection") is not None:
        if spec["perDeviceNodeSelection"] is True:
            chosen.append("`perDeviceNodeSelection`")
        else:
            causes.append(
                invalid(
                    f"{path}.perDeviceNodeSelection",
                    spec["perDeviceNodeSelection"],
                    "must be either unset or set to true",
                )
            )
    if slice_level:
        what = (
            "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` "
            "is required"
        )
    else:
        what = (
            "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when "
            "`perDeviceNodeSelection` is set to true in the ResourceSlice spec"
        )
    if not chosen:
        causes.append(required(path, what))
    elif len(chosen) > 1:
        causes.append(
            invalid(
                path,
                "{" + ", ".join(chosen) + "}",
                what + (", but multiple fields are set" if slice_level else ""),
            )
        )
    return causes


def resource_device(device: Any, path: str, per_device_node_selection: bool) -> list[Cause]:
    """``validateDevice``: name, attribute/capacity count and keys, attribute values, per-device
    placement only with ``perDeviceNodeSelection``, taints."""
    if not isinstance(device, dict):
        return [invalid(path, device, "must be an object")]
    causes = (
        dns_label(str(device.get("name") or ""), f"{path}.name")
        if device.get("name")
        else [required(f"{path}.name")]
    )
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    total = len(attributes) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
        causes.append(
            invalid(
                path,
                total,
                "the total number of attributes and capacities must not exceed "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE}",
            )
        )
    for name, attribute in attributes.items():
        causes += qualified_name(name, f"{path}.attributes")
        causes += device_attribute(attribute, f"{path}.attributes[{name}]")
    for name, value in capacity.items():
        causes += qualified_name(name, f"{path}.capacity")
        if not isinstance(value, dict) or "value" not in value:
            causes.append(required(f"{path}.capacity[{name}].value"))
        elif value.get("requestPolicy") is not None and not device.get("allowMultipleAllocations"):
            causes.append(
                forbidden(
                    f"{path}.capacity[{name}].requestPolicy",
                    "allowMultipleAllocations must be true",
                )
            )
    if per_device_node_selection:
        causes += placement(device, path, slice_level=False)
    elif any(device.get(k) is not None for k in ("nodeName", "nodeSelector", "allNodes")):
        causes.append(
            invalid(
                path,
                None,
                "`nodeName`, `nodeSelector` and `allNodes` can only be set if "
                "`perDeviceNodeSelection` is set to true in the ResourceSlice spec",
            )
        )
    causes += validate_list(
        device.get("taints"), DEVICE_TAINTS_MAX_LENGTH, device_taint, f"{path}.taints"
    )
    return causes


def device_attribute(attribute: Any, path: str) -> list[Cause]:
    """``validateDeviceAttribute``: exactly one of int/bool/string/version (or the list
    forms); strings ≤ 64 bytes; versions semver 2.0.0 and ≤ 64 bytes."""
    if not isinstance(attribute, dict):
        return [invalid(path, attribute, "exactly one value must be specified")]
    causes: list[Cause] = []
    present = [
        k
        for k in ("int", "bool", "string", "version", "ints", "bools", "strings", "versions")
        if attribute.get(k) is not None
    ]
    if "string" in present:
        causes += _string_value(attribute["string"], f"{path}.string")
    if "version" in present:
        causes += _version_value(attribute["version"], f"{path}.version")
    for plural in ("ints", "bools", "strings", "versions"):
        if plural in present:
            values = attribute[plural]
            if not values:
                causes.append(invalid(f"{path}.{plural}", values, "must not be empty if specified"))
            for index, item in enumerate(values or []):
                if plural == "strings":
                    causes += _string_value(item, f"{path}.strings[{index}]")
                if plural == "versions":
                    causes += _version_value(item, f"{path}.versions[{index}]")
    if not present:
        causes.append(invalid(path, "", "exactly one value must be specified"))
    elif len(present) > 1:
        causes.append(invalid(path, attribute, "exactly one value must be specified"))
    return causes


def _string_value(value: Any, path: str) -> list[Cause]:
    if len(str(value).encode()) > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH:
        return [too_long(path, DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH)]
    return []


def _version_value(value: Any, path: str) -> list[Cause]:
    causes = []
    if not _SEMVER.match(str(value)):
        causes.append(
            invalid(path, value, "must be a string compatible with semver.org spec 2.0.0")
        )
    if len(str(value)) > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH:
        causes.append(too_long(path, DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH))
    return causes


TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")


def device_taint(taint: Any, path: str) -> list[Cause]:
    """``validateDeviceTaint``: key a label name, value a label value, effect required and one
    of None/NoSchedule/NoExecute."""
    taint = taint if isinstance(taint, dict) else {}
    causes = label_name(taint.get("key"), f"{path}.key")
    if taint.get("value"):
        causes += label_value(taint["value"], f"{path}.value")
    effect = taint.get("effect")
    if not effect:
        causes.append(required(f"{path}.effect"))
    elif effect not in TAINT_EFFECTS:
        causes.append(not_supported(f"{path}.effect", effect, TAINT_EFFECTS))
    return causes


# -- DeviceClass ------------------------------------------------------------------------------


def device_class(new: JSON, old: JSON | None) -> list[Cause]:
    """``ValidateDeviceClass[Update]``: selectors (≤ 32, each with ``cel``), config (≤ 32, each
    opaque), ``extendedResourceName`` an extended resource name."""
    spec = new.get("spec") or {}
    causes = validate_list(
        spec.get("selectors"), DEVICE_SELECTORS_MAX_SIZE, device_selector, "spec.selectors"
    )
    causes += validate_list(
        spec.get("config"), DEVICE_CONFIG_MAX_SIZE, device_configuration, "spec.config"
    )
    name = spec.get("extendedResourceName")
    if name is not None and not is_extended_resource_name(str(name)):
        causes.append(
            invalid("spec.extendedResourceName", name, "must be a valid extended resource name")
        )
    return causes


def is_extended_resource_name(name: str) -> bool:
    """``v1helper.IsExtendedResourceName``: domain-qualified, not ``kubernetes.io/`` (native),
    not ``requests.``-prefixed, and ``requests.<name>`` a qualified name."""
    if "/" not in name or name.startswith("requests."):
        return False
    domain = name.split("/", 1)[0]
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return False
    return not label_name("requests." + name, "")


def device_selector(selector: Any, path: str) -> list[Cause]:
    """``validateSelector``: ``cel`` required; the expression ≤ 10 KiB (CEL itself is not
    compiled here)."""
    cel = (selector or {}).get("cel") if isinstance(selector, dict) else None
    if cel is None:
        return [required(f"{path}.cel")]
    expression = str(cel.get("expression") or "")
    if not expression:
        return [required(f"{path}.cel.expression", "expression is required")]
    if len(expression) > CEL_EXPRESSION_MAX_LENGTH:
        return [too_long(f"{path}.cel.expression", CEL_EXPRESSION_MAX_LENGTH)]
    return []


def device_configuration(config: Any, path: str) -> list[Cause]:
    """``validateDeviceConfiguration`` / ``validateOpaqueConfiguration``: ``opaque`` required,
    a valid driver, ``parameters`` a JSON object ≤ 10 KiB."""
    opaque = config.get("opaque") if isinstance(config, dict) else None
    if opaque is None:
        return [required(f"{path}.opaque")]
    causes = driver_name(opaque.get("driver"), f"{path}.opaque.driver")
    parameters = opaque.get("parameters")
    if parameters is None:
        causes.append(required(f"{path}.opaque.parameters"))
    elif len(json.dumps(parameters)) > OPAQUE_PARAMETERS_MAX_LENGTH:
        causes.append(too_long(f"{path}.opaque.parameters", OPAQUE_PARAMETERS_MAX_LENGTH))
    elif not isinstance(parameters, dict):
        causes.append(
            invalid(f"{path}.opaque.parameters", "<value omitted>", "must be a valid JSON object")
        )
    return causes


# -- ResourceClaim ----------------------------------------------------------------------------

ALLOCATION_MODES = ("All", "ExactCount")


def default_resource_claim(claim: JSON) -> None:
    """The v1 defaults (``SetDefaults_ExactDeviceRequest``): ``allocationMode: ExactCount``
    and, for it, ``count: 1`` (also in ``firstAvailable`` subrequests)."""
    devices = (claim.get("spec") or {}).get("devices") or {}
    for request in devices.get("requests") or []:
        if not isinstance(request, dict):
            continue
        targets = [request.get("exactly"), *(request.get("firstAvailable") or [])]
        for target in targets:
            if isinstance(target, dict):
                target.setdefault("allocationMode", "ExactCount")
                if target["allocationMode"] == "ExactCount":
                    target.setdefault("count", 1)


def resource_claim(new: JSON, old: JSON | None) -> list[Cause]:
    """``ValidateResourceClaim`` on create; on update ``spec`` is immutable and the status
    rules of ``ValidateResourceClaimStatusUpdate`` apply."""
    spec = new.get("spec") or {}
    if old is not None:
        causes: list[Cause] = []
        if spec != (old.get("spec") or {}):
            causes.append(immutable("spec", spec))
        return causes + claim_status(new, old)
    devices = spec.get("devices") or {}
    names = request_names(devices)
    causes = validate_list(
        devices.get("requests"),
        DEVICE_REQUESTS_MAX_SIZE,
        device_request,
        "spec.devices.requests",
        key=lambda r: (r or {}).get("name"),
    )
    causes += validate_list(
        devices.get("constraints"),
        DEVICE_CONSTRAINTS_MAX_SIZE,
        lambda c, p: device_constraint(c, p, names),
        "spec.devices.constraints",
    )
    causes += validate_list(
        devices.get("config"),
        DEVICE_CONFIG_MAX_SIZE,
        lambda c, p: request_refs(c, p, names) + device_configuration(c, p),
        "spec.devices.config",
    )
    return causes


def request_names(devices: JSON) -> dict[str, set[str]]:
    """``gatherRequestNames``: request name -> its subrequest names."""
    names: dict[str, set[str]] = {}
    for request in devices.get("requests") or []:
        if isinstance(request, dict):
            names[str(request.get("name"))] = {
                str((s or {}).get("name")) for s in request.get("firstAvailable") or []
            }
    return names


def _has_request(names: dict[str, set[str]], ref: str) -> bool:
    parts = ref.split("/")
    if len(parts) > 2 or parts[0] not in names:
        return False
    return len(parts) == 1 or parts[1] in names[parts[0]]


def request_name_ref(ref: Any, path: str, names: dict[str, set[str]]) -> list[Cause]:
    """``validateRequestNameRef``: ``<request>`` or ``<request>/<subrequest>`` of this claim."""
    message = (
        "must be the name of a request in the claim or the name of a request and a subrequest "
        "separated by '/'"
    )
    parts = str(ref).split("/")
    if len(parts) > 2:
        return [invalid(path, ref, message)]
    causes: list[Cause] = []
    for part in parts:
        causes += dns_label(part, path)
    if not _has_request(names, str(ref)):
        causes.append(invalid(path, ref, message))
    return causes


def request_refs(item: Any, path: str, names: dict[str, set[str]]) -> list[Cause]:
    refs = (item or {}).get("requests") if isinstance(item, dict) else None
    return validate_list(
        refs,
        DEVICE_REQUESTS_MAX_SIZE,
        lambda r, p: request_name_ref(r, p, names),
        f"{path}.requests",
        key=str,
    )


def device_request(request: Any, path: str) -> list[Cause]:
    """``validateDeviceRequest``: a DNS-label name; exactly one of ``exactly`` and
    ``firstAvailable`` (≤ 8 subrequests, unique names)."""
    request = request if isinstance(request, dict) else {}
    causes = dns_label(str(request.get("name") or ""), f"{path}.name")
    exactly = request.get("exactly")
    first = request.get("firstAvailable") or []
    if exactly is None and not first:
        causes.append(required(path, "exactly one of `exactly` or `firstAvailable` is required"))
    elif exactly is not None and first:
        causes.append(
            invalid(
                path,
                None,
                "exactly one of `exactly` or `firstAvailable` is required, but multiple fields "
                "are set",
            )
        )
    elif first:
        causes += validate_list(
            first,
            FIRST_AVAILABLE_MAX_SIZE,
            lambda s, p: (
                dns_label(str((s or {}).get("name") or ""), f"{p}.name") + exact_request(s, p)
            ),
            f"{path}.firstAvailable",
            key=lambda s: (s or {}).get("name"),
        )
    else:
        causes += exact_request(exactly, f"{path}.exactly")
    return causes


def exact_request(request: Any, path: str) -> list[Cause]:
    """``validateExactDeviceRequest``: a device class (required DNS subdomain), selectors,
    allocation mode and count (``All``: no count; ``ExactCount``: count > 0), tolerations."""
    request = request if isinstance(request, dict) else {}
    class_name = request.get("deviceClassName")
    causes = (
        dns_subdomain(str(class_name), f"{path}.deviceClassName")
        if class_name
        else [required(f"{path}.deviceClassName")]
    )
    causes += validate_list(
        request.get("selectors"), DEVICE_SELECTORS_MAX_SIZE, device_selector, f"{path}.selectors"
    )
    mode = request.get("allocationMode")
    count = request.get("count") or 0
    if mode == "All":
        if count != 0:
            causes.append(
                invalid(
                    f"{path}.count", count, "must not be specified when allocationMode is 'All'"
                )
            )
    elif mode == "ExactCount":
        if count <= 0:
            causes.append(invalid(f"{path}.count", count, "must be greater than zero"))
    else:
        causes.append(not_supported(f"{path}.allocationMode", mode, ALLOCATION_MODES))
    for index, toleration in enumerate(request.get("tolerations") or []):
        causes += device_toleration(toleration, f"{path}.tolerations[{index}]")
    return causes


def device_toleration(toleration: Any, path: str) -> list[Cause]:
    """``validateDeviceToleration``."""
    toleration = toleration if isinstance(toleration, dict) else {}
    causes: list[Cause] = []
    if toleration.get("key"):
        causes += label_name(toleration["key"], f"{path}.key")
    operator = toleration.get("operator")
    if operator == "Exists":
        if toleration.get("value"):
            causes.append(
                invalid(f"{path}.value", toleration["value"], "must be empty for operator `Exists`")
            )
    elif operator == "Equal":
        causes += label_value(toleration.get("value") or "", f"{path}.value")
    elif not operator:
        causes.append(required(f"{path}.operator"))
    else:
        causes.append(not_supported(f"{path}.operator", operator, ("Equal", "Exists")))
    effect = toleration.get("effect")
    if effect and effect not in TAINT_EFFECTS:
        causes.append(not_supported(f"{path}.effect", effect, TAINT_EFFECTS))
    return causes


def device_constraint(constraint: Any, path: str, names: dict[str, set[str]]) -> list[Cause]:
    """``validateDeviceConstraint``: request references; ``matchAttribute`` (or
    ``distinctAttribute``) required and fully qualified."""
    constraint = constraint if isinstance(constraint, dict) else {}
    causes = request_refs(constraint, path, names)
    if constraint.get("matchAttribute") is not None:
        causes += fully_qualified_name(constraint["matchAttribute"], f"{path}.matchAttribute")
    elif constraint.get("distinctAttribute") is not None:
        causes += fully_qualified_name(constraint["distinctAttribute"], f"{path}.distinctAttribute")
    else:
        causes.append(required(f"{path}.matchAttribute"))
    return causes


def claim_status(new: JSON, old: JSON) -> list[Cause]:
    """``validateResourceClaimStatusUpdate``: ``reservedFor`` (≤ 256, unique uids, each with
    resource/name/uid) only with an allocation and, while deleting, never growing; an
    allocation is immutable once set, and a new one is validated (results ≤ 32 referencing
    this claim's requests, driver/pool/device names, the node selector); ``devices`` entries
    must be allocated devices."""
    status = new.get("status") or {}
    old_status = old.get("status") or {}
    names = request_names(((new.get("spec") or {}).get("devices")) or {})
    path = "status"
    reserved = status.get("reservedFor") or []
    causes = validate_list(
        reserved,
        RESERVED_FOR_MAX_SIZE,
        consumer_reference,
        f"{path}.reservedFor",
        key=lambda r: (r or {}).get("uid"),
    )
    allocation = status.get("allocation")
    old_allocation = old_status.get("allocation")
    if reserved:
        if allocation is None:
            causes.append(
                forbidden(f"{path}.reservedFor", "may not be specified when `allocated` is not set")
            )
        elif (new.get("metadata") or {}).get("deletionTimestamp"):
            before = {json.dumps(r, sort_keys=True) for r in old_status.get("reservedFor") or []}
            if any(json.dumps(r, sort_keys=True) not in before for r in reserved):
                causes.append(
                    forbidden(
                        f"{path}.reservedFor",
                        "new entries may not be added while `deallocationRequested` or "
                        "`deletionTimestamp` are set",
                    )
                )
    if old_allocation is not None and allocation is not None:
        if allocation != old_allocation:
            causes.append(immutable(f"{path}.allocation", allocation))
    elif allocation is not None:
        causes += allocation_result(allocation, f"{path}.allocation", names)
    allocated = {
        (r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID"))
        for r in ((allocation or {}).get("devices") or {}).get("results") or []
        if isinstance(r, dict)
    }
    for index, device in enumerate(status.get("devices") or []):
        where = f"{path}.devices[{index}]"
        device = device if isinstance(device, dict) else {}
        causes += driver_name(device.get("driver"), f"{where}.driver")
        causes += pool_name(device.get("pool"), f"{where}.pool")
        causes += dns_label(str(device.get("device") or ""), f"{where}.device")
        key = (
            device.get("driver"),
            device.get("pool"),
            device.get("device"),
            device.get("shareID"),
        )
        if key not in allocated:
            shown = "/".join(str(k) for k in key[:3])
            causes.append(invalid(where, shown, "must be an allocated device in the claim"))
        causes += device_status_details(device, where)
    return causes


DEVICE_STATUS_DATA_MAX_LENGTH = 10 * 1024  # AllocatedDeviceStatusDataMaxLength
DEVICE_STATUS_MAX_CONDITIONS = 8  # AllocatedDeviceStatusMaxConditions
NETWORK_INTERFACE_NAME_MAX_LENGTH = 256  # NetworkDeviceDataInterfaceNameMaxLength
NETWORK_HARDWARE_ADDRESS_MAX_LENGTH = 128  # NetworkDeviceDataHardwareAddressMaxLength
NETWORK_MAX_IPS = 16  # NetworkDeviceDataMaxIPs


def device_status_details(device: JSON, where: str) -> list[Cause]:
    """The rest of ``validateDeviceStatus``: ``conditions`` (≤ 8), ``data`` (a JSON object of
    ≤ 10 KiB, ``validateRawExtension``) and ``validateNetworkDeviceData`` (``interfaceName``
    ≤ 256, ``hardwareAddress`` ≤ 128, ``ips`` ≤ 16, unique, each an interface address in
    canonical CIDR form, ``IsValidInterfaceAddress``)."""
    causes: list[Cause] = []
    conditions = device.get("conditions") or []
    if len(conditions) > DEVICE_STATUS_MAX_CONDITIONS:
        causes.append(
            too_many(f"{where}.conditions", len(conditions), DEVICE_STATUS_MAX_CONDITIONS)
        )
    if "data" in device and device["data"] is not None:
        raw = json.dumps(device["data"], separators=(",", ":"))
        if len(raw) > DEVICE_STATUS_DATA_MAX_LENGTH:
            causes.append(too_long(f"{where}.data", DEVICE_STATUS_DATA_MAX_LENGTH))
        elif not isinstance(device["data"], dict):
            causes.append(
                invalid(f"{where}.data", "<value omitted>", "must be a valid JSON object")
            )
    network = device.get("networkData")
    if isinstance(network, dict):
        path = f"{where}.networkData"
        if len(str(network.get("interfaceName") or "")) > NETWORK_INTERFACE_NAME_MAX_LENGTH:
            causes.append(too_long(f"{path}.interfaceName", NETWORK_INTERFACE_NAME_MAX_LENGTH))
        if len(str(network.get("hardwareAddress") or "")) > NETWORK_HARDWARE_ADDRESS_MAX_LENGTH:
            causes.append(too_long(f"{path}.hardwareAddress", NETWORK_HARDWARE_ADDRESS_MAX_LENGTH))
        ips = network.get("ips") or []
        if len(ips) > NETWORK_MAX_IPS:
            causes.append(too_many(f"{path}.ips", len(ips), NETWORK_MAX_IPS))
        else:
            seen: set[str] = set()
            for index, address in enumerate(ips):
                causes += interface_address(address, f"{path}.ips[{index}]")
                if address in seen:
                    causes.append(duplicate(f"{path}.ips[{index}]", address))
                seen.add(address)
    return causes


def interface_address(value: Any, path: str) -> list[Cause]:
    """``IsValidInterfaceAddress``: ``<ip>/<prefix>`` with a complete address, canonical."""
    text = str(value)
    try:
        interface = ipaddress.ip_interface(text) if "/" in text else None
    except ValueError:
        # ParseCIDRSloppy also takes IPv4 octets with leading zeros ("10.0.0.007/32"), which
        # then fail the canonical-form check below
        address, _, prefix = text.partition("/")
        octets = address.split(".")
        sloppy = ".".join(o.lstrip("0") or "0" for o in octets) if len(octets) == 4 else None
        try:
            interface = ipaddress.ip_interface(f"{sloppy}/{prefix}") if sloppy else None
        except ValueError:
            interface = None
    if interface is None:
        return [
            invalid(
                path,
                text,
                "must be a valid address in CIDR form, (e.g. 10.9.8.7/24 or 2001:db8::1/64)",
            )
        ]
    address = interface.ip
    prefix = interface.network.prefixlen
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address, prefix = address.ipv4_mapped, max(prefix - 96, 0)
    canonical = f"{address}/{prefix}"
    if text != canonical:
        return [invalid(path, text, f'must be in canonical form ("{canonical}")')]
    return []


def consumer_reference(reference: Any, path: str) -> list[Cause]:
    """``validateResourceClaimUserReference``."""
    reference = reference if isinstance(reference, dict) else {}
    return [required(f"{path}.{k}") for k in ("resource", "name", "uid") if not reference.get(k)]


def allocation_result(allocation: Any, path: str, names: dict[str, set[str]]) -> list[Cause]:
    """``validateAllocationResult`` for a new allocation."""
    allocation = allocation if isinstance(allocation, dict) else {}
    devices = allocation.get("devices") or {}
    causes = validate_list(
        devices.get("results"),
        ALLOCATION_RESULTS_MAX_SIZE,
        lambda r, p: allocation_result_entry(r, p, names),
        f"{path}.devices.results",
    )
    if allocation.get("nodeSelector") is not None:
        causes += node_selector(allocation["nodeSelector"], f"{path}.nodeSelector")
    return causes


def allocation_result_entry(result: Any, path: str, names: dict[str, set[str]]) -> list[Cause]:
    """``validateDeviceRequestAllocationResult``."""
    result = result if isinstance(result, dict) else {}
    causes = request_name_ref(result.get("request"), f"{path}.request", names)
    causes += driver_name(result.get("driver"), f"{path}.driver")
    causes += pool_name(result.get("pool"), f"{path}.pool")
    causes += dns_label(str(result.get("device") or ""), f"{path}.device")
    return causes


VALIDATORS: dict[tuple[str, str], Callable[[JSON, JSON | None], list[Cause]]] = {
    ("resource.k8s.io", "resourceslices"): resource_slice,
    ("resource.k8s.io", "deviceclasses"): device_class,
    ("resource.k8s.io", "resourceclaims"): resource_claim,
}


def validate_resource(group: str, plural: str, new: JSON, old: JSON | None) -> list[Cause]:
    """The built-in validation of ``group/plural`` (none for other kinds); defaults first."""
    validator = VALIDATORS.get((group, plural))
    if validator is None:
        return []
    if plural == "resourceclaims":
        default_resource_claim(new)
        if old is not None:  # stored objects are defaulted already; objects from tests may not be
            old = copy.deepcopy(old)
            default_resource_claim(old)
            drop_deallocated_status_devices(new, old)
            # the status strategy authorizes first, then validates: one 422 for both
            return authz.claim_status_causes(new, old) + validator(new, old)
    return validator(new, old)


def _shared_device_ids(entries: Any) -> set[tuple[Any, Any, Any, Any]]:
    return {
        (e.get("driver"), e.get("pool"), e.get("device"), e.get("shareID"))
        for e in entries or []
        if isinstance(e, dict)
    }


def drop_deallocated_status_devices(new: JSON, old: JSON) -> None:
    """``dropDeallocatedStatusDevices`` (pkg/registry/resource/resourceclaim/strategy.go):
    a status update that removes devices from the allocation also removes their
    ``status.devices`` entries, so a client deallocating a claim need not know the drivers'
    entries (before validation, which accepts entries of allocated devices only)."""
    new_status = new.get("status")
    if not isinstance(new_status, dict) or not new_status.get("devices"):
        return

    def results(claim: JSON) -> Any:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        return (allocation.get("devices") or {}).get("results")

    gone = _shared_device_ids(results(old)) - _shared_device_ids(results(new))
    kept = [
        d
        for d in new_status["devices"]
        if not isinstance(d, dict)
        or (d.get("driver"), d.get("pool"), d.get("device"), d.get("shareID")) not in gone
    ]
    if kept:
        new_status["devices"] = kept
    else:
        del new_status["devices"]
