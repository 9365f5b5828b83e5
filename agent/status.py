"""``akri status``: the Instances in a local state directory as a table or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agent.model.instance import Instance


def to_json(instances: Sequence[Instance]) -> str:
    """A JSON list of ``{"metadata": {"name": ...}, "spec": {...}}`` as in the CRD."""
    items: list[dict[str, Any]] = []
    for instance in instances:
        obj = instance.to_dict()
        items.append({"metadata": {"name": instance.name}, "spec": obj["spec"]})
    return json.dumps(items, indent=2, sort_keys=True)


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
    header = ("NAME", "CONFIGURATION", "NODES", "SHARED", "CAPACITY", "USED", "DEVICE USAGE")
    rows = [header]
    for inst in instances:
        used = sum(1 for v in inst.device_usage.values() if v)
        rows.append(
            (
                inst.name,
                inst.configuration_name,
                ",".join(inst.nodes) or "-",
                str(inst.shared).lower(),
                str(inst.capacity),
                str(used),
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
