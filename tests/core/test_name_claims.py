"""One rule for who holds a node-global name (issue 34.4-5, agent/core/name_claims.py), checked
over random sets of Configurations: the agents' decision (``Ownership``, what runs and what
the plugins serve) and the controller's DeviceClasses (``DeviceClassReconciler.desired``)
agree, no two holders can give one kubelet name two meanings, a serving name is never taken by
a newcomer, and a Configuration no agent can run changes nobody's names."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.controller.deviceclasses import DeviceClassReconciler
from agent.core.kube import KubeClient
from agent.core.model.configuration import Configuration, ConfigurationError, parse_configuration
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import configuration_resource_name, instance_name, instance_prefix
from agent.core.name_claims import RUNNABLE, SERVING, NameUser, decide_names, name_users
from agent.core.store.base import InstanceStore, InvalidConfiguration
from agent.node.app import build_handlers
from agent.node.discovery.ownership import Ownership
from agent.node.settings import AGENT_OPTIONS, AgentSettings, add_options, resolve
from discovery_handlers.embedded import EMBEDDED, details_problem

LONG = "a" * 70
NAMES = [
    "cam",
    "cam-202406",  # the shape of cam's Instance names
    "cam-facade",
    "cam-202406-abcdef",  # the shape of cam-202406's
    "cams",
    LONG,
    configuration_resource_name(LONG),  # another name, LONG's resource name
    "b" * 55,
    instance_prefix("b" * 55),  # another name, the same Instance prefix
    "x",
]
NAMESPACES = ["default", "tenant-b", "t3"]
CREATED = ["2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z", "2026-01-02T00:00:00Z"]
KINDS = ["runnable", "bad-details", "unknown-handler", "unparsable", "deleted"]
DIGESTS = ["202406", "facade", "abcdef", "111111"]
_SHAPE = re.compile(r"^(.+)-[0-9a-f]{6}$")


@dataclass(frozen=True)
class Entry:
    """One (namespace, name) in use: what its Configuration is, and its Instances' digests."""

    key: ObjectKey
    created: str | None
    kind: str
    digests: tuple[str, ...]


def raw(entry: Entry) -> dict[str, Any]:
    handler = {"name": "debugEcho", "discoveryDetails": "descriptions: [a]"}
    if entry.kind == "bad-details":
        handler["discoveryDetails"] = "{}"
    elif entry.kind == "unknown-handler":
        handler["name"] = "zigbee"
    elif entry.kind == "unparsable":
        handler["name"] = ""
    metadata: dict[str, Any] = {"name": entry.key.name, "namespace": entry.key.namespace}
    if entry.created is not None:
        metadata["creationTimestamp"] = entry.created
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": metadata,
        "spec": {"discoveryHandler": handler, "capacity": 1},
    }


class Objects:
    """The read side of a store holding ``entries`` (what Ownership and the controller's
    DeviceClass pass read)."""

    def __init__(self, entries: Iterable[Entry]) -> None:
        self.valid: list[Configuration] = []
        self.invalid: list[InvalidConfiguration] = []
        self.instances: list[Instance] = []
        for entry in entries:
            if entry.kind != "deleted":
                try:
                    self.valid.append(parse_configuration(raw(entry)))
                except ConfigurationError as error:
                    message = "; ".join(error.problems)
                    self.invalid.append(InvalidConfiguration(entry.key, message, entry.created))
            for digest in entry.digests:
                self.instances.append(
                    Instance(
                        name=instance_name(entry.key.name, digest),
                        namespace=entry.key.namespace,
                        configuration_name=entry.key.name,
                        capacity=1,
                    )
                )

    def configurations(self) -> list[Configuration]:
        return list(self.valid)

    def invalid_configurations(self) -> list[InvalidConfiguration]:
        return list(self.invalid)

    def instance_configurations(self) -> set[ObjectKey]:
        return {i.configuration_key for i in self.instances}

    def list_cached(self, configuration: ObjectKey | None = None) -> list[Instance]:
        return [i for i in self.instances if configuration in (None, i.configuration_key)]

    def on_catalog_change(self, listener: Callable[[], None]) -> None:
        pass


@st.composite
def entry_sets(draw: st.DrawFn) -> list[Entry]:
    keys = draw(
        st.lists(
            st.tuples(st.sampled_from(NAMESPACES), st.sampled_from(NAMES)),
            unique=True,
            max_size=8,
        )
    )
    entries = []
    for namespace, name in keys:
        kind = draw(st.sampled_from(KINDS))
        digests = draw(st.lists(st.sampled_from(DIGESTS), unique=True, max_size=2))
        if kind == "deleted" and not digests:
            digests = [DIGESTS[0]]  # a key only in use through its Instances
        # a Configuration has a creationTimestamp; a deleted one's key only has Instances
        created = None if kind == "deleted" else draw(st.sampled_from(CREATED))
        entries.append(Entry(ObjectKey(namespace, name), created, kind, tuple(digests)))
    return entries


