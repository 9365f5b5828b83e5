"""Which Configuration holds each node-global name: one rule, decided alike by every agent (which
Configurations it runs, whose Instances its device plugins and DRA driver serve), by the
controller (which DeviceClasses exist) and by ``akri status`` (the NOTE saying why one is
refused). See docs/slot-model.md, "One resource name, one meaning".

Configurations and Instances are namespaced, but what the agents hand out is not: kubelet
resource names ``akri.sh/<configuration>`` and ``akri.sh/<instance>``, DRA device and pool
names of driver ``akri.sh``, and the DeviceClasses' ``extendedResourceName``. Two
Configurations *collide* when they could give one of those names two meanings:

* the same name in two namespaces (then every name of theirs is shared);
* names whose configuration-level resource or Instance-name prefix are equal — only possible
  through the shortening of names longer than 52 characters;
* a name with the shape of an Instance name of the other (``<other>-<6 hex>``: ``cam-202406``
  beside ``cam``, whose device of digest ``202406`` would be the Instance ``cam-202406``).
  Akri reserves ``<configuration>-<digest>`` for Instances; deciding by shape does not depend
  on which devices happen to be discovered, so a name never changes meaning under running
  containers.

**A name that serves keeps it.** Each (namespace, name) in use is ranked:

1. *serving*: it has Instances (they may hold slots of running containers, so they are never
   displaced by a newcomer), whether its Configuration is there or already deleted;
2. *runnable*: a Configuration any agent can run — it parses, and its handler is embedded and
   accepts its discoveryDetails;
3. the rest: a Configuration that does not parse, whose discoveryDetails its handler refuses,
   or whose handler no agent embeds (an external handler may register later: it holds its
   names once it serves). These claim nothing — they never keep another from its names.

and, within a rank, the older first (``creationTimestamp``; then namespace and name, which are
unique). In that order each one holds its names unless one already holding collides with it:
then it is refused, with a reason naming that holder (log line, ``NameConflict`` Event,
``akri status`` NOTE); it starts by itself once the holder and its Instances are gone. No two
holders collide, so every node-global name has at most one meaning, and every agent and the
controller, deciding from the same objects, agree on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from agent.core.model.configuration import Configuration, ConfigurationError, parse_configuration
from agent.core.model.keys import DEFAULT_NAMESPACE, ObjectKey
from agent.core.model.naming import (
    configuration_resource_name,
    instance_prefix,
    instance_shaped_prefix,
)
from agent.core.store.base import InstanceStore

DetailsProblem = Callable[[str, str], str | None]
"""``(handler name, discoveryDetails) -> why no agent runs it`` (None: one can):
``discovery_handlers.embedded.details_problem``, passed in (``agent.core`` does not import the
handlers)."""

SERVING, RUNNABLE, NOT_RUNNABLE = 0, 1, 2


@dataclass(frozen=True)
class NameUser:
    """One ``(namespace, Configuration name)`` in use: configured (``created``: its
    creationTimestamp, None if unknown or not configured) and/or with Instances; ``problem``:
    why no agent can run it (None: one can; a key with only Instances has none)."""

    key: ObjectKey
    created: str | None = None
    has_instances: bool = False
    problem: str | None = None

    @property
    def rank(self) -> int:
        if self.has_instances:
            return SERVING
        return RUNNABLE if self.problem is None else NOT_RUNNABLE


@dataclass(frozen=True)
class NameDecision:
    """:func:`decide_names`: the keys holding their names (``owners``: Configuration name ->
    the namespace holding it), and why each other key is refused (naming its holder)."""

    owners: Mapping[str, str]
    refused: Mapping[ObjectKey, str]

    def holds(self, key: ObjectKey) -> bool:
        """Whether ``key`` holds its names (a key the decision did not see holds them unless
        its name is another namespace's)."""
        return key not in self.refused and self.owners.get(key.name, key.namespace) == key.namespace


def _order(user: NameUser) -> tuple[int, bool, str, str, str]:
    return (user.rank, user.created is None, user.created or "", user.key.namespace, user.key.name)


def _why(user: ObjectKey, holder: ObjectKey, kind: str) -> str:
    """Why ``user`` is refused: it collides with ``holder`` in way ``kind``."""
    if kind == "same":
        return (
            f"the name {user.name!r} is in use by the Configuration in namespace "
            f"{holder.namespace!r}"
        )
    if kind == "shortened":
        return (
            f"its kubelet resource names (akri.sh/{configuration_resource_name(user.name)}, "
            f"akri.sh/{instance_prefix(user.name)}-<digest>) are those of Configuration "
            f"{holder.namespace}/{holder.name} (long names are shortened)"
        )
    if kind == "shaped":  # the user's own resource name looks like the holder's Instances
        return (
            f"akri.sh/{configuration_resource_name(user.name)} has the shape of an Instance "
            f"name of Configuration {holder.namespace}/{holder.name} (<configuration>-<6 hex "
            f"digest>), which holds it: Akri reserves that shape for Instances, so this "
            f"Configuration would give that resource name a second meaning on a node"
        )
    # "shapes": the holder's resource name looks like one of the user's Instance names
    return (
        f"its Instance names (akri.sh/{instance_prefix(user.name)}-<6 hex digest>) include "
        f"akri.sh/{configuration_resource_name(holder.name)}, the resource name of "
        f"Configuration {holder.namespace}/{holder.name}, which holds it"
    )


def decide_names(users: Iterable[NameUser]) -> NameDecision:
    """Which keys hold their node-global names and why each other is refused (pure; module
    docstring). A key given twice counts once, as its last entry."""
    by_key = {user.key: user for user in users}
    # what the holders so far have taken, by the collision it makes
    names: dict[str, ObjectKey] = {}
    resources: dict[str, ObjectKey] = {}  # akri.sh/<configuration> part
    prefixes: dict[str, ObjectKey] = {}  # Instance-name prefix
    shaped: dict[str, ObjectKey] = {}  # a holder's resource name as an Instance prefix
    owners: dict[str, str] = {}
    refused: dict[ObjectKey, str] = {}
    for user in sorted(by_key.values(), key=_order):
        key = user.key
        resource, prefix = configuration_resource_name(key.name), instance_prefix(key.name)
        own_shape = instance_shaped_prefix(resource)
        collision: tuple[ObjectKey, str] | None = None
        if key.name in names:
            collision = names[key.name], "same"
        elif resource in resources:
            collision = resources[resource], "shortened"
        elif prefix in prefixes:
            collision = prefixes[prefix], "shortened"
        elif own_shape is not None and own_shape in prefixes:
            collision = prefixes[own_shape], "shaped"
        elif prefix in shaped:
            collision = shaped[prefix], "shapes"
        if collision is not None:
            refused[key] = _why(key, *collision)
            continue
        names[key.name] = key
        resources[resource] = key
        prefixes[prefix] = key
        if own_shape is not None:
            shaped.setdefault(own_shape, key)
        owners[key.name] = key.namespace
    return NameDecision(owners, refused)


def name_users(
    configurations: Iterable[Configuration],
    invalid: Iterable[tuple[ObjectKey, str | None, str]],
    with_instances: Iterable[ObjectKey],
    details_problem: DetailsProblem,
) -> list[NameUser]:
    """The users :func:`decide_names` weighs: ``configurations`` (parsed), ``invalid`` ones
    (key, creationTimestamp, why it does not parse), and the keys that have Instances."""
    users: dict[ObjectKey, NameUser] = {}
    for configuration in configurations:
        handler = configuration.discovery_handler
        users[configuration.key] = NameUser(
            configuration.key,
            configuration.creation_timestamp,
            problem=details_problem(handler.name, handler.discovery_details),
        )
    for key, created, message in invalid:
        users[key] = NameUser(key, created, problem=message or "invalid")
    for key in with_instances:
        known = users.get(key)
        users[key] = NameUser(
            key, known.created if known else None, True, known.problem if known else None
        )
    return list(users.values())


def decide_for_store(store: InstanceStore, details_problem: DetailsProblem) -> NameDecision:
    """:func:`decide_names` over a store's Configurations (valid or not) and Instances: what
    every agent (``agent/node/discovery/ownership.py``) and the controller
    (``agent/controller/deviceclasses.py``) decide."""
    return decide_names(
        name_users(
            store.configurations(),
            [(i.key, i.creation_timestamp, i.message) for i in store.invalid_configurations()],
            store.instance_configurations(),
            details_problem,
        )
    )


def decide_for_objects(
    configurations: Iterable[Mapping[str, object]],
    with_instances: Iterable[ObjectKey],
    details_problem: DetailsProblem,
) -> NameDecision:
    """:func:`decide_names` over raw Configuration objects (``akri status``), each parsed as
    the agents parse it."""
    valid: list[Configuration] = []
    invalid: list[tuple[ObjectKey, str | None, str]] = []
    for obj in configurations:
        metadata = obj.get("metadata")
        metadata = metadata if isinstance(metadata, Mapping) else {}
        key = ObjectKey(
            str(metadata.get("namespace") or DEFAULT_NAMESPACE), str(metadata.get("name"))
        )
        created = metadata.get("creationTimestamp")
        try:
            valid.append(parse_configuration(obj))
        except ConfigurationError as error:
            problems = "; ".join(error.problems)
            invalid.append((key, created if isinstance(created, str) else None, problems))
    return decide_names(name_users(valid, invalid, with_instances, details_problem))
