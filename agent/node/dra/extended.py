"""DRA first, device plugins as the fallback: which path serves ``limits: {akri.sh/<name>: N}``
on this node (KEP-5004).

The scheduler satisfies an extended resource from DRA on a node whose ``status.allocatable``
has none of it (0 or absent) when a DeviceClass carries it as ``extendedResourceName``; a node
whose device plugin advertises it keeps the device plugin. KEP-5004 forbids one node offering
a name both ways, so the agent picks one per node, at start (on ``auto`` again, in place,
when a DeviceClass appears or its Node's label, kubelet or runtime changes):

* ``--extended-resources dra`` / ``device-plugins`` force a path;
* ``auto`` (the default) takes DRA when (1) the DRA driver runs (``--dra``), (2) the node's
  kubelet is 1.36 or newer (``DRAExtendedResource`` is beta and on by default there; alpha
  and off in 1.34/1.35, where kubelet would not prepare the special claim), (3) the node's
  container runtime is known to inject CDI (:func:`runtime_cdi`: DRA hands a container its
  device only through CDI, a device plugin through ``Allocate`` — on a runtime without CDI a
  DRA pod starts without its device), and (4) the API server keeps
  ``extendedResourceName``: a DeviceClass the controller manages
  (``agent/core/deviceclasses.py``) carries it — an API server whose gate is off drops the
  field. Otherwise device plugins, with the reason.

Which runtimes inject CDI, from ``status.nodeInfo.containerRuntimeVersion`` (kubelet 1.36
passes CDI devices only in the CRI ``CDIDevices`` field, no longer as annotations):

* ``containerd://`` 2.x: yes (``enable_cdi`` defaults to true since 2.0,
  ``internal/cri/config/config_unix.go``);
* ``containerd://`` 1.7.2 and later 1.7: only with ``enable_cdi = true``, off by default
  (``pkg/cri/config/config_unix.go``): not known, so device plugins;
* ``containerd://`` before 1.7.2: no (1.6 has no CDI; 1.7.0/1.7.1 read CDI devices only from
  the annotations kubelet no longer sends);
* ``cri-o://`` 1.28 and later: yes (CDI always on; the ``CDIDevices`` field since 1.28);
  earlier: no;
* anything else (``docker://`` through cri-dockerd, unknown): not known, so device plugins.

The operator's word wins: the Node label ``akri.sh/runtime-cdi=true`` (say, a containerd 1.7
with ``enable_cdi = true``) or ``=false`` (a runtime whose CDI was turned off). The decision is
logged, exported (``akri_extended_resource_path``, ``akri_runtime_cdi``), posted as an Event on
the Node, and each node's local ResourceSlices carry it as the label
``akri.sh/extended-resources`` (``dra`` / ``device-plugins``), which ``akri status`` and the
publishers of shared pools read. A ResourceClaim prepared on a node whose runtime is not known
to inject CDI gets a warning (a log line, and an Event on the claim): :class:`CdiNotice`.

That decision is the node's *mode*. Which path each name takes is per (node, name)
(``agent/node/dra/name_paths.py``): a node in ``dra`` mode does not register the device plugin
of a name served through DRA (so kubelet reports 0 of it and the scheduler uses the slices),
but does register the plugins of the devices it shares with device-plugin nodes. The
device-plugin reclaimer keeps running, so slots that pods took through device plugins before a
name moved stay held until those pods end; no slot is released by a switch (slots live in the
Instances; DRA claims keep their ``D:`` values).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.deviceclasses import LABEL_SELECTOR, RESOURCE_PREFIX
from agent.core.kube import ApiError, KubeClient, TransportError, resource_path
from agent.core.store.informer import WatchExpiredError, watch_events
from agent.node.dra.checkpoint import PreparedClaim
from agent.node.dra.name_paths import modes_of_slices

log = logging.getLogger(__name__)

AUTO, DRA, DEVICE_PLUGINS = "auto", "dra", "device-plugins"
MODES = (AUTO, DRA, DEVICE_PLUGINS)
MIN_KUBELET = (1, 36)
RUNTIME_CDI_LABEL = "akri.sh/runtime-cdi"  # on a Node, set by its operator: "true" / "false"
_VERSION = re.compile(r"^v?(\d+)\.(\d+)")
_RUNTIME = re.compile(
    r"^(?P<name>[a-z0-9.-]+)://v?(?P<major>\d+)\.(?P<minor>\d+)(?:\.(?P<patch>\d+))?"
)
MAX_NOTICED_CLAIMS = 4096
WATCH_TIMEOUT = 290


@dataclass(frozen=True)
class RuntimeCdi:
    """Whether the node's container runtime injects CDI devices: True, False, or None (not
    known: off by default, or a runtime this table does not know) — and why."""

    runtime: str  # status.nodeInfo.containerRuntimeVersion, as reported
    applies: bool | None
    why: str
    # this version cannot inject CDI however it is configured (containerd before 1.7.2,
    # CRI-O before 1.28): only an upgrade gives it, not a setting and the Node label
    too_old: bool = False

    @property
    def shown(self) -> str:
        """``yes`` / ``no`` / ``unknown`` (the metric's label, ``akri status``)."""
        return {True: "yes", False: "no", None: "unknown"}[self.applies]

    @property
    def advice(self) -> str:
        """How to make this runtime inject CDI (acceptance F3: a runtime too old for CDI was
        told to turn it on)."""
        if self.too_old:
            return (
                "upgrade the runtime (containerd ≥ 1.7.2 with enable_cdi = true, then label "
                f"the Node {RUNTIME_CDI_LABEL}=true, or containerd 2.x; CRI-O ≥ 1.28)"
            )
        return f"turn CDI on in the runtime and label the Node {RUNTIME_CDI_LABEL}=true"


@dataclass(frozen=True)
class PathDecision:
    """The path of this node and why (``warning``: a forced path that will not deliver)."""

    path: str  # DRA or DEVICE_PLUGINS
    reason: str
    warning: str = ""
    # auto, device plugins only until akri controller's DeviceClasses can be seen: the agent
    # follows them and takes DRA once one carries extendedResourceName (follow_device_classes)
    awaits_classes: bool = False


def runtime_cdi(runtime: str | None, labels: Mapping[str, str] | None = None) -> RuntimeCdi:
    """Whether the runtime ``containerd://1.7.24`` (``status.nodeInfo.containerRuntimeVersion``)
    injects CDI (module docstring); the Node label ``akri.sh/runtime-cdi`` overrides."""
    text = (runtime or "").strip()
    label = str((labels or {}).get(RUNTIME_CDI_LABEL, "")).strip().lower()
    if label in ("true", "false"):
        applies = label == "true"
        too_old = _runtime_cdi_by_version(text).too_old
        return RuntimeCdi(
            text, applies, f"the Node is labelled {RUNTIME_CDI_LABEL}={label}", too_old
        )
    return _runtime_cdi_by_version(text)


def _runtime_cdi_by_version(text: str) -> RuntimeCdi:
    match = _RUNTIME.match(text)
    if match is None:
        return RuntimeCdi(
            text, None, f"container runtime {text or 'unknown'!r} is not known to inject CDI"
        )
    name = match["name"]
    version = (int(match["major"]), int(match["minor"]), int(match["patch"] or 0))
    shown = f"{name} {match['major']}.{match['minor']}" + (
        f".{match['patch']}" if match["patch"] else ""
    )
    if name == "containerd":
        if version >= (2, 0, 0):
            return RuntimeCdi(text, True, f"{shown} injects CDI (enable_cdi is on by default)")
        if version >= (1, 7, 2):
            return RuntimeCdi(
                text,
                None,
                f"{shown} injects CDI only with enable_cdi = true, off by default (label the "
                f"Node {RUNTIME_CDI_LABEL}=true if it is on)",
            )
        if version >= (1, 7, 0):
            return RuntimeCdi(
                text,
                False,
                f"{shown} reads CDI devices only from annotations, which kubelet no longer "
                "sends (1.7.2 or later with enable_cdi = true is needed)",
                too_old=True,
            )
        return RuntimeCdi(
            text, False, f"{shown} has no CDI support (1.7.2 or later is needed)", too_old=True
        )
    if name == "cri-o":
        if version >= (1, 28, 0):
            return RuntimeCdi(text, True, f"{shown} injects CDI (always on)")
        return RuntimeCdi(
            text,
            False,
            f"{shown} reads CDI devices only from annotations (1.28 is needed)",
            too_old=True,
        )
    return RuntimeCdi(
        text,
        None,
        f"{shown} is not known to inject CDI (label the Node {RUNTIME_CDI_LABEL}=true if it does)",
    )


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
    runtime: RuntimeCdi | None = None,
) -> PathDecision:
    """The pure rule (module docstring). ``classes``: the managed DeviceClasses, None when they
    could not be read; ``runtime``: the runtime's CDI (None: the Node could not be read)."""
    if mode == DEVICE_PLUGINS:
        return PathDecision(DEVICE_PLUGINS, "forced (--extended-resources device-plugins)")
    if not dra_enabled:
        return PathDecision(DEVICE_PLUGINS, "the DRA driver is off (--no-dra)")
    if mode == DRA:
        warning = ""
        if runtime is not None and runtime.applies is not True:
            warning = (
                f"{runtime.why}: pods served through DRA on this node may start without "
                "their device (no env vars, device nodes or mounts)"
            )
        return PathDecision(DRA, "forced (--extended-resources dra)", warning)
    version = kubelet_version(kubelet)
    if version is None:
        return PathDecision(DEVICE_PLUGINS, f"kubelet version unknown ({kubelet!r})")
    if version < MIN_KUBELET:
        return PathDecision(
            DEVICE_PLUGINS,
            f"kubelet {kubelet} is older than 1.36 (DRAExtendedResource off by default)",
        )
    if runtime is None:
        return PathDecision(DEVICE_PLUGINS, "the container runtime is unknown")
    if runtime.applies is not True:
        return PathDecision(DEVICE_PLUGINS, runtime.why)
    if classes is None:
        return PathDecision(
            DEVICE_PLUGINS, "the DeviceClasses could not be read", awaits_classes=True
        )
    keeps = api_keeps_extended_resource_name(classes)
    if keeps is None:
        return PathDecision(
            DEVICE_PLUGINS,
            "no DeviceClass with an extendedResourceName yet (is akri controller running, "
            "with a Configuration?); DRA once one appears",
            awaits_classes=True,
        )
    if not keeps:
        return PathDecision(
            DEVICE_PLUGINS,
            "the API server drops DeviceClass.spec.extendedResourceName "
            "(DRAExtendedResource is off)",
        )
    return PathDecision(
        DRA, f"kubelet {kubelet}, {runtime.why} and the API server supports extended resources"
    )


