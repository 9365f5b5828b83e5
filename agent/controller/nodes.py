"""Pure dead-node decisions: which nodes' slots and ``nodes`` entries the controller frees.

A node is **dead** when its Node object is gone, or when its ``Ready`` condition has been
anything but ``True`` for the whole grace period *as this controller saw it*. The grace is
counted on this process's monotonic clock from the moment it first saw the node not Ready,
never from the condition's ``lastTransitionTime``: a clock skew between the API server and
the controller must not free a live node's slots early. The price is on the safe side: a
controller that starts (or takes over the lease) counts the grace again.

A node that turns Ready again before the grace ends is forgotten (the next NotReady starts a
new grace), so a flapping node is never cleaned up while it keeps coming back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

NODE_GRACE = 300.0  # seconds: a NotReady node keeps its slots this long


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

    def observe(self, name: str, node: Mapping[str, Any] | None, now: float) -> None:
        """A Node changed (``node`` None: deleted)."""
        if node is None:
            self.ready.pop(name, None)
            self.not_ready_since.pop(name, None)
            return
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

    def is_dead(self, name: str, now: float) -> bool:
        """Gone, or not Ready for the whole grace."""
        if name not in self.ready:
            return True
        since = self.not_ready_since.get(name)
        return since is not None and now - since >= self.grace

    def dead_among(self, names: Iterable[str], now: float) -> set[str]:
        """The dead nodes among ``names`` (the nodes Instances list)."""
        return {name for name in names if self.is_dead(name, now)}

    def next_deadline(self, names: Iterable[str], now: float) -> float | None:
        """When the next not-Ready node among ``names`` reaches its grace (monotonic)."""
        deadlines = [
            self.not_ready_since[name] + self.grace
            for name in set(names)
            if name in self.not_ready_since and self.not_ready_since[name] + self.grace > now
        ]
        return min(deadlines, default=None)
