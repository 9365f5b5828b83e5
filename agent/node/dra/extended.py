"""DRA first, device plugins as the fallback: which path serves ``limits: {akri.sh/<name>: N}``
on this node (KEP-5004).

The scheduler satisfies an extended resource from DRA on a node whose ``status.allocatable``
has none of it (0 or absent) when a DeviceClass carries it as ``extendedResourceName``; a node
whose device plugin advertises it keeps the device plugin. KEP-5004 forbids one node offering
a name both ways, so the agent picks one per node, at start:

* ``--extended-resources dra`` / ``device-plugins`` force a path;
* ``auto`` (the default) takes DRA when (1) the DRA driver runs (``--dra``), (2) the node's
  kubelet is 1.36 or newer (``DRAExtendedResource`` is beta and on by default there; alpha
  and off in 1.34/1.35, where kubelet would not prepare the special claim), and (3) the API
  server keeps ``extendedResourceName``: a DeviceClass the controller manages
  (``agent/core/deviceclasses.py``) carries it — an API server whose gate is off drops the
  field. Otherwise device plugins, with the reason.

On the DRA path the agent does not register its device plugins (so kubelet reports 0 of the
``akri.sh/*`` resources and the scheduler uses the slices); the device-plugin reclaimer keeps
running, so slots that pods took through device plugins before a switch stay held until those
pods end. Switching is a restart of the agent with another decision: no slot is released by
it (slots live in the Instances; DRA claims keep their ``D:`` values).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.deviceclasses import LABEL_SELECTOR, RESOURCE_PREFIX
from agent.core.kube import ApiError, KubeClient, resource_path

log = logging.getLogger(__name__)

AUTO, DRA, DEVICE_PLUGINS = "auto", "dra", "device-plugins"
MODES = (AUTO, DRA, DEVICE_PLUGINS)
MIN_KUBELET = (1, 36)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)")


@dataclass(frozen=True)
class PathDecision:
    """The path of this node and why."""

    path: str  # DRA or DEVICE_PLUGINS
    reason: str


def kubelet_version(text: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of a ``status.nodeInfo.kubeletVersion`` (``v1.36.2``), or None."""
    match = _VERSION.match((text or "").strip())
    return (int(match[1]), int(match[2])) if match else None


def api_keeps_extended_resource_name(classes: Iterable[Mapping[str, Any]]) -> bool | None:
    """True when a managed DeviceClass carries ``extendedResourceName``; False when managed
    classes exist but none does (the API server dropped it: gate off); None when there is no
    managed class yet (the controller has not written any: no Configuration, or not running)."""
    found = list(classes)
    if not found:
        return None
    return any((c.get("spec") or {}).get("extendedResourceName") for c in found)


def choose_path(
    mode: str,
    *,
    dra_enabled: bool,
    kubelet: str | None,
    classes: Iterable[Mapping[str, Any]] | None,
) -> PathDecision:
    """The pure rule (module docstring). ``classes``: the managed DeviceClasses, None when they
    could not be read."""
    if mode == DEVICE_PLUGINS:
        return PathDecision(DEVICE_PLUGINS, "forced (--extended-resources device-plugins)")
    if not dra_enabled:
        return PathDecision(DEVICE_PLUGINS, "the DRA driver is off (--no-dra)")
    if mode == DRA:
        return PathDecision(DRA, "forced (--extended-resources dra)")
    version = kubelet_version(kubelet)
    if version is None:
        return PathDecision(DEVICE_PLUGINS, f"kubelet version unknown ({kubelet!r})")
    if version < MIN_KUBELET:
        return PathDecision(
            DEVICE_PLUGINS,
            f"kubelet {kubelet} is older than 1.36 (DRAExtendedResource off by default)",
        )
    if classes is None:
        return PathDecision(DEVICE_PLUGINS, "the DeviceClasses could not be read")
    keeps = api_keeps_extended_resource_name(classes)
    if keeps is None:
        return PathDecision(
            DEVICE_PLUGINS,
            "no DeviceClass with an extendedResourceName yet (is akri controller running, "
            "with a Configuration?)",
        )
    if not keeps:
        return PathDecision(
            DEVICE_PLUGINS,
            "the API server drops DeviceClass.spec.extendedResourceName "
            "(DRAExtendedResource is off)",
        )
    return PathDecision(DRA, f"kubelet {kubelet} and the API server support extended resources")