@dataclass(frozen=True)
class NodeFacts:
    """What the path decision read: the Node (None: not readable) and its runtime's CDI."""

    node: Mapping[str, Any] | None
    runtime: RuntimeCdi | None


async def read_node(client: KubeClient, node: str) -> NodeFacts:
    """The Node and its runtime's CDI (:func:`runtime_cdi`); a Node that cannot be read is
    said once and gives None."""
    try:
        obj = await client.get(resource_path("", "v1", "nodes", name=node))
    except ApiError as error:
        log.warning("cannot read Node %s for its kubelet and runtime versions: %s", node, error)
        return NodeFacts(None, None)
    return node_facts(obj)


async def decide_path(
    client: KubeClient,
    node: str,
    mode: str,
    *,
    dra_enabled: bool,
    facts: NodeFacts | None = None,
) -> PathDecision:
    """Read what :func:`choose_path` needs (the Node unless ``facts`` has it, the managed
    DeviceClasses) and decide; one log line says the path and why, and an Event on the Node
    (best effort)."""
    kubelet: str | None = None
    classes: list[Mapping[str, Any]] | None = None
    if facts is None and dra_enabled:
        facts = await read_node(client, node)
    runtime = facts.runtime if facts is not None else None
    if facts is not None and facts.node is not None:
        kubelet = ((facts.node.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion")
    if mode == AUTO and dra_enabled:
        try:
            found, _ = await client.list_all(
                resource_path("resource.k8s.io", "v1", "deviceclasses"),
                params={"labelSelector": LABEL_SELECTOR},
            )
            classes = list(found)
        except ApiError as error:
            log.warning("cannot list DeviceClasses (%s): extended resources stay on device "
                        "plugins", error)  # fmt: skip
    decision = choose_path(
        mode, dra_enabled=dra_enabled, kubelet=kubelet, classes=classes, runtime=runtime
    )
    await announce(client, node, facts, decision)
    return decision


def kubelet_of(facts: NodeFacts | None) -> str | None:
    """The Node's ``status.nodeInfo.kubeletVersion`` (None: not read)."""
    if facts is None or facts.node is None:
        return None
    info = (facts.node.get("status") or {}).get("nodeInfo") or {}
    version = info.get("kubeletVersion")
    return str(version) if version else None


async def announce(
    client: KubeClient, node: str, facts: NodeFacts | None, decision: PathDecision
) -> None:
    """Say a node's path and why: one log line (a warning for a forced path that will not
    deliver), an ``ExtendedResourcePath`` Event on the Node (best effort)."""
    line = path_line(node, decision)
    if decision.warning:
        log.warning("%s", line)
    else:
        log.info("%s", line)
    if facts is not None and facts.node is not None:
        await record_event(
            client,
            node,
            {"apiVersion": "v1", "kind": "Node", **_ref(facts.node, namespace=False)},
            "ExtendedResourcePath",
            line,
            warning=bool(decision.warning),
        )


ClassesSeen = Callable[[list[Mapping[str, Any]]], bool]


async def follow_device_classes(
    client: KubeClient, seen: ClassesSeen, *, retry: float = 1.0, poll: float = 30.0
) -> None:
    """List and watch the DeviceClasses akri controller manages, calling ``seen`` with all of
    them at the list and at every change, until it returns True. (``auto`` decided device
    plugins at the start because none carried ``extendedResourceName`` yet: installed in the
    README's order, the agent starts before the controller has written any.) A watch refused
    (an RBAC of an older install without ``watch``) falls back to a list every ``poll``
    seconds; a list refused (no ``list`` either) is said once and ends the following."""
    path = resource_path("resource.k8s.io", "v1", "deviceclasses")
    classes: dict[str, Mapping[str, Any]] = {}
    watch_refused = False
    delay = retry
    while True:
        try:
            found, version = await client.list_all(path, params={"labelSelector": LABEL_SELECTOR})
        except ApiError as error:
            if error.status in (401, 403, 404):
                log.warning(
                    "cannot list DeviceClasses (%s): extended resources stay on device plugins "
                    "until the agent restarts",
                    error,
                )
                return
            log.info("listing DeviceClasses failed (%s); again in %.0f s", error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, poll)
            continue
        except (TransportError, OSError) as error:
            log.info("listing DeviceClasses failed (%s); again in %.0f s", error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, poll)
            continue
        delay = retry
        classes = {str(c["metadata"]["name"]): c for c in found}
        if seen(list(classes.values())):
            return
        if watch_refused:
            await asyncio.sleep(poll)
            continue
        try:
            stream = client.watch(
                path, version, timeout_seconds=WATCH_TIMEOUT, label_selector=LABEL_SELECTOR
            )
            async with contextlib.aclosing(watch_events(stream, "deviceclasses")) as events:
                async for kind, obj in events:
                    name = str((obj.get("metadata") or {}).get("name", ""))
                    if kind in ("ADDED", "MODIFIED"):
                        classes[name] = obj
                    elif kind == "DELETED":
                        classes.pop(name, None)
                    else:
                        continue
                    if seen(list(classes.values())):
                        return
        except WatchExpiredError:
            continue
        except ApiError as error:
            if error.status in (401, 403):
                watch_refused = True
                log.warning(
                    "cannot watch DeviceClasses (%s): listing them every %.0f s instead (the "
                    "agent's RBAC of deploy/base/rbac.yaml allows watch)",
                    error,
                    poll,
                )
            else:
                await asyncio.sleep(retry)
        except (TransportError, OSError):
            await asyncio.sleep(retry)


def path_inputs(node: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """What of a Node the path decision reads: its kubelet and runtime versions and its
    ``akri.sh/runtime-cdi`` label (an operator labels a node after the install; a kubelet or
    runtime upgrade changes the versions)."""
    if node is None:
        return ("", "", "")
    info = (node.get("status") or {}).get("nodeInfo") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    return (
        str(info.get("kubeletVersion") or ""),
        str(info.get("containerRuntimeVersion") or ""),
        str(labels.get(RUNTIME_CDI_LABEL, "")),
    )


def node_facts(node: Mapping[str, Any]) -> NodeFacts:
    """The facts of a Node object as :func:`read_node` reads them."""
    info = (node.get("status") or {}).get("nodeInfo") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    return NodeFacts(node, runtime_cdi(info.get("containerRuntimeVersion"), labels))


async def read_classes(client: KubeClient) -> list[Mapping[str, Any]] | None:
    """The DeviceClasses akri controller manages (None: they could not be read)."""
    try:
        found, _ = await client.list_all(
            resource_path("resource.k8s.io", "v1", "deviceclasses"),
            params={"labelSelector": LABEL_SELECTOR},
        )
    except (ApiError, TransportError, OSError) as error:
        log.warning("cannot list DeviceClasses (%s)", error)
        return None
    return list(found)


NodeChanged = Callable[[Mapping[str, Any]], Awaitable[None]]


async def follow_node(
    client: KubeClient,
    node: str,
    known: tuple[str, str, str],
    changed: NodeChanged,
    *,
    retry: float = 1.0,
    longest: float = 30.0,
) -> None:
    """Watch this node's Node object and await ``changed`` with it whenever
    :func:`path_inputs` differ from the last ones (``known``: those the start decided on), so
    that a label set after the install, or an upgraded runtime, takes effect without a
    restart. An RBAC without ``list``/``watch`` on nodes (an install older than this
    follower) is said once and ends it: the start's decision stays until a restart."""
    path = resource_path("", "v1", "nodes")
    selector = f"metadata.name={node}"
    delay = retry
    while True:
        try:
            found, version = await client.list_all(path, params={"fieldSelector": selector})
            for obj in found:
                if path_inputs(obj) != known:
                    known = path_inputs(obj)
                    await changed(obj)
            delay = retry
            stream = client.watch(
                path, version, timeout_seconds=WATCH_TIMEOUT, field_selector=selector
            )
            async with contextlib.aclosing(watch_events(stream, "nodes")) as events:
                async for kind, obj in events:
                    if kind in ("ADDED", "MODIFIED") and path_inputs(obj) != known:
                        known = path_inputs(obj)
                        await changed(obj)
        except WatchExpiredError:
            continue
        except ApiError as error:
            if error.status in (401, 403):
                log.warning(
                    "cannot watch Node %s (%s): a change of its akri.sh/runtime-cdi label or "
                    "of its runtime takes effect when the agent restarts (deploy/base/rbac.yaml "
                    "grants list and watch on nodes)",
                    node,
                    error,
                )
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, longest)
        except (TransportError, OSError):
            await asyncio.sleep(delay)
            delay = min(delay * 2, longest)


def path_line(node: str, decision: PathDecision) -> str:
    """The one line that says a node's path and why (log, Event)."""
    shown = (
        "DRA (ResourceSlices, prepared by the DRA driver; device plugins only for the "
        "devices it shares with nodes on device plugins)"
        if decision.path == DRA
        else "device plugins"
    )
    line = f"extended resources ({RESOURCE_PREFIX}*) on node {node}: {shown} — {decision.reason}"
    return f"{line}; WARNING: {decision.warning}" if decision.warning else line


def _ref(obj: Mapping[str, Any], *, namespace: bool = True) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    ref = {"name": meta.get("name"), "uid": meta.get("uid")}
    if namespace:
        ref["namespace"] = meta.get("namespace")
    return {k: v for k, v in ref.items() if v}


async def record_event(
    client: KubeClient,
    node: str,
    involved: Mapping[str, Any],
    reason: str,
    message: str,
    *,
    warning: bool,
) -> None:
    """One core/v1 Event about ``involved`` (a Node: in ``default``, as kubelet's), best
    effort: a failure is logged, never raised."""
    namespace = str(involved.get("namespace") or "default")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved.get('name')}.", "namespace": namespace},
        "involvedObject": dict(involved),
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": "akri-agent", "host": node},
        "reportingComponent": "akri.sh/agent",
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await client.create(resource_path("", "v1", "events", namespace), body)
    except ApiError as error:
        log.warning(
            "could not record event %s on %s %s: %s",
            reason,
            involved.get("kind"),
            involved.get("name"),
            error,
        )


class CdiNotice:
    """A ResourceClaim prepared on a node whose runtime is not known to inject CDI: its
    containers may get none of the device (the CDI spec is written; the runtime ignores it).
    Said once per agent run in the log, and once per claim as a Warning Event on the claim
    (``kubectl describe resourceclaim``), so an explicit claim is never served in silence."""

    def __init__(self, client: KubeClient, node: str, runtime: RuntimeCdi) -> None:
        self._client = client
        self._node = node
        self.runtime = runtime
        self._noticed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.logged = False

    def message(self) -> str:
        return (
            f"node {self._node}: {self.runtime.why}; the containers using this claim may get "
            "none of the device (env vars, device nodes, mounts: they are handed over through "
            "CDI). Use the device plugins' limits akri.sh/<name> on this node, or "
            f"{self.runtime.advice}"
        )

    def prepared(self, claim: PreparedClaim) -> None:
        """After a prepare (sync, from the DRA driver): warn for a claim not warned about,
        while the runtime is not known to inject CDI (``runtime`` follows the Node)."""
        if self.runtime.applies is True or claim.uid in self._noticed:
            return
        self._noticed[claim.uid] = None
        if len(self._noticed) > MAX_NOTICED_CLAIMS:
            self._noticed.popitem(last=False)
        if not self.logged:
            self.logged = True
            log.warning(
                "ResourceClaim %s/%s prepared on a runtime without known CDI support: %s "
                "(said once; each claim gets an Event)",
                claim.namespace,
                claim.name,
                self.message(),
            )
        involved = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "name": claim.name,
            "namespace": claim.namespace,
            "uid": claim.uid,
        }
        task = asyncio.get_running_loop().create_task(
            record_event(
                self._client,
                self._node,
                involved,
                "RuntimeWithoutCDI",
                self.message(),
                warning=True,
            )
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until the Events are sent (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class ObservedPaths(dict[str, str]):
    """Node -> path (its mode) as the scheduler sees it; ``runtimes`` holds each node's
    container runtime and whether it injects CDI, ``plugin_names`` the names a node on DRA
    serves through its device plugins (shown by ``akri status``; the JSON form stays node ->
    path)."""

    def __init__(
        self,
        paths: Mapping[str, str],
        runtimes: Mapping[str, RuntimeCdi],
        plugin_names: Mapping[str, list[str]] | None = None,
    ) -> None:
        super().__init__(paths)
        self.runtimes = dict(runtimes)
        self.plugin_names = dict(plugin_names or {})


def observed_paths(
    nodes: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]]
) -> ObservedPaths:
    """Which path each node is on as the scheduler sees it (``akri status``): what its local
    slices' label ``akri.sh/extended-resources`` says, with, on a node on DRA, the
    ``akri.sh/`` names its ``status.allocatable`` has above 0 (the devices it shares with
    device-plugin nodes: ``agent/node/dra/name_paths.py``); a node without the label (an
    older agent) serves device plugins where it has such a resource, else DRA where it
    publishes an ``akri.sh`` pool (``spec.nodeName``)."""
    slices = list(slices)
    modes = modes_of_slices(slices)
    publishing = {
        str((item.get("spec") or {})["nodeName"])
        for item in slices
        if (item.get("spec") or {}).get("driver") == "akri.sh"
        and (item.get("spec") or {}).get("nodeName")
    }
    paths: dict[str, str] = {}
    runtimes: dict[str, RuntimeCdi] = {}
    plugin_names: dict[str, list[str]] = {}
    for node in nodes:
        name = str(node["metadata"]["name"])
        info = (node.get("status") or {}).get("nodeInfo") or {}
        labels = (node.get("metadata") or {}).get("labels") or {}
        allocatable = ((node.get("status") or {}).get("allocatable")) or {}
        advertised = sorted(
            str(key)
            for key, value in allocatable.items()
            if str(key).startswith(RESOURCE_PREFIX) and str(value) not in ("0", "")
        )
        if name in modes:
            paths[name] = modes[name]
            if modes[name] == DRA and advertised:
                plugin_names[name] = advertised
        elif advertised:
            paths[name] = DEVICE_PLUGINS
        elif name in publishing:
            paths[name] = DRA
        if name in paths and info.get("containerRuntimeVersion"):
            runtimes[name] = runtime_cdi(info["containerRuntimeVersion"], labels)
    return ObservedPaths(paths, runtimes, plugin_names)


