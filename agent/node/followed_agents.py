"""The agent Pods of the nodes that decide who publishes this agent's shared pools (its own
included; ``nodes_to_follow`` in ``agent/core/model/resource_slices.py``): whether each
node's agent is *there* (:mod:`agent.core.model.agent_pods`: a Pod of the agents' DaemonSet on
that node, not being deleted, Ready), so that a shared pool whose publisher's agent crashed,
was deleted or evicted, or is stuck (its readiness probe fails) while its Node stays Ready is
taken over by the next node within moments (issue 39.4).

The agents' Pods are found by the selector of this agent's own DaemonSet, read once (its own
Pod by ``POD_NAME``/``POD_NAMESPACE``, then the DaemonSet that owns it), and followed with one
list and watch per node — ``labelSelector=<that selector>`` and ``fieldSelector
spec.nodeName=<node>`` in the agent's namespace — for the same nodes as
:class:`~agent.node.followed_nodes.FollowedNodes`, never every Pod (DESIGN.md invariant 11).

Unknown counts as there, so that nothing changes where this cannot be read: not in a Pod (local
mode, a test harness), a Pod without a DaemonSet, an RBAC without ``list``/``watch`` on Pods
in the agent's namespace (an older install). Listeners are called when a node's agent comes or
goes, not on every status write of its Pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agent.core.kube import ApiError, KubeClient, TransportError, resource_path
from agent.core.model.agent_pods import agent_summary, agent_there, selector_string
from agent.core.store.informer import WatchExpiredError, watch_events
from agent.node.leaving import POD_NAME_ENV, POD_NAMESPACE_ENV, daemonset_owner

log = logging.getLogger(__name__)

WATCH_TIMEOUT = 290  # seconds a watch request lasts before it is renewed
RETRY = (1.0, 30.0)  # first and longest wait after a failed read
REFUSED = (401, 403)


class FollowedAgents:
    """Follows the agent Pods of a changing set of nodes (this node's always)."""

    def __init__(
        self,
        client: KubeClient,
        own: str,
        *,
        retry: tuple[float, float] = RETRY,
    ) -> None:
        self.client = client
        self.own = own
        self._environ: Mapping[str, str] = {}
        self._retry = retry
        self.selector: str | None = None  # the agents' labelSelector, once learned
        self.namespace: str | None = None
        self.unknown_why: str | None = None  # why every node's agent is unknown (there)
        self._wanted: set[str] = {own}
        self._pods: dict[str, dict[str, dict[str, Any]]] = {}  # known: node -> name -> Pod
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._resolving: asyncio.Task[None] | None = None
        self.listeners: list[Callable[[], None]] = []
        self.ready = asyncio.Event()  # this node's agent Pods were read once (or cannot be)

    def start(self, environ: Mapping[str, str]) -> None:
        """Learn the agents' selector (in a task) from ``environ``'s POD_NAME/POD_NAMESPACE,
        then follow the wanted nodes' agents."""
        if self._resolving is None:
            self._environ = environ
            self._resolving = asyncio.create_task(self._resolve(), name="agent-selector")

    def want(self, names: Iterable[str]) -> None:
        """Follow exactly ``names`` besides this node's own agent."""
        self._wanted = {self.own, *names}
        if self.selector is None:
            return
        changed = False
        for name in [n for n in self._tasks if n not in self._wanted]:
            self._tasks.pop(name).cancel()
            changed |= not self.there(name)
            self._pods.pop(name, None)
        for name in sorted(self._wanted - self._tasks.keys()):
            self._tasks[name] = asyncio.create_task(self._follow(name), name=f"agent-on-{name}")
        if changed:
            self._tell()

    def known(self, name: str) -> bool:
        return name in self._pods

    def there(self, name: str) -> bool:
        """Whether ``name``'s agent is there (unknown: True)."""
        pods = self._pods.get(name)
        return pods is None or agent_there(pods.values())

    def absent(self) -> frozenset[str]:
        """The followed nodes whose agent is known not to be there."""
        return frozenset(name for name in self._pods if not self.there(name))

    async def close(self) -> None:
        tasks = [t for t in (self._resolving, *self._tasks.values()) if t is not None]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the selector ----------------------------------------------------------------------
    async def _resolve(self) -> None:
        name = self._environ.get(POD_NAME_ENV)
        namespace = self._environ.get(POD_NAMESPACE_ENV)
        if not name or not namespace:
            self._unknown(f"not in a Pod (no {POD_NAME_ENV}/{POD_NAMESPACE_ENV})", quiet=True)
            return
        pod = await self._read(resource_path("", "v1", "pods", namespace, name), "its own Pod")
        if pod is None:
            return
        owner = daemonset_owner(pod)
        if owner is None:
            self._unknown(f"its Pod {namespace}/{name} belongs to no DaemonSet")
            return
        path = resource_path("apps", "v1", "daemonsets", namespace, owner)
        daemonset = await self._read(path, f"its DaemonSet {owner}")
        if daemonset is None:
            return
        selector = selector_string((daemonset.get("spec") or {}).get("selector"))
        if selector is None:
            self._unknown(f"its DaemonSet {owner} has no usable selector")
            return
        self.selector, self.namespace = selector, namespace
        log.info(
            "following the agents (Pods %s in %s) of the nodes this node shares devices with: "
            "a node whose agent is not Ready or gone publishes no shared pool",
            selector,
            namespace,
        )
        self.want(self._wanted)

    async def _read(self, path: str, what: str) -> dict[str, Any] | None:
        """GET ``path``, waiting out what waiting heals; None (and unknown) otherwise."""
        first, longest = self._retry
        delay = first
        while True:
            try:
                return await self.client.get(path, request_timeout=30)
            except ApiError as error:
                if error.status in (*REFUSED, 404):
                    self._unknown(f"cannot read {what} ({error.status})")
                    return None
            except (TransportError, OSError, TimeoutError):
                pass
            await asyncio.sleep(delay)
            delay = min(delay * 2, longest)

    def _unknown(self, why: str, *, quiet: bool = False) -> None:
        """Every node's agent is unknown (there) from now on: the agent behaves as before it
        followed agents."""
        first = self.unknown_why is None
        self.unknown_why = why
        self.ready.set()
        had = self.absent()
        self._pods.clear()
        for task in self._tasks.values():
            if task is not asyncio.current_task():
                task.cancel()
        self._tasks.clear()
        self.selector = None
        if first and not quiet:
            log.warning(
                "cannot follow the agents of the nodes this node shares devices with (%s): "
                "a shared pool is published as if every node's agent were Ready (deploy/base/"
                "rbac.yaml, Role akri-agent-self, grants get, list and watch on Pods in the "
                "agent's namespace)",
                why,
            )
        if had:
            self._tell()

    # -- the pods of one node ----------------------------------------------------------------
    async def _follow(self, node: str) -> None:
        assert self.selector is not None and self.namespace is not None
        path = resource_path("", "v1", "pods", self.namespace)
        labels, fields = self.selector, f"spec.nodeName={node}"
        first, longest = self._retry
        delay = first
        while True:
            try:
                found, version = await self.client.list_all(
                    path,
                    params={"labelSelector": labels, "fieldSelector": fields},
                    keep=agent_summary,
                )
                self._set(node, {str(p["metadata"]["name"]): p for p in found})
                delay = first
                stream = self.client.watch(
                    path,
                    version,
                    timeout_seconds=WATCH_TIMEOUT,
                    field_selector=fields,
                    label_selector=labels,
                )
                async with contextlib.aclosing(watch_events(stream, "agent pods")) as events:
                    async for kind, obj in events:
                        # a BOOKMARK carries only a resourceVersion: not a Pod
                        if kind not in ("ADDED", "MODIFIED", "DELETED"):
                            continue
                        pods = dict(self._pods.get(node) or {})
                        name = str((obj.get("metadata") or {}).get("name") or "")
                        if kind == "DELETED":
                            pods.pop(name, None)
                        else:
                            pods[name] = agent_summary(obj)
                        self._set(node, pods)
            except WatchExpiredError:
                continue
            except ApiError as error:
                if error.status in REFUSED:
                    self._unknown(f"listing the agent Pods refused ({error.status})")
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)
            except (TransportError, OSError, TimeoutError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)

    def _set(self, node: str, pods: dict[str, dict[str, Any]]) -> None:
        before = self.there(node)  # unknown counts as there: a first read there is no change
        self._pods[node] = pods
        if node == self.own:
            self.ready.set()
        after = self.there(node)
        if before == after:
            return
        if node == self.own:
            if not after:
                log.info(
                    "this agent's Pod is not Ready (starting, or its readiness probe fails) or "
                    "is being deleted: it publishes no shared pool until it is Ready"
                )
            else:
                log.info("this agent's Pod is Ready: it publishes the shared pools it is first for")
        elif not after:
            log.info(
                "the agent on node %s is not there (no Pod of it Ready and not being deleted): "
                "it publishes no shared pool and no shared pool selects it",
                node,
            )
        else:
            log.info("the agent on node %s is Ready again", node)
        self._tell()

    def _tell(self) -> None:
        for listener in list(self.listeners):
            listener()
