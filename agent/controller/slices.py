"""Pure: which DRA ResourceSlices a dead node leaves behind that no live node will handle.

A shared Instance's pool (``pool.name`` = the Instance, ``nodeSelector`` over its serving
nodes) is published by one agent, its first serving node, and rewritten *in place* by the next
one when that changes (``agent/core/model/resource_slices.py``, docs/dra.md): once the
controller has taken a dead node out of an Instance, the live publisher rewrites the pool's
slices without it, so the scheduler never sees the pool missing. A shared pool whose Instance
is gone is deleted by a node its nodeSelector lists. Both need a live node the slice lists; a
slice that lists only dead nodes (all the nodes of its Instance died, or its Instance went
with them) would stay for ever, so the controller deletes it (with a resourceVersion
precondition, so a version a live publisher wrote meanwhile is never the one deleted). Local
pools (``spec.nodeName``) stay: they go with the Node object (owner reference) when it is
deleted, and a NotReady node's pods are not scheduled there meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agent.core.model.resource_slices import DRIVER, selected_nodes


def stale_shared_slices(
    slices: Iterable[Mapping[str, Any]], dead_node: str, is_dead: Callable[[str], bool]
) -> list[tuple[str, str]]:
    """``(name, resourceVersion)`` of the akri.sh shared slices that list ``dead_node`` and
    no node alive (``is_dead`` false): no agent will rewrite or delete them."""
    stale = []
    for obj in slices:
        spec = obj.get("spec") or {}
        if spec.get("driver") != DRIVER or spec.get("nodeName") or not spec.get("nodeSelector"):
            continue
        listed = selected_nodes(spec)
        if dead_node in listed and all(node == dead_node or is_dead(node) for node in listed):
            meta = obj.get("metadata") or {}
            stale.append((str(meta.get("name")), str(meta.get("resourceVersion") or "")))
    return sorted(stale)
