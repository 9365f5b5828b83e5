"""``InstanceCache``: the store backends' typed Instance cache, indexed three ways.

* by ``(namespace, name)`` — an Instance's identity;
* by Configuration key — every runner lists its own Instances often;
* by bare name — kubelet resource names and DRA device names are node-global, so the device
  plugins and the DRA driver look Instances up by name (and let
  :mod:`agent.node.discovery.ownership` pick the namespace when two share one).
"""

from __future__ import annotations

from collections.abc import Iterator

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey


class InstanceCache:
    """A dict of Instances with secondary indexes kept in step."""

    def __init__(self) -> None:
        self._by_key: dict[ObjectKey, Instance] = {}
        self._by_configuration: dict[ObjectKey, dict[str, Instance]] = {}
        self._by_name: dict[str, dict[str, Instance]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def __iter__(self) -> Iterator[ObjectKey]:
        return iter(self._by_key)

    def get(self, key: ObjectKey) -> Instance | None:
        """The Instance ``key`` or None."""
        return self._by_key.get(key)

    def put(self, instance: Instance) -> tuple[Instance | None, bool]:
        """Store ``instance``; returns (the previous object, whether the set of Configuration
        keys that have Instances changed)."""
        key = instance.key
        previous = self._by_key.get(key)
        catalog = False
        if previous is not None and previous.configuration_key != instance.configuration_key:
            catalog |= self._unindex(previous)
        self._by_key[key] = instance
        group = self._by_configuration.get(instance.configuration_key)
        if group is None:
            group = self._by_configuration[instance.configuration_key] = {}
            catalog = True
        group[instance.name] = instance
        self._by_name.setdefault(instance.name, {})[instance.namespace] = instance
        return previous, catalog

    def remove(self, key: ObjectKey) -> tuple[Instance | None, bool]:
        """Drop ``key``; returns (the removed object or None, whether the set of Configuration
        keys that have Instances changed)."""
        previous = self._by_key.pop(key, None)
        if previous is None:
            return None, False
        return previous, self._unindex(previous)

    def _unindex(self, instance: Instance) -> bool:
        catalog = False
        group = self._by_configuration.get(instance.configuration_key)
        if group is not None:
            group.pop(instance.name, None)
            if not group:
                del self._by_configuration[instance.configuration_key]
                catalog = True
        named = self._by_name.get(instance.name)
        if named is not None:
            named.pop(instance.namespace, None)
            if not named:
                del self._by_name[instance.name]
        return catalog

    def all(self, configuration: ObjectKey | None = None) -> list[Instance]:
        """All Instances (or those of one Configuration), sorted by (namespace, name)."""
        if configuration is None:
            return [self._by_key[key] for key in sorted(self._by_key)]
        group = self._by_configuration.get(configuration, {})
        return [group[name] for name in sorted(group)]

    def named(self, name: str) -> list[Instance]:
        """Every Instance called ``name`` (one per namespace), sorted by namespace."""
        group = self._by_name.get(name, {})
        return [group[namespace] for namespace in sorted(group)]

    def configuration_keys(self) -> set[ObjectKey]:
        """Keys of the Configurations that have at least one Instance."""
        return set(self._by_configuration)

    def replace_all(self, instances: list[Instance]) -> None:
        """Make the cache hold exactly ``instances`` (no events)."""
        self._by_key.clear()
        self._by_configuration.clear()
        self._by_name.clear()
        for instance in instances:
            self.put(instance)