def collide(a: ObjectKey, b: ObjectKey) -> bool:
    """The definition, pair by pair: could ``a`` and ``b`` give one name two meanings?"""
    if a.name == b.name:
        return True
    ra, rb = configuration_resource_name(a.name), configuration_resource_name(b.name)
    pa, pb = instance_prefix(a.name), instance_prefix(b.name)

    def shape(resource: str) -> str | None:
        match = _SHAPE.match(resource)
        return match.group(1) if match else None

    return ra == rb or pa == pb or shape(ra) == pb or shape(rb) == pa


def desired_classes(objects: Objects) -> dict[str, dict[str, Any]]:
    reconciler = DeviceClassReconciler(
        cast(KubeClient, None), cast(InstanceStore, objects), details=details_problem
    )
    return reconciler.desired()


def users_of(objects: Objects) -> list[NameUser]:
    invalid = [(i.key, i.creation_timestamp, i.message) for i in objects.invalid]
    return name_users(objects.valid, invalid, objects.instance_configurations(), details_problem)


@settings(max_examples=400, deadline=None)
@given(entry_sets())
def test_agents_and_controller_agree_and_no_name_has_two_meanings(entries: list[Entry]) -> None:
    objects = Objects(entries)
    agents = Ownership(cast(InstanceStore, objects), details_problem)
    keys = {e.key for e in entries}
    held = {key for key in keys if agents.owns(key)}
    # no two holders collide: every kubelet name, DRA name and extendedResourceName has at
    # most one meaning on every node
    for a in held:
        for b in held:
            assert a == b or not collide(a, b), (a, b)
    # every key is held or refused naming a holder it collides with
    for key in keys - held:
        reason = agents.refusal(key)
        assert reason is not None
        assert any(collide(key, h) and f"{h.namespace}" in reason for h in held), (key, reason)
    # the controller's classes: one per extendedResourceName, each the holder's: the
    # configuration-level one of every holding Configuration, the instance-level one of each
    # of its Instances (a key without a valid Configuration runs nothing: no classes)
    classes = desired_classes(objects).values()
    extended = [c["spec"]["extendedResourceName"] for c in classes]
    assert len(extended) == len(set(extended))
    running = {c.key for c in objects.valid} & held
    wanted = {"akri.sh/" + configuration_resource_name(k.name) for k in running}
    wanted |= {"akri.sh/" + i.name for i in objects.instances if i.configuration_key in running}
    assert set(extended) == wanted


@settings(max_examples=300, deadline=None)
@given(
    entry_sets(), st.sampled_from(NAMESPACES), st.sampled_from(NAMES), st.sampled_from(KINDS[:4])
)
def test_a_newcomer_takes_no_name_and_one_no_agent_runs_changes_nothing(
    entries: list[Entry], namespace: str, name: str, kind: str
) -> None:
    """A Configuration created after all others (no Instances yet) leaves every runnable or
    serving holder holding; and the Configurations no agent can run (without Instances) can
    be taken away without changing who of the others holds."""
    key = ObjectKey(namespace, name)
    entries = [e for e in entries if e.key != key]
    before = decide_names(users_of(Objects(entries)))
    newcomer = Entry(key, "2027-01-01T00:00:00Z", kind, ())
    after = decide_names(users_of(Objects([*entries, newcomer])))
    for user in users_of(Objects(entries)):
        if user.rank in (SERVING, RUNNABLE) and before.holds(user.key):
            assert after.holds(user.key), (user, after.refused.get(user.key))
    # those that claim nothing: gone, the others decide alike
    users = users_of(Objects(entries))
    claiming = [u for u in users if u.rank in (SERVING, RUNNABLE)]
    alone = decide_names(claiming)
    for user in claiming:
        assert alone.holds(user.key) == before.holds(user.key), user


def test_the_embedded_handlers_are_those_the_agent_registers(tmp_path: Path) -> None:
    """The rule's "embedded" (discovery_handlers/embedded.py) is what ``build_handlers``
    gives an agent, and each accepts good details and names what is wrong in bad ones."""
    parser = argparse.ArgumentParser()
    add_options(parser, AGENT_OPTIONS)
    argv = ["--local", "--state-dir", str(tmp_path)]
    values = resolve(parser.parse_args(argv), AGENT_OPTIONS, {})
    assert set(build_handlers(AgentSettings.from_values(values)).names()) == set(EMBEDDED)
    assert details_problem("debugEcho", "descriptions: [a]") is None
    assert "descriptions is required" in (details_problem("debugEcho", "{}") or "")
    assert details_problem("zigbee", "") == "no agent embeds a discovery handler named 'zigbee'"
    assert details_problem("udev", "udevRules: ['KERNEL==\"video*\"']") is None
    assert (details_problem("udev", "udevRules: ['KERNEL=!!']") or "").startswith(
        "spec.discoveryHandler.discoveryDetails:"
    )
