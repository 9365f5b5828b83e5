"""Publishes this node's pools as ``resource.k8s.io/v1`` ResourceSlices and keeps them right.

* follows its own slices with an informer (``fieldSelector spec.driver=akri.sh``) and re-syncs
  on every change, so slices kubelet deletes (at its start, or 30 s after we disconnect) are
  re-created at once;
* pool rules: when a pool's content changes every slice of it gets ``generation + 1`` and the
  current ``resourceSliceCount``; ≤ 128 devices per slice; an empty pool keeps one empty slice;
* a shared Instance's pool has one publisher, decided from the Instance
  (``agent/core/model/resource_slices.py``: the first of its serving nodes that see the device,
  by the nodes' own offline marks; this node's own view comes from ``offline``, damped, which
  takes it out before its mark lands) and from the Nodes of those nodes (``unready``: a node
  whose Node is NotReady, deleted or out-of-service neither publishes nor is selected, so
  another node takes the pool over within moments of the publisher's node going NotReady).
  Its slices have fixed names (``akri.sh-<pool>-<index>``), so two nodes that both create the
  pool at once make one slice, not two; a new publisher adopts the existing slices (updates
  them in place with a higher generation), so the scheduler never sees the pool missing or
  twice. Each write
  records the Instance version it was decided on; a node whose view of the Instance is older
  than the slice's leaves it alone (it is behind, not the publisher);
* slices of shared pools whose Instance is gone are deleted by the first node their
  nodeSelector lists, or by any listed node once :data:`ORPHAN_GRACE` has passed — gone on
  the API server's word (``instance_exists``): this node's view holds only the Instances
  that list it, and one it has just left (the next publisher rewrites the pool in place) is
  not gone;
* every write is a create, or a PUT/DELETE with the resourceVersion it was decided on. A
  conflict (409: someone else wrote the slice first) re-reads that slice and leaves the pool
  alone for a jittered, doubling pause (:data:`CONFLICT_BACKOFF`) before deciding again;
* after each write the returned spec is compared with what was sent: fields the API server
  dropped (feature gate off, validation differences) are reported once, loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

from agent.core.kube import ApiError, KubeClient, resource_path
from agent.core.model.instance import Instance
from agent.core.model.resource_slices import (
    INSTANCE_UID_ANNOTATION,
    INSTANCE_VERSION_ANNOTATION,
    nodes_to_follow,
)
from agent.core.store.informer import Informer, Obj, RawEvent, compare_versions, watch_events
from agent.node.dra.name_paths import modes_of_slices
from agent.node.dra.slices import (
    DRAINING,
    DRIVER,
    HOSTNAME_LABEL,
    PATH_LABEL,
    USABLE,
    DeviceOptions,
    OptionsOf,
    Pool,
    SlotState,
    desired_pools,
    extended_eligibility,
    instance_devices,
    same_slice_content,
    selected_nodes,
    without_taint_times,
)

log = logging.getLogger(__name__)
# a shared Instance is a pool of its own: 1,000 of them compared in one go held the loop
YIELD_EVERY_POOLS = 64

GROUP = "resource.k8s.io"
VERSION = "v1"
PLURAL = "resourceslices"
POOL_LABEL = "akri.sh/pool"
WATCH_TIMEOUT = 290
# a slice holds up to 128 devices with their attributes (~400 KB; etcd allows 1.5 MiB): a
# page of client-go's 500 could pass the client's 64 MiB body limit, 32 cannot
SLICE_PAGE_SIZE = 32
# answers that waiting will not change: forbidden (RBAC, the slice admission policy), invalid
REFUSED = frozenset({400, 403, 422})
MAX_REPORTED_REFUSALS = 1024  # (pool, status, reason) already logged; forgotten when full
# after a conflict on a pool: seconds before it is decided again (the first pause, doubling
# per conflict in a row, up to the last), jittered down to half so nodes drift apart
CONFLICT_BACKOFF = (0.05, 5.0)
# a shared slice whose Instance is gone: deleted at once by the first node it lists, by the
# others (that node may be gone too) once it has been an orphan this long
ORPHAN_GRACE = 10.0
# a shared pool whose Instance this node's view no longer shows but the API server says exists
# (this node left it; its next publisher rewrites the pool without it): asked again this late
ALIVE_RECHECK = 60.0
MAX_SLICE_NAME = 253


class SliceConflict(Exception):
    """A slice write met a newer version (409): the pool is decided again later."""


def shared_slice_name(pool: str, index: int) -> str:
    """The fixed name of slice ``index`` of a shared pool: ``akri.sh-<pool>-<index>`` (a pool
    name is an Instance name, a DNS subdomain), shortened with a digest of the pool name when
    too long. Fixed, so that nodes creating one pool at once collide on the name (one wins,
    the others get 409 AlreadyExists) instead of making two slices of one pool."""
    name = f"{DRIVER}-{pool}-{index}"
    if len(name) <= MAX_SLICE_NAME:
        return name
    digest = hashlib.sha256(pool.encode()).hexdigest()[:10]
    keep = MAX_SLICE_NAME - len(f"{DRIVER}--{digest}-{index}")
    return f"{DRIVER}-{pool[:keep].rstrip('.-')}-{digest}-{index}"


def _label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.")
    return value or "pool"


def _pool_of(obj: Obj) -> str:
    return str(((obj.get("spec") or {}).get("pool") or {}).get("name") or "")


def _has_labels(obj: Obj, labels: Mapping[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


# of another node's local slice, all this agent reads: its identity (for the informer), its
# labels (its node's mode: name_paths.modes_of_slices) and spec.driver/nodeName/pool (sync's
# grouping by pool, which skips it); its devices (most of its size) are never read
FOREIGN_LOCAL_METADATA = ("name", "namespace", "resourceVersion", "uid", "labels")
FOREIGN_LOCAL_SPEC = ("driver", "nodeName", "pool")


def cached_part(obj: Obj, node: str) -> Obj:
    """What the publisher's cache keeps of slice ``obj`` on ``node``: the whole of this node's
    local slices and of the shared ones (no ``spec.nodeName``), which it compares and rewrites
    with their resourceVersion; of another node's local slice only what it reads
    (:data:`FOREIGN_LOCAL_METADATA`, :data:`FOREIGN_LOCAL_SPEC`), so that a cluster of many
    nodes costs each agent a small entry per node, not that node's devices (issue 41)."""
    spec = obj.get("spec") or {}
    owner = spec.get("nodeName")
    if not owner or owner == node:
        return obj
    meta = obj.get("metadata") or {}
    return {
        "metadata": {key: meta[key] for key in FOREIGN_LOCAL_METADATA if key in meta},
        "spec": {key: spec[key] for key in FOREIGN_LOCAL_SPEC if key in spec},
    }


