"""The DeviceClasses that let pods ask for Akri devices the device-plugin way through DRA
(KEP-5004, ``DeviceClass.spec.extendedResourceName``): pure, so that the controller — the only
component with a cluster-wide view — can own their create/update/delete.

For a Configuration ``cam`` (namespace ``ns``) and each of its Instances:

* ``cam.configuration.akri.sh`` with ``extendedResourceName: akri.sh/cam`` (the name the
  configuration-level device plugin registers: the Configuration name fitted like an Instance
  name) selecting every slot device of the Configuration;
* ``cam-8120fe.instance.akri.sh`` with ``extendedResourceName: akri.sh/cam-8120fe`` (the
  instance-level plugin's name) selecting that Instance's slot devices.

Selectors are CEL over the typed attributes the slices carry (``slices.py``): ``device.driver
== 'akri.sh' && device.attributes['akri.sh'].configuration == 'cam'`` (``.instance`` for an
Instance), and the slot's ``configurationExtendedResources`` (an Instance's class:
``extendedResources``) must be true: only slots that no node serves the name through a device
plugin for may serve a pod's limit (``agent/node/dra/name_paths.py``: such a node's slots would
be allocated through DRA in the seconds before kubelet posts its plugin's resource, and its
device plugin never asked). The test is guarded (``'extendedResources' in ...``): a slot
without the attribute (an older agent) does not match, where a plain lookup would be a CEL
runtime error that fails the pod's scheduling.

Names are unique by construction: the kind is the suffix, the Configuration or Instance name
(itself a DNS subdomain, unique among served names) the prefix; a name that would pass 253
characters is cut and given a hash of the full name.

**Who gets classes**: the extended resource name is node-global like the device plugins'
resource name, so only a Configuration that holds its names gets classes (``owns``: the rule
of ``agent/core/name_claims.py`` that every agent applies — a name that serves keeps it, then
the older runnable Configuration); a colliding one (the same name in another namespace, a name
shaped like another's Instances, long names shortened alike) gets none until the names are
free. No two holders collide, so no two classes carry one ``extendedResourceName``.

:func:`desired_device_classes` says which classes must exist; :func:`class_changes` compares
them with the classes found (by the ``app.kubernetes.io/managed-by`` label) and says what to
create, update and delete.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.model.keys import ObjectKey
from agent.core.model.naming import DNS_SUBDOMAIN_MAX, configuration_resource_name
from agent.core.model.resource_slices import DRIVER

# agent/node/dra/slices.py publishes both on every slot: may it serve akri.sh/<instance>,
# akri.sh/<configuration> limits through DRA
EXTENDED_ATTRIBUTE = "extendedResources"
CONFIGURATION_EXTENDED_ATTRIBUTE = "configurationExtendedResources"

API_VERSION = "resource.k8s.io/v1"
RESOURCE_PREFIX = "akri.sh/"
CONFIGURATION_SUFFIX = ".configuration.akri.sh"
INSTANCE_SUFFIX = ".instance.akri.sh"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "akri-controller"
CONFIGURATION_LABEL = "akri.sh/configuration"
NAMESPACE_LABEL = "akri.sh/configuration-namespace"
LABEL_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"

JSON = dict[str, Any]


def class_name(name: str, suffix: str) -> str:
    """``<name><suffix>``, cut with a hash of ``name`` when longer than a DNS subdomain."""
    full = name + suffix
    if len(full) <= DNS_SUBDOMAIN_MAX:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    keep = DNS_SUBDOMAIN_MAX - len(suffix) - len(digest) - 1
    return f"{name[:keep].rstrip('.-')}-{digest}{suffix}"


def cel_string(value: str) -> str:
    """A CEL string literal (single quotes; backslash and quote escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _label_value(text: str) -> str:
    # label values: ≤ 63, alphanumeric at both ends; Configuration names fit unless long
    if len(text) <= 63:
        return text
    return text[:52].rstrip(".-_") + "-" + hashlib.sha256(text.encode()).hexdigest()[:10]


def _device_class(name: str, resource: str, expression: str, key: ObjectKey) -> JSON:
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {
            "name": name,
            "labels": {
                MANAGED_BY_LABEL: MANAGED_BY,
                CONFIGURATION_LABEL: _label_value(key.name),
                NAMESPACE_LABEL: _label_value(key.namespace),
            },
        },
        "spec": {
            "selectors": [{"cel": {"expression": expression}}],
            "extendedResourceName": resource,
        },
    }


