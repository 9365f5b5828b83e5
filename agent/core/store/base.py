"""The ``InstanceStore`` interface every backend implements, and its errors and events.

Semantics follow the Kubernetes API server so the rest of the agent is backend-agnostic:

* every stored Instance has a ``resource_version``; :meth:`InstanceStore.update` is a
  compare-and-swap on it (a stale version raises :class:`ConflictError`);
* reads come from a watched cache (``get_cached``/``list_cached``), kept current by the
  backend; ``get`` bypasses the cache (used to re-read after a conflict);
* subscribers receive every change as an :class:`InstanceEvent`, starting with the current
  contents as ``ADDED`` so a late subscriber never misses state;
* objects are keyed by ``(namespace, name)`` (:class:`agent.core.model.keys.ObjectKey`)
  everywhere; ``instances_named`` finds the Instances of one name across namespaces;
* the *catalog* — which Configurations exist (valid or not, with their creation times) and
  which Configurations have Instances — decides which namespace may use a node-global name
  (:mod:`agent.node.discovery.ownership`); listeners registered with ``on_catalog_change`` hear
  about every change of it, synchronously.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import errno
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.core.aio.events import Broadcaster, Subscription
from agent.core.model.configuration import Configuration
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.properties import ObjectRef, PropertyResolutionError


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


class StorageError(StoreUnavailableError):
    """A state file could not be written or removed (disk full, quota, read-only file system,
    I/O error): the write did not happen and the previous file is intact. Transient from the
    agent's point of view — the same write succeeds once space returns — so it is a kind of
    "unavailable": a grant that needed it is refused with gRPC ``UNAVAILABLE``."""

    def __init__(self, path: str, error: OSError) -> None:
        self.path = path
        self.errno = error.errno
        name = errno.errorcode.get(error.errno or 0, "")
        self.cause = (error.strerror or str(error)) + (f" ({name})" if name else "")
        super().__init__(f"cannot write state file {path}: {self.cause}")


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
    """An Instance changed. ``previous`` is the cached object before the change, if any.
    ``left_view`` of a DELETED: True when it only means the Instance no longer concerns this
    node (it left it and holds none of its slots: its view drops it; it still exists), None
    when that cannot be told from a deletion (a watch filtered by label says both alike)."""

    type: EventType
    instance: Instance
    previous: Instance | None = None
    left_view: bool | None = False


@dataclass(frozen=True)
class ConfigurationEvent:
    """A Configuration was added, changed or deleted, or a source failed to provide one.

    ``error`` is set (and ``configuration`` is None) when a Configuration could not be read:
    ``source`` names the file or object and the message names the field; ``key`` is None when
    not even the name could be read (a file that is not YAML).
    """

    type: EventType
    key: ObjectKey | None
    configuration: Configuration | None = None
    error: str | None = None
    source: str = ""

    @property
    def name(self) -> str:
        """The Configuration's name ("" when unknown)."""
        return self.key.name if self.key is not None else ""


@dataclass(frozen=True)
class InvalidConfiguration:
    """A Configuration that exists but has never been valid (no good version to run).

    Its Instances are left exactly as they are until it is fixed or deleted."""

    key: ObjectKey
    message: str
    creation_timestamp: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


