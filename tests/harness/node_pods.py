"""The pod side of one simulated node: what kubelet (and the scheduler, for pods pinned to the
node) does with the Pod objects of the API-server double.

:class:`NodePods` polls the double's Pods every ``interval`` seconds:

* a Pod bound to the node (``spec.nodeName``), or pinned to it by a required node affinity
  ``matchFields metadata.name In [<node>]`` (broker Pods: the scheduler binds it), is started:
  bound, given the finalizer :data:`KUBELET_FINALIZER` (graceful deletion: the API server
  keeps a deleted Pod until kubelet has ended it), its ``akri.sh/*`` resources served — on a
  node with a DRA kubelet (``dra``) as the scheduler decides per name: a name the Node's
  ``status.allocatable`` has above 0 by the device plugins (:meth:`KubeletDouble.admit_pod`),
  any other through the scheduler's KEP-5004 claim (:func:`schedule_extended_resources`, then
  :meth:`DraKubeletDouble.prepare_pod`); on a node without one by the device plugins — and its
  phase set to ``Running``. A Pod that cannot be served yet stays ``Pending`` and is tried
  again;
* on a node with both, kubelet's node status update: the device plugins' capacity and
  allocatable are written to the Node at every step (kubelet does it every 10 s: the window
  in which a fresh plugin's resource is not yet allocatable is not emulated);
* a deleted Pod (``deletionTimestamp``) is ended like kubelet ends it: ``on_terminate`` (the
  container's SIGTERM, for Pods the test runs itself: an agent, the controller) runs to its
  end, kubelet forgets the Pod's devices (pod-resources), its DRA claims are unprepared —
  while that fails (no driver registered) the Pod stays ``Terminating``, as on a real node —
  and then the finalizer goes and the API server removes the Pod.

Not emulated: containers, restarts, probes, the Pod's own grace period (a deleted Pod ends as
soon as its terminate hook and unprepare are done).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.apiserver.errors import ApiError
from tests.doubles.dra_kubelet import DraKubeletDouble, DraKubeletError
from tests.doubles.dra_scheduler import AllocationError, schedule_extended_resources
from tests.doubles.kubelet_double import KubeletDouble

log = logging.getLogger(__name__)
JSON = dict[str, Any]
KUBELET_FINALIZER = "tests.akri.sh/kubelet"
AKRI_RESOURCE = "akri.sh/"
RETRY = 0.5  # seconds between two tries to start a Pod kubelet could not start
Hook = Callable[[JSON], Coroutine[Any, Any, None]]


def pinned_node(pod: JSON) -> str | None:
    """The node ``pod`` runs on: ``spec.nodeName``, else the one its required node affinity
    names with ``matchFields metadata.name In [<node>]`` (what the scheduler would bind)."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("operator") == "In":
                values = field.get("values") or []
                if len(values) == 1:
                    return str(values[0])
    return None


def akri_requests(pod: JSON) -> list[tuple[str, dict[str, int]]]:
    """``(container, {akri.sh/<name>: count})`` of every container asking for a device."""
    found: list[tuple[str, dict[str, int]]] = []
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        resources = container.get("resources") or {}
        amounts = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        wanted = {k: int(str(v)) for k, v in amounts.items() if k.startswith(AKRI_RESOURCE)}
        if wanted:
            found.append((str(container.get("name")), wanted))
    return found


