"""What the controller saw of Nodes and of the pods bound to the Nodes that do not serve, and
the verdict of the one rule (:mod:`agent.core.ledger.node_standing`) on each of them.

A node that does not serve (NotReady, its Node deleted, or tainted
``node.kubernetes.io/out-of-service``) keeps its slots while any of its pods that may hold a
slot exists (counted by the reconciler from a watch of the pods bound to that node, so a
deletion is seen within moments, not at the next poll). Its time not serving is counted on
this process's monotonic clock from the moment it first saw the node so, never from the
condition's ``lastTransitionTime``: a clock skew between the API server and the controller
must not free anything early. The price is on the safe side: a controller that starts (or
takes over the lease) counts again. A node that serves again before anything was freed is
forgotten (the next episode starts over), so a flapping node is never cleaned up while it
keeps coming back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.core.ledger.node_standing import (
    FreeVerdict,
    NodeFacts,
    decide_free,
    may_hold_slots,
    next_decision_at,
    node_ready,
    node_serves,
    out_of_service,
)

__all__ = ["NODE_GRACE", "NodeWatch", "may_hold_slots", "node_ready"]

NODE_GRACE = 300.0  # seconds: a NotReady node with none of its pods left keeps its place so long


@dataclass
class NodeWatch:
    """What the controller saw of the cluster's Nodes (fed by the Node informer) and of the
    pods of the nodes that do not serve (fed by the reconciler's per-node pod watches)."""

    grace: float = NODE_GRACE
    free_after: float | None = None  # --free-slots-of-unready-nodes-after (None: off)
    ready: dict[str, bool] = field(default_factory=dict)
    serving: dict[str, bool] = field(default_factory=dict)
    out_of_service: set[str] = field(default_factory=set)
    unserving_since: dict[str, float] = field(default_factory=dict)
    pods: dict[str, int] = field(default_factory=dict)  # a non-serving node's pods holding slots

    def observe(self, name: str, node: Mapping[str, Any] | None, now: float) -> None:
        """A Node changed (``node`` None: deleted)."""
        if node is None:
            self.ready.pop(name, None)
            self.serving.pop(name, None)
            self.out_of_service.discard(name)
            self.unserving_since.setdefault(name, now)
            return
        self.ready[name] = node_ready(node)
        serves = self.serving[name] = node_serves(node)
        if out_of_service(node):
            self.out_of_service.add(name)
        else:
            self.out_of_service.discard(name)
        if serves:
            self.unserving_since.pop(name, None)
            self.pods.pop(name, None)
        else:
            self.unserving_since.setdefault(name, now)

    def is_ready(self, name: str) -> bool:
        return self.ready.get(name, False)

    def ready_nodes(self) -> set[str]:
        return {name for name, ready in self.ready.items() if ready}

    def is_gone(self, name: str) -> bool:
        """No Node object (deleted, or never seen)."""
        return name not in self.serving

    def serves(self, name: str) -> bool:
        return self.serving.get(name, False)

    def note_unserving(self, name: str, now: float) -> None:
        """``name`` is named by an Instance: if it does not serve, its time counts from now
        if it was never seen to stop (a node gone before this controller started)."""
        if not self.serves(name):
            self.unserving_since.setdefault(name, now)

    def set_pods(self, name: str, holding: int | None) -> None:
        """How many of non-serving node ``name``'s pods may hold slots (None: not known)."""
        if holding is None or self.serves(name):
            self.pods.pop(name, None)
        else:
            self.pods[name] = holding

    def facts(self, name: str, now: float) -> NodeFacts:
        since = self.unserving_since.get(name)
        return NodeFacts(
            serves=self.serves(name),
            gone=self.is_gone(name),
            out_of_service=name in self.out_of_service,
            unserving_for=0.0 if since is None else now - since,
            pods_holding=self.pods.get(name),
        )

    def verdict(self, name: str, now: float) -> FreeVerdict:
        return decide_free(self.facts(name, now), grace=self.grace, free_after=self.free_after)

    def is_dead(self, name: str, now: float) -> bool:
        """Whether ``name``'s slots may be freed now (the rule's verdict)."""
        return self.verdict(name, now).free

    def dead_among(self, names: Iterable[str], now: float) -> set[str]:
        """The nodes among ``names`` (the nodes Instances list) whose slots may be freed."""
        return {name for name in names if self.is_dead(name, now)}

    def next_deadline(self, names: Iterable[str], now: float) -> float | None:
        """When (monotonic) a timer of the rule runs out for one of ``names``."""
        deadlines = []
        for name in set(names):
            left = next_decision_at(
                self.facts(name, now), grace=self.grace, free_after=self.free_after
            )
            if left is not None:
                deadlines.append(now + left)
        return min(deadlines, default=None)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is remembered of non-serving nodes no Instance names any more."""
        wanted = set(keep)
        for name in [n for n in self.unserving_since if n not in wanted and self.is_gone(n)]:
            del self.unserving_since[name]
        for name in [n for n in self.pods if n not in wanted]:
            del self.pods[name]
