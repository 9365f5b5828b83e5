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

Two *different* Configuration names can also give one kubelet name (docs/slot-model.md, "One
resource name, one meaning"), and are decided here too, so that no two plugins ever register
one resource name on a node:

3. names whose configuration-level resource (``akri.sh/<configuration>``) or Instance-name
   prefix are equal — only possible through the shortening of names longer than 52
   characters — are one name for rules 1 and 2 (the ``(namespace, name)`` pairs compete,
   ties broken by namespace, then name);
4. *Instance names win*: a Configuration whose resource name has the shape of an Instance
   name of another Configuration name in use (``<other>-<6 hex>``, e.g. ``cam-17ff2a`` beside
   ``cam``, whose device may get the Instance ``cam-17ff2a``) is refused while that other
   name is in use in any namespace. Akri reserves ``<configuration>-<digest>`` for Instances;
   refusing by shape does not depend on which devices happen to be discovered, so the
   resource name never changes meaning under running containers.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import (
    configuration_resource_name,
    instance_prefix,
    instance_shaped_prefix,
)
from agent.core.store.base import InstanceStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NameUser:
    """One ``(namespace, Configuration name)`` in use: configured (``created``: its
    creationTimestamp, None if unknown or not configured) and/or with Instances."""

    key: ObjectKey
    created: str | None = None
    has_instances: bool = False


@dataclass(frozen=True)
class NameDecision:
    """:func:`decide_names`: the namespace serving each Configuration name, and why every
    other user is refused (``refused``: key -> reason, naming the winner)."""

    owners: Mapping[str, str]
    refused: Mapping[ObjectKey, str]


def _winner(users: list[NameUser]) -> NameUser:
    """Rules 1-3: the only user with Instances; else the oldest among those with Instances
    (or among all), then by namespace and name."""
    with_instances = [u for u in users if u.has_instances]
    if len(with_instances) == 1:
        return with_instances[0]
    pool = with_instances or users
    return min(
        pool,
        key=lambda u: (u.created is None, u.created or "", u.key.namespace, u.key.name),
    )


def decide_names(users: Iterable[NameUser]) -> NameDecision:
    """Which ``(namespace, name)`` serves each node-global name (pure; module docstring,
    rules 1-4). Every agent decides the same from the same objects."""
    by_key: dict[ObjectKey, NameUser] = {}
    for user in users:
        by_key[user.key] = user
    # rule 3: names sharing a resource name or an Instance prefix form one group (union-find)
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent.setdefault(name, name) != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    names = sorted({key.name for key in by_key})
    first_with: dict[tuple[str, str], str] = {}
    for name in names:
        for tag in (("r", configuration_resource_name(name)), ("p", instance_prefix(name))):
            other = first_with.setdefault(tag, name)
            parent[find(name)] = find(other)
    groups: defaultdict[str, list[NameUser]] = defaultdict(list)
    for key in sorted(by_key):
        groups[find(key.name)].append(by_key[key])
    owners: dict[str, str] = {}
    refused: dict[ObjectKey, str] = {}
    for members in groups.values():
        winner = _winner(members)
        owners[winner.key.name] = winner.key.namespace
        for user in members:
            if user.key == winner.key:
                continue
            if user.key.name == winner.key.name:
                refused[user.key] = (
                    f"the name {user.key.name!r} is in use by the Configuration in namespace "
                    f"{winner.key.namespace!r}"
                )
            else:
                refused[user.key] = (
                    f"its kubelet resource names (akri.sh/"
                    f"{configuration_resource_name(user.key.name)}, akri.sh/"
                    f"{instance_prefix(user.key.name)}-<digest>) are those of Configuration "
                    f"{winner.key.namespace}/{winner.key.name} (long names are shortened)"
                )
    # rule 4: instance names win
    by_prefix: dict[str, str] = {}
    for name in names:
        by_prefix.setdefault(instance_prefix(name), name)
    for name, namespace in sorted(owners.items()):
        resource = configuration_resource_name(name)
        shaped = instance_shaped_prefix(resource)
        if shaped is None:
            continue
        rival = by_prefix.get(shaped)
        if rival is None or rival == name:
            continue
        del owners[name]
        refused[ObjectKey(namespace, name)] = (
            f"akri.sh/{resource} has the shape of an Instance name of Configuration {rival!r} "
            f"(<configuration>-<6 hex digest>), in use in this cluster: Instance names win, so "
            f"this Configuration would give that resource name a second meaning on a node"
        )
    return NameDecision(owners, refused)


class Ownership:
    """Owners of every Configuration name, recomputed whenever the store's catalog changes;
    listeners hear which names changed owner."""

    def __init__(self, store: InstanceStore) -> None:
        self._store = store
        self._owners: dict[str, str] = {}
        self._refused: dict[ObjectKey, str] = {}
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
        users: dict[ObjectKey, NameUser] = {}
        for configuration in self._store.configurations():
            users[configuration.key] = NameUser(configuration.key, configuration.creation_timestamp)
        for invalid in self._store.invalid_configurations():
            users[invalid.key] = NameUser(invalid.key, invalid.creation_timestamp)
        for key in self._store.instance_configurations():
            known = users.get(key)
            users[key] = NameUser(key, known.created if known else None, has_instances=True)
        decision = decide_names(users.values())
        by_name: defaultdict[str, set[str]] = defaultdict(set)
        for key in users:
            by_name[key.name].add(key.namespace)
        contested = {name: tuple(sorted(ns)) for name, ns in by_name.items() if len(ns) > 1}
        changed = {
            name
            for name in set(decision.owners) | set(self._owners)
            if decision.owners.get(name) != self._owners.get(name)
        }
        changed |= {
            key.name
            for key in set(decision.refused) | set(self._refused)
            if decision.refused.get(key) != self._refused.get(key)
        }
        self._owners = dict(decision.owners)
        self._refused = dict(decision.refused)
        self._contested = contested
        if changed:
            for listener in list(self._listeners):
                listener(changed)

    def owner(self, name: str) -> str | None:
        """The namespace owning Configuration name ``name`` (None if nobody uses it)."""
        return self._owners.get(name)

    def owns(self, configuration: ObjectKey) -> bool:
        """Whether ``configuration``'s namespace owns its name (and the name is not refused
        for colliding with another name's kubelet names)."""
        if configuration in self._refused:
            return False
        return (
            self._owners.get(configuration.name, configuration.namespace) == configuration.namespace
        )

    def refusal(self, configuration: ObjectKey) -> str | None:
        """Why ``configuration`` may not run here (None if it may)."""
        return self._refused.get(configuration)

    def refusals(self) -> dict[ObjectKey, str]:
        """Every refused Configuration key (some may only have Instances), with why."""
        return dict(self._refused)

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
