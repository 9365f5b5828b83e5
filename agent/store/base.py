"""The ``InstanceStore`` interface every backend implements, and its errors and events.

Semantics follow the Kubernetes API server so the rest of the agent is backend-agnostic:

* every stored Instance has a ``resource_version``; :meth:`InstanceStore.update` is a
  compare-and-swap on it (a stale version raises :class:`ConflictError`);
* reads come from a watched cache (``get_cached``/``list_cached``), kept current by the
  backend; ``get`` bypasses the cache (used to re-read after a conflict);
* subscribers receive every change as an :class:`InstanceEvent`, starting with the current
  contents as ``ADDED`` so a late subscriber never misses state.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.discovery.properties import ObjectRef, PropertyResolutionError
from agent.events import Broadcaster, Subscription
from agent.model.configuration import Configuration
from agent.model.instance import Instance


class StoreError(Exception):
    """Base class of store errors."""


class ConflictError(StoreError):
    """The write was decided on a stale resourceVersion (HTTP 409 Conflict)."""


class NotFoundError(StoreError):
    """The object does not exist (HTTP 404)."""


class AlreadyExistsError(StoreError):
    """An object with that name exists already (HTTP 409 AlreadyExists)."""


class StoreUnavailableError(StoreError):
    """The backend cannot be reached right now; retry later."""


class CorruptStateError(StoreError):
    """A state file cannot be read; the agent refuses to start rather than lose state."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"state file {path} is corrupt: {reason}")


class EventType(enum.Enum):
    """Kind of change."""

    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


@dataclass(frozen=True)
class InstanceEvent:
    """An Instance changed. ``previous`` is the cached object before the change, if any."""

    type: EventType
    instance: Instance
    previous: Instance | None = None


@dataclass(frozen=True)
class ConfigurationEvent:
    """A Configuration was added, changed or deleted, or a source failed to provide one.

    ``error`` is set (and ``configuration`` is None) when a Configuration could not be read:
    ``source`` names the file or object and the message names the field.
    """

    type: EventType
    name: str
    configuration: Configuration | None = None
    error: str | None = None
    source: str = ""


class InstanceStore(abc.ABC):
    """Get/list/watch/create/compare-and-swap update/delete of Instances; watch Configurations."""

    def __init__(self) -> None:
        self._instance_events: Broadcaster[InstanceEvent] = Broadcaster()
        self._configuration_events: Broadcaster[ConfigurationEvent] = Broadcaster()
        self._tasks: list[asyncio.Task[None]] = []

    async def _stop_watching(self) -> None:
        """Cancel the backend's background tasks and end every subscription."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._instance_events.close()
        self._configuration_events.close()

    @abc.abstractmethod
    async def start(self) -> None:
        """Load state and begin watching. Raises :class:`CorruptStateError` on bad state."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop watching and release resources."""

    @abc.abstractmethod
    def get_cached(self, name: str) -> Instance | None:
        """The cached Instance ``name`` or None."""

    @abc.abstractmethod
    def list_cached(self, configuration: str | None = None) -> list[Instance]:
        """All cached Instances (of one Configuration if given), sorted by name."""

    @abc.abstractmethod
    async def get(self, name: str) -> Instance:
        """Read ``name`` from the backend itself. Raises :class:`NotFoundError`."""

    @abc.abstractmethod
    async def create(self, instance: Instance) -> Instance:
        """Create; returns the stored object. Raises :class:`AlreadyExistsError`."""

    @abc.abstractmethod
    async def update(self, instance: Instance) -> Instance:
        """Replace ``instance`` if its resource_version is current.

        Raises :class:`ConflictError` (stale version) or :class:`NotFoundError`.
        """

    @abc.abstractmethod
    async def delete(self, name: str, *, resource_version: str | None = None) -> None:
        """Delete ``name``; with ``resource_version`` only if still at that version."""

    @abc.abstractmethod
    def configurations(self) -> list[Configuration]:
        """The currently known valid Configurations."""

    async def read_object(self, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        """A Secret (``kind="secret"``) or ConfigMap (``"configMap"``), None if it is absent.

        The local backend has neither, so a required ``valueFrom`` fails clearly there.
        """
        raise PropertyResolutionError(
            f"{kind} {namespace}/{name}: valueFrom needs the Kubernetes backend "
            "(local mode has no Secrets or ConfigMaps; use value, or optional: true)"
        )

    def watch_objects(
        self, refs: Iterable[ObjectRef], on_change: Callable[[], None]
    ) -> Callable[[], None]:
        """Call ``on_change`` whenever one of ``refs`` changes; returns a function that stops
        watching. The local backend has nothing to watch."""
        return lambda: None

    async def record_configuration_event(
        self, configuration: Configuration, reason: str, message: str, *, warning: bool = True
    ) -> None:
        """Make a problem with ``configuration`` visible (Kubernetes Event; log in local mode)."""
        return None

    def subscribe_instances(self) -> Subscription[InstanceEvent]:
        """Every Instance change; current Instances first as ADDED."""
        initial = [InstanceEvent(EventType.ADDED, inst) for inst in self.list_cached()]
        return self._instance_events.subscribe(initial)

    def subscribe_configurations(self) -> Subscription[ConfigurationEvent]:
        """Every Configuration change; current Configurations first as ADDED."""
        initial = [
            ConfigurationEvent(EventType.ADDED, cfg.name, cfg) for cfg in self.configurations()
        ]
        return self._configuration_events.subscribe(initial)

    def _publish_instance(self, event: InstanceEvent) -> None:
        self._instance_events.publish(event)

    def _publish_configuration(self, event: ConfigurationEvent) -> None:
        self._configuration_events.publish(event)
