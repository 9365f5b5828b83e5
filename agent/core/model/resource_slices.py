"""What the node agent and the controller both know of ResourceSlices: the driver name and
the node-selector form of a shared pool (written by the node that publishes it, read back by
the publishers and by the controller handing a dead node's pools over)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

DRIVER = "akri.sh"
HOSTNAME_LABEL = "kubernetes.io/hostname"


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
