"""Pure: which DRA ResourceSlices a dead node leaves behind that no live node will handle.

A shared Instance's pool (``pool.name`` = the Instance, ``nodeSelector`` over its serving
nodes that see the device, all of them when none does) is published by one agent, the first
node it selects, and rewritten *in place* by the next one when that changes
(``agent/core/model/resource_slices.py``, docs/dra.md): once the controller has taken a dead
node out of an Instance, a live node of it rewrites the pool's slices without it, so the
scheduler never sees the pool missing — also a live node the slice does not list because it
is in its offline grace (it then publishes the pool for itself, tainted). A shared pool whose
Instance is gone is deleted by a node its nodeSelector lists. A slice that neither a live node
it lists nor a live node of its Instance will handle (all of them died, or its Instance went
with them; or, before anything is freed, none of them serves: their Nodes are NotReady,
deleted or out-of-service, :func:`unpublished_shared_slices`) would stay for ever, offering
what it last said, so the controller deletes it (with a resourceVersion
precondition, so a version a live publisher wrote meanwhile is never the one deleted). Local
pools (``spec.nodeName``) stay: they go with the Node object (owner reference) when it is
deleted, and a NotReady node's pods are not scheduled there meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from agent.core.model.instance import Instance
from agent.core.model.resource_slices import DRIVER, pool_candidates, selected_nodes


def pool_members(instances: Iterable[Instance]) -> dict[str, set[str]]:
    """Pool name (a shared pool is named after its Instance) -> the nodes that may publish it:
    those that see the device, all of its serving nodes only when none does
    (``pool_candidates``, the agents' own rule). A pool whose devices only nodes offline can
    serve while the nodes that see them are down is published by nobody, so it is deleted."""
    members: dict[str, set[str]] = {}
    for instance in instances:
        members.setdefault(instance.name, set()).update(pool_candidates(instance)[0])
    return members


def _no_members(pool: str) -> Collection[str]:
    return ()


def stale_shared_slices(
    slices: Iterable[Mapping[str, Any]],
    dead_node: str,
    is_dead: Callable[[str], bool],
    members: Callable[[str], Collection[str]] = _no_members,
) -> list[tuple[str, str]]:
    """``(name, resourceVersion)`` of the akri.sh shared slices that list ``dead_node`` and
    no node alive (``is_dead`` false), and whose Instance (``members``: the ``nodes`` of the
    Instances named like the pool, none when it is gone) lists no live node either: no agent
    will rewrite or delete them."""
    stale = []
    for obj in slices:
        spec = obj.get("spec") or {}
        if spec.get("driver") != DRIVER or spec.get("nodeName") or not spec.get("nodeSelector"):
            continue
        listed = selected_nodes(spec)
        pool = str((spec.get("pool") or {}).get("name") or "")
        handled = [n for n in (*listed, *members(pool)) if n != dead_node and not is_dead(n)]
        if dead_node in listed and not handled:
            meta = obj.get("metadata") or {}
            stale.append((str(meta.get("name")), str(meta.get("resourceVersion") or "")))
    return sorted(stale)


def unpublished_shared_slices(
    slices: Iterable[Mapping[str, Any]],
    serves: Callable[[str], bool],
    members: Callable[[str], Collection[str]] = _no_members,
) -> list[tuple[str, str]]:
    """``(name, resourceVersion)`` of the akri.sh shared slices that no node whose Node serves
    (``serves``: exists, not NotReady, not out-of-service) will rewrite or delete: neither a
    node the slice lists nor a node of its Instance (``members``) serves. Their publisher went
    NotReady and no other node can take over (issue 39.4): the pool would go on offering
    what it last said — slots taken since through device plugins among them — so it goes,
    and the first node of it that serves again publishes it anew."""
    stale = []
    for obj in slices:
        spec = obj.get("spec") or {}
        if spec.get("driver") != DRIVER or spec.get("nodeName") or not spec.get("nodeSelector"):
            continue
        pool = str((spec.get("pool") or {}).get("name") or "")
        nodes = {*selected_nodes(spec), *members(pool)}
        if nodes and not any(serves(node) for node in nodes):
            meta = obj.get("metadata") or {}
            stale.append((str(meta.get("name")), str(meta.get("resourceVersion") or "")))
    return sorted(stale)
