"""Pure: whether a node's agent is *there* — the rule the agents (who publishes a shared pool,
``agent/core/model/resource_slices.py``) and the controller (which shared pools nobody will
rewrite, ``agent/controller/slices.py``) both follow (issue 39.4).

A Node that is Ready says nothing of the agent on it: the agent may have crashed (or be
crash-looping), its Pod may be deleted or evicted, or no longer scheduled there, or the agent
may be stuck. A pool it published would then stay as it last wrote it, advertising slots taken
since through other nodes' device plugins. So a node's agent is there while a Pod of the
agents' DaemonSet bound to that node (``spec.nodeName``) exists, is not being deleted and is
``Ready`` — its readiness probe (``/readyz``) passes: store synced, device plugins and the DRA
driver registered with kubelet. An agent that is not Ready neither publishes a shared pool nor
is selected by one, in its own view too, so every agent reading the same Pods agrees.

The agents' Pods are those the DaemonSet's (immutable) selector matches: :func:`selector_string`
of it, learned once from the agent's own Pod and its DaemonSet. A node whose agent Pods cannot
be read is *unknown*, and unknown counts as there, as an unknown Node counts as serving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

# what akri controller selects the agents' Pods by (deploy/base/daemonset.yaml, the chart)
AGENT_SELECTOR = "app.kubernetes.io/name=akri-agent"


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Whether a Pod's ``Ready`` condition is ``True`` (absent: not Ready)."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def agent_pod_there(pod: Mapping[str, Any]) -> bool:
    """Whether this agent Pod is one that serves: not being deleted, and Ready."""
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and pod_ready(pod)


def agent_there(pods: Iterable[Mapping[str, Any]]) -> bool:
    """Whether one of a node's agent Pods serves (during a rollout the old one may be
    terminating while the new one starts: either Ready and not being deleted will do)."""
    return any(agent_pod_there(pod) for pod in pods)


def pod_node(pod: Mapping[str, Any]) -> str:
    """The node a Pod is bound to (``""``: not scheduled yet)."""
    return str((pod.get("spec") or {}).get("nodeName") or "")


def agent_summary(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What the rule reads of an agent Pod (a cache keeps this, not the whole Pod)."""
    meta = pod.get("metadata") or {}
    kept = {k: meta[k] for k in ("name", "namespace", "resourceVersion") if k in meta}
    if meta.get("deletionTimestamp"):
        kept["deletionTimestamp"] = meta["deletionTimestamp"]
    ready = "True" if pod_ready(pod) else "False"
    return {
        "kind": "Pod",
        "metadata": kept,
        "spec": {"nodeName": pod_node(pod)},
        "status": {"conditions": [{"type": "Ready", "status": ready}]},
    }


def selector_string(selector: Mapping[str, Any] | None) -> str | None:
    """A ``metav1.LabelSelector`` (a DaemonSet's ``spec.selector``) as a ``labelSelector``
    query, or None when it selects nothing expressible (absent, empty: it would select every
    Pod of the namespace)."""
    if not selector:
        return None
    parts = [f"{key}={value}" for key, value in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        key = expression.get("key")
        operator = expression.get("operator")
        values = ",".join(sorted(str(v) for v in expression.get("values") or []))
        if not key:
            return None
        if operator == "In":
            parts.append(f"{key} in ({values})")
        elif operator == "NotIn":
            parts.append(f"{key} notin ({values})")
        elif operator == "Exists":
            parts.append(str(key))
        elif operator == "DoesNotExist":
            parts.append(f"!{key}")
        else:
            return None
    return ",".join(parts) or None


def agents_there(pods: Iterable[Mapping[str, Any]]) -> Callable[[str], bool]:
    """node -> whether its agent is there, from every agent Pod a selector found (akri
    controller's one watch for the cluster). When it found none at all — the agents are
    labelled otherwise (another install), or none runs yet — every node's agent is unknown,
    and unknown counts as there."""
    by_node: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        by_node.setdefault(pod_node(pod), []).append(pod)
    if not by_node:
        return lambda _node: True
    return lambda node: agent_there(by_node.get(node, ()))
