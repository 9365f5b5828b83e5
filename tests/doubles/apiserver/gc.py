"""The garbage collector of the API-server double: ownerReferences and the deletion
finalizers ``orphan`` and ``foregroundDeletion``, as kube-controller-manager's garbage
collector and the apiserver's generic registry handle them.

Rules ported from upstream (``pkg/controller/garbagecollector/garbagecollector.go``
``attemptToDeleteItem`` / ``classifyReferences`` / ``processDeletingDependentsItem`` /
``orphanDependents``, and ``apiserver/pkg/registry/generic/registry/store.go``
``deletionFinalizersForGarbageCollection`` / ``shouldOrphanDependents`` /
``shouldDeleteDependents``):

* an owner reference names (apiVersion's group, kind, name, uid); a namespaced dependent's
  owner is looked up in the dependent's namespace, a cluster-scoped owner at cluster scope.
  An owner that does not exist, or exists with another uid, is *dangling*; one being deleted
  with ``foregroundDeletion`` is *waiting*; any other (even one terminating for another
  finalizer) is *solid*. A cluster-scoped dependent naming a namespaced kind, or a kind
  that is not served, cannot be resolved: it is never collected;
* a dependent with a solid owner stays, and its dangling and waiting references are removed;
  otherwise it is deleted (uid precondition) — in the foreground when an owner is waiting
  and it has dependents itself, else with the policy its own finalizers name (orphan,
  foreground) or in the background;
* DELETE computes the object's GC finalizers: ``propagationPolicy`` (``Orphan``,
  ``Background``, ``Foreground``) or the deprecated ``orphanDependents`` win, else a GC
  finalizer already on the object, else the default (background: no finalizer). Changing
  them on an object already being deleted is allowed (the server's own write);
* an owner with ``foregroundDeletion`` has all its dependents deleted and keeps the finalizer
  until no dependent with ``blockOwnerDeletion: true`` remains; one with ``orphan`` has
  its uid removed from every dependent's ``ownerReferences``, then the finalizer removed.

The real collector runs asynchronously; here the work runs at the end of each write that
caused it (same lock), so a test sees the collected state as soon as its request returns
while the objects still pass through every state (terminating, finalizers removed)
with a watch event each. Not ported: the cycle breaking of ``unblockOwnerReferences``
(a foreground deletion of mutually owned objects), and namespace deletion
ordering.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tests.doubles.apiserver.errors import ApiError
from tests.doubles.apiserver.resources import GroupResource, ResourceType

if TYPE_CHECKING:
    from tests.doubles.apiserver.store import Event, Store

JSON = dict[str, Any]
Key = tuple[str, str]
Ref = tuple[GroupResource, Key]

ORPHAN = "orphan"
FOREGROUND = "foregroundDeletion"
GC_FINALIZERS = (ORPHAN, FOREGROUND)
POLICIES = ("Orphan", "Background", "Foreground")


def _meta(obj: JSON) -> JSON:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _owner_uids(obj: JSON | None) -> set[str]:
    if obj is None:
        return set()
    refs = _meta(obj).get("ownerReferences") or []
    return {str(r.get("uid")) for r in refs if isinstance(r, dict) and r.get("uid")}


def deletion_finalizers(obj: JSON, options: JSON) -> list[str]:
    """The finalizers ``obj`` has after a DELETE with ``options`` (upstream
    ``deletionFinalizersForGarbageCollection``): the GC finalizers are dropped and added
    back as the options (or, without any, the finalizers already there) say."""
    current = list(_meta(obj).get("finalizers") or [])
    orphan_dependents = options.get("orphanDependents")
    policy = options.get("propagationPolicy")
    if isinstance(orphan_dependents, bool):
        orphan, foreground = orphan_dependents, False
    elif policy is not None:
        orphan, foreground = policy == "Orphan", policy == "Foreground"
    else:
        orphan, foreground = ORPHAN in current, FOREGROUND in current and ORPHAN not in current
    kept = [f for f in current if f not in GC_FINALIZERS]
    if orphan:
        kept.append(ORPHAN)
    if foreground:
        kept.append(FOREGROUND)
    return current if set(kept) == set(current) else kept


def validate_delete_options(options: JSON) -> list[tuple[str, str, str]]:
    """Causes for DeleteOptions the real server refuses (422)."""
    causes: list[tuple[str, str, str]] = []
    policy = options.get("propagationPolicy")
    if policy is not None and policy not in POLICIES:
        causes.append(
            (
                "FieldValueNotSupported",
                "propagationPolicy",
                f'Unsupported value: "{policy}": supported values: "Foreground", '
                '"Background", "Orphan", "nil"',
            )
        )
    if policy is not None and options.get("orphanDependents") is not None:
        causes.append(
            (
                "FieldValueInvalid",
                "propagationPolicy",
                'Invalid value: "": orphanDependents and deletionPropagation cannot be both set',
            )
        )
    return causes


class GarbageCollector:
    """Cascading deletion for one :class:`Store` (which calls :meth:`observe` for every
    committed event and :meth:`drain` at the end of each write)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.enabled = True
        # seconds the collector lags behind the write that gave it work (0: it runs at the
        # end of that write). kube-controller-manager's collector is asynchronous: on a real
        # cluster the agents see a deleted Configuration well before its Instances terminate
        self.delay = 0.0
        self._queued_at: float | None = None
        # owner uid -> dependents naming it; uid -> where the object is
        self._dependents: defaultdict[str, set[Ref]] = defaultdict(set)
        self._where: dict[str, Ref] = {}
        self._work: deque[tuple[str, Ref]] = deque()
        self._running = False
        # what the collector did, for tests: ("delete", gr, key, policy) / ("unown", ...)
        self.actions: list[tuple[str, GroupResource, Key, str]] = []

    # --- the dependency graph -------------------------------------------------------------

    def observe(self, event: Event) -> None:
        ref = (event.gr, self._key_of(event.obj))
        uid = str(_meta(event.obj).get("uid") or "")
        old_owners = _owner_uids(event.old)
        new_owners = set() if event.type == "DELETED" else _owner_uids(event.obj)
        for owner in old_owners - new_owners:
            self._dependents[owner].discard(ref)
            if not self._dependents[owner]:
                del self._dependents[owner]
        for owner in new_owners - old_owners:
            self._dependents[owner].add(ref)
        if not self.enabled:
            return
        if event.type == "DELETED":
            self._where.pop(uid, None)
            for dependent in sorted(self._dependents.get(uid, ())):
                self._work.append(("attempt", dependent))
        else:
            if uid:
                self._where[uid] = ref
            meta = _meta(event.obj)
            finalizers = meta.get("finalizers") or []
            if meta.get("deletionTimestamp"):
                old_finalizers = _meta(event.old).get("finalizers") or [] if event.old else []
                starting = not (_meta(event.old).get("deletionTimestamp") if event.old else None)
                if FOREGROUND in finalizers:
                    if starting or FOREGROUND not in old_finalizers:
                        # an owner starting a foreground deletion: all its dependents go
                        for dependent in sorted(self._dependents.get(uid, ())):
                            self._work.append(("attempt", dependent))
                    self._work.append(("foreground", ref))
                if ORPHAN in finalizers:
                    self._work.append(("orphan", ref))
            elif new_owners and (event.type == "ADDED" or new_owners != old_owners):
                # a dependent created (or re-pointed) with owners that may be gone already
                self._work.append(("attempt", ref))
        # a dependent of an owner deleting in the foreground changed or went: re-check it
        for owner in old_owners | new_owners:
            where = self._where.get(owner)
            if where is not None:
                self._work.append(("foreground", where))

    @staticmethod
    def _key_of(obj: JSON) -> Key:
        meta = _meta(obj)
        return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))

    def drain(self) -> None:
        """Run the queued work (and the work it causes) to the end; with a :attr:`delay`,
        only once the oldest work has waited that long (:meth:`due`)."""
        if self._running or not self.enabled:
            return
        if self.delay > 0 and self._work:
            if self._queued_at is None:
                self._queued_at = time.monotonic()
            if time.monotonic() - self._queued_at < self.delay:
                return  # the server's periodic pass drains it (Store.collector_pass)
        self._queued_at = None
        self._running = True
        try:
            while self._work:
                job, ref = self._work.popleft()
                try:
                    if job == "attempt":
                        self._attempt_to_delete(ref)
                    elif job == "foreground":
                        self._process_deleting_dependents(ref)
                    else:
                        self._orphan_dependents(ref)
                except ApiError:
                    # the object changed under the collector (a precondition, a conflict):
                    # the event of that change queued the work again
                    continue
        finally:
            self._running = False

    # --- helpers --------------------------------------------------------------------------

    def _get(self, ref: Ref) -> tuple[ResourceType, JSON] | None:
        rt = self.store.registry.get(ref[0])
        if rt is None:
            return None
        obj = self.store._bucket(rt).get(ref[1])
        return (rt, obj) if obj is not None else None

    def _resolve_kind(self, ref: JSON) -> ResourceType | None:
        api_version = str(ref.get("apiVersion") or "")
        group, _, version = api_version.rpartition("/")
        for rt in self.store.registry:
            if rt.group == group and rt.kind == ref.get("kind") and version in rt.versions:
                return rt
        return None

    def _classify(
        self, dependent: JSON, dependent_rt: ResourceType
    ) -> tuple[list[JSON], list[JSON], list[JSON]]:
        """``(solid, dangling, waiting)`` owner references of ``dependent``."""
        solid: list[JSON] = []
        dangling: list[JSON] = []
        waiting: list[JSON] = []
        namespace = _meta(dependent).get("namespace") or ""
        for ref in _meta(dependent).get("ownerReferences") or []:
            owner_rt = self._resolve_kind(ref)
            if owner_rt is None or (owner_rt.namespaced and not dependent_rt.namespaced):
                solid.append(ref)  # unresolvable: never collected
                continue
            key = (namespace if owner_rt.namespaced else "", str(ref.get("name") or ""))
            owner = self.store._bucket(owner_rt).get(key)
            if owner is None or _meta(owner).get("uid") != ref.get("uid"):
                dangling.append(ref)
            elif _meta(owner).get("deletionTimestamp") and FOREGROUND in (
                _meta(owner).get("finalizers") or []
            ):
                waiting.append(ref)
            else:
                solid.append(ref)
        return solid, dangling, waiting

    def _rewrite(self, rt: ResourceType, obj: JSON, meta_change: JSON) -> None:
        """A compare-and-swap write of ``obj`` with metadata fields replaced (as the
        collector's PATCH with a uid precondition)."""
        candidate = dict(obj)
        meta = dict(_meta(obj))
        for field, value in meta_change.items():
            if value is None:
                meta.pop(field, None)
            else:
                meta[field] = value
        candidate["metadata"] = meta
        key = self._key_of(obj)
        self.store._write_update(rt, rt.preferred_version, key, obj, candidate, None, False)

    def _delete(self, rt: ResourceType, obj: JSON, policy: str) -> None:
        meta = _meta(obj)
        self.actions.append(("delete", rt.gr, self._key_of(obj), policy))
        self.store.delete(
            rt,
            rt.preferred_version,
            meta.get("namespace") or None,
            str(meta["name"]),
            {"propagationPolicy": policy, "preconditions": {"uid": meta.get("uid")}},
        )

    def _existing_dependents(self, uid: str) -> Iterator[tuple[ResourceType, JSON]]:
        for ref in sorted(self._dependents.get(uid, ())):
            found = self._get(ref)
            if found is not None:
                yield found

    # --- the three jobs -------------------------------------------------------------------

    def _attempt_to_delete(self, ref: Ref) -> None:
        found = self._get(ref)
        if found is None:
            return
        rt, obj = found
        meta = _meta(obj)
        if meta.get("deletionTimestamp"):
            if FOREGROUND in (meta.get("finalizers") or []):
                self._process_deleting_dependents(ref)
            return
        if not meta.get("ownerReferences"):
            return
        solid, dangling, waiting = self._classify(obj, rt)
        if solid:
            if not dangling and not waiting:
                return
            gone = {str(r.get("uid")) for r in dangling + waiting}
            refs = [r for r in meta["ownerReferences"] if str(r.get("uid")) not in gone]
            self.actions.append(("unown", rt.gr, ref[1], ",".join(sorted(gone))))
            self._rewrite(rt, obj, {"ownerReferences": refs or None})
            return
        uid = str(meta.get("uid") or "")
        if waiting and self._dependents.get(uid):
            self._delete(rt, obj, "Foreground")
            return
        finalizers = meta.get("finalizers") or []
        if ORPHAN in finalizers:
            policy = "Orphan"
        elif FOREGROUND in finalizers:
            policy = "Foreground"
        else:
            policy = "Background"
        self._delete(rt, obj, policy)

    def _process_deleting_dependents(self, ref: Ref) -> None:
        found = self._get(ref)
        if found is None:
            return
        rt, owner = found
        meta = _meta(owner)
        finalizers = list(meta.get("finalizers") or [])
        if not meta.get("deletionTimestamp") or FOREGROUND not in finalizers:
            return
        uid = str(meta.get("uid") or "")
        blocking: list[tuple[ResourceType, JSON]] = []
        for dep_rt, dependent in self._existing_dependents(uid):
            for owner_ref in _meta(dependent).get("ownerReferences") or []:
                if owner_ref.get("uid") == uid and owner_ref.get("blockOwnerDeletion") is True:
                    blocking.append((dep_rt, dependent))
                    break
        if not blocking:
            finalizers.remove(FOREGROUND)
            self._rewrite(rt, owner, {"finalizers": finalizers or None})
            return
        for dep_rt, dependent in blocking:
            dep_meta = _meta(dependent)
            if not (
                dep_meta.get("deletionTimestamp")
                and FOREGROUND in (dep_meta.get("finalizers") or [])
            ):
                self._work.append(("attempt", (dep_rt.gr, self._key_of(dependent))))

    def _orphan_dependents(self, ref: Ref) -> None:
        found = self._get(ref)
        if found is None:
            return
        rt, owner = found
        meta = _meta(owner)
        finalizers = list(meta.get("finalizers") or [])
        if not meta.get("deletionTimestamp") or ORPHAN not in finalizers:
            return
        uid = str(meta.get("uid") or "")
        for dep_rt, dependent in list(self._existing_dependents(uid)):
            refs = [
                r for r in _meta(dependent).get("ownerReferences") or [] if str(r.get("uid")) != uid
            ]
            self.actions.append(("unown", dep_rt.gr, self._key_of(dependent), uid))
            self._rewrite(dep_rt, dependent, {"ownerReferences": refs or None})
        finalizers.remove(ORPHAN)
        self._rewrite(rt, owner, {"finalizers": finalizers or None})
