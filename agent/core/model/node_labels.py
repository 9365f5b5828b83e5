"""Which nodes an Instance concerns, as labels the API server can filter watches by.

An agent watches only the Instances that concern its node (DESIGN invariant 11: a node pays
for its own devices, not for the cluster's): those that list it in ``spec.nodes`` and those
where it still holds slots (``deviceUsage``: a node that left keeps seeing the Instance until
its slots are released). Every Instance our agents write carries one label per such node —
``node.akri.sh/<hash>`` — and a label selector on the watch lets the API server send each node
only its own. A node name (up to 253 characters) does not fit a label value or a label key's
name part (63), so the key holds a hash of it: 20 hex characters of blake2b (80 bits: no two
node names of a cluster collide in practice; a collision would only show a node one Instance
too many, never hide one).

:data:`LABELLED` marks an Instance whose node labels a writer of ours computed from its
content: an Instance without it was written by Akri's agent or an earlier version of ours,
and is found with the selector ``!akri.sh/node-labels`` (empty in a cluster that has moved on).

Pure functions; the Kubernetes store (:mod:`agent.core.store.kubernetes`) applies them.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from agent.core.model.device_usage import holder_node, parse_usage

NODE_LABEL_PREFIX = "node.akri.sh/"
LABELLED = "akri.sh/node-labels"
LABELLED_VALUE = "v1"
UNLABELLED_SELECTOR = f"!{LABELLED}"
NODE_HASH_LENGTH = 20  # hex characters: within the 63 of a label key's name part


@functools.lru_cache(maxsize=4096)
def node_label(node: str) -> str:
    """The label key that says an Instance concerns ``node``."""
    digest = hashlib.blake2b(node.encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()
    return NODE_LABEL_PREFIX + digest[:NODE_HASH_LENGTH]


def node_selector(node: str) -> str:
    """The label selector of the Instances that concern ``node``."""
    return node_label(node)


def concerned_nodes(nodes: Iterable[str], device_usage: Mapping[str, str]) -> set[str]:
    """The nodes listed, and the nodes holding a slot."""
    concerned = set(nodes)
    for value in device_usage.values():
        if value:
            holder = holder_node(parse_usage(value))
            if holder:
                concerned.add(holder)
    return concerned


def concerned_nodes_of(obj: Mapping[str, Any]) -> set[str]:
    """:func:`concerned_nodes` of a raw Instance object (malformed fields count as empty)."""
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    nodes = spec.get("nodes")
    usage = spec.get("deviceUsage")
    return concerned_nodes(
        (str(n) for n in nodes) if isinstance(nodes, list) else (),
        {str(k): str(v) for k, v in usage.items()} if isinstance(usage, Mapping) else {},
    )


def labels_for(labels: Mapping[str, str], nodes: Iterable[str]) -> dict[str, str]:
    """``labels`` with exactly the node labels of ``nodes`` and the :data:`LABELLED` mark
    (every other label kept as it is)."""
    result = {k: v for k, v in labels.items() if not k.startswith(NODE_LABEL_PREFIX)}
    for node in nodes:
        result[node_label(node)] = ""
    result[LABELLED] = LABELLED_VALUE
    return result


def labels_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    """``metadata.labels`` of a raw object (empty when absent or malformed)."""
    meta = obj.get("metadata")
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    return labels if isinstance(labels, Mapping) else {}


def with_node_labels(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the raw Instance ``obj`` whose labels match its content (for a write)."""
    meta = dict(obj.get("metadata") or {})
    meta["labels"] = labels_for(labels_of(obj), sorted(concerned_nodes_of(obj)))
    return {**obj, "metadata": meta}


def labels_current(obj: Mapping[str, Any]) -> bool:
    """True when ``obj``'s node labels (and the mark) are those its content asks for."""
    return labels_match(labels_of(obj), concerned_nodes_of(obj))


def labels_match(labels: Mapping[str, str], concerned: Iterable[str]) -> bool:
    """True when ``labels`` hold the mark and exactly the node labels of ``concerned``."""
    if labels.get(LABELLED) != LABELLED_VALUE:
        return False
    have = {k for k in labels if k.startswith(NODE_LABEL_PREFIX)}
    return have == {node_label(n) for n in concerned}


def labelled_for(obj: Mapping[str, Any], node: str) -> bool:
    """True when ``obj`` carries ``node``'s label (it is in that node's watch)."""
    return node_label(node) in labels_of(obj)
