"""Kubernetes backend: Instances and Configurations on the API server (:mod:`agent.core.kube`).

* Reads come from informer caches (list + watch, resumed from the last resourceVersion,
  relist on 410 Gone, capped backoff while the server is unreachable).
* Every Instance write is compare-and-swap: ``update`` is a PUT carrying the resourceVersion
  it was decided on (409 → :class:`ConflictError`), ``delete`` carries a resourceVersion
  precondition. There is no blind merge patch of ``deviceUsage`` or ``nodes``.
* Successful writes are applied to the cache at once (write-through), so the next decision
  never works on an older version than our own last write.
* An agent watches only the Instances that concern its node (label selector
  ``node.akri.sh/<hash>``, :mod:`agent.core.model.node_labels`): every Instance write carries
  the labels of the nodes its content concerns, so the API server filters; an Instance it
  must join that does not list it yet is read by its (deterministic) name. Instances without
  the labels (Akri's agent, earlier versions) are labelled when touched, and at start those
  that concern this node are found with ``!akri.sh/node-labels`` and labelled. The
  controller (``all_instances``) watches them all.
* Secrets/ConfigMaps named by ``discoveryProperties`` are read and watched by
  :mod:`agent.core.store.kube_properties`.
* Invalid Configurations and discovery problems become Kubernetes Events on the Configuration
  (sent, de-duplicated and bounded by :mod:`agent.core.store.kube_events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.kube import ApiError, KubeClient, ResponseTooLargeError, resource_path
from agent.core.kube.client import MAX_RETRY_AFTER
from agent.core.model.configuration import (
    Configuration,
    ConfigurationError,
    object_key,
    parse_configuration,
)
from agent.core.model.instance import Instance, InstanceFormatError
from agent.core.model.keys import ObjectKey
from agent.core.model.naming import DEVICE_DIGEST_ANNOTATION, offline_annotation
from agent.core.model.node_labels import (
    UNLABELLED_SELECTOR,
    concerned_nodes,
    concerned_nodes_of,
    labelled_for,
    labels_current,
    node_label,
    node_selector,
    with_node_labels,
)
from agent.core.model.properties import ObjectRef
from agent.core.store.base import (
    AlreadyExistsError,
    ConfigurationEvent,
    ConflictError,
    EventType,
    InstanceEvent,
    InstanceStore,
    InvalidConfiguration,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from agent.core.store.cache import InstanceCache
from agent.core.store.informer import (
    Informer,
    ListFn,
    Obj,
    RawEvent,
    WatchFn,
    identity_only,
    watch_events,
)
from agent.core.store.kube_events import EventRecorder
from agent.core.store.kube_properties import PropertySources

log = logging.getLogger(__name__)

GROUP = "akri.sh"
VERSION = "v0"
INSTANCES = "instances"
CONFIGURATIONS = "configurations"
WATCH_TIMEOUT_SECONDS = 290
PROBE_TIMEOUT = 2.0  # seconds for the GET /version that tells a backing-off watch the API is back
PROBE_REUSE = 0.9  # seconds one probe's answer serves both informers
# an Instance this node's own write took out of its view (it left, holding no slot) is known
# to exist this long without asking the API server (instance_exists)
LEFT_TRUST = 60.0
CRD_DEADLINE = 300.0  # seconds to wait at start for the akri.sh CRDs to be served
MAX_START_BACKOFF = 10.0
TRANSIENT = (0, 429, 500, 502, 503, 504)


@dataclass(frozen=True)
class KubernetesSettings:
    """Where to find the API server and what to watch."""

    node_name: str
    namespace: str | None = None  # None: all namespaces
    kubeconfig: str | None = None
    request_timeout: float = 30.0
    crd_deadline: float = CRD_DEADLINE
    # every Instance of the cluster (the controller), not only those concerning node_name
    all_instances: bool = False


def _status_of(error: BaseException) -> int | None:
    status = getattr(error, "status", None)
    return status if isinstance(status, int) else None


def _translate(error: BaseException, what: str) -> StoreError:
    status = _status_of(error)
    body = str(getattr(error, "body", "") or getattr(error, "reason", "") or error)
    if status == 409 and "AlreadyExists" in body:
        return AlreadyExistsError(what)
    if status == 409:
        return ConflictError(f"{what}: {body[:300]}")
    if status == 404:
        return NotFoundError(what)
    if status is None or status == 0 or status >= 500 or status == 429:
        return StoreUnavailableError(f"{what}: {type(error).__name__}: {body[:300]}")
    return StoreError(f"{what}: HTTP {status}: {body[:300]}")


class KubernetesInstanceStore(InstanceStore):
    """The store used in a cluster."""

    # kube-controller-manager's garbage collector deletes an Instance whose owner
    # Configuration is gone (Akri's ownerReference, kept on every Instance we write)
    garbage_collected = True

    def __init__(self, api_client: KubeClient, settings: KubernetesSettings) -> None:
        super().__init__()
        self._client = api_client
        self.settings = settings
        self._instances = InstanceCache()
        self._configurations: dict[ObjectKey, Configuration] = {}
        self._invalid: dict[ObjectKey, InvalidConfiguration] = {}  # never valid (yet)
        self._config_errors: dict[ObjectKey, str] = {}  # latest error, reported once
        # the label selector of this node's Instances (None: the controller's full view)
        self.instance_selector = (
            None if settings.all_instances else node_selector(settings.node_name)
        )
        self._instance_informer = Informer(
            "instances",
            self._lister(INSTANCES, self.instance_selector),
            self._watcher(INSTANCES, self.instance_selector),
            self._on_instance,
            keep=identity_only,  # the typed Instances in self._instances are the cache
            probe=self._probe,
            admits=None if self.instance_selector is None else self._in_view,
        )
        self.relabelled = 0  # Instances this store labelled (written by Akri or older agents)
        # name -> monotonic time this node's own write took that Instance out of its view
        self._left_at: dict[str, float] = {}
        self._config_informer = Informer(
            "configurations",
            self._lister(CONFIGURATIONS),
            self._watcher(CONFIGURATIONS),
            self._on_configuration,
            probe=self._probe,
        )
        self.request_count = 0
        self._probed_at = -PROBE_REUSE  # the last probe of the API server (shared, see _probe)
        self._probe_error: Exception | None = None
        self._events = EventRecorder(
            api_client, settings.node_name, settings.request_timeout, self._count_request
        )
        self._properties = PropertySources(
            api_client, settings.request_timeout, WATCH_TIMEOUT_SECONDS, self._count_request
        )

    def _count_request(self) -> None:
        self.request_count += 1

    @property
    def events_dropped(self) -> int:
        """Events not sent because too many were pending (``akri_events_dropped_total``)."""
        return self._events.dropped

    @property
    def api_client(self) -> KubeClient:
        """The shared :class:`KubeClient` (for the DRA slice publisher)."""
        return self._client

    def _instances_path(self, namespace: str, name: str | None = None) -> str:
        return resource_path(GROUP, VERSION, INSTANCES, namespace, name)

    async def read_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """A ``resource.k8s.io/v1`` ResourceClaim, or None if it does not exist."""
        self.request_count += 1
        path = resource_path("resource.k8s.io", "v1", "resourceclaims", namespace, name)
        try:
            return await self._client.get(path, request_timeout=self.settings.request_timeout)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        for informer, plural in (
            (self._config_informer, CONFIGURATIONS),
            (self._instance_informer, INSTANCES),
        ):
            await first_list(informer, plural, self.settings.crd_deadline)
        if self.instance_selector is not None:
            await self._label_unlabelled()
        self._tasks = [
            asyncio.create_task(self._config_informer.run(), name="watch-configurations"),
            asyncio.create_task(self._instance_informer.run(), name="watch-instances"),
        ]

    async def close(self) -> None:
        await self._stop_watching()
        await self._client.close()

    # -- list / watch plumbing -------------------------------------------------------------
    async def _probe(self) -> None:
        """Does the API server answer? ``GET /version``: the cheapest request there is, allowed
        to every client (``system:public-info-viewer``); raises while it does not. The two
        informers share one answer per :data:`PROBE_REUSE` seconds, so a node sends about
        one probe a second during an outage."""
        now = time.monotonic()
        if now - self._probed_at < PROBE_REUSE:
            if self._probe_error is not None:
                raise self._probe_error
            return
        self._probed_at = now
        self.request_count += 1
        try:
            await self._client.get("/version", request_timeout=PROBE_TIMEOUT)
        except Exception as error:
            self._probe_error = error
            raise
        self._probe_error = None

    def _lister(self, plural: str, label_selector: str | None = None) -> ListFn:
        path = resource_path(GROUP, VERSION, plural, self.settings.namespace or None)
        params = {"labelSelector": label_selector} if label_selector else None

        async def list_fn() -> tuple[list[Obj], str]:
            self.request_count += 1
            return await self._client.list_all(
                path, params=params, request_timeout=self.settings.request_timeout
            )

        return list_fn

    def _watcher(self, plural: str, label_selector: str | None = None) -> WatchFn:
        path = resource_path(GROUP, VERSION, plural, self.settings.namespace or None)

        def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
            stream = self._client.watch(
                path,
                version,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
                label_selector=label_selector,
            )
            return watch_events(stream, plural)

        return watch_fn

    # -- this node's view: node labels -----------------------------------------------------
    def _in_view(self, obj: Obj) -> bool:
        """Whether ``obj`` is in this node's watch (carries its label)."""
        return labelled_for(obj, self.settings.node_name)

    def _needs_labels(self, obj: Obj) -> bool:
        """``obj`` concerns this node (or carries its label) but its node labels are not
        those its content asks for: a writer without them (Akri's agent, an earlier version of
        ours) changed it, or a membership apply left a label another manager owns too."""
        if self.instance_selector is None or labels_current(obj):
            return False
        node = self.settings.node_name
        return node in concerned_nodes_of(obj) or labelled_for(obj, node)

    async def _relabel(self, obj: Obj) -> Obj:
        """Write ``obj``'s node labels as its content asks (a resourceVersion-checked PUT
        that changes nothing else; on a conflict decided again on a fresh read, a few
        times). Returns the stored object; one that cannot be written (refused, gone,
        unavailable) is returned as it was, and labelled at its next touch."""
        meta = obj.get("metadata") or {}
        path = self._instances_path(str(meta.get("namespace") or "default"), str(meta["name"]))
        for _ in range(3):
            self.request_count += 1
            try:
                stored = await self._client.replace(
                    path, with_node_labels(obj), request_timeout=self.settings.request_timeout
                )
            except ApiError as error:
                if error.status != 409:
                    log.warning("could not label instance %s: %s", meta.get("name"), error)
                    return obj
                self.request_count += 1
                try:
                    obj = await self._client.get(
                        path, request_timeout=self.settings.request_timeout
                    )
                except ApiError:
                    return obj
                if not self._needs_labels(obj):
                    return obj
                continue
            self.relabelled += 1
            return stored
        return obj

    async def _label_unlabelled(self) -> None:
        """Label the Instances that concern this node and carry no node labels (written by
        Akri's agent or an earlier version of ours, which this node's watch cannot see): the
        list ``!akri.sh/node-labels`` keeps only those (empty once a cluster has moved on),
        and the labelled ones enter the watch. A failure is logged; they are labelled when
        touched (a device reported again is read by name)."""
        node = self.settings.node_name
        path = resource_path(GROUP, VERSION, INSTANCES, self.settings.namespace or None)

        def concerning(obj: Obj) -> Obj | None:
            return obj if node in concerned_nodes_of(obj) else None

        self.request_count += 1
        try:
            found, _version = await self._client.list_all(
                path,
                params={"labelSelector": UNLABELLED_SELECTOR},
                request_timeout=self.settings.request_timeout,
                keep=concerning,
            )
        except Exception as error:
            log.warning("listing unlabelled instances at start failed: %s", error)
            return
        for obj in found:
            stored = await self._relabel(obj)
            if stored is not obj:
                self._instance_informer.apply_local(RawEvent("MODIFIED", stored))
        if found:
            log.info(
                "labelled %d instance(s) concerning %s written without node labels (by Akri's "
                "agent or an earlier version)",
                len(found),
                node,
            )

    # -- events from the informers ---------------------------------------------------------
    def _on_instance(self, event: RawEvent) -> None:
        if event.type == "DELETED":
            self._on_instance_deleted(event.obj)
            return
        try:
            instance = Instance.from_dict(event.obj)
        except InstanceFormatError as error:
            log.warning("ignoring malformed Instance: %s", error)
            return
        previous, catalog = self._instances.put(instance)
        kind = EventType.ADDED if previous is None else EventType.MODIFIED
        self._publish_instance(InstanceEvent(kind, instance, previous))
        if catalog:
            self._catalog_changed()

    def _on_instance_deleted(self, obj: Obj) -> None:
        """A deletion: ``obj`` is the last state (from a watch) or, after a relist, only the
        identity the informer kept (the typed copy here is the last state we know)."""
        meta = obj.get("metadata") or {}
        key = ObjectKey(str(meta.get("namespace") or "default"), str(meta.get("name") or ""))
        previous, catalog = self._instances.remove(key)
        try:
            instance = Instance.from_dict(obj) if obj.get("spec") is not None else previous
        except InstanceFormatError:
            instance = previous
        left: bool | None = False
        if self.instance_selector is not None and "spec" in obj:
            if not self._in_view(obj):
                left = True  # our own write took this node out
            elif not meta.get("deletionTimestamp"):
                # the watch says "deleted" for both (kube-apiserver sends the last state this
                # node's selector matched); one of ours that was deleted was terminating
                left = None
        if instance is not None:
            self._publish_instance(InstanceEvent(EventType.DELETED, instance, previous, left))
        if catalog:
            self._catalog_changed()

    def _on_configuration(self, event: RawEvent) -> None:
        key = object_key(event.obj)
        if key is None:
            log.warning("ignoring a Configuration without a name")
            return
        if event.type == "DELETED":
            old = self._configurations.pop(key, None)
            invalid = self._invalid.pop(key, None)
            self._config_errors.pop(key, None)
            self._publish_configuration(ConfigurationEvent(EventType.DELETED, key, old))
            if old is not None or invalid is not None:
                self._catalog_changed()
            return
        meta = event.obj.get("metadata") or {}
        try:
            configuration = parse_configuration(event.obj)
        except ConfigurationError as error:
            message = "; ".join(error.problems)
            source = f"configuration {key}"
            newly_invalid = key not in self._configurations and key not in self._invalid
            if key not in self._configurations:  # no good version: remember it exists
                self._invalid[key] = InvalidConfiguration(
                    key, message, meta.get("creationTimestamp"), dict(event.obj)
                )
            if self._config_errors.get(key) != message:
                self._config_errors[key] = message
                log.error("invalid %s: %s", source, message)
                self._events.record_soon(
                    event.obj, "Configuration", "InvalidConfiguration", message
                )
            self._publish_configuration(
                ConfigurationEvent(EventType.MODIFIED, key, None, message, source)
            )
            if newly_invalid:
                self._catalog_changed()
            return
        was_broken = self._config_errors.pop(key, None) is not None
        self._invalid.pop(key, None)
        old = self._configurations.get(key)
        self._configurations[key] = configuration
        if was_broken:
            log.info("configuration %s is valid again: accepted", key)
        if old is None:
            self._catalog_changed()
        kind = EventType.ADDED if old is None else EventType.MODIFIED
        if old is not None and old.raw.get("spec") == configuration.raw.get("spec"):
            return  # metadata-only change (Akri #372): nothing to do
        self._publish_configuration(ConfigurationEvent(kind, key, configuration))

    # -- reads -----------------------------------------------------------------------------
    def get_cached(self, key: ObjectKey) -> Instance | None:
        return self._instances.get(key)

    def list_cached(self, configuration: ObjectKey | None = None) -> list[Instance]:
        return self._instances.all(configuration)

    def instances_named(self, name: str) -> list[Instance]:
        return self._instances.named(name)

    def instance_configurations(self) -> set[ObjectKey]:
        return self._instances.configuration_keys()

    def _remember_left(self, name: str) -> None:
        now = time.monotonic()
        for old in [n for n, at in self._left_at.items() if now - at >= LEFT_TRUST]:
            del self._left_at[old]
        self._left_at[name] = now

    async def instance_exists(self, name: str) -> bool:
        if self.instance_selector is None or self._instances.named(name):
            return bool(self._instances.named(name))
        left = self._left_at.get(name)
        if left is not None and time.monotonic() - left < LEFT_TRUST:
            return True  # this node's own write took it out of its view: it exists
        self.request_count += 1
        path = resource_path(GROUP, VERSION, INSTANCES, self.settings.namespace or None)
        found, _version = await self._client.list_all(
            path,
            params={"fieldSelector": f"metadata.name={name}"},
            request_timeout=self.settings.request_timeout,
            keep=identity_only,
        )
        return bool(found)

    def configurations(self) -> list[Configuration]:
        return [self._configurations[key] for key in sorted(self._configurations)]

    def invalid_configurations(self) -> list[InvalidConfiguration]:
        return [self._invalid[key] for key in sorted(self._invalid)]

    async def get(self, key: ObjectKey) -> Instance:
        self.request_count += 1
        try:
            obj = await self._client.get(
                self._instances_path(key.namespace, key.name),
                request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            translated = _translate(error, f"instance {key}")
            if isinstance(translated, NotFoundError):
                self._forget(key)
            raise translated from error
        if self._needs_labels(obj):
            obj = await self._relabel(obj)
        self._instance_informer.apply_local(RawEvent("MODIFIED", obj))
        return Instance.from_dict(obj)

    def _forget(self, key: ObjectKey) -> None:
        """The server says ``key`` is gone: drop it from the cache (with an event)."""
        cached = self._instances.get(key)
        if cached is not None:
            self._instance_informer.apply_local(RawEvent("DELETED", cached.to_dict()))

    # -- writes ----------------------------------------------------------------------------
    async def create(self, instance: Instance) -> Instance:
        body = with_node_labels(instance.evolve(resource_version=None, uid=None).to_dict())
        self.request_count += 1
        try:
            obj = await self._client.create(
                self._instances_path(instance.namespace),
                body,
                request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            raise _translate(error, f"instance {instance.key}") from error
        self._instance_informer.apply_local(RawEvent("ADDED", obj))
        return Instance.from_dict(obj)

    async def update(self, instance: Instance) -> Instance:
        if instance.resource_version is None:
            raise ConflictError(f"{instance.key}: update needs the resourceVersion it is based on")
        self.request_count += 1
        try:
            obj = await self._client.replace(
                self._instances_path(instance.namespace, instance.name),
                with_node_labels(instance.to_dict()),
                request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            translated = _translate(error, f"instance {instance.key}")
            if isinstance(translated, ConflictError | NotFoundError):
                with contextlib.suppress(StoreError):
                    await self.get(instance.key)  # refresh the cache for the next decision
            raise translated from error
        meta = obj.get("metadata") or {}
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            # the write removed the last finalizer of a terminating Instance: it is gone
            self._instance_informer.apply_local(RawEvent("DELETED", obj))
        else:
            self._written(obj)
        return Instance.from_dict(obj)

    async def delete(self, key: ObjectKey, *, resource_version: str | None = None) -> None:
        self.request_count += 1
        try:
            answer = await self._client.delete(
                self._instances_path(key.namespace, key.name),
                delete_options(resource_version),
                request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            translated = _translate(error, f"instance {key}")
            if isinstance(translated, ConflictError):
                with contextlib.suppress(StoreError):
                    await self.get(key)
            if isinstance(translated, NotFoundError):
                self._forget(key)
            raise translated from error
        if (answer.get("metadata") or {}).get("deletionTimestamp") and answer.get("spec"):
            # finalizers keep it (akri.sh/slots: slots still held): it is terminating, not
            # gone; forgetting it would hide it until the watch caught up with our "delete"
            self._instance_informer.apply_local(RawEvent("MODIFIED", answer))
            return
        self._forget(key)

    # why membership applies are not used (an API server refused one for good), or None
    _membership_refused: str | None = None

    async def apply_membership(
        self,
        key: ObjectKey,
        node: str,
        member: bool,
        *,
        uid: str | None,
        offline: str | None = None,
        fingerprint: str | None = None,
    ) -> Instance | None:
        """Server-side apply of ``node``'s entry of ``spec.nodes`` as field manager
        :func:`membership_manager` (``nodes`` is ``x-kubernetes-list-type: set`` in the CRD:
        each element is owned by the managers that applied it, so concurrent joins and leaves
        merge instead of conflicting). A leave applies ``nodes: []``, which removes the entry
        only if no other manager owns it too. An apply refused for good (403: RBAC without
        ``patch``, as deployed before it was granted; 405/415; 422 from an admission check)
        turns them off for this process, with one warning: None, the caller writes the
        membership with a checked write as before. An apply refused because the Instance was
        deleted (and maybe re-created) meanwhile raises :class:`ConflictError` (re-read; the
        caller decides again) or :class:`NotFoundError`, and leaves applies on.

        ``offline``: the node's offline annotation (:func:`offline_annotation`, a map key of
        its own in ``metadata.annotations``) is part of the same applied configuration, so an
        apply without it — a node seeing the device again, or leaving — removes it unless
        another manager owns it too (the stored Instance then still has it; the caller
        removes it with a checked write)."""
        if self._membership_refused is not None:
            return None
        metadata: dict[str, Any] = {"name": key.name, "namespace": key.namespace}
        if uid:
            metadata["uid"] = uid  # a precondition: 409 if the Instance was re-created
        annotations: dict[str, str] = {}
        if member and offline is not None:
            annotations[offline_annotation(node)] = offline
        if fingerprint:
            # applied with the entry: an Instance whose writer set another device's value
            # refuses the apply (409, a field manager conflict), so a digest collision is
            # never joined, not even for a moment
            annotations[DEVICE_DIGEST_ANNOTATION] = fingerprint
        if annotations:
            metadata["annotations"] = annotations
        cached = self._instances.get(key)
        if member or (cached is not None and node in concerned_nodes((), cached.device_usage)):
            # this node's label is its own too: listed (or holding slots), it stays in its view
            metadata["labels"] = {node_label(node): ""}
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Instance",
            "metadata": metadata,
            "spec": {"nodes": [node] if member else []},
        }
        self.request_count += 1
        try:
            obj = await self._client.apply(
                self._instances_path(key.namespace, key.name),
                body,
                field_manager=membership_manager(node),
                request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            translated = _translate(error, f"instance {key}")
            status = _status_of(error)
            if status == 422:
                # re-read to tell a real refusal from two answers that only say the Instance
                # is not the one decided on: gone (an apply creates a missing object, and one
                # with only spec.nodes is invalid: spec.configurationName is required), or
                # re-created (a real API server refuses the stale uid as a change of an
                # immutable field, 422, not 409: kubernetes/kubernetes#127625)
                live = await self.get(key)  # raises NotFoundError when gone
                if uid and live.uid != uid:
                    raise ConflictError(
                        f"instance {key} was re-created (uid {live.uid}, not {uid})"
                    ) from error
            if status in (403, 405, 415, 422):
                self._membership_refused = f"HTTP {status}"
                log.warning(
                    "the API server refused a server-side apply of spec.nodes of %s (%s); "
                    "joins and leaves are written with checked updates from now on (grant "
                    "'patch' on instances.akri.sh: deploy/base/rbac.yaml)",
                    key,
                    str(translated)[:300],
                )
                return None
            if isinstance(translated, ConflictError | NotFoundError):
                with contextlib.suppress(StoreError):
                    await self.get(key)
            raise translated from error
        if self._needs_labels(obj):
            obj = await self._relabel(obj)
        self._written(obj)
        return Instance.from_dict(obj)

    def _written(self, obj: Obj) -> None:
        """Our write's answer into the cache (it leaves the cache when it took this node out
        of its view: remembered, so that :meth:`instance_exists` need not ask)."""
        if self.instance_selector is not None and not self._in_view(obj):
            self._remember_left(str((obj.get("metadata") or {}).get("name") or ""))
        self._instance_informer.apply_local(RawEvent("MODIFIED", obj))

    # -- Secrets / ConfigMaps for discoveryProperties --------------------------------------
    async def read_object(self, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        return await self._properties.read(kind, namespace, name)

    def watch_objects(
        self, refs: Iterable[ObjectRef], on_change: Callable[[], None]
    ) -> Callable[[], None]:
        return self._properties.watch(refs, on_change)

    # -- Kubernetes Events -----------------------------------------------------------------
    async def record_raw_configuration_event(
        self, raw: Mapping[str, Any], reason: str, message: str, *, warning: bool = True
    ) -> None:
        await self._events.record(raw, "Configuration", reason, message, warning=warning)

    async def record_instance_event(
        self, instance: Instance, reason: str, message: str, *, warning: bool = True
    ) -> None:
        await self._events.record(instance.to_dict(), "Instance", reason, message, warning=warning)


async def first_list(
    informer: Informer,
    plural: str,
    crd_deadline: float,
    *,
    group: str = GROUP,
    not_served: str | None = None,
    sleep: Callable[[float], Any] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """The informer's first list, waiting out what heals by waiting: 429 (a real API server
    answers it while the storage of just-applied CRDs initialises, with ``Retry-After``),
    5xx and no answer at all are retried with capped backoff, honouring ``retryAfterSeconds``,
    each wait logged; 404 (the CRDs are not installed yet) until ``crd_deadline``. 401/403
    cannot heal: raised at once, naming the verb and resource.

    Every failure that ends the wait is a :class:`StoreError`. ``not_served`` is its message
    when ``plural.group`` is still not served at the deadline (default: install the CRDs)."""
    started = clock()
    backoff = 0.5
    what = f"{plural}.{group}"
    while True:
        try:
            await informer.initial_list()
            return
        except ResponseTooLargeError as error:
            raise StoreError(
                f"initial list of {what}: one object is over the client's size limit ({error})"
            ) from error
        except ApiError as error:
            if error.status in (401, 403):
                raise StoreError(
                    f"HTTP {error.status}: the agent may not list {what} (verb list, "
                    f"resource {plural}, group {group}): check its ServiceAccount and "
                    "deploy/base/rbac.yaml"
                ) from error
            if error.status == 404:
                if clock() - started >= crd_deadline:
                    raise StoreError(
                        not_served
                        or f"{what} is not served after {crd_deadline:.0f}s: are the CRDs "
                        "installed? (kubectl apply -f crds/)"
                    ) from error
                reason = "not served yet (CRDs not installed?)"
            elif error.status in TRANSIENT:
                reason = str(error)[:200]
            else:
                raise _translate(error, f"initial list of {what}") from error
            # the server's figure, but never longer than the client waits on its own
            # requests: a bogus retryAfterSeconds of hours must not stall the start
            wait = min(error.retry_after or backoff, MAX_RETRY_AFTER)
            backoff = min(backoff * 2, MAX_START_BACKOFF)
            log.warning("listing %s at start: %s; retrying in %.1fs", what, reason, wait)
            await sleep(wait)


def membership_manager(node: str) -> str:
    """The field manager of ``node``'s own ``spec.nodes`` entry (server-side apply)."""
    return f"akri.sh/{node}"


def delete_options(resource_version: str | None) -> dict[str, Any]:
    """A ``DeleteOptions`` body, with a resourceVersion precondition if one is given."""
    options: dict[str, Any] = {}
    if resource_version:
        options["preconditions"] = {"resourceVersion": resource_version}
    return options


def dumps(obj: Any) -> str:
    """Compact JSON (for logs)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)