async def decide_path(
    client: KubeClient, node: str, mode: str, *, dra_enabled: bool
) -> PathDecision:
    """Read what :func:`choose_path` needs (the Node, the managed DeviceClasses) and decide;
    one log line says the path and why."""
    kubelet: str | None = None
    classes: list[Mapping[str, Any]] | None = None
    if mode == AUTO and dra_enabled:
        try:
            obj = await client.get(resource_path("", "v1", "nodes", name=node))
            kubelet = ((obj.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion")
        except ApiError as error:
            log.warning("cannot read Node %s for its kubelet version: %s", node, error)
        try:
            found, _ = await client.list_all(
                resource_path("resource.k8s.io", "v1", "deviceclasses"),
                params={"labelSelector": LABEL_SELECTOR},
            )
            classes = list(found)
        except ApiError as error:
            log.warning("cannot list DeviceClasses (%s): extended resources stay on device "
                        "plugins", error)  # fmt: skip
    decision = choose_path(mode, dra_enabled=dra_enabled, kubelet=kubelet, classes=classes)
    log.info(
        "extended resources (%s*) on node %s: %s — %s",
        RESOURCE_PREFIX,
        node,
        "DRA (ResourceSlices, prepared by the DRA driver; device plugins not registered)"
        if decision.path == DRA
        else "device plugins",
        decision.reason,
    )
    return decision


def observed_paths(
    nodes: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]]
) -> dict[str, str]:
    """Which path each node is on as the scheduler sees it (``akri status``): a node whose
    ``status.allocatable`` has an ``akri.sh/`` resource above 0 serves device plugins; a node
    that publishes an ``akri.sh`` pool (``spec.nodeName``) and advertises none serves DRA."""
    publishing = set()
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") == "akri.sh" and spec.get("nodeName"):
            publishing.add(str(spec["nodeName"]))
    paths: dict[str, str] = {}
    for node in nodes:
        name = str(node["metadata"]["name"])
        allocatable = ((node.get("status") or {}).get("allocatable")) or {}
        advertised = any(
            key.startswith(RESOURCE_PREFIX) and str(value) not in ("0", "")
            for key, value in allocatable.items()
        )
        if advertised:
            paths[name] = DEVICE_PLUGINS
        elif name in publishing:
            paths[name] = DRA
    return paths


async def read_observed_paths(client: KubeClient) -> dict[str, str] | None:
    """:func:`observed_paths` from the cluster (Nodes, ``akri.sh`` ResourceSlices), or None
    when they may not be read (RBAC) or DRA is not served."""
    try:
        nodes, _ = await client.list_all(resource_path("", "v1", "nodes"))
        slices, _ = await client.list_all(
            resource_path("resource.k8s.io", "v1", "resourceslices"),
            params={"fieldSelector": "spec.driver=akri.sh"},
        )
    except ApiError as error:
        if error.status in (401, 403, 404):
            return None
        raise
    return observed_paths(nodes, slices)


def paths_table(paths: Mapping[str, str] | None) -> str:
    """The ``akri status`` section: which path serves ``akri.sh/<name>`` limits per node."""
    if paths is None:
        return "Extended resources (akri.sh/<name> limits): Nodes or ResourceSlices not readable"
    if not paths:
        return "Extended resources (akri.sh/<name> limits): no node serves any yet"
    width = max(len("NODE"), *(len(n) for n in paths))
    lines = [f"{'NODE':<{width}}  EXTENDED RESOURCES"]
    for node, path in sorted(paths.items()):
        shown = "DRA (ResourceSlices)" if path == DRA else "device plugins"
        lines.append(f"{node:<{width}}  {shown}")
    return "\n".join(lines)
