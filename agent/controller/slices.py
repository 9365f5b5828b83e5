"""Pure: which DRA ResourceSlices a dead node leaves behind for a live node to publish.

A shared Instance's pool (``pool.name`` = the Instance, ``nodeSelector`` over its nodes) is
published by one agent (docs/dra.md). Once the controller has removed a dead node from the
Instances, a slice whose ``nodeSelector`` still lists that node is stale: deleting it (with a
resourceVersion precondition, so a live publisher's fresh version is never the one deleted)
lets the pool's new publisher write it again for the nodes that remain. Local pools
(``spec.nodeName``) stay: they go with the Node object (owner reference) when it is deleted,
and a NotReady node's pods are not scheduled there meanwhile.

The selector forms are those ``agent/node/dra/slices.py`` writes and reads (the controller
does not import the node agent, so the few lines that read them are repeated here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agent.core.model.resource_slices import DRIVER, selected_nodes


def stale_shared_slices(
    slices: Iterable[Mapping[str, Any]], dead_node: str
) -> list[tuple[str, str]]:
    """``(name, resourceVersion)`` of the akri.sh shared slices that still list ``dead_node``."""
    stale = []
    for obj in slices:
        spec = obj.get("spec") or {}
        if spec.get("driver") != DRIVER or spec.get("nodeName") or not spec.get("nodeSelector"):
            continue
        if dead_node in selected_nodes(spec):
            meta = obj.get("metadata") or {}
            stale.append((str(meta.get("name")), str(meta.get("resourceVersion") or "")))
    return sorted(stale)
