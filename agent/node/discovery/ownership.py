"""Which namespace may use a Configuration name on a node.

Configurations and Instances are namespaced, but what the agent hands to kubelet is not:
``akri.sh/<instance>`` and ``akri.sh/<configuration>`` are node-global resource names, and
DRA device and pool names of driver ``akri.sh`` are global too. Two namespaces with a
Configuration of the same name would produce the same names (Instance names are
``<configuration>-<digest>``), so one would serve or free the other's slots. The rule:

1. if exactly one namespace has Instances of that Configuration name, it owns the name —
   existing Instances may hold slots of running containers, so they are never displaced;
2. otherwise the namespace of the oldest Configuration (``creationTimestamp``, then
   namespace name) among those with Instances (or, if none has any, among all) owns it.

The other namespace's Configuration is refused (log line + Event naming the owner) and waits:
it starts by itself once the owner's Configuration is deleted and its Instances are gone.
Its Instances that list this node are retired like a deleted Configuration's (this node
drains them while it holds slots in them, then leaves): nothing here serves them any more,
and slots held in them must still be freed once their containers end. Every agent applies
the same rule to the same API objects, so all nodes agree. The device plugins and the DRA
driver only ever see the owner's Instances (:class:`ServedInstances`), looked up by the
global name; the reclaimers also see another namespace's *draining* Instances, since only
they can free the slots that keep a retiring node in them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import InstanceStore

log = logging.getLogger(__name__)


def owner_namespace(
    configured: Mapping[str, str | None], with_instances: Collection[str]
) -> str | None:
    """The namespace that owns one Configuration name. ``configured``: namespace -> the
    creationTimestamp of its Configuration of that name (None if unknown);
    ``with_instances``: namespaces that have Instances of it."""
    if len(with_instances) == 1:
        return next(iter(with_instances))
    candidates = set(with_instances) or set(configured)
    if not candidates:
        return None
    return min(
        candidates, key=lambda ns: (configured.get(ns) is None, configured.get(ns) or "", ns)
    )


class Ownership:
    """Owners of every Configuration name, recomputed whenever the store's catalog changes;
    listeners hear which names changed owner."""

    def __init__(self, store: InstanceStore) -> None:
        self._store = store
        self._owners: dict[str, str] = {}
        self._contested: dict[str, tuple[str, ...]] = {}  # name -> every namespace using it
        self._listeners: list[Callable[[set[str]], None]] = []
        store.on_catalog_change(self.refresh)
        self.refresh()

    def add_listener(self, listener: Callable[[set[str]], None]) -> None:
        """Call ``listener`` with the names whose owner changed."""
        self._listeners.append(listener)

    def refresh(self) -> None:
        """Recompute every owner (cheap: one pass over Configurations and the Configuration
        keys that have Instances)."""
        configured: defaultdict[str, dict[str, str | None]] = defaultdict(dict)
        for configuration in self._store.configurations():
            configured[configuration.name][configuration.namespace] = (
                configuration.creation_timestamp
            )
        for invalid in self._store.invalid_configurations():
            configured[invalid.key.name][invalid.key.namespace] = invalid.creation_timestamp
        with_instances: defaultdict[str, set[str]] = defaultdict(set)
        for key in self._store.instance_configurations():
            with_instances[key.name].add(key.namespace)
        owners: dict[str, str] = {}
        contested: dict[str, tuple[str, ...]] = {}
        for name in set(configured) | set(with_instances):
            owner = owner_namespace(configured.get(name, {}), with_instances.get(name, set()))
            if owner is not None:
                owners[name] = owner
            users = set(configured.get(name, {})) | with_instances.get(name, set())
            if len(users) > 1:
                contested[name] = tuple(sorted(users))
        changed = {
            name
            for name in set(owners) | set(self._owners)
            if owners.get(name) != self._owners.get(name)
        }
        self._owners = owners
        self._contested = contested
        if changed:
            for listener in list(self._listeners):
                listener(changed)

    def owner(self, name: str) -> str | None:
        """The namespace owning Configuration name ``name`` (None if nobody uses it)."""
        return self._owners.get(name)

    def owns(self, configuration: ObjectKey) -> bool:
        """Whether ``configuration``'s namespace owns its name."""
        return (
            self._owners.get(configuration.name, configuration.namespace) == configuration.namespace
        )

    def contested(self, name: str) -> tuple[str, ...]:
        """Every namespace using ``name`` when more than one does (else empty)."""
        return self._contested.get(name, ())


class ServedInstances:
    """The store's Instances as the node-global names see them: only the owner namespace's,
    looked up by bare name (:meth:`get`, :meth:`of_configuration`, :meth:`all`: the device
    plugins and the DRA driver). The reclaimers ask :meth:`served`, which also admits
    another namespace's draining Instances."""

    def __init__(self, store: InstanceStore, ownership: Ownership) -> None:
        self.store = store
        self.ownership = ownership

    def owned(self, instance: Instance) -> bool:
        """Whether ``instance`` belongs to its Configuration name's owner."""
        return self.ownership.owns(instance.configuration_key)

    def served(self, instance: Instance) -> bool:
        """Whether the reclaimers look at ``instance``: the owner's Instances, and any
        Instance a node drains — e.g. one of a namespace that lost the name while its
        containers ran (docs/slot-model.md, "Namespaces"). Reclaiming such a slot is safe
        although kubelet's ids are node-global: a slot is freed only when no container on
        this node is assigned its device id at all, whichever namespace it came from."""
        return self.owned(instance) or bool(instance.draining_nodes)

    def get(self, name: str) -> Instance | None:
        """The served Instance called ``name``, or None."""
        for instance in self.store.instances_named(name):
            if self.owned(instance):
                return instance
        return None

    def of_configuration(self, configuration_name: str) -> list[Instance]:
        """Served Instances of one Configuration name, sorted by name."""
        owner = self.ownership.owner(configuration_name)
        if owner is None:
            return []
        return self.store.list_cached(ObjectKey(owner, configuration_name))

    def all(self) -> list[Instance]:
        """Every served Instance, sorted by name."""
        instances = [i for i in self.store.list_cached() if self.owned(i)]
        return sorted(instances, key=lambda i: i.name)