def paths_table(paths: Mapping[str, str] | None) -> str:
    """The ``akri status`` section: which path serves ``akri.sh/<name>`` limits per node, and
    (from :class:`ObservedPaths`) each node's runtime and whether it injects CDI."""
    if paths is None:
        return "Extended resources (akri.sh/<name> limits): Nodes or ResourceSlices not readable"
    if not paths:
        return "Extended resources (akri.sh/<name> limits): no node serves any yet"
    runtimes = paths.runtimes if isinstance(paths, ObservedPaths) else {}
    plugin_names = paths.plugin_names if isinstance(paths, ObservedPaths) else {}
    width = max(len("NODE"), *(len(n) for n in paths))
    shown = {
        node: "DRA (ResourceSlices)" if path == DRA else "device plugins"
        for node, path in paths.items()
    }
    for node, names in plugin_names.items():
        listed = ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
        shown[node] = f"DRA; device plugins for {listed}"
    if not runtimes:
        lines = [f"{'NODE':<{width}}  EXTENDED RESOURCES"]
        lines += [f"{node:<{width}}  {shown[node]}" for node in sorted(paths)]
        return "\n".join(lines)
    column = max(len("EXTENDED RESOURCES"), *(len(v) for v in shown.values()))
    lines = [f"{'NODE':<{width}}  {'EXTENDED RESOURCES':<{column}}  RUNTIME (CDI)"]
    for node in sorted(paths):
        runtime = runtimes.get(node)
        detail = f"{runtime.runtime} ({runtime.shown})" if runtime is not None else ""
        lines.append(f"{node:<{width}}  {shown[node]:<{column}}  {detail}".rstrip())
    return "\n".join(lines)
