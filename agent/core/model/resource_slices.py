"""What the node agent and the controller both know of ResourceSlices: the driver name, who
publishes a shared pool for which nodes, and the node-selector form of a shared pool (written by
the node that publishes it, read back by the publishers and by the controller cleaning up after
dead nodes).

**One publisher per shared pool, decided from the Instance** (docs/dra.md, "Who publishes a
shared pool"): the pool of a shared Instance follows the nodes that see the device. Its
*serving* nodes are ``nodes`` without those that only drain it (``akri.sh/draining``: they
lost the device and refuse prepares); of those, the nodes that see the device right now are
the ones without an offline mark (each node records its own offline grace in the Instance,
``akri.sh/offline.<node>``); a node whose Node does not serve (NotReady, deleted, tainted
out-of-service: each agent follows the Nodes that decide its part, :func:`nodes_to_follow`)
counts as none of
them. The pool is available on exactly those and published by the one whose name sorts
first; only when **every** serving node is offline does it list them all, its
devices tainted ``akri.sh/offline``, published by the first. Every node reads the same
Instance, so once their caches agree exactly one node publishes. While they disagree (an
Instance change not yet seen everywhere), the slice itself says which Instance version it was
written from (:data:`INSTANCE_VERSION_ANNOTATION`, with the Instance's uid): a node whose view
is older than that leaves the slice alone, so a slice only moves forward and two nodes never
take turns rewriting it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Protocol

DRIVER = "akri.sh"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# on a shared pool's slices: the Instance (uid, resourceVersion) whose view wrote them
INSTANCE_UID_ANNOTATION = "akri.sh/instance-uid"
INSTANCE_VERSION_ANNOTATION = "akri.sh/instance-version"


class SharedInstance(Protocol):
    """What the rule needs of an Instance (``agent.core.model.instance.Instance``)."""

    @property
    def nodes(self) -> tuple[str, ...]: ...

    @property
    def draining_nodes(self) -> tuple[str, ...]: ...

    @property
    def offline_nodes(self) -> tuple[str, ...]: ...


def serving_nodes(instance: SharedInstance) -> tuple[str, ...]:
    """The nodes a shared Instance's pool may be available on, sorted: ``nodes`` without
    those that only drain it; all of ``nodes`` when every node drains (the pool then holds no
    device, or only evicting ones, and its selector may not be empty)."""
    draining: Collection[str] = set(instance.draining_nodes)
    serving = sorted({node for node in instance.nodes if node not in draining})
    return tuple(serving or sorted(set(instance.nodes)))


def shared_pool_nodes(
    instance: SharedInstance,
    node: str | None = None,
    offline_here: bool = False,
    unready: Collection[str] = (),
) -> tuple[tuple[str, ...], bool]:
    """``(the nodes a shared Instance's pool selects, whether all of them are offline)``: the
    serving nodes that see the device — without an offline mark in the Instance — whose Node
    serves (not in ``unready``: NotReady, deleted, tainted out-of-service, as
    :mod:`agent.core.ledger.node_standing` says); when none of them sees it, every serving node
    whose Node serves (the pool is then tainted: the devices stay visible to claims that
    tolerate the taint, as a local device's do in its grace). When no node that could be
    selected serves, none: nobody publishes the pool (the controller deletes what is left of
    it, docs/controller.md) — also when the nodes that see the device are all down and only
    nodes offline serve: those cannot reach the device either, and standing in for the
    others would make every offline node follow the nodes before it for the whole of its grace
    (:func:`pool_candidates`).

    ``node``'s own view counts too when ``offline_here`` (it has stopped seeing the device and
    its mark is on its way): it then takes itself out before the others can know. Only that
    way round — a node that sees the device again stays out until its mark is gone — so that a
    node never believes it publishes a pool that the others, reading the stored marks, give
    to another node."""
    down: Collection[str] = set(unready)
    candidates, all_offline = pool_candidates(instance, node, offline_here)
    serving = tuple(n for n in candidates if n not in down)
    return serving, all_offline and bool(serving)


def pool_candidates(
    instance: SharedInstance, node: str | None = None, offline_here: bool = False
) -> tuple[tuple[str, ...], bool]:
    """``(the nodes that may publish a shared Instance's pool on the Instance's word, whether
    they are offline)``: its serving nodes that see the device; when none does, every serving
    node (offline, all of them). Which of them publishes then depends on their Nodes and agents
    only (:func:`shared_pool_nodes`); the controller deletes a pool none of them serves."""
    offline: Collection[str] = set(instance.offline_nodes)
    if offline_here and node is not None:
        offline = {*offline, node}
    serving = serving_nodes(instance)
    seeing = tuple(n for n in serving if n not in offline)
    return (seeing, False) if seeing else (serving, True)


def shared_publisher(
    instance: SharedInstance,
    node: str | None = None,
    offline_here: bool = False,
    unready: Collection[str] = (),
) -> str | None:
    """The node that publishes a shared Instance's pool: the first node it selects
    (:func:`shared_pool_nodes`) — the first serving node whose Node serves, so that a
    publisher whose node goes NotReady is replaced as soon as the others see it."""
    nodes, _ = shared_pool_nodes(instance, node, offline_here, unready)
    return nodes[0] if nodes else None


def publisher_order(
    instance: SharedInstance, node: str | None = None, offline_here: bool = False
) -> tuple[str, ...]:
    """The serving nodes of a shared Instance in the order that picks its publisher: those
    that see the device, then those offline (each sorted; ``node``'s own view counts as in
    :func:`shared_pool_nodes`). The publisher is the first of them whose Node serves and
    whose agent is there — :func:`shared_publisher` is exactly that."""
    offline: Collection[str] = set(instance.offline_nodes)
    if offline_here and node is not None:
        offline = {*offline, node}
    serving = serving_nodes(instance)
    return (
        *(n for n in serving if n not in offline),
        *(n for n in serving if n in offline),
    )


def nodes_to_follow(
    instance: SharedInstance,
    node: str,
    offline_here: bool = False,
    unready: Collection[str] = (),
) -> tuple[str, ...]:
    """The nodes whose standing (Node, agent Pod) ``node`` must follow to tell whether it
    publishes a shared Instance's pool: it does when every node before it in
    :func:`publisher_order` does not serve. So it follows the node just before it; when that
    one is known not to serve (in ``unready``), the one before that as well; ... back to the
    first that serves (or is not read yet: unknown serves) — then it does not publish — or to
    the start of the order — then it publishes. Typically one node: each node follows its
    predecessor, and the publisher none. When the publisher's Node goes NotReady or its agent
    goes, the node after it sees it and takes the pool over (one more read per node skipped
    when several go at once); when the order changes (a node joins, leaves or goes offline),
    only the nodes next to the change follow another node, never the whole pool.

    A pool therefore selects the nodes after its publisher on their stored standing only (the
    Instance: its nodes, their offline and draining marks), not on their Nodes' and agents'
    (docs/dra.md, "Which nodes each agent follows"). ``unready``: the followed nodes known
    not to serve. A node that does not serve the pool (it drains it) needs none, nor does a
    node offline while another node sees the device: it cannot publish then
    (:func:`pool_candidates`), so a loss of the device on half the nodes costs those nodes no
    reads."""
    if node not in pool_candidates(instance, node, offline_here)[0]:
        return ()
    order = publisher_order(instance, node, offline_here)
    down: Collection[str] = set(unready)
    walked: list[str] = []
    for candidate in reversed(order[: order.index(node)]):
        walked.append(candidate)
        if candidate not in down:
            break
    return tuple(reversed(walked))


def shared_node_selector(nodes: Iterable[str]) -> dict[str, Any]:
    """The ``nodeSelector`` of a shared pool: the nodes that see the device.

    The API server allows a ResourceSlice exactly one node-selector term, and a ``matchFields``
    requirement on ``metadata.name`` exactly one value (``ValidateResourceSliceSpec``,
    ``validateNodeFieldSelectorRequirement``): neither a list of node names in one field
    requirement nor one term per node is accepted (both are 422). A label requirement may list
    many values, so the pool selects on the ``kubernetes.io/hostname`` label, which kubelet
    sets to the node name unless ``--hostname-override`` makes them differ (the agent warns at
    start when its own Node's label does not match, docs/dra.md)."""
    return {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [
                    {"key": HOSTNAME_LABEL, "operator": "In", "values": sorted(set(nodes))}
                ]
            }
        ]
    }


def selected_nodes(spec: Mapping[str, Any]) -> set[str]:
    """Node names a shared slice's ``nodeSelector`` lists: the ``kubernetes.io/hostname In``
    values this agent writes, and ``metadata.name In`` values (slices written by agents before
    the selector changed form; any number of terms), so a pool is read back and adopted
    whichever form it is stored in."""
    names: set[str] = set()
    selector = spec.get("nodeSelector") or {}
    for term in selector.get("nodeSelectorTerms") or []:
        for requirement in term.get("matchFields") or []:
            if requirement.get("key") == "metadata.name" and requirement.get("operator") == "In":
                names.update(str(v) for v in requirement.get("values") or [])
        for requirement in term.get("matchExpressions") or []:
            if requirement.get("key") == HOSTNAME_LABEL and requirement.get("operator") == "In":
                names.update(str(v) for v in requirement.get("values") or [])
    return names
