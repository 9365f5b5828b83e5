"""Pure: whether a node's slots may be freed by anyone but the node itself — the one rule the
controller and the node's own agent both follow (DESIGN.md invariant 10).

A node that stops answering is not a node whose pods are gone. Its containers may still run
(a kubelet killed while containerd goes on, a network partition between the node and the
control plane) and keep using the devices whose slots it holds; freeing those slots on a
timer lets a pod on another node take a device that is already in use. So:

* a node **serves** while its Node object exists, its ``Ready`` condition is not ``False`` or
  ``Unknown`` and it has no ``node.kubernetes.io/out-of-service`` taint (:func:`node_serves`).
  Nothing of a serving node is freed by anyone but its own agent;
* a node that does not serve keeps its slots while Kubernetes still has pods bound to it that
  may hold slots (:func:`may_hold_slots`: not Succeeded/Failed — Running or Terminating —
  and using ``akri.sh/*`` resources or ResourceClaims). They are freed once those pods are
  gone: deleted by the kubelet, force-deleted, or deleted by the pod garbage collector after
  the Node is deleted or tainted out-of-service. A Node gone or out of service is freed as
  soon as that is so; a merely NotReady one only after the grace as well (a kubelet that
  restarts makes its Node NotReady for a moment: its place in the Instances stays);
* an operator who prefers availability to safety may opt in to a timer
  (``--free-slots-of-unready-nodes-after``): then a node not serving for that long is freed
  even while its pods remain, with the risk that says its name;
* the node's own agent writes itself into an Instance (creates one, joins one, adopts the
  slots its containers use) only while its Node serves (:func:`may_join`). The controller
  frees only nodes that do not serve: the two can never undo each other's writes, so no
  write loop can form between them. Once the Node serves again the agent joins again, with
  its kubelet's evidence of what its containers use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
EXTENDED_RESOURCE_PREFIX = "akri.sh/"  # device-plugin (and KEP-5004) resources: akri.sh/<name>
_CONTAINER_GROUPS = ("containers", "initContainers", "ephemeralContainers")


def node_ready(node: Mapping[str, Any]) -> bool:
    """Whether a Node object's ``Ready`` condition is ``True`` (absent: not Ready)."""
    for condition in (node.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def out_of_service(node: Mapping[str, Any]) -> bool:
    """Whether the Node carries the ``node.kubernetes.io/out-of-service`` taint (any value or
    effect): the operator's statement that the node is shut down for good and its pods may
    be force-deleted (the pod garbage collector then does)."""
    for taint in (node.get("spec") or {}).get("taints") or []:
        if isinstance(taint, Mapping) and taint.get("key") == OUT_OF_SERVICE_TAINT:
            return True
    return False


def _says_not_ready(node: Mapping[str, Any]) -> bool:
    """Whether the Node has a ``Ready`` condition that is not ``True`` (False, Unknown)."""
    for condition in (node.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") != "True"
    return False


def node_serves(node: Mapping[str, Any] | None) -> bool:
    """Whether a node serves: its Node exists (``node`` not None), nothing says it is not
    Ready (a Node without a ``Ready`` condition — just registered, or written by hand — is
    not said to be down) and it is not tainted out-of-service. Only a node that does not
    serve may have its slots freed by the controller; only a node that serves writes itself
    into Instances."""
    return node is not None and not _says_not_ready(node) and not out_of_service(node)


def may_join(node: Mapping[str, Any] | None, known: bool = True) -> bool:
    """Whether a node's agent may write itself into an Instance (create, join, adopt slots):
    while its Node serves, or while it does not know its Node (``known`` False: not read
    yet, or the agent may not read Nodes — it then behaves as before this rule)."""
    return not known or node_serves(node)


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


@dataclass(frozen=True)
class NodeFacts:
    """What Kubernetes says of one node, as the deciding process saw it."""

    serves: bool
    gone: bool = False  # no Node object
    out_of_service: bool = False
    unserving_for: float = 0.0  # seconds it has not served, on the decider's own clock
    pods_holding: int | None = None  # its pods that may hold slots; None: not known


@dataclass(frozen=True)
class FreeVerdict:
    """:func:`decide_free`: whether the node's slots may be freed now, and why (a log line's
    words). ``forced``: freed by the opt-in timer while its pods may still use them."""

    free: bool
    why: str
    forced: bool = False


def decide_free(facts: NodeFacts, *, grace: float, free_after: float | None) -> FreeVerdict:
    """The rule (module docstring). ``grace``: how long a NotReady node with none of its pods
    left keeps its place; ``free_after``: the opt-in timer (None: off)."""
    if facts.serves:
        return FreeVerdict(False, "it is Ready")
    timed_out = free_after is not None and facts.unserving_for >= free_after
    if facts.pods_holding is None or facts.pods_holding > 0:
        if timed_out:
            return FreeVerdict(
                True,
                f"not Ready for over {free_after:g}s (--free-slots-of-unready-nodes-after), "
                + (
                    "its pods could not be listed"
                    if facts.pods_holding is None
                    else f"{facts.pods_holding} of its pods that may use the devices still exist"
                ),
                forced=True,
            )
        if facts.pods_holding is None:
            return FreeVerdict(False, "its pods could not be listed yet")
        return FreeVerdict(
            False, f"{facts.pods_holding} of its pods that may use akri.sh devices still exist"
        )
    if facts.gone:
        return FreeVerdict(True, "its Node is deleted and none of its pods is left")
    if facts.out_of_service:
        return FreeVerdict(True, "it is tainted out-of-service and none of its pods is left")
    if facts.unserving_for >= grace:
        return FreeVerdict(True, f"not Ready for over {grace:g}s and none of its pods is left")
    return FreeVerdict(False, f"not Ready for less than {grace:g}s")


def next_decision_at(facts: NodeFacts, *, grace: float, free_after: float | None) -> float | None:
    """In how many seconds :func:`decide_free` may answer otherwise on the same facts (a
    timer runs out), or None: only a change of the facts (a pod or Node event) can."""
    if facts.serves:
        return None
    timers = [free_after] if free_after is not None else []
    if facts.pods_holding == 0 and not facts.gone and not facts.out_of_service:
        timers.append(grace)
    left = [timer - facts.unserving_for for timer in timers if timer > facts.unserving_for]
    return min(left, default=None)
