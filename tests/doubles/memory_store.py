"""An in-memory InstanceStore: the watched cache alone, with no backend behind it.

Stands for the agent's store (local files or the API server) where a test needs only what
the device plugins read: ``put``/``remove`` change the cache and publish the event, as a
watch would. It differs from a real backend in that nothing is persisted, resourceVersions
are not checked (``update`` always wins) and ``full_lists`` counts whole-cache reads so that
tests can see how often a consumer recomputes.
"""

from __future__ import annotations

from agent.core.model.configuration import Configuration
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import EventType, InstanceEvent, InstanceStore, NotFoundError
from agent.core.store.cache import InstanceCache


class MemoryStore(InstanceStore):
    """The cache only: ``put``/``remove`` change it and publish the event, like a watch."""

    def __init__(self) -> None:
        super().__init__()
        self._cache = InstanceCache()
        self.full_lists = 0  # list_cached() of everything

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        await self._stop_watching()

    def get_cached(self, key: ObjectKey) -> Instance | None:
        return self._cache.get(key)

    def list_cached(self, configuration: ObjectKey | None = None) -> list[Instance]:
        if configuration is None:
            self.full_lists += 1
        return self._cache.all(configuration)

    def instances_named(self, name: str) -> list[Instance]:
        return self._cache.named(name)

    def instance_configurations(self) -> set[ObjectKey]:
        return self._cache.configuration_keys()

    async def get(self, key: ObjectKey) -> Instance:
        found = self._cache.get(key)
        if found is None:
            raise NotFoundError(str(key))
        return found

    async def create(self, instance: Instance) -> Instance:
        self.put(instance)
        return instance

    async def update(self, instance: Instance) -> Instance:
        self.put(instance)
        return instance

    async def delete(self, key: ObjectKey, *, resource_version: str | None = None) -> None:
        self.remove(key.name)

    def configurations(self) -> list[Configuration]:
        return []

    def put(self, instance: Instance) -> None:
        previous, catalog = self._cache.put(instance)
        kind = EventType.ADDED if previous is None else EventType.MODIFIED
        self._publish_instance(InstanceEvent(kind, instance, previous))
        if catalog:
            self._catalog_changed()

    def remove(self, name: str) -> None:
        previous, catalog = self._cache.remove(ObjectKey("default", name))
        assert previous is not None
        self._publish_instance(InstanceEvent(EventType.DELETED, previous, previous))
        if catalog:
            self._catalog_changed()
