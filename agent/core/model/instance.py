"""Typed ``Instance`` (``akri.sh/v0``) and its JSON form."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.core.model.keys import DEFAULT_NAMESPACE, ObjectKey
from agent.core.model.naming import (
    DEVICE_DIGEST_ANNOTATION,
    DRAINING_ANNOTATION,
    OFFLINE_ANNOTATION,
    offline_annotation,
    slot_id,
)

API_VERSION = "akri.sh/v0"
KIND = "Instance"


class InstanceFormatError(ValueError):
    """An Instance object does not have Akri's shape."""


@dataclass(frozen=True)
class Instance:
    """An Akri Instance. Treat as immutable: use :meth:`evolve` to derive a changed copy."""

    name: str
    configuration_name: str
    capacity: int
    namespace: str = DEFAULT_NAMESPACE
    cdi_name: str = ""
    broker_properties: Mapping[str, str] = field(default_factory=dict)
    shared: bool = False
    nodes: tuple[str, ...] = ()
    device_usage: Mapping[str, str] = field(default_factory=dict)
    resource_version: str | None = None
    uid: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    owner_references: tuple[Mapping[str, Any], ...] = ()
    deletion_timestamp: str | None = None
    finalizers: tuple[str, ...] = ()
    extra_metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def evolve(self, **changes: Any) -> Instance:
        """A copy with ``changes`` applied (dataclasses.replace with a clearer name)."""
        return replace(self, **changes)

    @property
    def key(self) -> ObjectKey:
        """``(namespace, name)``: the Instance's identity."""
        return ObjectKey(self.namespace, self.name)

    @property
    def configuration_key(self) -> ObjectKey:
        """The key of its Configuration (always in the Instance's own namespace)."""
        return ObjectKey(self.namespace, self.configuration_name)

    @property
    def draining_nodes(self) -> tuple[str, ...]:
        """Nodes that lost the device (or its Configuration) but still hold slots in use, so
        they stay in ``nodes`` until those slots are released (annotation, see slot-model)."""
        return self.marked_nodes(DRAINING_ANNOTATION)

    @property
    def offline_nodes(self) -> tuple[str, ...]:
        """Nodes of ``nodes`` that do not see the device right now but keep the Instance for
        their offline grace (their slots are Unhealthy there): those with an annotation of
        their own (:func:`~agent.core.model.naming.offline_annotation`, shared Instances), and
        those an earlier agent listed in ``akri.sh/offline``."""
        legacy = self.marked_nodes(OFFLINE_ANNOTATION)
        if not self.annotations:
            return legacy
        own = tuple(n for n in self.nodes if offline_annotation(n) in self.annotations)
        return (*own, *(n for n in legacy if n not in own)) if legacy else own

    def offline_since(self, node: str) -> str | None:
        """When ``node`` recorded that it stopped seeing the device (the value of its own
        offline annotation, RFC 3339), or None."""
        return self.annotations.get(offline_annotation(node))

    def without_offline_mark(self, node: str) -> Instance:
        """A copy without ``node``'s offline marks (its own annotation and its entry in an
        earlier agent's list)."""
        key = offline_annotation(node)
        cleared = self.with_node_mark(OFFLINE_ANNOTATION, node, False)
        if key not in cleared.annotations:
            return cleared
        return cleared.evolve(
            annotations={k: v for k, v in cleared.annotations.items() if k != key}
        )

    def marked_nodes(self, annotation: str) -> tuple[str, ...]:
        """The node names in a comma-separated node-list annotation."""
        text = self.annotations.get(annotation, "")
        return tuple(node for node in text.split(",") if node)

    def with_node_mark(self, annotation: str, node: str, present: bool) -> Instance:
        """A copy with ``node`` added to / removed from a node-list annotation."""
        nodes = set(self.marked_nodes(annotation))
        nodes = nodes | {node} if present else nodes - {node}
        annotations = {k: v for k, v in self.annotations.items() if k != annotation}
        if nodes:
            annotations[annotation] = ",".join(sorted(nodes))
        return self.evolve(annotations=annotations)

    @property
    def device_fingerprint(self) -> str | None:
        """Fingerprint of the device this Instance stands for, when our agent wrote it."""
        return self.annotations.get(DEVICE_DIGEST_ANNOTATION)

    def slot_ids(self) -> list[str]:
        """Slot ids ``<name>-0`` … ``<name>-<capacity-1>``."""
        # built once per (name, capacity): every Instance change asks for them again, and
        # formatting 1000 ids cost more than the rest of an Allocate's bookkeeping
        return list(_slot_ids(self.name, self.capacity))

    def to_dict(self) -> dict[str, Any]:
        """The Kubernetes JSON object."""
        metadata: dict[str, Any] = copy.deepcopy(dict(self.extra_metadata))
        metadata["name"] = self.name
        metadata["namespace"] = self.namespace
        if self.resource_version is not None:
            metadata["resourceVersion"] = self.resource_version
        else:
            metadata.pop("resourceVersion", None)
        if self.uid is not None:
            metadata["uid"] = self.uid
        if self.labels:
            metadata["labels"] = dict(self.labels)
        if self.annotations:
            metadata["annotations"] = dict(self.annotations)
        if self.owner_references:
            metadata["ownerReferences"] = [dict(ref) for ref in self.owner_references]
        if self.deletion_timestamp is not None:
            metadata["deletionTimestamp"] = self.deletion_timestamp
        if self.finalizers:
            metadata["finalizers"] = list(self.finalizers)
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": metadata,
            "spec": {
                "configurationName": self.configuration_name,
                "cdiName": self.cdi_name,
                "capacity": self.capacity,
                "brokerProperties": dict(self.broker_properties),
                "shared": self.shared,
                "nodes": list(self.nodes),
                "deviceUsage": dict(self.device_usage),
            },
        }

    @classmethod
    def from_dict(cls, obj: Any) -> Instance:
        """Parse a Kubernetes JSON object; raises :class:`InstanceFormatError`."""
        if not isinstance(obj, Mapping):
            raise InstanceFormatError("Instance must be an object")
        metadata = obj.get("metadata")
        spec = obj.get("spec")
        if not isinstance(metadata, Mapping) or not isinstance(spec, Mapping):
            raise InstanceFormatError("Instance needs metadata and spec objects")
        name = metadata.get("name")
        if not isinstance(name, str) or not name:
            raise InstanceFormatError("metadata.name is missing")
        config = spec.get("configurationName")
        if not isinstance(config, str) or not config:
            raise InstanceFormatError(f"{name}: spec.configurationName is missing")
        capacity = spec.get("capacity", 1)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InstanceFormatError(f"{name}: spec.capacity must be a non-negative integer")
        nodes = spec.get("nodes") or []
        usage = spec.get("deviceUsage") or {}
        props = spec.get("brokerProperties") or {}
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise InstanceFormatError(f"{name}: spec.nodes must be a list of strings")
        for label, mapping in (("deviceUsage", usage), ("brokerProperties", props)):
            if not isinstance(mapping, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
            ):
                raise InstanceFormatError(f"{name}: spec.{label} must map strings to strings")
        known = {"name", "namespace", "resourceVersion", "uid", "labels", "annotations"}
        known |= {"ownerReferences", "deletionTimestamp", "finalizers"}
        finalizers = metadata.get("finalizers") or []
        if not isinstance(finalizers, list) or not all(isinstance(f, str) for f in finalizers):
            raise InstanceFormatError(f"{name}: metadata.finalizers must be a list of strings")
        return cls(
            name=name,
            namespace=str(metadata.get("namespace") or DEFAULT_NAMESPACE),
            configuration_name=config,
            cdi_name=str(spec.get("cdiName") or ""),
            capacity=capacity,
            broker_properties=dict(props),
            shared=bool(spec.get("shared", False)),
            nodes=tuple(dict.fromkeys(nodes)),
            device_usage=dict(usage),
            resource_version=_opt_str(metadata.get("resourceVersion")),
            uid=_opt_str(metadata.get("uid")),
            labels=dict(metadata.get("labels") or {}),
            annotations=dict(metadata.get("annotations") or {}),
            owner_references=tuple(dict(ref) for ref in metadata.get("ownerReferences") or []),
            deletion_timestamp=_opt_str(metadata.get("deletionTimestamp")),
            finalizers=tuple(dict.fromkeys(finalizers)),
            extra_metadata={k: v for k, v in metadata.items() if k not in known},
        )


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@functools.lru_cache(maxsize=4096)
def _slot_ids(name: str, capacity: int) -> tuple[str, ...]:
    return tuple(slot_id(name, index) for index in range(capacity))
