"""The discovery-handler interface.

A handler turns a Configuration's ``discoveryDetails`` (YAML text, opaque to the agent) and
resolved ``discoveryProperties`` into an async stream of **full** device lists: every item is
the complete current list (as in Akri's ``DiscoverResponse``), not a delta. The agent diffs
consecutive lists itself. Handlers are either embedded (a Python object implementing
:class:`DiscoveryHandler`) or external processes speaking Akri's gRPC discovery protocol;
both look the same to the agent.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field


class InvalidDiscoveryDetailsError(ValueError):
    """``discoveryDetails`` cannot be used by this handler (gRPC: InvalidArgument)."""


@dataclass(frozen=True)
class Mount:
    """A host path mounted into containers that use the device."""

    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class DeviceSpec:
    """A device node given to containers, with cgroup permissions (``r``, ``w``, ``m``)."""

    container_path: str
    host_path: str
    permissions: str = "rwm"


@dataclass(frozen=True)
class Device:
    """One discovered device. ``id`` is stable and hashed into the Instance name."""

    id: str
    properties: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    device_specs: tuple[DeviceSpec, ...] = ()


DiscoveryProperties = Mapping[str, bytes | None]


class DiscoveryHandler(abc.ABC):
    """An embedded discovery handler."""

    name: str
    """The name Configurations use in ``spec.discoveryHandler.name``."""

    @property
    @abc.abstractmethod
    def shared(self) -> bool:
        """True if devices are visible from several nodes (IP cameras), False for local ones."""

    @abc.abstractmethod
    def validate(self, discovery_details: str) -> Sequence[str] | None:
        """Raise :class:`InvalidDiscoveryDetailsError` with a clear message if unusable;
        return warnings (e.g. unknown fields that are ignored, as Akri's handlers do)."""

    @abc.abstractmethod
    def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        """Yield the full device list now and again whenever it changes."""
