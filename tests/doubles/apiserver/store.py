"""In-memory object storage with Kubernetes semantics, independent of HTTP.

Everything the routes do to objects happens here: create/get/list/update/patch/delete,
resourceVersion preconditions, generation, the status subresource, finalizers, CRD
registration, the bounded event history and the watchers fed from it.

The store is guarded by a re-entrant lock, so tests may call it from a thread other than
the one serving HTTP; watchers are woken through their own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import yaml

from tests.doubles.apiserver import errors, managed_fields
from tests.doubles.apiserver.errors import ApiError
from tests.doubles.apiserver.gc import (
    GarbageCollector,
    deletion_finalizers,
    validate_delete_options,
)
from tests.doubles.apiserver.patches import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from tests.doubles.apiserver.resource_validation import validate_resource
from tests.doubles.apiserver.resources import (
    CRD_GR,
    NAMESPACES_GR,
    CRDError,
    GroupResource,
    ResourceRegistry,
    ResourceType,
    builtin_resources,
    resource_type_from_crd,
)
from tests.doubles.apiserver.selectors import FieldSelector, LabelSelector
from tests.doubles.apiserver.validation import prune_and_default, validate_metadata, validate_schema


def json_copy(value: Any) -> Any:
    """A deep copy of JSON data (what every stored object is), through the C JSON codec:
    several times faster than ``copy.deepcopy`` on large objects such as an Instance with
    1000 slots, so the double's own cost stays out of the agent's benchmark figures."""
    return json.loads(json.dumps(value))


JSON = dict[str, Any]
Key = tuple[str, str]  # (namespace or "", name)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _collecting(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """A public write of the store: the garbage collection it causes runs before it returns
    (the outermost write drains; the collector's own writes only queue work)."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        store = args[0]
        assert isinstance(store, Store)
        with store.lock:
            result = method(*args, **kwargs)
            store.gc.drain()
            return result

    return wrapper


MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
APPLY_PATCH_CBOR = "application/apply-patch+cbor"
PATCH_TYPES: tuple[str, ...] = (JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH, APPLY_PATCH)

DEFAULT_NAMESPACES: tuple[str, ...] = ("default", "kube-system", "kube-public", "kube-node-lease")
CRD_CLEANUP_FINALIZER = "customresourcecleanup.apiextensions.k8s.io"
NAMESPACE_CLEANUP_DELAY = 2.0  # seconds between a namespace's deletion and its objects'
_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def _set_managed_fields(obj: JSON, entries: Any) -> None:
    meta = _meta(obj)
    if entries:
        meta["managedFields"] = json_copy(entries)
    else:
        meta.pop("managedFields", None)


def now_rfc3339(later: float = 0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=later)).strftime("%Y-%m-%dT%H:%M:%SZ")


PODS_GR = GroupResource("", "pods")
DEFAULT_POD_GRACE = 30  # seconds (core/v1 DefaultTerminationGracePeriodSeconds)


def _pod_grace(pod: JSON, options: JSON) -> int:
    """The grace period of a Pod's deletion: DeleteOptions.gracePeriodSeconds, else the
    Pod's terminationGracePeriodSeconds, else 30 s."""
    for value in (
        options.get("gracePeriodSeconds"),
        (pod.get("spec") or {}).get("terminationGracePeriodSeconds"),
    ):
        if isinstance(value, int) and value >= 0:
            return value
    return DEFAULT_POD_GRACE


def _meta_causes(rt: ResourceType, cause: tuple[str, str, str]) -> list[tuple[str, str, str]]:
    """The causes of a refused ObjectMeta update: a custom resource's is reported twice, as a
    real kube-apiserver does (the generic registry's ValidateObjectMetaUpdate and the custom
    resource strategy's ValidateUpdate both find it; seen on v1.36.2)."""
    return [cause, cause] if rt.custom else [cause]


def _meta(obj: JSON) -> JSON:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
        obj["metadata"] = meta
    return meta


def _content(obj: JSON, *, skip_status: bool) -> JSON:
    """The part of an object whose change bumps ``metadata.generation``."""
    skipped = {"metadata", "apiVersion", "kind"}
    if skip_status:
        skipped.add("status")
    return {k: v for k, v in obj.items() if k not in skipped}


def _without_type(obj: JSON) -> JSON:
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}


@dataclass(frozen=True)
class Event:
    """One committed change, as kept in the history and fanned out to watchers."""

    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    gr: GroupResource
    obj: JSON  # state after the change (for DELETED: the last state, with the deletion RV)
    old: JSON | None  # state before (MODIFIED / DELETED)

    @property
    def namespace(self) -> str:
        return str((self.obj.get("metadata") or {}).get("namespace") or "")