def _eligible(attribute: str) -> str:
    """The CEL term every extended-resource class adds: the slot may serve the class's name."""
    attributes = f"device.attributes[{cel_string(DRIVER)}]"
    return f"{cel_string(attribute)} in {attributes} && {attributes}.{attribute}"


def configuration_class(key: ObjectKey) -> JSON:
    """The DeviceClass of a Configuration's configuration-level extended resource."""
    attribute = f"device.attributes[{cel_string(DRIVER)}].configuration"
    expression = (
        f"device.driver == {cel_string(DRIVER)} && {attribute} == {cel_string(key.name)} && "
        + _eligible(CONFIGURATION_EXTENDED_ATTRIBUTE)
    )
    return _device_class(
        class_name(key.name, CONFIGURATION_SUFFIX),
        RESOURCE_PREFIX + configuration_resource_name(key.name),
        expression,
        key,
    )


def instance_class(configuration: ObjectKey, instance: str) -> JSON:
    """The DeviceClass of one Instance's instance-level extended resource."""
    attribute = f"device.attributes[{cel_string(DRIVER)}].instance"
    expression = (
        f"device.driver == {cel_string(DRIVER)} && {attribute} == {cel_string(instance)} && "
        + _eligible(EXTENDED_ATTRIBUTE)
    )
    return _device_class(
        class_name(instance, INSTANCE_SUFFIX), RESOURCE_PREFIX + instance, expression, configuration
    )


@dataclass(frozen=True)
class InstanceRef:
    """What the classes need of an Instance: its name and its Configuration's key."""

    name: str
    configuration: ObjectKey


def desired_device_classes(
    configurations: Iterable[ObjectKey],
    instances: Iterable[InstanceRef],
    owns: Callable[[ObjectKey], bool],
) -> dict[str, JSON]:
    """Class name -> DeviceClass for every owned Configuration and each of its Instances."""
    owned = {key for key in configurations if owns(key)}
    classes: dict[str, JSON] = {}
    for key in sorted(owned):
        device_class = configuration_class(key)
        classes[device_class["metadata"]["name"]] = device_class
    for instance in sorted(instances, key=lambda i: i.name):
        if instance.configuration in owned:
            device_class = instance_class(instance.configuration, instance.name)
            classes[device_class["metadata"]["name"]] = device_class
    return classes


@dataclass(frozen=True)
class ClassChanges:
    """What to write so the cluster's managed DeviceClasses equal the desired ones."""

    create: tuple[JSON, ...]
    update: tuple[JSON, ...]  # desired objects carrying the stored resourceVersion
    delete: tuple[JSON, ...]  # stored objects (delete with their resourceVersion)


def class_changes(desired: Mapping[str, JSON], stored: Iterable[Mapping[str, Any]]) -> ClassChanges:
    """Compare by name; only classes with our ``managed-by`` label are ever updated or
    deleted (an operator's own class of the same name is left alone and not overwritten)."""
    found = {str(o["metadata"]["name"]): o for o in stored}
    create, update, delete = [], [], []
    for name, wanted in sorted(desired.items()):
        current = found.get(name)
        if current is None:
            create.append(wanted)
            continue
        labels = (current.get("metadata") or {}).get("labels") or {}
        if labels.get(MANAGED_BY_LABEL) != MANAGED_BY:
            continue
        spec = dict(current.get("spec") or {})
        if "extendedResourceName" not in spec:
            # dropped by an API server whose DRAExtendedResource gate is off: writing it
            # again would change nothing, so that alone is no difference
            spec["extendedResourceName"] = wanted["spec"]["extendedResourceName"]
        if spec != wanted["spec"] or labels != wanted["metadata"]["labels"]:
            meta = {
                **wanted["metadata"],
                "resourceVersion": current["metadata"].get("resourceVersion"),
            }
            update.append({**wanted, "metadata": meta})
    for name, current in sorted(found.items()):
        labels = (current.get("metadata") or {}).get("labels") or {}
        if name not in desired and labels.get(MANAGED_BY_LABEL) == MANAGED_BY:
            delete.append(dict(current))
    return ClassChanges(tuple(create), tuple(update), tuple(delete))


def keeps_extended_resource_name(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """Whether the API server kept ``spec.extendedResourceName`` (it drops the field when the
    ``DRAExtendedResource`` gate is off): the agent's test for the DRA path."""
    wanted = (sent.get("spec") or {}).get("extendedResourceName")
    return bool(wanted) and (stored.get("spec") or {}).get("extendedResourceName") == wanted
