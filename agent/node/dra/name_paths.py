"""Which path serves each ``akri.sh/<name>`` on each node: per (node, resource name), not per
node (KEP-5004; docs/dra.md, "Which path each name takes").

Each agent decides its node's **mode** (``agent/node/dra/extended.py``): ``dra`` where the
node's kubelet, runtime and API server can serve extended resources through DRA, else
``device-plugins``; it labels its local ResourceSlices with it (``akri.sh/extended-resources``),
so every agent knows every node's mode (a node that says nothing counts as device plugins).

The scheduler decides per node and per name: a node whose ``status.allocatable`` has the name
above 0 gets it from the device plugin; one with 0 or none gets it through DRA, from the
slots the name's DeviceClass selects (``shouldDelegateResourceToDRA`` and
``filterExtendedResources``, ``pkg/scheduler/framework/plugins``). A DeviceClass cannot see the
node, so a slot either matches a name's class everywhere it can be allocated or nowhere. Hence
the rule, the same on every node, from the Instances and the modes alone:

* **instance-level** ``akri.sh/<instance>``: through DRA on every node of the Instance when
  every node its pool serves (:func:`serving_nodes`) is in ``dra`` mode — its slots then carry
  ``extendedResources: true`` — else through the instance-level device plugin on every one of
  them (a ``dra``-mode node included), and its slots carry ``false``: a device shared with a
  device-plugin node is served through device plugins on both, never lost on either;
* **configuration-level** ``akri.sh/<configuration>``: the nodes linked through the shared
  Instances of the Configuration form groups; in a group whose nodes are all in ``dra`` mode
  the name goes through DRA (the slots of its Instances carry
  ``configurationExtendedResources: true``), in any other group through the configuration-level
  device plugins. A group and not a node, so that no slot a node's device plugin offers for the
  name can be allocated for it through DRA on that node, and no node on DRA misses a slot it
  sees.

So a node never serves one name both ways, and a node that serves a name through a device
plugin has no slot that the name's DeviceClass selects — also in the seconds before kubelet
posts a freshly registered plugin's resource (allocatable still 0, when the scheduler would
otherwise take DRA). Pure functions; the agent applies them in the slice publisher (the slots'
attributes) and in the device-plugin manager (which plugins a ``dra``-mode node runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.model.resource_slices import serving_nodes

DRA, DEVICE_PLUGINS = "dra", "device-plugins"
Modes = Mapping[str, str]  # node -> its mode; a node that is absent counts as device plugins
# on a node's local ResourceSlices (spec.nodeName): its mode, "dra" / "device-plugins"
MODE_LABEL = "akri.sh/extended-resources"


def modes_of_slices(slices: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Node -> mode, from the label its agent puts on its local ``akri.sh`` slices (what the
    publishers and ``akri status`` know of the other nodes)."""
    modes: dict[str, str] = {}
    for item in slices:
        spec = item.get("spec") or {}
        owner = spec.get("nodeName")
        label = ((item.get("metadata") or {}).get("labels") or {}).get(MODE_LABEL)
        if owner and label in (DRA, DEVICE_PLUGINS):
            modes[str(owner)] = str(label)
    return modes


def instance_on_dra(instance: Instance, modes: Modes) -> bool:
    """Whether ``akri.sh/<instance>`` goes through DRA (on every node of the Instance)."""
    nodes = serving_nodes(instance)
    return bool(nodes) and all(modes.get(node) == DRA for node in nodes)


def device_plugin_nodes(instance: Instance, modes: Modes) -> list[str]:
    """The serving nodes of ``instance`` not in ``dra`` mode (why it is not on DRA)."""
    return [node for node in serving_nodes(instance) if modes.get(node) != DRA]


def configuration_dra_nodes(instances: Iterable[Instance], modes: Modes) -> frozenset[str]:
    """Among the nodes serving ``instances`` (one Configuration's), those whose group — the
    nodes linked to it through shared Instances — is all in ``dra`` mode: where
    ``akri.sh/<configuration>`` goes through DRA."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for instance in instances:
        nodes = serving_nodes(instance)
        for node in nodes:
            parent[root(node)] = root(nodes[0])
    groups: dict[str, list[str]] = {}
    for node in list(parent):
        groups.setdefault(root(node), []).append(node)
    return frozenset(
        node
        for members in groups.values()
        if all(modes.get(member) == DRA for member in members)
        for node in members
    )


def configuration_on_dra(node: str, instances: Sequence[Instance], modes: Modes) -> bool:
    """Whether ``akri.sh/<configuration>`` goes through DRA on ``node`` (``instances``: the
    Configuration's): ``node`` is in ``dra`` mode and its group is (a node serving none of
    them is a group of its own)."""
    if modes.get(node) != DRA:
        return False
    if not any(node in serving_nodes(instance) for instance in instances):
        return True
    return node in configuration_dra_nodes(instances, modes)


@dataclass(frozen=True)
class Eligibility:
    """The two attributes of a slot: may it serve ``akri.sh/<instance>`` limits through DRA
    (``extendedResources``), and ``akri.sh/<configuration>`` limits
    (``configurationExtendedResources``)."""

    instance: bool
    configuration: bool


def slot_eligibility(
    instances: Sequence[Instance], modes: Modes
) -> Callable[[Instance], Eligibility]:
    """:class:`Eligibility` of each of ``instances`` (all the Instances this node knows; the
    groups of each Configuration are computed once, on first use)."""
    by_configuration: dict[ObjectKey, list[Instance]] = {}
    for instance in instances:
        by_configuration.setdefault(instance.configuration_key, []).append(instance)
    groups: dict[ObjectKey, frozenset[str]] = {}

    def eligibility(instance: Instance) -> Eligibility:
        if not instance_on_dra(instance, modes):
            return Eligibility(False, False)
        key = instance.configuration_key
        if key not in groups:
            groups[key] = configuration_dra_nodes(by_configuration.get(key, [instance]), modes)
        # the serving nodes are one group (the Instance links them): one of them tells
        return Eligibility(True, serving_nodes(instance)[0] in groups[key])

    return eligibility


class NodeNamePaths:
    """This node's side of the rule, for the device-plugin manager: whether it serves a name
    through its device plugin. ``mode``: this node's mode now; ``modes``: every node's (this
    one's included) as the slice publisher knows them."""

    def __init__(self, node: str, mode: Callable[[], str], modes: Callable[[], Modes]) -> None:
        self.node = node
        self._mode = mode
        self._modes = modes

    @property
    def mode(self) -> str:
        return self._mode()

    def modes(self) -> dict[str, str]:
        """Every node's mode, this node's as it is now."""
        return {**self._modes(), self.node: self._mode()}

    def instance_on_plugins(self, instance: Instance) -> bool:
        """Whether ``akri.sh/<instance>`` is served here through the device plugin."""
        return self._mode() != DRA or not instance_on_dra(instance, self.modes())

    def configuration_on_plugins(self, instances: Sequence[Instance]) -> bool:
        """Whether the configuration-level name of ``instances`` (one Configuration's) is
        served here through the device plugin."""
        if self._mode() != DRA:
            return True
        return not configuration_on_dra(self.node, instances, self.modes())

    def why_instance(self, instance: Instance) -> str:
        """One line: which path ``akri.sh/<instance>`` takes here, and why."""
        if self._mode() != DRA:
            return "this node serves akri.sh/* through device plugins"
        others = device_plugin_nodes(instance, self.modes())
        if not others:
            return "every node of the Instance serves akri.sh/* through DRA"
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        return f"shared with {shown}, not on DRA: device plugins on every node of it"
