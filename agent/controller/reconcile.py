"""The controller's I/O: watch, decide (pure modules), write.

One pass (:meth:`Reconciler.reconcile_once`) looks at everything in the caches:

1. **nodes that do not serve** (NotReady, deleted, tainted out-of-service) keep their slots
   while their pods that may hold one exist (one rule for the controller and the agents,
   :mod:`agent.core.ledger.node_standing`; the pods of each such node are watched with a
   ``spec.nodeName`` field selector, so their deletion is seen at once). A node the rule
   frees (a *dead* node) is taken out of each Instance that lists it, or that
   holds a slot of it: each is rewritten by :func:`~agent.core.ledger.decisions.decide_evict_node`
   through resourceVersion-checked writes (the decision is re-made on every re-read, and
   dropped if the node turned Ready meanwhile); an Instance left without a node is deleted
   with a resourceVersion precondition; terminating Instances get the node's share of their
   ``akri.sh/slots`` finalizer released (:func:`~agent.core.ledger.finalizer.
   release_finalizer_share`); the dead node's stale shared ResourceSlices are deleted for
   their next publisher (:mod:`agent.controller.slices`);
2. **brokers** (:mod:`agent.controller.brokers`): Pods / Jobs per Instance;
3. **Services** (:mod:`agent.controller.services`) following Running broker Pods.

Passes run when any watched collection changes (coalesced), when a grace period ends, and
every ``resync_interval``. Creating an object that exists already (409) counts as done, and
every delete carries a uid precondition so that a newer object of the same name survives.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.controller import brokers, services, slices
from agent.controller.nodes import NodeWatch
from agent.controller.watched import HOLDS_SLOTS, Watched, broker_summary, pod_summary
from agent.core.kube import ApiError, KubeClient, TransportError, resource_path
from agent.core.ledger.decisions import Eviction, decide_evict_node, node_slots
from agent.core.ledger.finalizer import release_finalizer_share
from agent.core.model.agent_pods import AGENT_SELECTOR, agent_summary, agents_there
from agent.core.model.configuration import Configuration
from agent.core.model.device_usage import holder_node, parse_usage
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import ConflictError, InstanceStore, NotFoundError, StoreError
from agent.core.store.cas import DEFAULT_RETRY, STATS
from agent.core.store.informer import Obj, RawEvent

log = logging.getLogger("agent.controller")

COALESCE = 0.02  # seconds: a burst of watch events makes one pass
YIELD_EVERY = 100  # Instances planned between two turns of the event loop
EVICT = "evict"  # the akri_slot_writes_total operation of the dead-node writes
POD_WATCH_RETRY = 2.0  # seconds before listing a non-serving node's pods again after a failure
OBSERVED_MEMO = 50_000  # broker Pods/Jobs versions remembered (about 2.5 per cached Pod)


@dataclass(frozen=True)
class ReconcileSettings:
    """Timing of the reconciler (seconds)."""

    node_grace: float = 300.0
    free_slots_of_unready_nodes_after: float | None = None  # opt-in timer (None: off)
    pending_broker_grace: float = brokers.PENDING_GRACE
    failed_broker_grace: float = brokers.FAILED_GRACE
    resync_interval: float = 60.0
    namespace: str | None = None  # None: every namespace
    request_timeout: float = 30.0
    # the agents' Pods (every namespace): a shared pool none of whose nodes has its agent
    # there is deleted (None: not followed, every agent counts as there)
    agent_selector: str | None = AGENT_SELECTOR


@dataclass
class ControllerStats:
    """Counters for ``/metrics`` (docs/metrics.md)."""

    pods_created: collections.Counter[str] = field(default_factory=collections.Counter)
    pods_removed: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    jobs_created: collections.Counter[str] = field(default_factory=collections.Counter)
    services_created: collections.Counter[str] = field(default_factory=collections.Counter)
    services_deleted: collections.Counter[str] = field(default_factory=collections.Counter)
    brokers_waiting: dict[str, int] = field(default_factory=dict)  # configuration -> nodes
    nodes_cleaned: int = 0
    nodes_freed_by_timer: int = 0  # of them, freed by the opt-in timer while pods remained
    nodes_holding: int = 0  # nodes not serving whose slots are kept for their pods
    slots_freed: int = 0
    instances_deleted: int = 0
    slices_handed_over: int = 0
    passes: int = 0
    pass_failures: int = 0  # passes ended by an unexpected exception (a bug)
    write_errors: int = 0
    last_pass_seconds: float = 0.0


def _configuration_label(obj: Mapping[str, Any]) -> str:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return str(labels.get(brokers.CONFIGURATION_LABEL) or "")


def parse_time(text: Any) -> float:
    """An RFC 3339 timestamp (``creationTimestamp``) as epoch seconds (0 when absent/odd)."""
    if not isinstance(text, str) or not text:
        return 0.0
    try:
        # C-speed parsing: a pass reads the creationTimestamp of every broker Pod
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return 0.0
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def observed(obj: Mapping[str, Any]) -> brokers.ObservedPod:
    """A broker Pod (or Job) as the pure decisions see it."""
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = obj.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    if obj.get("kind") == "Job" or "active" in status or "succeeded" in status:
        phase = "Running" if status.get("active") else phase
    return brokers.ObservedPod(
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        node=str(labels.get(brokers.TARGET_NODE_LABEL) or ""),
        spec=str(labels.get(brokers.SPEC_LABEL) or ""),
        phase=phase,
        created=parse_time(meta.get("creationTimestamp")),
        deleting=bool(meta.get("deletionTimestamp")),
    )


def _holding(watched: Watched) -> int | None:
    """How many of the watched pods may hold slots; None once the watch has been lost (a
    pod bound meanwhile would not be seen: the rule keeps the slots until it is back)."""
    if watched.lost():
        return None
    return sum(1 for pod in watched.cache.values() if pod.get(HOLDS_SLOTS))


class Reconciler:
    """Watches and reconciles; :meth:`run` only while this replica leads."""

    def __init__(
        self,
        client: KubeClient,
        store: InstanceStore,
        settings: ReconcileSettings,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.store = store
        self.settings = settings
        self._monotonic = monotonic
        self._wall = wall
        self.stats = ControllerStats()
        self.nodes = NodeWatch(
            grace=settings.node_grace, free_after=settings.free_slots_of_unready_nodes_after
        )
        # the pods bound to each node that does not serve and that an Instance names
        self.node_pods: dict[str, Watched] = {}
        self._pod_watch_failed: dict[str, float] = {}  # node -> when its pods' list failed
        self._holding_reported: dict[str, int] = {}  # node -> pods count last logged
        self.wake = asyncio.Event()
        ns = settings.namespace
        self.node_cache = Watched(client, "nodes", resource_path("", "v1", "nodes"), self._on_node)
        self.pod_cache = Watched(
            client,
            "broker-pods",
            resource_path("", "v1", "pods", ns),
            self._on_change,
            label_selector=brokers.BROKER_SELECTOR,
            keep=broker_summary,
        )
        self.job_cache = Watched(
            client,
            "broker-jobs",
            resource_path("batch", "v1", "jobs", ns),
            self._on_change,
            label_selector=brokers.BROKER_SELECTOR,
            keep=broker_summary,
        )
        self.service_cache = Watched(
            client,
            "broker-services",
            resource_path("", "v1", "services", ns),
            self._on_change,
            label_selector=brokers.BROKER_SELECTOR,
        )
        self.slice_cache = Watched(
            client,
            "resourceslices",
            resource_path("resource.k8s.io", "v1", "resourceslices"),
            lambda _event: None,  # read when a node is cleaned, never a reason for a pass
        )
        # the agents' Pods: whether each node's agent is there (Ready, not being deleted)
        self.agent_cache: Watched | None = None
        if settings.agent_selector:
            self.agent_cache = Watched(
                client,
                "agent-pods",
                resource_path("", "v1", "pods"),
                self._on_change,
                label_selector=settings.agent_selector,
                keep=agent_summary,
            )
        self._observed: dict[tuple[Any, Any], brokers.ObservedPod] = {}
        self.synced = False
        self.dra_slices = True  # False when the cluster does not serve resource.k8s.io/v1
        self._subscriptions: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []

    # -- caches ----------------------------------------------------------------------------
    def observed(self, obj: Mapping[str, Any]) -> brokers.ObservedPod:
        """:func:`observed`, remembered per object version: a pass over 10,000 broker Pods
        reads each of them twice, and between two passes few of them change."""
        meta = obj.get("metadata") or {}
        key = (meta.get("uid"), meta.get("resourceVersion"))
        if not all(key):
            return observed(obj)  # no identity to remember it by
        found = self._observed.get(key)
        if found is None:
            if len(self._observed) > OBSERVED_MEMO:
                self._observed.clear()  # old versions pile up: start over (rare)
            found = self._observed[key] = observed(obj)
        return found

    def _on_node(self, event: RawEvent) -> None:
        name = str((event.obj.get("metadata") or {}).get("name") or "")
        self.nodes.observe(name, None if event.type == "DELETED" else event.obj, self._monotonic())
        self.wake.set()

    def _on_change(self, _event: RawEvent) -> None:
        self.wake.set()

    async def start(self) -> None:
        """Fill every cache (the store must be started) and keep them watched."""
        for cache in (self.node_cache, self.pod_cache, self.job_cache, self.service_cache):
            await cache.start()
        try:
            await self.slice_cache.start()
        except ApiError as error:
            if error.status != 404:
                raise
            self.dra_slices = False
            log.info("the cluster serves no resource.k8s.io/v1 ResourceSlices: no hand-over")
        if self.dra_slices and self.agent_cache is not None:
            try:
                await self.agent_cache.start()
            except ApiError as error:
                if error.status not in (401, 403):
                    raise
                log.warning(
                    "cannot list the agents' Pods (%s): a shared ResourceSlice whose nodes' "
                    "agents are all gone stays until their Nodes stop serving",
                    error,
                )
                self.agent_cache = None
        for subscribe in (self.store.subscribe_instances, self.store.subscribe_configurations):
            subscription = subscribe()
            self._subscriptions.append(subscription)
            self._tasks.append(asyncio.create_task(self._follow(subscription)))
        self.synced = True

    async def _follow(self, subscription: Any) -> None:
        async for _event in subscription:
            self.wake.set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for subscription in self._subscriptions:
            close = getattr(subscription, "close", None)
            if close is not None:
                close()
        for cache in (
            self.node_cache,
            self.pod_cache,
            self.job_cache,
            self.service_cache,
            self.slice_cache,
            *([self.agent_cache] if self.agent_cache is not None else []),
            *self.node_pods.values(),
        ):
            await cache.stop()
        self.node_pods.clear()

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Reconcile until cancelled (while leading)."""
        while True:
            self.wake.clear()
            started = self._monotonic()
            try:
                next_at = await self.reconcile_once()
            except (ApiError, TransportError, StoreError) as error:
                log.warning("reconcile pass failed (%s); retrying", error)
                next_at = self._monotonic() + 1.0 + random.random()
            except Exception:
                # a bug must not leave a leader that holds the Lease and does nothing
                self.stats.pass_failures += 1
                log.exception("reconcile pass failed; retrying in about 5 s")
                next_at = self._monotonic() + 4.0 + 2 * random.random()
            self.stats.passes += 1
            self.stats.last_pass_seconds = self._monotonic() - started
            timeout = self.settings.resync_interval
            if next_at is not None:
                timeout = min(timeout, max(0.05, next_at - self._monotonic()))
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation that
            # arrives as the event is set, and the leader's stop would then wait forever
            try:
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
            except TimeoutError:
                continue
            await asyncio.sleep(COALESCE)

    async def reconcile_once(self) -> float | None:
        """One pass; returns when (monotonic) the next grace period ends, if any."""
        deadlines: list[float] = []
        await self._clean_dead_nodes(deadlines)
        configurations = {c.key: c for c in self.store.configurations()}
        instances = self.store.list_cached()
        now = self._wall()
        await self._reconcile_brokers(configurations, instances, now, deadlines)
        await self._reconcile_services(configurations, instances)
        return min(deadlines, default=None)

    # -- dead nodes ------------------------------------------------------------------------
    async def _clean_dead_nodes(self, deadlines: list[float]) -> None:
        if not self.node_cache.informer.connected.is_set():
            # the Node watch is down (API server unreachable, relisting): what the cache says
            # of readiness may be stale, and a node seen NotReady may be back — decide nothing
            deadlines.append(self._monotonic() + 1.0)
            return
        instances = self.store.list_cached()
        listed: set[str] = set()
        for instance in instances:
            listed.update(instance.nodes)
            # a holder no longer listed (its value left behind) is a candidate too
            for value in set(instance.device_usage.values()):
                holder = holder_node(parse_usage(value)) if value else None
                if holder is not None:
                    listed.add(holder)
        await self._follow_unserving_pods(listed, deadlines)
        now = self._monotonic()
        dead = sorted(self.nodes.dead_among(listed, now))
        upcoming = self.nodes.next_deadline(listed, now)
        if upcoming is not None:
            deadlines.append(upcoming)
        self._report_holding(listed, now)
        for node in dead:
            await self.clean_node(node)
        await self._delete_unpublished_pools()

    async def _follow_unserving_pods(self, listed: set[str], deadlines: list[float]) -> None:
        """Watch the pods bound to each node an Instance names that does not serve
        (``fieldSelector spec.nodeName=<node>``): their count is the rule's evidence, and
        every deletion (the kubelet's, a force-delete, the pod garbage collector's after the
        Node is deleted or tainted out-of-service) wakes a pass at once. Watches of nodes
        that serve again, or that no Instance names, are stopped."""
        self.nodes.forget(listed)
        now = self._monotonic()
        wanted = set()
        for node in listed:
            self.nodes.note_unserving(node, now)
            if not self.nodes.serves(node):
                wanted.add(node)
        for node in [n for n in self.node_pods if n not in wanted]:
            await self.node_pods.pop(node).stop()
            self.nodes.set_pods(node, None)
        for node in [n for n in self._holding_reported if n not in wanted]:
            del self._holding_reported[node]
        for node in sorted(wanted):
            watched = self.node_pods.get(node)
            if watched is None:
                failed = self._pod_watch_failed.get(node)
                if failed is not None and now - failed < POD_WATCH_RETRY:
                    deadlines.append(failed + POD_WATCH_RETRY)
                    continue
                watched = Watched(
                    self.client,
                    f"pods-on-{node}",
                    resource_path("", "v1", "pods"),
                    self._on_change,
                    field_selector=f"spec.nodeName={node}",
                    request_timeout=self.settings.request_timeout,
                    keep=pod_summary,
                )
                self.node_pods[node] = watched  # stopped with the others if cancelled now
                try:
                    await watched.start()
                except (ApiError, TransportError) as error:
                    del self.node_pods[node]
                    self._pod_watch_failed[node] = self._monotonic()
                    deadlines.append(self._monotonic() + POD_WATCH_RETRY)
                    self.nodes.set_pods(node, None)
                    log.warning(
                        "cannot list the pods of node %s, which is not Ready (%s): its slots "
                        "are kept until they can be listed",
                        node,
                        error,
                    )
                    continue
                self._pod_watch_failed.pop(node, None)
            self.nodes.set_pods(node, _holding(watched))

    def _report_holding(self, listed: set[str], now: float) -> None:
        """Say once per episode (and when the count changes) that a node that does not serve
        keeps its slots for its pods, and what the operator can do."""
        holding = 0
        for node in sorted(listed):
            facts = self.nodes.facts(node, now)
            if facts.serves or facts.pods_holding == 0 or self.nodes.verdict(node, now).free:
                continue
            holding += 1
            if facts.pods_holding is None or self._holding_reported.get(node) == facts.pods_holding:
                continue
            self._holding_reported[node] = facts.pods_holding
            state = (
                "deleted"
                if facts.gone
                else "tainted out-of-service"
                if facts.out_of_service
                else "not Ready"
            )
            log.warning(
                "node %s is %s but %d of its pods that may use akri.sh devices still exist: "
                "its slots are kept until Kubernetes says those pods are gone (if the node is "
                "down for good: delete the Node, taint it node.kubernetes.io/out-of-service, "
                "or force-delete the pods; docs/controller.md)%s",
                node,
                state,
                facts.pods_holding,
                (
                    ""
                    if self.nodes.free_after is None
                    else f"; freed anyway after {self.nodes.free_after:g}s not Ready "
                    "(--free-slots-of-unready-nodes-after)"
                ),
            )  # fmt: skip
        self.stats.nodes_holding = holding

    async def clean_node(self, node: str) -> None:
        """Free everything ``node`` holds and take it out of every Instance.

        Live Instances: :func:`decide_evict_node` (an update, or a delete when no node is
        left). Terminating ones (deleted, waiting on the ``akri.sh/slots`` finalizer for their
        holders, issue 30) — including those this pass just deleted — get the dead node's
        share released by :func:`release_finalizer_share`, which drops the finalizer when
        nothing else is held, so a dead node never keeps a deleted Instance alive."""
        freed: dict[ObjectKey, int] = {}  # slots freed per Instance touched (each counted once)
        for instance in self.store.list_cached():
            if instance.deletion_timestamp is not None:
                continue  # the finalizer's rules below
            if node not in instance.nodes and not node_slots(instance, node):
                continue
            eviction = await self._evict(instance.key, node)
            if eviction is None:
                continue
            freed[instance.key] = len(eviction.freed)
        held_before = {
            instance.key: len(node_slots(instance, node))
            for instance in self.store.list_cached()
            if instance.deletion_timestamp is not None
        }
        if self.nodes.is_dead(node, self._monotonic()):
            for key in await release_finalizer_share(self.store, node):
                # an Instance the eviction just deleted: its slots were counted there
                freed.setdefault(key, held_before.get(key, 0))
        if not freed:
            return
        self.stats.nodes_cleaned += 1
        self.stats.slots_freed += sum(freed.values())
        verdict = self.nodes.verdict(node, self._monotonic())
        if verdict.forced:
            self.stats.nodes_freed_by_timer += 1
        log.warning(
            "node %s: %s: removed from %d Instance(s), %d slot(s) freed%s",
            node,
            verdict.why,
            len(freed),
            sum(freed.values()),
            (
                " (its containers may still be running: another node may now be given "
                "a device they use)"
                if verdict.forced
                else ""
            ),
        )  # fmt: skip
        await self._hand_over_slices(node)

    async def _evict(self, key: ObjectKey, node: str) -> Eviction | None:
        """decide_evict_node on the cached, then on every re-read version of ``key``: an
        update or (no node left) a delete, both resourceVersion-checked."""
        current = self.store.get_cached(key)
        for attempt in range(1, DEFAULT_RETRY.attempts + 1):
            if not self.nodes.is_dead(node, self._monotonic()):
                return None  # it came back: nothing of a live node is freed
            try:
                if current is None:
                    current = await self.store.get(key)
                eviction = decide_evict_node(current, node)
                if eviction is None:
                    return None
                if eviction.delete:
                    await self.store.delete(key, resource_version=current.resource_version)
                    self.stats.instances_deleted += 1
                else:
                    await self.store.update(eviction.instance)
                STATS.record(EVICT, writes=1)
            except NotFoundError:
                return None
            except ConflictError:
                STATS.record(EVICT, conflicts=1)
                await asyncio.sleep(DEFAULT_RETRY.delay(attempt))
                current = None
                continue
            await self._record_eviction(current, node, eviction)
            return eviction
        STATS.record(EVICT, gave_up=1)
        log.warning("instance %s: gave up removing dead node %s (conflicts)", key.name, node)
        return None

    async def _record_eviction(self, instance: Instance, node: str, eviction: Eviction) -> None:
        what = "deleted (no node left)" if eviction.delete else "updated"
        log.info(
            "instance %s: dead node %s removed, slots freed: %s; %s",
            instance.name,
            node,
            ", ".join(eviction.freed) or "none",
            what,
        )
        await self.store.record_instance_event(
            instance,
            "DeadNodeRemoved",
            f"node {node}: {self.nodes.verdict(node, self._monotonic()).why}: removed; "
            f"slots freed: {', '.join(eviction.freed) or 'none'}; Instance {what}",
        )

    def _pool_members(self) -> dict[str, set[str]]:
        return slices.pool_members(self.store.list_cached())

    def _agents_there(self) -> Callable[[str], bool]:
        """node -> whether its agent is there (unknown: True; the watch lost: all unknown,
        a Pod may have come back meanwhile)."""
        cache = self.agent_cache
        if cache is None or cache.lost():
            return lambda _node: True
        return agents_there(cache.cache.values())

    async def _delete_unpublished_pools(self) -> None:
        """Shared pools none of whose nodes publishes: each one's Node does not serve (the
        publisher's went NotReady and no other serves) or its agent is not there (crashed,
        deleted, evicted, not Ready). Nobody would rewrite them, so they go at once."""
        if not self.dra_slices:
            return
        members = self._pool_members()
        there = self._agents_there()
        for name, version in slices.unpublished_shared_slices(
            self.slice_cache.cache.values(),
            lambda node: self.nodes.serves(node) and there(node),
            lambda pool: members.get(pool, ()),
        ):
            if await self._delete_slice(name, version):
                log.warning(
                    "ResourceSlice %s: none of the nodes that may publish its pool (those "
                    "that see the device; every node only when none does) is Ready with its "
                    "agent Ready (Node NotReady, deleted or out-of-service, or agent Pod not "
                    "Ready, being deleted or gone): deleted, so that it offers nothing stale; "
                    "the first of them Ready again publishes it anew",
                    name,
                )

    async def _delete_slice(self, name: str, version: str) -> bool:
        """Delete a slice at ``version`` (False: gone, or rewritten meanwhile: theirs now)."""
        path = resource_path("resource.k8s.io", "v1", "resourceslices", None, name)
        body = {"kind": "DeleteOptions", "apiVersion": "v1",
                "preconditions": {"resourceVersion": version}}  # fmt: skip
        try:
            await self.client.delete(path, body)
        except ApiError as error:
            if error.status not in (404, 409):
                raise
            return False
        stored = self.slice_cache.cache.get(f"/{name}")  # cluster-scoped: no namespace
        if stored is not None:
            self.slice_cache.wrote(stored, deleted=True)  # not sent again before the watch
        self.stats.slices_handed_over += 1
        return True

    async def _hand_over_slices(self, node: str) -> None:
        if not self.dra_slices:
            return
        now = self._monotonic()
        members = self._pool_members()
        for name, version in slices.stale_shared_slices(
            self.slice_cache.cache.values(),
            node,
            lambda name: self.nodes.is_dead(name, now),
            lambda pool: members.get(pool, ()),
        ):
            if await self._delete_slice(name, version):
                log.info("ResourceSlice %s listed only dead nodes (%s): deleted", name, node)

    # -- brokers ---------------------------------------------------------------------------
    def _by_instance(
        self, cache: Watched, *, pinned: bool = False
    ) -> dict[tuple[str, str], list[Obj]]:
        """Cached brokers by (namespace, Instance); ``pinned``: only broker Pods this
        controller made from a brokerPodSpec (they name their node) — a broker Job's Pods
        carry the same ``controller``/``instance`` labels but belong to their Job."""
        grouped: dict[tuple[str, str], list[Obj]] = collections.defaultdict(list)
        for obj in cache.cache.values():
            meta = obj.get("metadata") or {}
            labels = meta.get("labels") or {}
            instance = labels.get(brokers.INSTANCE_LABEL)
            if instance and (not pinned or brokers.TARGET_NODE_LABEL in labels):
                grouped[(str(meta.get("namespace") or ""), str(instance))].append(obj)
        return grouped

    async def _reconcile_brokers(
        self,
        configurations: Mapping[ObjectKey, Configuration],
        instances: Iterable[Instance],
        now: float,
        deadlines: list[float],
    ) -> None:
        pods = self._by_instance(self.pod_cache, pinned=True)
        jobs = self._by_instance(self.job_cache)
        timing = brokers.Timing(
            self.settings.pending_broker_grace, self.settings.failed_broker_grace
        )
        ready = self.nodes.ready_nodes()
        waiting: collections.Counter[ObjectKey] = collections.Counter()
        seen: set[tuple[str, str]] = set()
        for index, instance in enumerate(instances):
            if index and not index % YIELD_EVERY:
                # let the health server and the watches in: a pass over 1,000 Instances with
                # nothing to write would otherwise hold the loop for its whole 0.1-0.2 s
                await asyncio.sleep(0)
            ident = (instance.namespace, instance.name)
            if instance.deletion_timestamp is not None:
                # terminating: its akri.sh/slots finalizer waits for the slots its brokers
                # hold, and owner GC deletes them only once the Instance is gone — they go
                # now, Configuration or not (issue 33.3), with the Instances that are gone
                continue
            seen.add(ident)
            configuration = configurations.get(instance.configuration_key)
            if configuration is None:
                continue  # Akri: no Configuration, nothing to do (owner GC follows)
            mine = [self.observed(obj) for obj in pods.get(ident, ())]
            plan = brokers.plan_pods(configuration, instance, mine, ready, now, timing)
            if plan.next_check is not None:
                deadlines.append(self._monotonic() + max(0.0, plan.next_check - now))
            if plan.waiting:
                waiting[configuration.key] += len(plan.waiting)
            for removal in plan.remove:
                await self._remove_pod(instance.namespace, configuration.name, removal)
            for pod in plan.create:
                await self._create(self.pod_cache, "pods", pod, configuration.name)
            job_plan = brokers.plan_job(
                configuration, instance, [observed(obj) for obj in jobs.get(ident, ())]
            )
            if job_plan.create is not None:
                await self._create(self.job_cache, "jobs", job_plan.create, configuration.name)
            elif job_plan.waiting:
                waiting[configuration.key] += 1
        # brokers of Instances that are gone (Akri deletes them; owner GC would too, later)
        # or terminating (nobody else would: see above)
        for (namespace, instance_name), objs in pods.items():
            if (namespace, instance_name) in seen:
                continue
            for obj in objs:
                orphan = observed(obj)
                if not orphan.deleting:
                    removal = brokers.Removal(orphan.name, orphan.uid, "InstanceGone")
                    await self._remove_pod(namespace, _configuration_label(obj), removal)
        for (namespace, instance_name), objs in jobs.items():
            if (namespace, instance_name) in seen:
                continue
            for obj in objs:
                orphan = observed(obj)
                if not orphan.deleting and await self._delete(
                    "jobs", namespace, orphan.name, orphan.uid
                ):
                    log.info("configuration %s/%s: broker Job %s removed (InstanceGone)",
                             namespace, _configuration_label(obj), orphan.name)  # fmt: skip
        by_name: collections.Counter[str] = collections.Counter()
        for key, number in waiting.items():
            by_name[key.name] += number
        self.stats.brokers_waiting = dict(by_name)
        for key, number in sorted(waiting.items()):
            configuration = configurations[key]
            # the same message at most every 5 minutes (the Event recorder's rule)
            await self.store.record_configuration_event(
                configuration,
                "BrokerWaitingForSlot",
                f"{number} broker(s) not started: their Instance has no free slot for them "
                f"(capacity {configuration.capacity}); they start when a slot is freed",
            )

    async def _create(self, cache: Watched, plural: str, obj: Obj, configuration: str) -> None:
        meta = obj["metadata"]
        group, version = ("batch", "v1") if plural == "jobs" else ("", "v1")
        path = resource_path(group, version, plural, meta["namespace"])
        try:
            created = await self.client.create(path, obj)
        except ApiError as error:
            if error.status == 409:
                return  # exists already (Akri: success)
            self.stats.write_errors += 1
            log.warning("cannot create %s %s/%s: %s", plural[:-1], meta["namespace"],
                        meta["name"], error)  # fmt: skip
            return
        cache.wrote(created)
        counter = {"pods": self.stats.pods_created, "jobs": self.stats.jobs_created,
                   "services": self.stats.services_created}[plural]  # fmt: skip
        counter[configuration] += 1
        log.info("configuration %s/%s: broker %s %s created", meta["namespace"], configuration,
                 obj["kind"], meta["name"])  # fmt: skip

    async def _delete(self, plural: str, namespace: str, name: str, uid: str) -> bool | None:
        """True: deleted; None: gone already (404); False: not deleted (a newer object of that
        name, or an error, logged)."""
        group = "batch" if plural == "jobs" else ""
        path = resource_path(group, "v1", plural, namespace, name)
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if uid:
            body["preconditions"] = {"uid": uid}
        if plural == "jobs":
            body["propagationPolicy"] = "Background"  # its pods go too
        try:
            await self.client.delete(path, body)
        except ApiError as error:
            if error.status == 404:
                return None  # gone already
            if error.status == 409:
                return False  # a newer object of that name
            self.stats.write_errors += 1
            log.warning("cannot delete %s %s/%s: %s", plural[:-1], namespace, name, error)
            return False
        return True

    async def _remove_pod(
        self, namespace: str, configuration: str, removal: brokers.Removal
    ) -> None:
        if await self._delete("pods", namespace, removal.name, removal.uid):
            self.stats.pods_removed[(configuration, removal.reason)] += 1
            log.info("configuration %s/%s: broker Pod %s removed (%s)", namespace, configuration,
                     removal.name, removal.reason)  # fmt: skip

    # -- services --------------------------------------------------------------------------
    async def _reconcile_services(
        self, configurations: Mapping[ObjectKey, Configuration], instances: Iterable[Instance]
    ) -> None:
        running_instances: set[tuple[str, str]] = set()
        running_configurations: set[tuple[str, str]] = set()
        for cache in (self.pod_cache,):
            for obj in cache.cache.values():
                meta = obj.get("metadata") or {}
                labels = meta.get("labels") or {}
                if self.observed(obj).running:
                    namespace = str(meta.get("namespace") or "")
                    running_instances.add((namespace, str(labels.get(brokers.INSTANCE_LABEL))))
                    running_configurations.add(
                        (namespace, str(labels.get(brokers.CONFIGURATION_LABEL)))
                    )
        wanted: list[dict[str, Any]] = []
        for instance in instances:
            configuration = configurations.get(instance.configuration_key)
            if configuration is None:
                continue
            if (instance.namespace, instance.name) not in running_instances:
                continue
            service = services.instance_service(configuration, instance)
            if service is not None:
                wanted.append(service)
        for key, configuration in configurations.items():
            if (key.namespace, key.name) not in running_configurations:
                continue
            service = services.configuration_service(configuration)
            if service is not None:
                wanted.append(service)
        owners = {c.uid for c in configurations.values() if c.uid}
        owners.update(i.uid for i in instances if i.uid)
        plan = services.plan_services(wanted, self.service_cache.cache, owners)
        for obj in plan.create:
            configuration_name = self._service_configuration(obj)
            await self._create(self.service_cache, "services", obj, configuration_name)
        for obj in plan.replace:
            meta = obj["metadata"]
            path = resource_path("", "v1", "services", meta["namespace"], meta["name"])
            try:
                stored = await self.client.replace(path, obj)
            except ApiError as error:
                if error.status not in (404, 409):
                    self.stats.write_errors += 1
                    log.warning("cannot update Service %s/%s: %s", meta["namespace"],
                                meta["name"], error)  # fmt: skip
                continue  # re-decided on the next pass
            self.service_cache.wrote(stored)
        for service_key, uid in plan.delete:
            namespace, name = service_key.split("/", 1)
            stored_obj = self.service_cache.cache.get(service_key) or {}
            deleted = await self._delete("services", namespace, name, uid)
            if stored_obj and deleted is not False:
                # gone: a pass before the watch's DELETED event must not send the DELETE
                # again (a 404 on a real cluster)
                self.service_cache.wrote(stored_obj, deleted=True)
            if deleted:
                self.stats.services_deleted[self._service_configuration(stored_obj)] += 1
                log.info("Service %s removed: no Running broker left", service_key)

    def _service_configuration(self, obj: Mapping[str, Any]) -> str:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if brokers.CONFIGURATION_LABEL in labels:
            return str(labels[brokers.CONFIGURATION_LABEL])
        namespace = str((obj.get("metadata") or {}).get("namespace") or "")
        for instance in self.store.instances_named(str(labels.get(brokers.INSTANCE_LABEL))):
            if instance.namespace == namespace:
                return instance.configuration_name
        return ""

    # -- views for metrics -----------------------------------------------------------------
    def broker_pod_counts(self) -> dict[tuple[str, str], int]:
        """Non-terminating broker Pods per (configuration, node): ``akri_broker_pod_count``."""
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for obj in self.pod_cache.cache.values():
            pod = self.observed(obj)
            if pod.deleting or not pod.node:
                continue  # terminating, or a broker Job's Pod
            labels = (obj.get("metadata") or {}).get("labels") or {}
            counts[(str(labels.get(brokers.CONFIGURATION_LABEL) or ""), pod.node)] += 1
        return dict(counts)

    def count_by_configuration(self, cache: Watched) -> dict[str, int]:
        counts: collections.Counter[str] = collections.Counter()
        for obj in cache.cache.values():
            counts[self._service_configuration(obj)] += 1
        return dict(counts)
