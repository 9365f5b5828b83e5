"""Pure dead-node decisions: which nodes' slots and ``nodes`` entries the controller frees.

A node is **dead** when its Node object is gone, or when its ``Ready`` condition has been
anything but ``True`` for the whole grace period *as this controller saw it*. The grace is
counted on this process's monotonic clock from the moment it first saw the node not Ready,
never from the condition's ``lastTransitionTime``: a clock skew between the API server and
the controller must not free a live node's slots early. The price is on the safe side: a
controller that starts (or takes over the lease) counts the grace again.

A node that turns Ready again before the grace ends is forgotten (the next NotReady starts a
new grace), so a flapping node is never cleaned up while it keeps coming back.

A node whose Node object is **gone** (``kubectl delete node``, or never seen) may still be a
running machine: its pods stay in the API until the pod garbage collector deletes them (about
40 s after the Node, kube-controller-manager's orphaned-pod quarantine), and their containers
keep the devices meanwhile (issue 34.7). So a gone node is dead only once none of its pods
that may hold a slot (:func:`may_hold_slots`) exists any more — as the reconciler last listed
them (:meth:`NodeWatch.set_pods`; unknown until listed) — or once it has been gone for the
whole grace (the same bound as a NotReady node: pods that never go, e.g. held by a finalizer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

NODE_GRACE = 300.0  # seconds: a NotReady node keeps its slots this long


EXTENDED_RESOURCE_PREFIX = "akri.sh/"  # device-plugin (and KEP-5004) resources: akri.sh/<name>
_CONTAINER_GROUPS = ("containers", "initContainers", "ephemeralContainers")


def may_hold_slots(pod: Mapping[str, Any]) -> bool:
    """Whether ``pod``'s containers may be using an Instance's slot: not finished (phase
    Succeeded/Failed) and asking for an ``akri.sh/<name>`` resource or for ResourceClaims
    (which claims are ours is not read: the safe side). The value a slot holds cannot say
    which pod took it (``<node>``, ``C:<vdev>:<node>``), so this is per pod, not per slot."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return False
    spec = pod.get("spec") or {}
    if spec.get("resourceClaims") or status.get("extendedResourceClaimStatus"):
        return True
    for group in _CONTAINER_GROUPS:
        for container in spec.get(group) or []:
            resources = (container or {}).get("resources") or {}
            for kind in ("limits", "requests"):
                amounts = resources.get(kind) or {}
                if any(str(name).startswith(EXTENDED_RESOURCE_PREFIX) for name in amounts):
                    return True
    return False


def node_ready(node: Mapping[str, Any]) -> bool:
    """Whether a Node object's ``Ready`` condition is ``True`` (absent: not Ready)."""
    for condition in (node.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


@dataclass
class NodeWatch:
    """What the controller saw of the cluster's Nodes (fed by the Node informer)."""

    grace: float = NODE_GRACE
    ready: dict[str, bool] = field(default_factory=dict)
    not_ready_since: dict[str, float] = field(default_factory=dict)
    gone_since: dict[str, float] = field(default_factory=dict)  # Node object gone, seen when
    pods_left: dict[str, int] = field(default_factory=dict)  # a gone node's pods holding slots

    def observe(self, name: str, node: Mapping[str, Any] | None, now: float) -> None:
        """A Node changed (``node`` None: deleted)."""
        self.pods_left.pop(name, None)
        if node is None:
            self.ready.pop(name, None)
            self.not_ready_since.pop(name, None)
            self.gone_since.setdefault(name, now)
            return
        self.gone_since.pop(name, None)
        is_ready = node_ready(node)
        self.ready[name] = is_ready
        if is_ready:
            self.not_ready_since.pop(name, None)
        else:
            self.not_ready_since.setdefault(name, now)

    def is_ready(self, name: str) -> bool:
        return self.ready.get(name, False)

    def ready_nodes(self) -> set[str]:
        return {name for name, ready in self.ready.items() if ready}

    def is_gone(self, name: str) -> bool:
        """No Node object (deleted, or never seen)."""
        return name not in self.ready

    def note_gone(self, name: str, now: float) -> None:
        """``name`` is a gone node an Instance names: its grace counts from now if it was
        never seen deleted (a node gone before this controller started)."""
        if self.is_gone(name):
            self.gone_since.setdefault(name, now)

    def set_pods(self, name: str, holding: int | None) -> None:
        """How many of gone node ``name``'s pods may hold slots (None: could not list)."""
        if holding is None:
            self.pods_left.pop(name, None)
        elif self.is_gone(name):
            self.pods_left[name] = holding

    def is_dead(self, name: str, now: float) -> bool:
        """Gone with none of its slot-holding pods left (or gone for the whole grace), or
        not Ready for the whole grace."""
        if self.is_gone(name):
            if self.pods_left.get(name) == 0:
                return True
            gone = self.gone_since.get(name)
            return gone is not None and now - gone >= self.grace
        since = self.not_ready_since.get(name)
        return since is not None and now - since >= self.grace

    def dead_among(self, names: Iterable[str], now: float) -> set[str]:
        """The dead nodes among ``names`` (the nodes Instances list)."""
        return {name for name in names if self.is_dead(name, now)}

    def next_deadline(self, names: Iterable[str], now: float) -> float | None:
        """When the next not-Ready or gone node among ``names`` reaches its grace
        (monotonic)."""
        deadlines = [
            since[name] + self.grace
            for since in (self.not_ready_since, self.gone_since)
            for name in set(names)
            if name in since and since[name] + self.grace > now
        ]
        return min(deadlines, default=None)

    def forget_gone(self, keep: Iterable[str]) -> None:
        """Drop what is remembered of gone nodes no Instance names any more."""
        wanted = set(keep)
        for table in (self.gone_since, self.pods_left):
            for name in [n for n in table if n not in wanted]:
                del table[name]
