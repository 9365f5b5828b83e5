"""``akri status``: the Instances in a local state directory as a table or JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agent.ledger.decisions import node_slots
from agent.model.instance import Instance
from agent.model.keys import DEFAULT_NAMESPACE


def to_json(instances: Sequence[Instance]) -> str:
    """A JSON list of ``{"metadata": {"name": ...}, "spec": {...}}`` as in the CRD (with
    ``namespace`` and ``annotations`` in ``metadata`` when they are not the defaults)."""
    items: list[dict[str, Any]] = []
    for instance in instances:
        obj = instance.to_dict()
        metadata: dict[str, Any] = {"name": instance.name}
        if instance.namespace != DEFAULT_NAMESPACE:
            metadata["namespace"] = instance.namespace
        if instance.annotations:
            metadata["annotations"] = dict(instance.annotations)
        items.append({"metadata": metadata, "spec": obj["spec"]})
    return json.dumps(items, indent=2, sort_keys=True)


def state(instance: Instance) -> str:
    """``ok``, or ``offline (node)`` for each node in its offline grace (its slots are
    Unhealthy there) and ``draining: N slots in use (node)`` for each node that stays in the
    Instance only until its slots are released."""
    parts = [f"offline ({node})" for node in instance.offline_nodes]
    for node in instance.draining_nodes:
        count = len(node_slots(instance, node))
        parts.append(f"draining: {count} slot{'s' if count != 1 else ''} in use ({node})")
    return "; ".join(parts) or "ok"


def _usage_summary(instance: Instance) -> str:
    parts = []
    for slot in instance.slot_ids() + sorted(
        k for k in instance.device_usage if k not in set(instance.slot_ids())
    ):
        value = instance.device_usage.get(slot, "")
        parts.append(f"{slot.rsplit('-', 1)[-1]}={value or '-'}")
    return " ".join(parts)


def to_table(instances: Sequence[Instance]) -> str:
    """An aligned text table: name, configuration, nodes, shared, capacity, deviceUsage."""
    header = (
        "NAME",
        "CONFIGURATION",
        "NODES",
        "SHARED",
        "CAPACITY",
        "USED",
        "STATE",
        "DEVICE USAGE",
    )
    rows = [header]
    for inst in instances:
        used = sum(1 for v in inst.device_usage.values() if v)
        name = inst.name if inst.namespace == DEFAULT_NAMESPACE else f"{inst.namespace}/{inst.name}"
        rows.append(
            (
                name,
                inst.configuration_name,
                ",".join(inst.nodes) or "-",
                str(inst.shared).lower(),
                str(inst.capacity),
                str(used),
                state(inst),
                _usage_summary(inst),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True))
        + "  "
        + row[-1]
        for row in rows
    ]
    if not instances:
        lines.append("(no instances)")
    return "\n".join(line.rstrip() for line in lines)


def configurations_table(
    configurations: Sequence[Mapping[str, Any]], instances: Sequence[Instance]
) -> str:
    """Configurations (raw API objects, valid or not) with their handler, capacity and
    Instance count."""
    rows = [("CONFIGURATION", "HANDLER", "CAPACITY", "INSTANCES", "SLOTS USED")]
    for obj in configurations:
        metadata = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        namespace, name = metadata.get("namespace", DEFAULT_NAMESPACE), metadata.get("name", "?")
        mine = [i for i in instances if i.namespace == namespace and i.configuration_name == name]
        used = sum(1 for i in mine for v in i.device_usage.values() if v)
        slots = sum(i.capacity for i in mine)
        rows.append(
            (
                name if namespace == DEFAULT_NAMESPACE else f"{namespace}/{name}",
                str((spec.get("discoveryHandler") or {}).get("name", "?")),
                str(spec.get("capacity", "?")),
                str(len(mine)),
                f"{used}/{slots}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