class NodePods:
    """kubelet's handling of one node's Pods (see the module docstring)."""

    def __init__(
        self,
        api: ApiServerDouble,
        node: str,
        *,
        device_plugins: KubeletDouble | None = None,
        dra: DraKubeletDouble | None = None,
        interval: float = 0.05,
    ) -> None:
        self.api = api
        self.node = node
        self.device_plugins = device_plugins
        self.dra = dra
        self.interval = interval
        self.hooks: dict[tuple[str, str], Hook] = {}  # (namespace, name) -> on terminate
        self.running: dict[str, JSON] = {}  # uid -> the Pod as started
        self.prepared: set[str] = set()  # uids of Pods whose DRA claims kubelet prepared
        self.ended: list[str] = []  # namespace/name of every Pod ended here
        self._terminating: dict[str, asyncio.Task[None]] = {}
        self._unprepare: dict[str, list[tuple[str, str, str]]] = {}  # pod uid -> its claims
        self._retry_at: dict[str, float] = {}  # pod uid -> when to try starting it again
        self._task: asyncio.Task[None] | None = None

    def on_terminate(self, namespace: str, name: str, hook: Hook) -> None:
        """Run ``hook`` (the container's SIGTERM and its exit) when that Pod is deleted."""
        self.hooks[(namespace, name)] = hook

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pods-{self.node}")

    async def stop(self) -> None:
        for task in [self._task, *self._terminating.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = None

    def terminating(self) -> list[str]:
        """``namespace/name`` of this node's Pods deleted but not ended (stuck, or ending)."""
        return sorted(
            f"{p['metadata'].get('namespace')}/{p['metadata']['name']}"
            for p in self.api.list("pods")
            if pinned_node(p) == self.node and p["metadata"].get("deletionTimestamp")
        )

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:
                log.exception("node %s: pod step failed", self.node)
            await asyncio.sleep(self.interval)

    async def step(self) -> None:
        if self.dra is not None and self.device_plugins is not None:
            self.post_node_status()
        for pod in self.api.list("pods"):
            if pinned_node(pod) != self.node:
                continue
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                if KUBELET_FINALIZER in (meta.get("finalizers") or []):
                    await self._end(pod)
            elif meta["uid"] not in self.running:
                await self._start(pod)

    def post_node_status(self) -> None:
        """kubelet's node status update of the device plugins' resources (the Node's other
        status is kept; a write that meets a newer Node is tried at the next step)."""
        post_node_status(self.api, self.node, self.device_plugins)

    def _write(self, pod: JSON, subresource: str | None = None) -> JSON | None:
        """A resourceVersion-checked write of ``pod`` (None: it changed or went meanwhile)."""
        rt = self.api.resource("pods")
        meta = pod["metadata"]
        try:
            return self.api.store.update(
                rt, rt.preferred_version, meta["namespace"], meta["name"], pod,
                subresource=subresource,
            )  # fmt: skip
        except ApiError as error:
            if error.code in (404, 409):
                return None
            raise

    async def _start(self, pod: JSON) -> None:
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        if KUBELET_FINALIZER not in (meta.get("finalizers") or []):
            pod["spec"]["nodeName"] = self.node  # the scheduler's binding
            meta["finalizers"] = [*(meta.get("finalizers") or []), KUBELET_FINALIZER]
            written = self._write(pod)
            if written is None:
                return
            pod = written
        loop = asyncio.get_running_loop()
        if loop.time() < self._retry_at.get(uid, 0.0):
            return
        self._retry_at[uid] = loop.time() + RETRY
        phase = "Running"
        wanted = akri_requests(pod)
        if wanted and self.dra is not None:
            status = (pod.get("status") or {}).get("extendedResourceClaimStatus")
            if not status:
                try:
                    claim = schedule_extended_resources(self.api, namespace, name, self.node)
                except AllocationError as error:
                    log.info("pod %s/%s is not scheduled: %s", namespace, name, error)
                    return  # tried again later
                if claim is not None:
                    pod = self.api.get("pods", name, namespace) or pod
                    status = (pod.get("status") or {}).get("extendedResourceClaimStatus")
            if status:
                try:
                    # kubelet retries a failed prepare of the same claim; the pod stays Pending
                    await self.dra.prepare_pod(pod)
                except DraKubeletError as error:
                    log.info("pod %s/%s stays Pending: %s", namespace, name, error)
                    return
                self.prepared.add(uid)
            # the names the scheduler left to the device plugins (allocatable above 0)
            through_dra = {
                (m.get("containerName"), m.get("resourceName"))
                for m in (status or {}).get("requestMappings") or []
            }
            wanted = [
                (container, left)
                for container, amounts in wanted
                if (left := {r: n for r, n in amounts.items() if (container, r) not in through_dra})
            ]
        if wanted and self.device_plugins is not None:
            plugins = self.device_plugins
            counts: dict[str, int] = {}
            for _, amounts in wanted:
                for resource, count in amounts.items():
                    counts[resource] = counts.get(resource, 0) + count
            if any(plugins.allocatable(r) < count for r, count in counts.items()):
                return  # the scheduler's fit check: not (yet) in the node's allocatable
            admitted = await plugins.admit_pod(namespace, name, wanted)
            if admitted.error is not None:
                phase = "Failed"  # kubelet's UnexpectedAdmissionError
                await self.device_plugins.delete_pod(namespace, name)
        current = self.api.get("pods", name, namespace)
        if current is None:
            return
        current["status"] = {**(current.get("status") or {}), "phase": phase}
        if self._write(current, "status") is not None:
            self.running[uid] = current

    async def _end(self, pod: JSON) -> None:
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        hook = self.hooks.get((namespace, name))
        if hook is not None:
            task = self._terminating.get(uid)
            if task is None:
                self._terminating[uid] = asyncio.create_task(hook(pod))
                return
            if not task.done():
                return  # still stopping
        if self.device_plugins is not None:
            await self.device_plugins.delete_pod(namespace, name)
        referenced = self.dra is not None and any(uid in i.pods for i in self.dra.claims.values())
        if self.dra is not None and (uid in self.prepared or referenced):
            # kubelet keeps the claims a failed unprepare left and retries them (the double's
            # remove_pod forgets the pod's references at the first try)
            refs = self._unprepare.get(uid)
            try:
                if refs is None:
                    refs = [i.ref for i in self.dra.claims.values() if i.pods == {uid}]
                    self._unprepare[uid] = refs
                    await self.dra.remove_pod(uid)
                else:
                    await self.dra.unprepare(refs)
            except DraKubeletError as error:
                log.info("pod %s/%s stays Terminating: %s", namespace, name, error)
                return
            self.prepared.discard(uid)
            self._unprepare.pop(uid, None)
        meta["finalizers"] = [f for f in meta.get("finalizers") or [] if f != KUBELET_FINALIZER]
        if self._write(pod) is not None:
            self.running.pop(uid, None)
            self.ended.append(f"{namespace}/{name}")


def post_node_status(api: ApiServerDouble, node: str, plugins: KubeletDouble | None) -> None:
    """What kubelet's node status update writes of the device plugins: each resource's
    capacity and allocatable on the Node (``akri.sh/*`` only; the rest of its status kept). A
    resource whose plugin went away stays with allocatable 0 (its capacity kept), as kubelet
    keeps it (``markResourceUnhealthy``)."""
    found = api.get("nodes", node)
    if found is None or plugins is None:
        return
    status = dict(found.get("status") or {})
    before = (status.get("capacity") or {}, status.get("allocatable") or {})
    capacity, allocatable = (
        {k: v for k, v in old.items() if not k.startswith(AKRI_RESOURCE)} for old in before
    )
    for resource in plugins.resources():
        capacity[resource] = str(plugins.capacity(resource))
        allocatable[resource] = str(plugins.allocatable(resource))
    if (capacity, allocatable) == before:
        return
    status["capacity"], status["allocatable"] = capacity, allocatable
    with contextlib.suppress(ApiError):  # a newer Node: the next step writes it
        api.store.update(
            api.resource("nodes"), "v1", None, node, {**found, "status": status},
            subresource="status",
        )  # fmt: skip
