"""``Instance.spec.deviceUsage`` values: parse and format.

Akri's forms (reference: Akri ``DeviceUsage``):

========================  ==========================================================
value                     meaning
========================  ==========================================================
``""`` (or key absent)    free
``<node>``                held by the instance-level device plugin on ``<node>``
``C:<vdev>:<node>``       held by the configuration-level plugin on ``<node>`` for
                          virtual device ``<vdev>``
``D:<claim-uid>:<node>``  ours: held by the DRA plugin on ``<node>`` for ResourceClaim
                          ``<claim-uid>`` (Akri reads it as a foreign node name, so an
                          Akri agent sharing the Instance treats it as taken)
========================  ==========================================================

Anything else (e.g. ``C:x``) parses to :class:`UnknownUsage`, which counts as *held*: a value
we cannot understand is never handed out again (safety first), and is reported clearly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Free:
    """A free slot."""


@dataclass(frozen=True)
class NodeUsage:
    """Held by the instance-level plugin of ``node``."""

    node: str


@dataclass(frozen=True)
class ConfigurationUsage:
    """Held by the configuration-level plugin of ``node`` for virtual device ``vdev``."""

    vdev: str
    node: str


@dataclass(frozen=True)
class ClaimUsage:
    """Held by the DRA plugin of ``node`` for the ResourceClaim with uid ``claim_uid``."""

    claim_uid: str
    node: str


@dataclass(frozen=True)
class UnknownUsage:
    """A value we cannot parse. Treated as held by nobody we know."""

    raw: str
    problem: str


SlotUsage = Free | NodeUsage | ConfigurationUsage | ClaimUsage | UnknownUsage
HeldUsage = NodeUsage | ConfigurationUsage | ClaimUsage
FREE = Free()


def _triple(value: str) -> tuple[str, str] | None:
    parts = value.split(":")
    if len(parts) != 3 or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


def parse_usage(value: str) -> SlotUsage:
    """Parse one deviceUsage value."""
    if value == "":
        return FREE
    if value.startswith("C:"):
        triple = _triple(value)
        if triple is None:
            return UnknownUsage(value, "expected C:<vdev>:<node>")
        return ConfigurationUsage(vdev=triple[0], node=triple[1])
    if value.startswith("D:"):
        triple = _triple(value)
        if triple is None:
            return UnknownUsage(value, "expected D:<claim-uid>:<node>")
        return ClaimUsage(claim_uid=triple[0], node=triple[1])
    if ":" in value:
        return UnknownUsage(value, "node names cannot contain ':'")
    return NodeUsage(node=value)


def format_usage(usage: SlotUsage) -> str:
    """The deviceUsage string for ``usage``."""
    if isinstance(usage, Free):
        return ""
    if isinstance(usage, NodeUsage):
        return usage.node
    if isinstance(usage, ConfigurationUsage):
        return f"C:{usage.vdev}:{usage.node}"
    if isinstance(usage, ClaimUsage):
        return f"D:{usage.claim_uid}:{usage.node}"
    return usage.raw


def holder_node(usage: SlotUsage) -> str | None:
    """The node holding a slot, or None when free or unknown."""
    if isinstance(usage, NodeUsage | ConfigurationUsage | ClaimUsage):
        return usage.node
    return None


def is_free(usage: SlotUsage) -> bool:
    """True only for a free slot (unknown values are not free)."""
    return isinstance(usage, Free)
