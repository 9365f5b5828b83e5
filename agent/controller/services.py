"""Pure Service decisions: the instance and configuration Services that follow broker Pods.

Akri (``controller/src/util/pod_watcher.rs``, ``shared/src/k8s/service.rs``): a Service exists
while at least one broker Pod it selects is Running and not terminating, and is removed when
none is left.

* ``instanceServiceSpec`` → ``<instance>-svc`` (``.`` → ``-``), selector ``controller=akri.sh``
  + ``akri.sh/instance=<instance>``, owned by the Instance;
* ``configurationServiceSpec`` → ``<configuration>-svc``, selector ``controller=akri.sh`` +
  ``akri.sh/configuration=<configuration>``, owned by the Configuration.

A spec edit replaces the stored Service's spec (the one it was made from is the annotation
``akri.sh/service-spec``, a hash), keeping what the API server allocated (``clusterIP``,
``clusterIPs``, node ports already assigned are not kept: a changed port list gets new ones).

A Service whose owner is gone (its Configuration or Instance deleted) is not deleted here: the
garbage collector deletes it with its owner, and the controller's DELETE raced it (a 404 in
every uninstall, seen in a real cluster's audit log). One whose owner remains and whose
brokers stopped is deleted here, once.
"""

from __future__ import annotations

import copy
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.controller.brokers import (
    APP_LABEL,
    CONFIGURATION_LABEL,
    CONTROLLER_LABEL,
    CONTROLLER_VALUE,
    INSTANCE_LABEL,
    dashed,
    instance_owner,
    owner_reference,
    spec_hash,
)
from agent.core.model.configuration import API_VERSION as CONFIGURATION_API_VERSION
from agent.core.model.configuration import Configuration
from agent.core.model.instance import Instance

SPEC_ANNOTATION = "akri.sh/service-spec"
KEEP_ALLOCATED = ("clusterIP", "clusterIPs")


def instance_service_name(instance_name: str) -> str:
    return dashed(f"{instance_name}-svc")


def configuration_service_name(configuration_name: str) -> str:
    return dashed(f"{configuration_name}-svc")


def _service(
    name: str,
    namespace: str,
    spec: Mapping[str, Any],
    selector: dict[str, str],
    owner: dict[str, Any],
) -> dict[str, Any]:
    body: dict[str, Any] = copy.deepcopy(dict(spec))
    body["selector"] = selector  # Akri's selector, whatever the user wrote
    labels = {APP_LABEL: name, **selector}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": {SPEC_ANNOTATION: spec_hash(spec)},
            "ownerReferences": [owner],
        },
        "spec": body,
    }


def instance_service(configuration: Configuration, instance: Instance) -> dict[str, Any] | None:
    """The instance Service ``instance`` should have (None: the Configuration asks for none)."""
    spec = configuration.instance_service_spec
    if spec is None:
        return None
    selector = {CONTROLLER_LABEL: CONTROLLER_VALUE, INSTANCE_LABEL: instance.name}
    return _service(
        instance_service_name(instance.name),
        instance.namespace,
        spec,
        selector,
        instance_owner(instance),
    )


def configuration_service(configuration: Configuration) -> dict[str, Any] | None:
    """The configuration Service (None: the Configuration asks for none)."""
    spec = configuration.configuration_service_spec
    if spec is None:
        return None
    selector = {CONTROLLER_LABEL: CONTROLLER_VALUE, CONFIGURATION_LABEL: configuration.name}
    owner = owner_reference(
        CONFIGURATION_API_VERSION, "Configuration", configuration.name, configuration.uid
    )
    return _service(
        configuration_service_name(configuration.name),
        configuration.namespace,
        spec,
        selector,
        owner,
    )


@dataclass(frozen=True)
class ServicePlan:
    """Services to create, to replace (the stored object with the new spec) and to delete
    (``namespace/name``, uid)."""

    create: tuple[dict[str, Any], ...] = ()
    replace: tuple[dict[str, Any], ...] = ()
    delete: tuple[tuple[str, str], ...] = ()


def replacement(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> dict[str, Any] | None:
    """``stored`` turned into ``wanted`` (None when it already is): labels, annotations,
    owners and spec from ``wanted``, the allocated addresses and resourceVersion kept."""
    meta = stored.get("metadata") or {}
    want_meta = wanted["metadata"]
    same = (
        (meta.get("annotations") or {}).get(SPEC_ANNOTATION)
        == want_meta["annotations"][SPEC_ANNOTATION]
        and (meta.get("labels") or {}) == want_meta["labels"]
        and [r.get("uid") for r in meta.get("ownerReferences") or []]
        == [r.get("uid") for r in want_meta["ownerReferences"]]
    )
    if same:
        return None
    spec = copy.deepcopy(dict(wanted["spec"]))
    for key in KEEP_ALLOCATED:
        value = (stored.get("spec") or {}).get(key)
        if value is not None and key not in spec:
            spec[key] = value
    new_meta = {**copy.deepcopy(dict(meta)), **copy.deepcopy(dict(want_meta))}
    return {**wanted, "metadata": new_meta, "spec": spec}


def service_key(obj: Mapping[str, Any]) -> str:
    """``namespace/name`` of a Service object."""
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def collected_with_owner(obj: Mapping[str, Any], owners: Container[str]) -> bool:
    """Whether the garbage collector deletes the Service ``obj``: an owner it names (by uid)
    is not among ``owners``, the uids of the Configurations and Instances that exist (an
    Instance being deleted exists: its Services are the controller's to delete)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(
        isinstance(ref, Mapping) and ref.get("uid") and str(ref["uid"]) not in owners
        for ref in refs
    )


def plan_services(
    wanted: Iterable[dict[str, Any]],
    stored: Mapping[str, Mapping[str, Any]],
    owners: Container[str] | None = None,
) -> ServicePlan:
    """Bring the Services this controller manages (``stored``: every Service labelled
    ``controller=akri.sh``, by ``namespace/name``) to exactly ``wanted``; one to delete whose
    owner is not among ``owners`` (uids; None: not checked) is the garbage collector's."""
    want = {service_key(item): item for item in wanted}
    create: list[dict[str, Any]] = []
    replace: list[dict[str, Any]] = []
    delete: list[tuple[str, str]] = []
    for key, item in sorted(want.items()):
        current = stored.get(key)
        if current is None:
            create.append(item)
        elif (current.get("metadata") or {}).get("deletionTimestamp"):
            continue  # going away: re-created once gone
        else:
            updated = replacement(current, item)
            if updated is not None:
                replace.append(updated)
    for key in sorted(set(stored) - set(want)):
        current = stored[key]
        if (current.get("metadata") or {}).get("deletionTimestamp"):
            continue
        if owners is not None and collected_with_owner(current, owners):
            continue
        delete.append((key, str((current.get("metadata") or {}).get("uid") or "")))
    return ServicePlan(tuple(create), tuple(replace), tuple(delete))