def _generation(obj: Obj) -> int:
    return int(((obj.get("spec") or {}).get("pool") or {}).get("generation") or 0)


def _selected_nodes(obj: Obj) -> set[str]:
    """Node names a shared slice's nodeSelector lists (either stored form)."""
    return selected_nodes(obj.get("spec") or {})


def written_from(obj: Obj) -> tuple[str, str]:
    """The Instance (uid, resourceVersion) a shared slice was written from; empty strings for
    a slice written before slices recorded it."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return (
        str(annotations.get(INSTANCE_UID_ANNOTATION) or ""),
        str(annotations.get(INSTANCE_VERSION_ANNOTATION) or ""),
    )


def behind(existing: Sequence[Obj], pool: Pool) -> bool:
    """Whether a slice of the shared ``pool`` was written from a newer version of its Instance
    than this node's view: the node's cache is behind (it will catch up through the watch), so
    it must not write the pool now, whoever it believes the publisher is. A slice of another
    Instance of the name (another uid), or one that recorded nothing, is not newer."""
    if pool.instance_uid is None or pool.instance_version is None:
        return False
    for obj in existing:
        uid, version = written_from(obj)
        if uid == pool.instance_uid and compare_versions(version, pool.instance_version) == 1:
            return True
    return False


def _unchanged(existing: list[Obj], specs: list[dict[str, Any]]) -> bool:
    """Whether the pool's slices already hold exactly ``specs`` (in any order: slices get
    generated names, so their name order says nothing), all at one generation."""
    if len(existing) != len(specs) or len({_generation(o) for o in existing}) > 1:
        return False
    unmatched = [o.get("spec") or {} for o in existing]
    if any(
        (stored.get("pool") or {}).get("resourceSliceCount") != len(specs) for stored in unmatched
    ):
        return False
    for spec in specs:
        match = next((i for i, s in enumerate(unmatched) if same_slice_content(s, spec)), None)
        if match is None:
            return False
        unmatched.pop(match)
    return True


class SlicePublisher:
    """Keeps this node's ResourceSlices equal to :func:`desired_pools`."""

    def __init__(
        self,
        api_client: KubeClient,
        node: str,
        list_instances: Callable[[], list[Instance]],
        offline: Callable[[], Collection[str]],
        *,
        debounce: float = 0.02,
        options_of: OptionsOf | None = None,
        instance_exists: Callable[[str], Awaitable[bool]] | None = None,
        unready: Callable[[], Collection[str]] = frozenset,
        follow_nodes: Callable[[Collection[str]], None] = lambda _nodes: None,
    ) -> None:
        self._client = api_client
        # asks the API server whether an Instance this node's view no longer shows still
        # exists (None: the view is complete); and until when each was last found to
        self._instance_exists = instance_exists
        self._alive_until: dict[str, float] = {}
        # the nodes whose Node does not serve (NotReady, deleted, out-of-service): no shared
        # pool selects them or is published by them; ``follow_nodes`` is told which nodes
        # tell whether it publishes its shared pools (resource_slices.nodes_to_follow: the
        # node before it in each pool, back to the first that serves; agent/node/
        # followed_nodes.py and followed_agents.py watch those)
        self._unready = unready
        self._follow_nodes = follow_nodes
        self._options_of = options_of
        # cleared when the API server drops the fields (its feature gate is off): consumable
        # capacity falls back to one device per slot, taints to withdrawing offline slots
        self.consumable_supported = True
        self.taints_supported = True
        self.binds_to_node_supported = True
        # the path this node serves akri.sh/* through ("dra" / "device-plugins"; None: not
        # decided): labels its local slices, and decides with the other nodes' labels which
        # slots may serve extended resources (slices.extended_eligibility)
        self.extended_path: str | None = None
        self.node = node
        self._list_instances = list_instances
        self._offline = offline
        self._debounce = debounce
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._informer = Informer(
            "resourceslices",
            self._list,
            self._watch,
            self._on_event,
            keep=lambda obj: cached_part(obj, node),
        )
        self._node_uid: str | None = None
        self._reported_drops: set[str] = set()
        self._reported_refusals: set[tuple[str, int, str]] = set()
        self.refused_writes = 0  # pool writes the API server refused (403/400/422), skipped
        self.conflicts = 0  # slice writes that met a newer version (409)
        self.deferred = 0  # pool syncs left to a node with a newer view of the Instance
        # per pool after conflicts: (conflicts in a row, monotonic time it may be written again)
        self._backoff: dict[str, tuple[int, float]] = {}
        # shared pools whose Instance is gone: monotonic time this node first saw it so
        self._orphaned_since: dict[str, float] = {}
        # per Instance: (resourceVersion, state) -> its slice devices; a sync with 1000
        # Instances otherwise rebuilds 4000 attribute maps for every Instance event
        self._devices: dict[str, tuple[tuple[str, SlotState], Sequence[dict[str, Any]]]] = {}
        self.writes = 0
        self.syncs = 0
        self.synced = asyncio.Event()
        # called (sync) when a node's mode changed: this node's, or a label of another's
        self.paths_listeners: list[Callable[[], None]] = []
        self._last_paths: dict[str, str] | None = None
        # another node's local slice name -> its mode label as last seen (_foreign_devices_only)
        self._foreign_modes: dict[str, str | None] = {}
        self._loaded = False

    async def start(self) -> None:
        """First list of our slices (:meth:`load`, unless done), then follow them and publish."""
        await self.load()
        self._tasks = [
            asyncio.create_task(self._informer.run(), name="watch-resourceslices"),
            asyncio.create_task(self._loop(), name="publish-resourceslices"),
        ]
        self.trigger()

    async def load(self) -> None:
        """First list of the ``akri.sh`` slices (waiting out 429, 5xx and no answer like the
        store's first lists): every node's mode is known from then on (:meth:`node_paths`).
        Raises :class:`StoreError` for what waiting cannot heal: 401/403, or a cluster that
        does not serve ``resource.k8s.io/v1``."""
        from agent.core.store.kubernetes import first_list

        if self._loaded:
            return

        await first_list(
            self._informer,
            PLURAL,
            0.0,  # an API group missing now will not appear by waiting
            group=GROUP,
            not_served=(
                f"{PLURAL}.{GROUP} ({GROUP}/{VERSION}) is not served: DRA is unavailable on "
                "this cluster (it needs Kubernetes 1.34 or later); run the agent with "
                "--no-dra (AKRI_DRA=false) to use device plugins only"
            ),
        )
        self._node_uid = await self._lookup_node_uid()
        self._loaded = True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def trigger(self) -> None:
        """Something changed (Instances, offline set, slices): re-sync soon."""
        self._wake.set()

    # -- informer plumbing ---------------------------------------------------------------
    async def _list(self) -> tuple[list[Obj], str]:
        return await self._client.list_all(
            resource_path(GROUP, VERSION, PLURAL),
            params={"fieldSelector": f"spec.driver={DRIVER}"},
            page_size=SLICE_PAGE_SIZE,
            request_timeout=30,
        )

    def _watch(self, version: str) -> AsyncGenerator[tuple[str, Obj], None]:
        stream = self._client.watch(
            resource_path(GROUP, VERSION, PLURAL),
            version,
            timeout_seconds=WATCH_TIMEOUT,
            field_selector=f"spec.driver={DRIVER}",
        )
        return watch_events(stream, PLURAL)

    def _on_event(self, event: RawEvent) -> None:
        if self._foreign_devices_only(event):
            return
        self.trigger()

    def _foreign_devices_only(self, event: RawEvent) -> bool:
        """Whether ``event`` changed another node's local slice but not that node's mode
        label: nothing this node publishes reads the rest of it (:func:`cached_part`), so it
        is no reason for a sync — which walks every slice of the cluster: at 50 such writes
        a second across the cluster, 21 % of a core for nothing (issue 41)."""
        spec = event.obj.get("spec") or {}
        owner = spec.get("nodeName")
        if not owner or owner == self.node:
            return False
        meta = event.obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if event.type == "DELETED":
            self._foreign_modes.pop(name, None)
            return False  # that node's mode may be gone with it
        mode = (meta.get("labels") or {}).get(PATH_LABEL)
        known = name in self._foreign_modes and self._foreign_modes[name] == mode
        self._foreign_modes[name] = mode
        return known

    async def _lookup_node_uid(self) -> str | None:
        """The Node's uid (for the slices' owner reference, so they go with the Node), or
        None: slices are then published without an owner, which only delays their cleanup."""
        try:
            node = await self._client.get(resource_path("", "v1", "nodes", name=self.node))
            hostname = (node["metadata"].get("labels") or {}).get(HOSTNAME_LABEL)
            if hostname is not None and hostname != self.node:
                # shared pools select nodes by this label, listing node names
                log.warning(
                    "Node %s has label %s=%s: shared devices published through DRA are not "
                    "schedulable on it (their pools select %s = node name)",
                    self.node,
                    HOSTNAME_LABEL,
                    hostname,
                    HOSTNAME_LABEL,
                )
            return str(node["metadata"]["uid"])
        except (ApiError, KeyError, TypeError) as error:
            log.warning(
                "cannot read Node %s (%s: %s): ResourceSlices are published without an "
                "owner reference",
                self.node,
                type(error).__name__,
                error,
            )
            return None

    # -- syncing ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        backoff = 0.5
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._debounce)
            self._wake.clear()
            try:
                await self.sync()
                backoff = 0.5
                self.synced.set()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning(
                    "publishing ResourceSlices failed (%s: %s); retrying in %.1fs",
                    type(error).__name__,
                    error,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                self._wake.set()

    async def sync(self) -> None:
        """Make every pool this node publishes match the cache; delete orphaned shared pools."""
        self.syncs += 1
        instances = self._list_instances()
        # pure and O(Instances) (88 ms for the first pass at 1,000): off the event loop, which
        # keeps answering Allocates meanwhile. Only this task touches the device memo.
        offline = frozenset(self._offline())  # a snapshot: the loop may change the set
        # the nodes whose standing decides who publishes each shared pool (and, for the pools
        # this node publishes, which nodes they select); only those are followed
        unready = frozenset(self._unready())
        self._follow_nodes(
            frozenset(
                followed
                for instance in instances
                if instance.shared
                for followed in nodes_to_follow(
                    instance, self.node, instance.name in offline, unready
                )
            )
        )
        unready = frozenset(self._unready())  # without the nodes no longer followed
        paths = self.node_paths()
        if paths != self._last_paths:
            self._last_paths = paths
            for listener in list(self.paths_listeners):
                listener()
        pools = await asyncio.to_thread(self._desired, instances, offline, paths, unready)
        self._forget_devices({i.name for i in instances})
        by_pool: dict[str, list[Obj]] = {}
        for obj in self._informer.cache.values():
            by_pool.setdefault(_pool_of(obj), []).append(obj)
        now = time.monotonic()
        for index, (pool, specs) in enumerate(pools):
            if not self._backing_off(pool.name, now):
                await self._guarded(
                    pool.name, self._sync_pool(pool, specs, by_pool.get(pool.name, []))
                )
            if index % YIELD_EVERY_POOLS == YIELD_EVERY_POOLS - 1:
                # an unchanged pool costs a comparison and no I/O: let the loop breathe
                await asyncio.sleep(0)
        existing_instances = {i.name for i in instances}
        orphans: set[str] = set()
        for name, objs in by_pool.items():
            local_of_this_node = any(
                (o.get("spec") or {}).get("nodeName") == self.node for o in objs
            )
            if local_of_this_node and name != self.node:
                if not self._backing_off(name, now):
                    await self._guarded(name, self._delete_all(objs))
                continue
            listed = set().union(*(_selected_nodes(o) for o in objs))
            # an orphaned shared pool is removed by a node its nodeSelector lists (the only
            # nodes deploy/base/resourceslice-policy.yaml lets write it): the first one at
            # once, the others if it is still there after ORPHAN_GRACE (that node may be gone)
            shared_orphan = (
                all(not (o.get("spec") or {}).get("nodeName") for o in objs)
                and name not in existing_instances
                and self.node in listed
            )
            if not shared_orphan:
                continue
            orphans.add(name)
            since = self._orphaned_since.setdefault(name, now)
            if min(listed) != self.node and now - since < ORPHAN_GRACE:
                self._wake_at(since + ORPHAN_GRACE - now)
                continue
            if self._backing_off(name, now) or not await self._gone(name, now):
                continue
            await self._guarded(name, self._delete_all(objs))
        for name in self._orphaned_since.keys() - orphans:
            del self._orphaned_since[name]
        for name in self._alive_until.keys() - orphans:
            del self._alive_until[name]

    async def _gone(self, instance: str, now: float) -> bool:
        """Whether the Instance of a shared pool this node's view does not show is gone: not
        when it still exists (this node left it; its next publisher rewrites the pool),
        asked again after :data:`ALIVE_RECHECK`; not when the API server cannot say now."""
        if self._instance_exists is None:
            return True
        if now < self._alive_until.get(instance, now):
            return False
        try:
            exists = await self._instance_exists(instance)
        except Exception as error:  # unavailable: decided at a later sync
            log.info("cannot tell whether instance %s still exists: %s", instance, error)
            self._wake_at(ORPHAN_GRACE)
            return False
        if exists:
            self._alive_until[instance] = now + ALIVE_RECHECK
            self._wake_at(ALIVE_RECHECK)
        return not exists

    def _backing_off(self, pool: str, now: float) -> bool:
        """Whether ``pool`` waits after a conflict (a sync is scheduled for its end)."""
        state = self._backoff.get(pool)
        if state is None or now >= state[1]:
            return False
        self._wake_at(state[1] - now)
        return True

    def _wake_at(self, delay: float) -> None:
        asyncio.get_running_loop().call_later(max(delay, 0.0), self.trigger)

    def _conflicted(self, pool: str) -> None:
        """A write of ``pool`` met a newer version: leave the pool alone for a while (the
        slice was re-read; the wait lets the watch bring what changed, and two nodes that
        both still want to write drift apart instead of trading 409s every debounce)."""
        self.conflicts += 1
        in_a_row = self._backoff.get(pool, (0, 0.0))[0] + 1
        first, last = CONFLICT_BACKOFF
        pause = min(last, first * 2 ** (in_a_row - 1)) * random.uniform(0.5, 1.0)
        self._backoff[pool] = (in_a_row, time.monotonic() + pause)
        self._wake_at(pause)

    async def _delete_all(self, objs: list[Obj]) -> None:
        for obj in objs:
            await self._delete(obj)

    async def _guarded(self, pool: str, write: Awaitable[None]) -> None:
        """Run one pool's writes. A conflict (:class:`SliceConflict`) backs the pool off. A
        write the API server refuses for good (403: RBAC or the ResourceSlice admission
        policy; 400/422: invalid) is logged once per pool and reason, counted, and skipped:
        before, it aborted the sync of every pool after it, and the retry loop then refused
        the same write again for ever. The next sync tries again."""
        try:
            await write
        except SliceConflict:
            self._conflicted(pool)
            return
        except ApiError as error:
            if error.status not in REFUSED:
                raise
            self.refused_writes += 1
            key = (pool, error.status, error.reason)
            if key in self._reported_refusals:
                return
            if len(self._reported_refusals) >= MAX_REPORTED_REFUSALS:
                self._reported_refusals.clear()
            self._reported_refusals.add(key)
            log.error(
                "the API server refused writing ResourceSlice pool %s (%d %s): %s; the other "
                "pools are published",
                pool,
                error.status,
                error.reason,
                str(error)[:500],
            )
            return
        self._backoff.pop(pool, None)

    def _desired(
        self,
        instances: list[Instance],
        offline: Collection[str],
        paths: Mapping[str, str],
        unready: Collection[str] = (),
    ) -> list[tuple[Pool, list[dict[str, Any]]]]:
        pools = desired_pools(
            instances,
            self.node,
            offline,
            self._devices_of,
            self._effective_options,
            extended_eligibility(instances, paths),
            unready,
        )
        return [(pool, pool.slice_specs()) for pool in pools]

    def node_paths(self) -> dict[str, str]:
        """Node -> its mode (the path it serves ``akri.sh/*`` through where the names allow:
        ``agent/node/dra/name_paths.py``): this node's own decision, the others' from the
        label on their local slices (a node without one is unknown)."""
        paths = modes_of_slices(self._informer.cache.values())
        paths.pop(self.node, None)
        if self.extended_path is not None:
            paths[self.node] = self.extended_path
        return paths

    def _labels(self, pool: Pool) -> dict[str, str]:
        labels = {POOL_LABEL: _label_value(pool.name)}
        if pool.node_name is not None and self.extended_path is not None:
            labels[PATH_LABEL] = self.extended_path
        return labels

    def _effective_options(self, instance: Instance) -> DeviceOptions:
        if self._options_of is None:
            return DeviceOptions()
        options = self._options_of(instance)
        if options.consumable and not self.consumable_supported:
            return DeviceOptions(consumable=False, evict=options.evict)
        return options

    def _devices_of(self, instance: Instance, state: SlotState) -> Sequence[dict[str, Any]]:
        """:func:`instance_devices`, memoized per Instance version (an Instance object with a
        given resourceVersion never changes; without one it is computed every time)."""
        if not self.taints_supported and state.availability != USABLE:
            # untainted offline slots would be allocated: withdraw them, as before taints
            state = SlotState(DRAINING, DeviceOptions(state.options.consumable), state.node)
        binds = self.binds_to_node_supported
        if instance.resource_version is None:
            return instance_devices(instance, state, binds_to_node=binds)
        key = (instance.resource_version, state)
        cached = self._devices.get(instance.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        devices = instance_devices(instance, state, binds_to_node=binds)
        self._devices[instance.name] = (key, devices)
        return devices

    def _forget_devices(self, present: set[str]) -> None:
        if len(self._devices) > len(present):
            for name in self._devices.keys() - present:
                del self._devices[name]

    async def _sync_pool(
        self, pool: Pool, specs: list[dict[str, Any]], existing: list[Obj]
    ) -> None:
        labels = self._labels(pool)
        # the path label is the one label that changes (the agent restarted on another path)
        path = {k: v for k, v in labels.items() if k == PATH_LABEL}
        if _unchanged(existing, specs) and all(_has_labels(o, path) for o in existing):
            return
        shared = pool.node_name is None
        if shared and behind(existing, pool):
            self.deferred += 1  # a node with a newer view of the Instance wrote it
            return
        existing = sorted(existing, key=lambda o: str(o["metadata"]["name"]))
        count = len(specs)
        generation = max((_generation(o) for o in existing), default=0)
        generation += 1
        for obj in existing[count:]:
            if self._foreign(obj):
                if not shared:
                    # a shared slice in the pool named like this node's own (a shared
                    # Instance's name can be a node's): not ours to adopt or delete
                    log.warning(
                        "ResourceSlice %s in pool %s is a shared pool's slice; this node's "
                        "pool of that name leaves it alone",
                        obj["metadata"]["name"],
                        pool.name,
                    )
                    continue
                obj = await self._adopt(obj, pool, specs[0])
            await self._delete(obj)
        for index, spec in enumerate(specs):
            full = {
                **spec,
                "pool": {
                    "name": pool.name,
                    "generation": generation,
                    "resourceSliceCount": count,
                },
            }
            if index < len(existing):
                await self._update(existing[index], pool, full)
            else:
                await self._create(pool, index, full)

    def _foreign(self, obj: Obj) -> bool:
        """A shared slice whose nodeSelector does not list this node: the pool's publisher
        before it changed (the admission policy lets this node rewrite it, not delete it)."""
        return not (obj.get("spec") or {}).get("nodeName") and self.node not in _selected_nodes(obj)

    async def _adopt(self, obj: Obj, pool: Pool, spec: dict[str, Any]) -> Obj:
        """Rewrite a surplus slice of an adopted shared pool to the pool's new nodeSelector
        (content and generation unchanged), so that it may be deleted: a DELETE carries no new
        object, and deploy/base/resourceslice-policy.yaml lets only a node a shared slice lists
        delete it. Returns the stored slice."""
        return await self._replace(
            obj, pool, {**(obj.get("spec") or {}), "nodeSelector": spec["nodeSelector"]}
        )

    def _annotations(self, pool: Pool) -> dict[str, str]:
        """What a shared pool's slices record of the Instance view they were written from."""
        if pool.node_name is not None or pool.instance_uid is None:
            return {}
        return {
            INSTANCE_UID_ANNOTATION: pool.instance_uid,
            INSTANCE_VERSION_ANNOTATION: pool.instance_version or "",
        }

    def _metadata(self, pool: Pool, index: int) -> dict[str, Any]:
        metadata: dict[str, Any] = {"labels": self._labels(pool)}
        name = shared_slice_name(pool.name, index) if pool.node_name is None else None
        taken = self._informer.cache.get(f"/{name}") if name else None
        if name is not None and (taken is None or _pool_of(taken) == pool.name):
            metadata["name"] = name
        else:
            # a node's pool (kubelet's convention), or a fixed name another pool's slice
            # already has (a slice nobody of ours named)
            metadata["generateName"] = f"{DRIVER}-{_label_value(pool.name)[:40]}-"
        annotations = self._annotations(pool)
        if annotations:
            metadata["annotations"] = annotations
        if pool.node_name is not None and self._node_uid:
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": self.node,
                    "uid": self._node_uid,
                    "controller": True,
                }
            ]
        return metadata

    async def _create(self, pool: Pool, index: int, spec: dict[str, Any]) -> None:
        metadata = self._metadata(pool, index)
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": spec,
        }
        try:
            created = await self._client.create(
                resource_path(GROUP, VERSION, PLURAL), body, request_timeout=30
            )
        except ApiError as error:
            if error.status == 409 and "name" in metadata:
                # another node created this slice of the pool first: see what it wrote
                await self._reread(metadata["name"])
                raise SliceConflict(metadata["name"]) from error
            raise
        self.writes += 1
        self._informer.apply_local(RawEvent("ADDED", created))
        self._check_dropped(spec, created)

    async def _update(self, obj: Obj, pool: Pool, spec: dict[str, Any]) -> None:
        updated = await self._replace(obj, pool, spec)
        self._check_dropped(spec, updated)

    async def _replace(self, obj: Obj, pool: Pool, spec: dict[str, Any]) -> Obj:
        """PUT ``obj`` with ``spec`` (its labels and, for a shared pool, the Instance version
        it was decided on, over its own metadata), with the resourceVersion it was decided on.
        Raises :class:`SliceConflict` when someone else changed or removed it meanwhile (after
        reading it again)."""
        body = dict(obj)
        meta = dict(body.get("metadata") or {})
        meta["labels"] = {**(meta.get("labels") or {}), **self._labels(pool)}
        annotations = self._annotations(pool)
        if annotations:
            meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
        body["metadata"] = meta
        body["spec"] = spec
        name = obj["metadata"]["name"]
        try:
            updated = await self._client.replace(
                resource_path(GROUP, VERSION, PLURAL, name=name), body, request_timeout=30
            )
        except ApiError as error:
            if error.status in (404, 409):
                await self._reread(name, obj)
                raise SliceConflict(name) from error
            raise
        self.writes += 1
        self._informer.apply_local(RawEvent("MODIFIED", updated))
        return updated

    async def _delete(self, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        version = obj["metadata"].get("resourceVersion")
        options = {"preconditions": {"resourceVersion": version} if version else {}}
        try:
            await self._client.delete(
                resource_path(GROUP, VERSION, PLURAL, name=name), options, request_timeout=30
            )
            self.writes += 1
        except ApiError as error:
            if error.status == 409:
                # changed since we decided: it is not gone, see what it is now
                await self._reread(name, obj)
                raise SliceConflict(name) from error
            if error.status != 404:
                raise
        self._informer.apply_local(RawEvent("DELETED", obj))

    async def _reread(self, name: str, known: Obj | None = None) -> None:
        """Read slice ``name`` into the cache after a conflict (the watch may take a while
        to bring it; deciding again from the stale copy would only conflict again)."""
        try:
            current = await self._client.get(
                resource_path(GROUP, VERSION, PLURAL, name=name), request_timeout=30
            )
        except ApiError as error:
            if error.status != 404:
                return  # the pause after the conflict, then the watch, will tell
            if known is not None:
                self._informer.apply_local(RawEvent("DELETED", known))
            return
        self._informer.apply_local(RawEvent("MODIFIED", current))

    def _check_dropped(self, sent: dict[str, Any], stored: Obj) -> None:
        got = without_taint_times(stored.get("spec") or {})
        # a real API server stores an empty list as absent (omitempty): both mean "none"
        if json.dumps(got.get("devices") or [], sort_keys=True) == json.dumps(
            sent.get("devices") or [], sort_keys=True
        ):
            return
        if self._fall_back(sent.get("devices") or [], got.get("devices") or []):
            return
        key = str(sent.get("pool", {}).get("name"))
        if key in self._reported_drops:
            return
        self._reported_drops.add(key)
        log.error(
            "the API server changed or dropped fields of ResourceSlice pool %s (a feature gate "
            "may be off or the schema differs): sent %s, stored %s",
            key,
            json.dumps(sent.get("devices"))[:500],
            json.dumps(got.get("devices"))[:500],
        )

    def _fall_back(self, sent: list[dict[str, Any]], stored: list[dict[str, Any]]) -> bool:
        """Whether the difference is a feature the API server does not keep (its gate is
        off): consumable capacity (``allowMultipleAllocations``, ``capacity.*.requestPolicy``,
        KEP-5075), taints (KEP-5055) or ``bindsToNode`` (KEP-5007). Then say so once and
        publish without it from the next sync on: one device per slot, offline slots
        withdrawn, shared devices not bound to a node."""
        kept = {d.get("name"): d for d in stored if isinstance(d, dict)}
        fell_back = False
        for device in sent:
            back = kept.get(device.get("name")) or {}
            if device.get("allowMultipleAllocations") and (
                not back.get("allowMultipleAllocations")
                or not all(
                    (c or {}).get("requestPolicy") for c in (back.get("capacity") or {}).values()
                )
            ):
                if self.consumable_supported:
                    log.warning(
                        "the API server dropped consumable capacity (allowMultipleAllocations, "
                        "requestPolicy) from ResourceSlice device %s: the DRAConsumableCapacity "
                        "feature gate is off; publishing one device per slot instead",
                        device.get("name"),
                    )
                self.consumable_supported = False
                fell_back = True
            if device.get("taints") and not back.get("taints"):
                if self.taints_supported:
                    log.warning(
                        "the API server dropped the taints of ResourceSlice device %s: the "
                        "DRADeviceTaints feature gate is off; offline devices are withdrawn "
                        "from the slices instead of tainted",
                        device.get("name"),
                    )
                self.taints_supported = False
                fell_back = True
            if device.get("bindsToNode") and not back.get("bindsToNode"):
                if self.binds_to_node_supported:
                    log.warning(
                        "the API server dropped bindsToNode from ResourceSlice device %s (the "
                        "DRADeviceBindingConditions or DRAResourceClaimDeviceStatus feature "
                        "gate is off): claims of shared devices keep their pool's node "
                        "selector, so where claim status is authorized per node the agent "
                        "cannot write their status.devices; publishing without it",
                        device.get("name"),
                    )
                self.binds_to_node_supported = False
                fell_back = True
        if fell_back:
            self._devices.clear()
            self.trigger()
        return fell_back
