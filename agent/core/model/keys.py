"""``ObjectKey``: a namespaced Kubernetes object's identity, ``(namespace, name)``.

Configurations and Instances are namespaced: two namespaces may hold objects of the same name,
so every map of them in the agent is keyed by both. Kubelet resource names
(``akri.sh/<name>``) and DRA device/pool names are node-global, not namespaced; which
namespace may use a name there is decided in :mod:`agent.node.discovery.ownership`.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_NAMESPACE = "default"


class ObjectKey(NamedTuple):
    """``namespace/name`` of an object."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"
