"""The Node objects this agent needs: its own, and those of the nodes that decide who
publishes its shared pools (``nodes_to_follow`` in ``agent/core/model/resource_slices.py``: the
node just before it in each pool, back to the first that serves) — one ``fieldSelector
metadata.name=<node>`` list and watch each, never a watch of every Node (an agent pays for the
nodes that share its devices, not for the cluster: DESIGN.md invariant 11).

What they are for is whether each node *serves* (:func:`~agent.core.ledger.node_standing.
node_serves`: its Node exists, is Ready and is not tainted out-of-service):

* this node's own standing decides whether its agent may write itself into an Instance (the
  rule it shares with the controller, :mod:`agent.core.ledger.node_standing`): a node that
  does not serve may have its slots freed by the controller, and re-claiming them would only
  start a write loop;
* the other nodes' decide who publishes a shared pool: the first serving node whose Node
  serves (``agent/core/model/resource_slices.py``), so that a publisher whose node goes
  NotReady is replaced within moments.

A Node that cannot be read (an RBAC without ``list``/``watch`` on nodes, an older install), or
this node's own Node never seen (not registered yet), is *unknown*, and unknown counts as
serving: the agent then behaves as it did before it followed Nodes. Another node's Node that
is not there is deleted (an Instance lists it: it existed). Listeners are called when a node's
standing changes, not on every status heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from agent.core.kube import ApiError, KubeClient, TransportError, resource_path
from agent.core.ledger.node_standing import may_join, node_serves
from agent.core.store.informer import WatchExpiredError, watch_events

log = logging.getLogger(__name__)

WATCH_TIMEOUT = 290  # seconds a watch request lasts before it is renewed
RETRY = (1.0, 30.0)  # first and longest wait after a failed list or watch


class FollowedNodes:
    """Follows a changing set of Node objects by name (this node's always)."""

    def __init__(self, client: KubeClient, own: str, *, retry: tuple[float, float] = RETRY):
        self.client = client
        self.own = own
        self._retry = retry
        self._nodes: dict[str, dict[str, Any] | None] = {}  # known: name -> Node (None: gone)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.listeners: list[Callable[[], None]] = []
        self.refused = False  # the API refused reading Nodes (RBAC): every node unknown
        self.ready = asyncio.Event()  # this node's Node was read once (or cannot be)
        self._reported_own: bool | None = None

    def start(self) -> None:
        """Follow this node's Node (the others as :meth:`want` names them)."""
        self.want(())

    def want(self, names: Iterable[str]) -> None:
        """Follow exactly ``names`` besides this node's own Node."""
        if self.refused:
            return
        wanted = {self.own, *names}
        changed = False
        for name in [n for n in self._tasks if n not in wanted]:
            self._tasks.pop(name).cancel()
            changed |= not self.serves(name)
            self._nodes.pop(name, None)
        for name in sorted(wanted - self._tasks.keys()):
            self._tasks[name] = asyncio.create_task(self._follow(name), name=f"node-{name}")
        if changed:
            for listener in list(self.listeners):
                listener()

    def known(self, name: str) -> bool:
        return name in self._nodes

    def serves(self, name: str) -> bool:
        """Whether ``name`` serves (unknown: True)."""
        return not self.known(name) or node_serves(self._nodes[name])

    def may_join(self) -> bool:
        """Whether this node may write itself into Instances now (the shared rule)."""
        return may_join(self._nodes.get(self.own), self.known(self.own))

    def unserving(self) -> frozenset[str]:
        """The followed nodes known not to serve."""
        return frozenset(name for name in self._nodes if not self.serves(name))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _set(self, name: str, node: dict[str, Any] | None) -> None:
        before = self.serves(name) if self.known(name) else None
        self._nodes[name] = node
        after = self.serves(name)
        if name == self.own:
            self.ready.set()
            self._report_own(after, node)
        if before != after:
            for listener in list(self.listeners):
                listener()

    def _report_own(self, serves: bool, node: dict[str, Any] | None) -> None:
        if self._reported_own == serves:
            return
        first = self._reported_own is None
        self._reported_own = serves
        if not serves:
            state = "deleted" if node is None else "not Ready, or tainted out-of-service"
            log.warning(
                "this node's Node %s is %s: the agent keeps the slots it holds and writes "
                "itself into no Instance (no create, join or adoption) until it serves again "
                "(the controller may free its slots once Kubernetes says its pods are gone; "
                "docs/controller.md)",
                self.own,
                state,
            )
        elif not first:
            log.info("this node's Node %s is Ready again: joining Instances again", self.own)

    async def _follow(self, name: str) -> None:
        path = resource_path("", "v1", "nodes")
        selector = f"metadata.name={name}"
        first, longest = self._retry
        delay = first
        while True:
            try:
                found, version = await self.client.list_all(
                    path, params={"fieldSelector": selector}
                )
                if found or self.known(name) or name != self.own:
                    # another node an Instance lists whose Node is not there: deleted
                    self._set(name, found[0] if found else None)
                else:
                    self.ready.set()  # this node not registered (yet): unknown, as before
                delay = first
                stream = self.client.watch(
                    path, version, timeout_seconds=WATCH_TIMEOUT, field_selector=selector
                )
                async with contextlib.aclosing(watch_events(stream, "nodes")) as events:
                    async for kind, obj in events:
                        # a BOOKMARK carries only a resourceVersion: no conditions, no taints
                        # (read as a Node it would say a NotReady node serves again)
                        if kind in ("ADDED", "MODIFIED"):
                            self._set(name, obj)
                        elif kind == "DELETED":
                            self._set(name, None)
            except WatchExpiredError:
                continue
            except ApiError as error:
                if error.status in (401, 403):
                    self._refuse(error)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)
            except (TransportError, OSError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)

    def _refuse(self, error: ApiError) -> None:
        if self.refused:
            return
        self.refused = True
        log.warning(
            "cannot read Nodes (%s): this agent cannot tell whether its node or the nodes it "
            "shares devices with are Ready; it behaves as if they all were (deploy/base/"
            "rbac.yaml grants list and watch on nodes)",
            error,
        )
        self._nodes.clear()
        self.ready.set()
        for task in self._tasks.values():
            if task is not asyncio.current_task():
                task.cancel()
        for listener in list(self.listeners):
            listener()
