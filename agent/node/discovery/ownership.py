"""Which Configurations this node runs and whose Instances it serves under the node-global names.

Configurations and Instances are namespaced, but ``akri.sh/<instance>``,
``akri.sh/<configuration>`` and DRA device and pool names are not, and some Configurations
collide (the same name in two namespaces, long names shortened alike, a name with the shape
of another's Instance names). The rule that decides which one holds the names is
:mod:`agent.core.name_claims` — a name that serves keeps it; then the older runnable
Configuration; one no agent can run claims nothing — shared with the controller (which
DeviceClasses exist) and ``akri status``, so all agree.

A refused Configuration (log line + ``NameConflict`` Event naming the holder) waits: it starts
by itself once the holder and its Instances are gone. Its Instances that list this node are
retired like a deleted Configuration's (this node drains them while it holds slots in them,
then leaves): nothing here serves them any more, and slots held in them must still be freed
once their containers end. The device plugins and the DRA driver only ever see the holder's
Instances (:class:`ServedInstances`), looked up by the global name; the reclaimers also see
another namespace's *draining* Instances, since only they can free the slots that keep a
retiring node in them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.name_claims import (
    DetailsProblem,
    NameDecision,
    NameUser,
    decide_for_store,
    decide_names,
)
from agent.core.store.base import InstanceStore
from discovery_handlers.embedded import details_problem

__all__ = ["NameDecision", "NameUser", "Ownership", "ServedInstances", "decide_names"]

log = logging.getLogger(__name__)


class Ownership:
    """Owners of every Configuration name, recomputed whenever the store's catalog changes;
    listeners hear which names changed owner."""

    def __init__(self, store: InstanceStore, details: DetailsProblem = details_problem) -> None:
        self._store = store
        self._details = details
        self._decision = NameDecision({}, {})
        self._contested: dict[str, tuple[str, ...]] = {}  # name -> every namespace using it
        self._listeners: list[Callable[[set[str]], None]] = []
        store.on_catalog_change(self.refresh)
        self.refresh()

    def add_listener(self, listener: Callable[[set[str]], None]) -> None:
        """Call ``listener`` with the names whose owner changed."""
        self._listeners.append(listener)

    def refresh(self) -> None:
        """Decide again (cheap: one pass over the Configurations and the Configuration keys
        that have Instances; a handler's verdict on discoveryDetails is cached). Called on
        every catalog change, and by the discovery manager on every Configuration event (an
        edit may make one runnable or not)."""
        decision = decide_for_store(self._store, self._details)
        by_name: defaultdict[str, set[str]] = defaultdict(set)
        for configuration in self._store.configurations():
            by_name[configuration.name].add(configuration.namespace)
        for invalid in self._store.invalid_configurations():
            by_name[invalid.key.name].add(invalid.key.namespace)
        for key in self._store.instance_configurations():
            by_name[key.name].add(key.namespace)
        contested = {name: tuple(sorted(ns)) for name, ns in by_name.items() if len(ns) > 1}
        old = self._decision
        changed = {
            name
            for name in set(decision.owners) | set(old.owners)
            if decision.owners.get(name) != old.owners.get(name)
        }
        changed |= {
            key.name
            for key in set(decision.refused) | set(old.refused)
            if decision.refused.get(key) != old.refused.get(key)
        }
        self._decision = decision
        self._contested = contested
        if changed:
            for listener in list(self._listeners):
                listener(changed)

    def owner(self, name: str) -> str | None:
        """The namespace holding Configuration name ``name`` (None if nobody does)."""
        return self._decision.owners.get(name)

    def owns(self, configuration: ObjectKey) -> bool:
        """Whether ``configuration`` holds its names (not refused, and its name is not
        another namespace's)."""
        return self._decision.holds(configuration)

    def refusal(self, configuration: ObjectKey) -> str | None:
        """Why ``configuration`` may not run here (None if it may)."""
        return self._decision.refused.get(configuration)

    def refusals(self) -> dict[ObjectKey, str]:
        """Every refused Configuration key (some may only have Instances), with why."""
        return dict(self._decision.refused)

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