class InstanceStore(abc.ABC):
    """Get/list/watch/create/compare-and-swap update/delete of Instances; watch Configurations."""

    # whether a garbage collector deletes the Instances whose owner Configuration is gone
    # (their ownerReferences), as Kubernetes' does: then the nodes need not leave them
    garbage_collected = False
    # files on this machine (local mode): log lines say what happens in its terms, not in the
    # API server's (a deleted Instance is kept while slots are held; no "finalizer" to remove)
    local = False

    def __init__(self) -> None:
        self._instance_events: Broadcaster[InstanceEvent] = Broadcaster()
        self._configuration_events: Broadcaster[ConfigurationEvent] = Broadcaster()
        self._tasks: list[asyncio.Task[None]] = []
        self._catalog_listeners: list[Callable[[], None]] = []

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
    def get_cached(self, key: ObjectKey) -> Instance | None:
        """The cached Instance ``key`` or None."""

    @abc.abstractmethod
    def list_cached(self, configuration: ObjectKey | None = None) -> list[Instance]:
        """All cached Instances (of one Configuration if given), sorted by key."""

    @abc.abstractmethod
    def instances_named(self, name: str) -> list[Instance]:
        """Every cached Instance called ``name``, in any namespace (sorted by namespace)."""

    async def instance_exists(self, name: str) -> bool:
        """Whether an Instance called ``name`` exists in any namespace — also one this node's
        view does not show (a Kubernetes agent's cache holds only its node's Instances)."""
        return bool(self.instances_named(name))

    @abc.abstractmethod
    def instance_configurations(self) -> set[ObjectKey]:
        """Keys of the Configurations that have at least one cached Instance."""

    @abc.abstractmethod
    async def get(self, key: ObjectKey) -> Instance:
        """Read ``key`` from the backend itself. Raises :class:`NotFoundError`."""

    @abc.abstractmethod
    async def create(self, instance: Instance) -> Instance:
        """Create; returns the stored object. Raises :class:`AlreadyExistsError`."""

    @abc.abstractmethod
    async def update(self, instance: Instance) -> Instance:
        """Replace ``instance`` if its resource_version is current.

        Raises :class:`ConflictError` (stale version) or :class:`NotFoundError`.
        """

    @abc.abstractmethod
    async def delete(self, key: ObjectKey, *, resource_version: str | None = None) -> None:
        """Delete ``key``; with ``resource_version`` only if still at that version."""

    async def apply_membership(
        self,
        key: ObjectKey,
        node: str,
        member: bool,
        *,
        uid: str | None,
        offline: str | None = None,
        fingerprint: str | None = None,
    ) -> Instance | None:
        """Add ``node`` to (``member``) or take it out of ``spec.nodes`` of ``key`` without a
        resourceVersion precondition, so that nodes joining and leaving one shared Instance
        at the same moment never conflict: a server-side apply of the node's own entry with a
        field manager per node (``spec.nodes`` is a set, ``x-kubernetes-list-type: set``), or
        the same under the local store's lock. Nothing else changes — ``deviceUsage`` in
        particular stays a resourceVersion-checked write's. ``uid`` is the Instance the
        decision was made on: a re-created one (another uid) raises :class:`ConflictError`.

        The same write carries the node's offline mark, which is the node's own too: with
        ``offline`` (the time it stopped seeing the device; members only) the annotation
        :func:`~agent.core.model.naming.offline_annotation` is set to it, without it the
        node's annotation is removed (so a leave takes both away).

        ``fingerprint``: the device's (annotation ``akri.sh/device-digest``), for a join decided
        without reading the Instance (one this node's view does not show): an Instance that
        holds another device's raises :class:`ConflictError` and is not joined (a digest
        collision); one without any gets it.

        Returns the stored Instance — which may still list ``node`` after a leave when another
        writer owns the entry too (on a Kubernetes API server: an entry written by a plain
        update, e.g. the creator's); the caller then removes it with a checked write — or None
        when this backend has no such write (the caller uses a checked write). Raises
        :class:`NotFoundError`."""
        return None

    @abc.abstractmethod
    def configurations(self) -> list[Configuration]:
        """The Configurations in force: every valid one, and the last good version of one
        whose latest edit is invalid. Sorted by key."""

    def invalid_configurations(self) -> list[InvalidConfiguration]:
        """Configurations that exist but have no good version (sorted by key)."""
        return []

    def unreadable_sources(self) -> list[str]:
        """Sources whose Configurations cannot even be named right now (e.g. a file that is
        not YAML): while any exists, no Instance may be taken for an orphan."""
        return []

    def on_catalog_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (synchronously) whenever the catalog changes: a Configuration
        appears, disappears or becomes (in)valid, a Configuration gains its first or loses
        its last Instance, or the set of unreadable sources changes."""
        self._catalog_listeners.append(listener)

    def _catalog_changed(self) -> None:
        for listener in list(self._catalog_listeners):
            listener()

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
        """Make a problem with ``configuration`` visible (Kubernetes Event; the caller's log
        line in local mode)."""
        await self.record_raw_configuration_event(
            configuration.raw, reason, message, warning=warning
        )

    async def record_raw_configuration_event(
        self, raw: Mapping[str, Any], reason: str, message: str, *, warning: bool = True
    ) -> None:
        """:meth:`record_configuration_event` for a Configuration that may not be valid."""
        return None

    async def record_instance_event(
        self, instance: Instance, reason: str, message: str, *, warning: bool = True
    ) -> None:
        """Make something about ``instance`` visible (Kubernetes Event; log in local mode)."""
        return None

    def subscribe_instances(self) -> Subscription[InstanceEvent]:
        """Every Instance change; current Instances first as ADDED."""
        initial = [InstanceEvent(EventType.ADDED, inst) for inst in self.list_cached()]
        return self._instance_events.subscribe(initial)

    def subscribe_configurations(self) -> Subscription[ConfigurationEvent]:
        """Every Configuration change; current Configurations first as ADDED."""
        initial = [
            ConfigurationEvent(EventType.ADDED, cfg.key, cfg) for cfg in self.configurations()
        ]
        return self._configuration_events.subscribe(initial)

    def _publish_instance(self, event: InstanceEvent) -> None:
        self._instance_events.publish(event)

    def _publish_configuration(self, event: ConfigurationEvent) -> None:
        self._configuration_events.publish(event)