@dataclass(eq=False)
class Watcher:
    """A registered watch: receives matching events through an asyncio queue."""

    gr: GroupResource
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[str, JSON] | None] = field(default_factory=asyncio.Queue)
    closed: bool = False
    # resourceVersion of the last event queued for this watch, and of the last one its
    # stream has written (the server answers a write once its watch events are out)
    offered: int = 0
    sent: int = 0

    def matches(self, obj: JSON | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and (meta.get("namespace") or "") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    def translate(self, event: Event) -> tuple[str, JSON] | None:
        """What this watcher sees of ``event``: selector transitions become ADDED/DELETED."""
        if event.type == "ADDED":
            return ("ADDED", event.obj) if self.matches(event.obj) else None
        if event.type == "DELETED":
            return ("DELETED", event.obj) if self.matches(event.obj) else None
        was, now = self.matches(event.old), self.matches(event.obj)
        if was and now:
            return ("MODIFIED", event.obj)
        if was and event.old is not None:
            # as kube-apiserver's watch cache (cacheWatcher.convertToWatchEvent): an object
            # that stops matching the selector is a DELETED event carrying its previous
            # content (the last state the watcher was entitled to) at the event's version
            gone = copy.deepcopy(event.old)
            gone.setdefault("metadata", {})["resourceVersion"] = str(event.rv)
            return ("DELETED", gone)
        if now:
            return ("ADDED", event.obj)
        return None

    def push(self, item: tuple[str, JSON] | None) -> None:
        with contextlib.suppress(RuntimeError):  # loop already closed
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def offer(self, event: Event) -> None:
        if self.closed or event.gr != self.gr:
            return
        seen = self.translate(event)
        if seen is not None:
            self.offered = max(self.offered, event.rv)
            self.push(seen)

    def waits_to_send(self, rv: int) -> bool:
        """Whether the event of version ``rv`` (or a later one) is queued but not written."""
        return not self.closed and self.offered >= rv > self.sent

    def close(self) -> None:
        """End the watch stream (server stopping or ``Store.close_watchers``)."""
        if not self.closed:
            self.closed = True
            self.push(None)


@dataclass
class WatchStart:
    """A registered watcher plus the events to send before the live ones."""

    watcher: Watcher
    initial: list[tuple[str, JSON]]
    rv: int  # resourceVersion of the state the initial events describe


class Store:
    """Objects, resource versions, event history and watchers."""

    def __init__(
        self,
        *,
        history_size: int = 1000,
        namespaces: Iterable[str] = DEFAULT_NAMESPACES,
        require_namespace: bool = False,
        validate: bool = True,
    ) -> None:
        self.registry = ResourceRegistry(builtin_resources())
        self.validate = validate
        # the stored ValidatingAdmissionPolicies decide CREATE and UPDATE (admission.py); off
        # unless asked for (ApiServerDouble(admission_policies=True))
        self.admission_policies = False
        self.lock = threading.RLock()
        self.require_namespace = require_namespace
        # a deleted namespace's objects go this long after it (kube-controller-manager's
        # namespace controller is asynchronous: kubectl delete -k still finds them)
        self.namespace_cleanup_delay = NAMESPACE_CLEANUP_DELAY
        self._namespaces_terminating: dict[str, float] = {}  # name -> monotonic deletion time
        self._objects: dict[GroupResource, dict[Key, JSON]] = {}
        self._rv = 0
        self._history: deque[Event] = deque(maxlen=max(1, history_size))
        # Every event with rv > _compacted_rv is still in the history.
        self._compacted_rv = 0
        self._watchers: set[Watcher] = set()
        # Hooks called after each committed event (used by tests and by the server).
        self.listeners: list[Callable[[Event], None]] = []
        # ownerReferences and the orphan / foregroundDeletion finalizers (gc.py)
        self.gc = GarbageCollector(self)
        ns_rt = self.registry.get(NAMESPACES_GR)
        assert ns_rt is not None
        for ns in namespaces:
            self.create(ns_rt, "v1", None, {"metadata": {"name": ns}})

    # --- resource versions and history ---------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._rv

    @property
    def compacted_rv(self) -> int:
        return self._compacted_rv

    @property
    def history_size(self) -> int:
        return self._history.maxlen or 0

    def set_history_size(self, size: int) -> None:
        with self.lock:
            events = list(self._history)
            self._history = deque(maxlen=max(1, size))
            for ev in events:
                self._append_history(ev)

    def compact(self, keep: int = 0) -> int:
        """Forget all but the newest ``keep`` events (like an etcd compaction): watches from an
        older resourceVersion then get ``410 Gone``. Returns the compacted revision."""
        with self.lock:
            while len(self._history) > keep:
                self._compacted_rv = self._history.popleft().rv
            if not self._history:
                self._compacted_rv = self._rv
            return self._compacted_rv

    def events(self) -> list[Event]:
        """The retained event history (oldest first)."""
        with self.lock:
            return list(self._history)

    def _append_history(self, event: Event) -> None:
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            self._compacted_rv = self._history[0].rv
        self._history.append(event)

    def _emit(self, type_: str, rt: ResourceType, obj: JSON, old: JSON | None) -> None:
        event = Event(
            rv=int(obj["metadata"]["resourceVersion"]),
            type=type_,
            gr=rt.gr,
            # no copies: a stored object is never changed in place (every write stores a new
            # dict and readers get copies from _output), so the history can share it; copying
            # a 1000-slot Instance twice per write was most of the double's time per Allocate
            obj=obj,
            old=old,
        )
        self._append_history(event)
        for watcher in list(self._watchers):
            watcher.offer(event)
        self.gc.observe(event)
        for listener in list(self.listeners):
            listener(event)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    # --- lookup helpers ------------------------------------------------------------------

    def _bucket(self, rt: ResourceType) -> dict[Key, JSON]:
        return self._objects.setdefault(rt.gr, {})

    @staticmethod
    def _key(rt: ResourceType, namespace: str | None, name: str) -> Key:
        return ((namespace or "") if rt.namespaced else "", name)

    @staticmethod
    def _storage_key(rt: ResourceType, key: Key) -> str:
        prefix = f"/registry/{rt.group}/{rt.plural}" if rt.group else f"/registry/{rt.plural}"
        return f"{prefix}/{key[0]}/{key[1]}" if key[0] else f"{prefix}/{key[1]}"

    def _output(self, rt: ResourceType, version: str, obj: JSON) -> JSON:
        out = json_copy(obj)
        out["apiVersion"] = rt.api_version(version)
        out["kind"] = rt.kind
        # Keep apiVersion/kind first, like the real serializer.
        return {"apiVersion": out.pop("apiVersion"), "kind": out.pop("kind"), **out}

    def _require(self, rt: ResourceType, namespace: str | None, name: str) -> tuple[Key, JSON]:
        key = self._key(rt, namespace, name)
        obj = self._bucket(rt).get(key)
        if obj is None:
            raise errors.not_found(rt.gr, name)
        return key, obj

    # --- reads ---------------------------------------------------------------------------

    def get(self, rt: ResourceType, version: str, namespace: str | None, name: str) -> JSON:
        with self.lock:
            _, obj = self._require(rt, namespace, name)
            return self._output(rt, version, obj)

    def list_objects(
        self,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        labels: LabelSelector | None = None,
        fields: FieldSelector | None = None,
    ) -> tuple[list[JSON], int]:
        """Matching objects sorted by (namespace, name), and the list resourceVersion."""
        labels = labels or LabelSelector()
        fields = fields or FieldSelector()
        with self.lock:
            items = []
            for key in sorted(self._bucket(rt)):
                obj = self._bucket(rt)[key]
                if namespace is not None and rt.namespaced and key[0] != namespace:
                    continue
                if labels.matches(_meta(obj).get("labels")) and fields.matches(obj):
                    items.append(self._output(rt, version, obj))
            return items, self._rv

    # --- create --------------------------------------------------------------------------

    def _check_namespace(self, rt: ResourceType, namespace: str | None, body: JSON) -> str | None:
        meta = _meta(body)
        body_ns = meta.get("namespace") or None
        if not rt.namespaced:
            meta.pop("namespace", None)
            return None
        if namespace is None:
            namespace = body_ns
        if not namespace:
            raise errors.bad_request("the server could not find the requested resource")
        if body_ns and body_ns != namespace:
            raise errors.namespace_mismatch()
        meta["namespace"] = namespace
        if self.require_namespace and ("", namespace) not in self._objects.get(NAMESPACES_GR, {}):
            raise errors.not_found(NAMESPACES_GR, namespace)
        return namespace

    @_collecting
    def create(
        self,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        body: JSON,
        *,
        dry_run: bool = False,
        field_validation: str = "Warn",
        field_manager: str | None = None,
        applied: bool = False,
    ) -> JSON:
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be a JSON object")
        obj = json_copy(body)
        with self.lock:
            namespace = self._check_namespace(rt, namespace, obj)
            meta = _meta(obj)
            if meta.get("resourceVersion"):
                raise errors.internal("resourceVersion should not be set on objects to be created")
            name = meta.get("name") or ""
            if not name:
                prefix = meta.get("generateName") or ""
                if not prefix:
                    raise errors.invalid(
                        rt.gr,
                        rt.kind,
                        "",
                        [
                            (
                                "FieldValueRequired",
                                "metadata.name",
                                "Required value: name or generateName is required",
                            )
                        ],
                    )
                for _ in range(8):
                    suffix = "".join(random.choice(_NAME_SUFFIX_ALPHABET) for _ in range(5))
                    name = prefix + suffix
                    if self._key(rt, namespace, name) not in self._bucket(rt):
                        break
                meta["name"] = name
            key = self._key(rt, namespace, name)
            if key in self._bucket(rt):
                raise errors.already_exists(rt.gr, name)
            if rt.namespaced and namespace in self._namespaces_terminating:
                raise errors.ApiError(
                    403,
                    f'{rt.plural} "{name}" is forbidden: unable to create new content in '
                    f"namespace {namespace} because it is being terminated",
                )
            if self._crd_terminating(rt):
                raise errors.ApiError(
                    405, "create not allowed while custom resource definition is terminating"
                )
            for server_field in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
                meta.pop(server_field, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            if rt.has_status and rt.gr != NAMESPACES_GR:
                obj.pop("status", None)
            obj["apiVersion"] = rt.api_version(version)
            obj["kind"] = rt.kind
            if not applied:  # an apply that creates has recorded its own ownership
                self._track_ownership(rt, version, None, obj, field_manager)
            self._before_write(rt, version, None, obj, field_validation)
            if dry_run:
                return self._output(rt, version, obj)
            meta["resourceVersion"] = self._next_rv()
            self._bucket(rt)[key] = obj
            self._emit("ADDED", rt, obj, None)
            self._after_write(rt, None, obj)
            return self._output(rt, version, obj)

    # --- update / patch ------------------------------------------------------------------

    @_collecting
    def update(
        self,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        name: str,
        body: JSON,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        field_validation: str = "Warn",
        field_manager: str | None = None,
    ) -> JSON:
        """PUT: replace the object (or only its status). A ``metadata.resourceVersion`` in the
        body must be current; without one the update is unconditional."""
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be a JSON object")
        candidate = json_copy(body)
        meta = _meta(candidate)
        if meta.get("name") and meta["name"] != name:
            raise errors.name_mismatch(meta["name"], name)
        with self.lock:
            self._check_namespace(rt, namespace, candidate)
            key, current = self._require(rt, namespace, name)
            return self._write_update(
                rt,
                version,
                key,
                current,
                candidate,
                subresource,
                dry_run,
                field_validation,
                field_manager=field_manager,
            )

    @_collecting
    def patch(
        self,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        name: str,
        patch_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
        force: bool | None = None,
        dry_run: bool = False,
        strict_strategic: bool = False,
        field_validation: str = "Warn",
    ) -> tuple[JSON, bool]:
        """PATCH with any of :data:`PATCH_TYPES`. Returns ``(object, created)``; only
        server-side apply creates."""
        if patch_type != APPLY_PATCH and force is not None:
            raise errors.invalid(
                rt.gr,
                rt.kind,
                name,
                [
                    (
                        "FieldValueForbidden",
                        "force",
                        "Forbidden: may not be specified for non-apply patch",
                    )
                ],
            )
        if patch_type == STRATEGIC_PATCH and strict_strategic and rt.custom:
            raise errors.unsupported_media_type(patch_type, [JSON_PATCH, MERGE_PATCH, APPLY_PATCH])
        with self.lock:
            key = self._key(rt, namespace, name)
            current = self._bucket(rt).get(key)
            if patch_type == APPLY_PATCH:
                if not field_manager:
                    raise errors.invalid(
                        GroupResource("meta.k8s.io", "patchoptions"),
                        "PatchOptions",
                        "",
                        [
                            (
                                "FieldValueRequired",
                                "fieldManager",
                                "Required value: is required for apply patch",
                            )
                        ],
                    )
                if not isinstance(patch, dict):
                    raise errors.bad_request("apply patch must be a YAML or JSON object")
                if not patch.get("apiVersion") or not patch.get("kind"):
                    raise errors.bad_request(
                        "invalid object type: apiVersion and kind must be set in an apply patch"
                    )
                body_name = (patch.get("metadata") or {}).get("name")
                if body_name and body_name != name:
                    raise errors.name_mismatch(body_name, name)
                if current is None:
                    if subresource:
                        raise errors.not_found(rt.gr, name)
                    uid = (patch.get("metadata") or {}).get("uid")
                    if uid:
                        # upstream patcher.applyPatch: an apply naming a uid creates nothing
                        raise errors.conflict(
                            rt.gr,
                            name,
                            f"uid mismatch: the provided object specified uid {uid}, and no "
                            "existing object was found",
                        )
                    body = self._applied(rt, version, None, patch, field_manager)
                    _meta(body)["name"] = name
                    if _meta(body).get("resourceVersion"):
                        raise errors.stale(rt.gr, name)
                    return self.create(
                        rt,
                        version,
                        namespace,
                        body,
                        dry_run=dry_run,
                        field_validation=field_validation,
                        applied=True,
                    ), True
            if current is None:
                raise errors.not_found(rt.gr, name)
            try:
                if patch_type == JSON_PATCH:
                    candidate = json_patch(current, patch)
                elif patch_type == STRATEGIC_PATCH and not rt.custom:
                    candidate = strategic_merge_patch(current, patch)
                elif patch_type == APPLY_PATCH:
                    assert field_manager is not None
                    candidate = self._applied(rt, version, current, patch, field_manager)
                else:
                    if not isinstance(patch, dict):
                        raise PatchError("a merge patch must be a JSON object")
                    candidate = merge_patch(current, patch)
            except PatchError as exc:
                raise ApiError(422, str(exc)) from exc
            if not isinstance(candidate, dict):
                raise ApiError(422, "the patched object is not a JSON object")
            meta = _meta(candidate)
            if meta.get("name") != name:
                raise errors.bad_request("metadata.name cannot be changed by a patch")
            if rt.namespaced and meta.get("namespace") != key[0]:
                raise errors.namespace_mismatch()
            return (
                self._write_update(
                    rt,
                    version,
                    key,
                    current,
                    candidate,
                    subresource,
                    dry_run,
                    field_validation,
                    field_manager=field_manager,
                    applied=patch_type == APPLY_PATCH,
                    patched=True,
                ),
                False,
            )

    def _write_update(
        self,
        rt: ResourceType,
        version: str,
        key: Key,
        current: JSON,
        candidate: JSON,
        subresource: str | None,
        dry_run: bool,
        field_validation: str = "Warn",
        *,
        field_manager: str | None = None,
        applied: bool = False,
        patched: bool = False,
    ) -> JSON:
        name = key[1]
        cur_meta = current["metadata"]
        cand_meta = _meta(candidate)
        rv = cand_meta.get("resourceVersion")
        if rv not in (None, "") and str(rv) != cur_meta["resourceVersion"]:
            raise errors.stale(rt.gr, name)
        uid = cand_meta.get("uid")
        if uid and uid != cur_meta["uid"] and patched:
            # a patch (server-side apply included) has no uid precondition upstream
            # (rest.DefaultUpdatedObjectInfo(nil, ...)): the patched object's uid differs
            # from the stored one and ValidateObjectMetaUpdate refuses it (422, not 409;
            # kubernetes/kubernetes#127625)
            raise errors.invalid(
                rt.gr,
                rt.kind,
                name,
                _meta_causes(
                    rt,
                    (
                        "FieldValueInvalid",
                        "metadata.uid",
                        f'Invalid value: "{uid}": field is immutable',
                    ),
                ),
            )
        if uid and uid != cur_meta["uid"]:
            # a PUT: the body's uid is a storage precondition (DefaultUpdatedObjectInfo(obj))
            raise errors.precondition_failed(
                rt.gr,
                self._storage_key(rt, key),
                name,
                f"UID in precondition: {uid}, UID in object meta: {cur_meta['uid']}",
            )
        if subresource == "status":
            new = json_copy(current)
            if "status" in candidate:
                new["status"] = json_copy(candidate["status"])
            else:
                new.pop("status", None)
        else:
            new = json_copy(candidate)
            if rt.has_status:
                if "status" in current:
                    new["status"] = json_copy(current["status"])
                else:
                    new.pop("status", None)
        meta = _meta(new)
        for server_field in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "namespace",
            "name",
        ):
            if server_field in cur_meta:
                meta[server_field] = cur_meta[server_field]
            else:
                meta.pop(server_field, None)
        meta["resourceVersion"] = cur_meta["resourceVersion"]
        new["apiVersion"] = current.get("apiVersion", rt.api_version(version))
        new["kind"] = rt.kind
        if "finalizers" in meta and not meta["finalizers"]:
            del meta["finalizers"]
        if subresource == "status":
            _set_managed_fields(new, cur_meta.get("managedFields"))
        elif not applied:  # an apply has recorded its own ownership
            self._track_ownership(rt, version, current, new, field_manager)
        self._before_write(rt, version, current, new, field_validation)
        if cur_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(cur_meta.get("finalizers") or [])
            if added:
                listed = ", ".join(json.dumps(f) for f in sorted(added))
                raise errors.invalid(
                    rt.gr,
                    rt.kind,
                    name,
                    _meta_causes(
                        rt,
                        (
                            "FieldValueForbidden",
                            "metadata.finalizers",
                            "Forbidden: no new finalizers can be added if the object is being "
                            f"deleted, found new finalizers []string{{{listed}}}",
                        ),
                    ),
                )
        if _content(new, skip_status=rt.has_status) != _content(current, skip_status=rt.has_status):
            meta["generation"] = int(cur_meta.get("generation", 0)) + 1
        if _without_type(new) == _without_type(current):
            return self._output(rt, version, current)  # no-op: no new resourceVersion, no event
        if dry_run:
            return self._output(rt, version, new)
        meta["resourceVersion"] = self._next_rv()
        self._bucket(rt)[key] = new
        self._emit("MODIFIED", rt, new, current)
        self._after_write(rt, current, new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(rt, key)
        return self._output(rt, version, new)

    def _applied(
        self, rt: ResourceType, version: str, current: JSON | None, patch: JSON, manager: str
    ) -> JSON:
        """``current`` after ``manager`` applies ``patch``; 409 when it would change fields
        other managers own (an apply without ``force``)."""
        try:
            return managed_fields.apply(
                current,
                patch,
                manager,
                self._set_lists(rt, version),
                rt.api_version(version),
                now_rfc3339(),
                maps=self._granular_maps(rt),
            )
        except managed_fields.ApplyConflict as conflict:
            raise errors.apply_conflict(conflict.conflicts) from None

    def _granular_maps(self, rt: ResourceType) -> list[managed_fields.Path]:
        """The maps whose keys have owners (``metadata.annotations`` and ``metadata.labels``),
        on custom resources, as the set-typed lists."""
        return [managed_fields.ANNOTATIONS, managed_fields.LABELS] if rt.custom else []

    def _set_lists(self, rt: ResourceType, version: str) -> list[managed_fields.Path]:
        """The set-typed lists of a custom resource (their elements have owners): those of
        its schema, and ``metadata.finalizers`` (``+listType=set`` in ObjectMeta)."""
        if not rt.custom:
            return []
        return [*managed_fields.set_list_paths(rt.schemas.get(version)), managed_fields.FINALIZERS]

    def _track_ownership(
        self,
        rt: ResourceType,
        version: str,
        current: JSON | None,
        new: JSON,
        field_manager: str | None,
    ) -> None:
        """A plain write: ``new`` gets the stored ownership, updated for what it changed
        (a client's own ``managedFields`` are ignored)."""
        paths = self._set_lists(rt, version)
        if not paths:
            return
        _set_managed_fields(new, (current or {}).get("metadata", {}).get("managedFields"))
        managed_fields.track_update(
            current,
            new,
            field_manager,
            paths,
            rt.api_version(version),
            now_rfc3339(),
            maps=self._granular_maps(rt),
        )

    # --- delete --------------------------------------------------------------------------

    @_collecting
    def delete(
        self,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        name: str,
        options: JSON | None = None,
        *,
        dry_run: bool = False,
    ) -> JSON:
        """Delete, or mark for deletion when finalizers are present. Returns the object."""
        options = options or {}
        causes = validate_delete_options(options)
        if causes:
            raise errors.invalid(
                GroupResource("meta.k8s.io", "deleteoptions"), "DeleteOptions", "", causes
            )
        with self.lock:
            key, current = self._require(rt, namespace, name)
            meta = current["metadata"]
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != meta["uid"]:
                raise errors.precondition_failed(
                    rt.gr,
                    self._storage_key(rt, key),
                    name,
                    f"UID in precondition: {pre['uid']}, UID in object meta: {meta['uid']}",
                )
            if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
                raise errors.precondition_failed(
                    rt.gr,
                    self._storage_key(rt, key),
                    name,
                    f"ResourceVersion in precondition: {pre['resourceVersion']}, "
                    f"ResourceVersion in object meta: {meta['resourceVersion']}",
                )
            if dry_run:
                return self._output(rt, version, current)
            if rt.gr == CRD_GR:
                return self._output(rt, version, self._delete_crd(rt, key, current))
            if rt.gr == NAMESPACES_GR:
                return self._output(rt, version, self._terminate_namespace(rt, key, current))
            # the garbage collector's finalizers (orphan / foregroundDeletion) follow the
            # options, also on an object already being deleted (the server's own write)
            finalizers = (
                deletion_finalizers(current, options)
                if self.gc.enabled
                else list(meta.get("finalizers") or [])
            )
            if finalizers:
                if meta.get("deletionTimestamp") and finalizers == meta.get("finalizers"):
                    return self._output(rt, version, current)
                new = json_copy(current)
                new_meta = new["metadata"]
                new_meta["finalizers"] = finalizers
                if not meta.get("deletionTimestamp"):
                    # a Pod's deletion is graceful (its registry's CheckGracefulDelete): the
                    # timestamp is when its grace period ends
                    grace = _pod_grace(current, options) if rt.gr == PODS_GR else 0
                    new_meta["deletionTimestamp"] = now_rfc3339(grace)
                    new_meta["deletionGracePeriodSeconds"] = grace
                    new_meta["generation"] = int(new_meta.get("generation", 0)) + 1
                new_meta["resourceVersion"] = self._next_rv()
                self._bucket(rt)[key] = new
                self._emit("MODIFIED", rt, new, current)
                self._after_write(rt, current, new)
                return self._output(rt, version, new)
            return self._output(rt, version, self._remove(rt, key))

    def _remove(self, rt: ResourceType, key: Key) -> JSON:
        current = self._bucket(rt).pop(key)
        if rt.gr == CRD_GR:
            # stop serving its objects (none left after the cleanup finalizer; a finalizer
            # removed by hand leaves them behind on a real server, here they are dropped)
            self._drop_custom(resource_type_from_crd(current).gr)
        final = json_copy(current)
        final["metadata"]["resourceVersion"] = self._next_rv()
        self._emit("DELETED", rt, final, current)
        self._after_write(rt, current, None)
        if rt.custom:
            self._finish_crd_cleanup(rt)
        return final

    def _crd_of(self, rt: ResourceType) -> tuple[ResourceType, Key, JSON] | None:
        crd_rt = self.registry.get(CRD_GR)
        if crd_rt is None:
            return None
        key = self._key(crd_rt, None, f"{rt.plural}.{rt.group}")
        crd = self._bucket(crd_rt).get(key)
        return None if crd is None else (crd_rt, key, crd)

    def _crd_terminating(self, rt: ResourceType) -> bool:
        found = self._crd_of(rt) if rt.custom else None
        return found is not None and bool(_meta(found[2]).get("deletionTimestamp"))

    def _delete_crd(self, rt: ResourceType, key: Key, current: JSON) -> JSON:
        """Like the CRD's REST delete and the ``customresourcecleanup`` finalizer
        controller (apiextensions-apiserver ``registry/customresourcedefinition/etcd.go``,
        ``controller/finalizer/crd_finalizer.go``): the CRD is marked terminating (condition
        ``Terminating``), every custom object is deleted — their own finalizers honoured —
        and the CRD goes only once none is left. Until then it is still served (reads,
        updates, deletes; creates are refused)."""
        if not _meta(current).get("deletionTimestamp"):
            new = json_copy(current)
            meta = new["metadata"]
            meta["deletionTimestamp"] = now_rfc3339()
            meta["deletionGracePeriodSeconds"] = 0
            finalizers = list(meta.get("finalizers") or [])
            if CRD_CLEANUP_FINALIZER not in finalizers:
                finalizers.append(CRD_CLEANUP_FINALIZER)
            meta["finalizers"] = finalizers
            conditions = [
                c for c in (new.get("status") or {}).get("conditions") or []
                if c.get("type") != "Terminating"
            ]  # fmt: skip
            conditions.append(
                {
                    "type": "Terminating",
                    "status": "True",
                    "reason": "InstanceDeletionInProgress",
                    "message": "CustomResource deletion is in progress",
                    "lastTransitionTime": now_rfc3339(),
                }
            )
            new.setdefault("status", {})["conditions"] = conditions
            meta["resourceVersion"] = self._next_rv()
            self._bucket(rt)[key] = new
            self._emit("MODIFIED", rt, new, current)
            current = new
        served = self.registry.get(resource_type_from_crd(current).gr)
        if served is not None:
            for ns, name in sorted(self._bucket(served)):
                if (ns, name) in self._bucket(served):
                    self.delete(served, served.preferred_version, ns or None, name)
            self._finish_crd_cleanup(served)
        else:
            self._finish_crd_cleanup_of(rt, key)
        return self._bucket(rt).get(key, current)

    def _finish_crd_cleanup(self, served: ResourceType) -> None:
        found = self._crd_of(served)
        if found is not None:
            self._finish_crd_cleanup_of(found[0], found[1])

    def _finish_crd_cleanup_of(self, crd_rt: ResourceType, key: Key) -> None:
        crd = self._bucket(crd_rt).get(key)
        if crd is None or not _meta(crd).get("deletionTimestamp"):
            return
        served = self.registry.get(resource_type_from_crd(crd).gr)
        if served is not None and self._bucket(served):
            return  # objects left (their finalizers): the CRD waits for them
        finalizers = [f for f in _meta(crd).get("finalizers") or [] if f != CRD_CLEANUP_FINALIZER]
        if finalizers:
            return  # someone else's finalizer
        self._remove(crd_rt, key)

    @_collecting
    def delete_collection(
        self,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        labels: LabelSelector | None = None,
        fields: FieldSelector | None = None,
        options: JSON | None = None,
        *,
        dry_run: bool = False,
    ) -> list[JSON]:
        with self.lock:
            items, _ = self.list_objects(rt, version, namespace, labels, fields)
            return [
                self.delete(
                    rt,
                    version,
                    _meta(o).get("namespace"),
                    _meta(o)["name"],
                    options,
                    dry_run=dry_run,
                )
                for o in items
            ]

    def _terminate_namespace(self, rt: ResourceType, key: Key, current: JSON) -> JSON:
        """A deleted namespace turns ``Terminating``; the namespace controller
        (:meth:`namespace_controller_pass`) deletes its objects later and then it."""
        if _meta(current).get("deletionTimestamp"):
            return current
        new = json_copy(current)
        meta = new["metadata"]
        meta["deletionTimestamp"] = now_rfc3339()
        meta["deletionGracePeriodSeconds"] = 0
        new.setdefault("status", {})["phase"] = "Terminating"
        meta["resourceVersion"] = self._next_rv()
        self._bucket(rt)[key] = new
        self._emit("MODIFIED", rt, new, current)
        self._namespaces_terminating[key[1]] = time.monotonic()
        return new

    def _delete_namespace_contents(self, namespace: str) -> bool:
        """Delete every object of ``namespace`` (their finalizers honoured); whether none is
        left."""
        left = False
        for rt in self.registry:
            if not rt.namespaced:
                continue
            for key in [k for k in self._bucket(rt) if k[0] == namespace]:
                self.delete(rt, rt.preferred_version, namespace, key[1])
                left = left or key in self._bucket(rt)
        return not left

    @_collecting
    def collector_pass(self) -> None:
        """The garbage collector's delayed work, once due (``gc.delay``; the decorator
        drains it)."""

    @_collecting
    def namespace_controller_pass(self) -> list[str]:
        """The namespace controller: each namespace terminating for ``namespace_cleanup_delay``
        seconds has its objects deleted, and goes once none is left (an object held by a
        finalizer keeps it ``Terminating``). Returns the namespaces removed."""
        removed: list[str] = []
        ns_rt = self.registry.get(NAMESPACES_GR)
        assert ns_rt is not None
        now = time.monotonic()
        for name, since in sorted(self._namespaces_terminating.items()):
            if now - since < self.namespace_cleanup_delay:
                continue
            if not self._delete_namespace_contents(name):
                continue
            self._namespaces_terminating.pop(name, None)
            key = self._key(ns_rt, None, name)
            if key in self._bucket(ns_rt):
                self._remove(ns_rt, key)
                removed.append(name)
        return removed

    # --- CRDs ----------------------------------------------------------------------------

    def _admit(self, rt: ResourceType, version: str, old: JSON | None, new: JSON) -> None:
        from tests.doubles.apiserver import admission

        policies = list(self._objects.get(admission.POLICIES, {}).values())
        bindings = list(self._objects.get(admission.BINDINGS, {}).values())
        admission.admit(policies, bindings, rt, version, old, new)

    def _before_write(
        self,
        rt: ResourceType,
        version: str,
        old: JSON | None,
        new: JSON,
        field_validation: str = "Warn",
    ) -> None:
        """Validation and server-side defaulting of a write about to be committed."""
        name = str(_meta(new).get("name", ""))
        if rt.group == "resource.k8s.io" and rt.plural == "resourceslices":
            # like the real server (protobuf storage, `omitempty`): an empty devices list is
            # stored as absent
            spec = new.get("spec")
            if isinstance(spec, dict) and spec.get("devices") == []:
                del spec["devices"]
        if self.validate:
            causes = validate_metadata(new, dns_label_name=rt.gr == NAMESPACES_GR)
            if not rt.custom:
                causes += validate_resource(rt.group, rt.plural, new, old)
            schema = rt.schemas.get(version) if rt.custom else None
            if schema is not None:
                dropped = prune_and_default(new, schema)
                if dropped and field_validation == "Strict":
                    unknown = ", ".join(f'unknown field "{p}"' for p in dropped)
                    raise errors.bad_request(
                        f'{rt.kind} in version "{version}" cannot be handled as a {rt.kind}: '
                        f"strict decoding error: {unknown}"
                    )
                causes += validate_schema(new, schema)
            if causes:
                raise errors.invalid(rt.gr, rt.kind, name, causes)
        if self.admission_policies:
            self._admit(rt, version, old, new)
        if rt.gr == CRD_GR:
            try:
                served = resource_type_from_crd(new)
            except CRDError as exc:
                raise errors.invalid(
                    rt.gr, rt.kind, str(_meta(new).get("name", "")), exc.causes
                ) from exc
            names = json_copy(new["spec"]["names"])
            names.setdefault("singular", served.singular)
            names.setdefault("listKind", served.list_kind)
            storage = next(v["name"] for v in new["spec"]["versions"] if v.get("storage"))
            stored = list((old or {}).get("status", {}).get("storedVersions") or [])
            if storage not in stored:
                stored.append(storage)
            ts = (old or {}).get("status", {}).get("conditions", [{}])[0].get(
                "lastTransitionTime"
            ) or now_rfc3339()
            new["status"] = {
                "conditions": [
                    {
                        "type": "NamesAccepted",
                        "status": "True",
                        "reason": "NoConflicts",
                        "message": "no conflicts found",
                        "lastTransitionTime": ts,
                    },
                    {
                        "type": "Established",
                        "status": "True",
                        "reason": "InitialNamesAccepted",
                        "message": "the initial names have been accepted",
                        "lastTransitionTime": ts,
                    },
                ],
                "acceptedNames": names,
                "storedVersions": stored,
            }
        elif rt.gr == NAMESPACES_GR:
            status = new.setdefault("status", {})
            status["phase"] = "Terminating" if _meta(new).get("deletionTimestamp") else "Active"

    def _after_write(self, rt: ResourceType, old: JSON | None, new: JSON | None) -> None:
        """Keep the served resources in sync with the stored CRDs."""
        if rt.gr != CRD_GR:
            return
        if new is None:
            return  # the custom objects were dropped by _remove
        served = resource_type_from_crd(new)
        if old is not None:
            previous = resource_type_from_crd(old).gr
            if previous != served.gr:
                self._drop_custom(previous)
        if served.versions:
            self.registry.register(served)
        else:
            self.registry.unregister(served.gr)

    def _drop_custom(self, gr: GroupResource) -> None:
        """A CRD went away: stop serving it and delete its objects (finalizers ignored)."""
        registered = self.registry.get(gr)
        if registered is not None:
            bucket = self._bucket(registered)
            for key in sorted(bucket):
                obj = bucket[key]
                if _meta(obj).get("finalizers"):
                    obj = json_copy(obj)
                    del obj["metadata"]["finalizers"]
                    bucket[key] = obj
                self._remove(registered, key)
            self.registry.unregister(gr)
        self._objects.pop(gr, None)

    def load_crds(self, *paths: str | Path) -> list[ResourceType]:
        """Create (or update) every CRD found in the given YAML files (multi-document files
        and non-CRD documents are fine; the latter are ignored)."""
        crd_rt = self.registry.get(CRD_GR)
        assert crd_rt is not None
        loaded: list[ResourceType] = []
        for path in paths:
            with open(path, encoding="utf-8") as fh:
                docs = [d for d in yaml.safe_load_all(fh) if isinstance(d, dict)]
            for doc in docs:
                if doc.get("kind") != "CustomResourceDefinition":
                    continue
                self.apply_object(crd_rt, doc)
                loaded.append(resource_type_from_crd(doc))
        return loaded

    def apply_object(self, rt: ResourceType, body: JSON, namespace: str | None = None) -> JSON:
        """Create ``body`` or replace the existing object of that name (test helper)."""
        name = _meta(body).get("name", "")
        with self.lock:
            key = self._key(rt, namespace or _meta(body).get("namespace"), name)
            if name and key in self._bucket(rt):
                body = json_copy(body)
                _meta(body).pop("resourceVersion", None)
                return self.update(rt, rt.preferred_version, key[0] or None, name, body)
            return self.create(rt, rt.preferred_version, namespace, body)

    # --- watch ---------------------------------------------------------------------------

    def watch(
        self,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        resource_version: str | None,
        *,
        send_initial_events: bool | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> WatchStart:
        """Register a watcher. ``resource_version`` None/""/"0" starts with synthetic ADDED
        events for the current objects; a number replays the retained events after it, or
        raises 410 Gone (reason Expired) when that part of the history is compacted."""
        loop = loop or asyncio.get_running_loop()
        with self.lock:
            watcher = Watcher(rt.gr, namespace if rt.namespaced else None, labels, fields, loop)
            initial: list[tuple[str, JSON]] = []
            snapshot = resource_version in (None, "", "0") or bool(send_initial_events)
            if snapshot:
                items, _ = self.list_objects(rt, version, namespace, labels, fields)
                initial = [("ADDED", o) for o in items]
            else:
                assert resource_version is not None
                try:
                    since = int(resource_version)
                except ValueError as exc:
                    raise errors.bad_request(
                        f'invalid resource version "{resource_version}"'
                    ) from exc
                if since < self._compacted_rv:
                    raise errors.gone(
                        f"too old resource version: {since} ({self._compacted_rv + 1})"
                    )
                for event in self._history:
                    if event.rv > since and event.gr == rt.gr:
                        seen = watcher.translate(event)
                        if seen is not None:
                            initial.append(seen)
            self._watchers.add(watcher)
            return WatchStart(watcher, initial, self._rv)

    def unwatch(self, watcher: Watcher) -> None:
        with self.lock:
            watcher.closed = True
            self._watchers.discard(watcher)

    def close_watchers(self) -> int:
        """End every open watch stream (clients see the stream end and re-watch)."""
        with self.lock:
            watchers = list(self._watchers)
            for w in watchers:
                w.close()
            return len(watchers)

    @property
    def watcher_count(self) -> int:
        return len(self._watchers)

    def output(self, rt: ResourceType, version: str, obj: JSON) -> JSON:
        return self._output(rt, version, obj)
