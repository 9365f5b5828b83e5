"""Kubernetes backend: Instances and Configurations on the API server (:mod:`agent.core.kube`).

* Reads come from informer caches (list + watch, resumed from the last resourceVersion,
  relist on 410 Gone, capped backoff while the server is unreachable).
* Every Instance write is compare-and-swap: ``update`` is a PUT carrying the resourceVersion
  it was decided on (409 → :class:`ConflictError`), ``delete`` carries a resourceVersion
  precondition. There is no blind merge patch of ``deviceUsage`` or ``nodes``.
* Successful writes are applied to the cache at once (write-through), so the next decision
  never works on an older version than our own last write.
* Invalid Configurations and discovery problems become Kubernetes Events on the Configuration.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
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
from agent.core.model.properties import ObjectRef, PropertyResolutionError
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

log = logging.getLogger(__name__)

GROUP = "akri.sh"
VERSION = "v0"
INSTANCES = "instances"
CONFIGURATIONS = "configurations"
WATCH_TIMEOUT_SECONDS = 290
EVENT_REPEAT_INTERVAL = 300.0
# Events are best effort: under a flood of distinct messages (a handler reporting thousands of
# bad devices) neither the de-duplication memory nor the requests in flight may grow without
# bound. Over these, the oldest memory is forgotten, and new Events are dropped and counted.
MAX_EVENT_KEYS = 4096
MAX_EVENTS_IN_FLIGHT = 32
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

    def __init__(self, api_client: KubeClient, settings: KubernetesSettings) -> None:
        super().__init__()
        self._client = api_client
        self.settings = settings
        self._instances = InstanceCache()
        self._configurations: dict[ObjectKey, Configuration] = {}
        self._invalid: dict[ObjectKey, InvalidConfiguration] = {}  # never valid (yet)
        self._config_errors: dict[ObjectKey, str] = {}  # latest error, reported once
        self._instance_informer = Informer(
            "instances",
            self._lister(INSTANCES),
            self._watcher(INSTANCES),
            self._on_instance,
            keep=identity_only,  # the typed Instances in self._instances are the cache
        )
        self._config_informer = Informer(
            "configurations",
            self._lister(CONFIGURATIONS),
            self._watcher(CONFIGURATIONS),
            self._on_configuration,
        )
        # (object, reason, message) -> when last sent; oldest first (re-sent keys move to the
        # end), so expired entries are dropped from the front
        self._events_sent: collections.OrderedDict[tuple[str, str, str], float] = (
            collections.OrderedDict()
        )
        self._events_in_flight = 0
        self.events_dropped = 0  # Events not sent because MAX_EVENTS_IN_FLIGHT were pending
        self._event_tasks: set[asyncio.Task[None]] = set()
        self.request_count = 0

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
        self._tasks = [
            asyncio.create_task(self._config_informer.run(), name="watch-configurations"),
            asyncio.create_task(self._instance_informer.run(), name="watch-instances"),
        ]

    async def close(self) -> None:
        await self._stop_watching()
        await self._client.close()

    # -- list / watch plumbing -------------------------------------------------------------
    def _lister(self, plural: str) -> ListFn:
        path = resource_path(GROUP, VERSION, plural, self.settings.namespace or None)

        async def list_fn() -> tuple[list[Obj], str]:
            self.request_count += 1
            return await self._client.list_all(path, request_timeout=self.settings.request_timeout)

        return list_fn

    def _watcher(self, plural: str) -> WatchFn:
        path = resource_path(GROUP, VERSION, plural, self.settings.namespace or None)

        def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
            stream = self._client.watch(path, version, timeout_seconds=WATCH_TIMEOUT_SECONDS)
            return watch_events(stream, plural)

        return watch_fn

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
        if instance is not None:
            self._publish_instance(InstanceEvent(EventType.DELETED, instance, previous))
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
                task = asyncio.get_running_loop().create_task(
                    self._event_for_raw(event.obj, "Configuration", "InvalidConfiguration", message)
                )
                # a reference, or the loop may collect the task before it runs
                self._event_tasks.add(task)
                task.add_done_callback(self._event_tasks.discard)
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
        self._instance_informer.apply_local(RawEvent("MODIFIED", obj))
        return Instance.from_dict(obj)

    def _forget(self, key: ObjectKey) -> None:
        """The server says ``key`` is gone: drop it from the cache (with an event)."""
        cached = self._instances.get(key)
        if cached is not None:
            self._instance_informer.apply_local(RawEvent("DELETED", cached.to_dict()))

    # -- writes ----------------------------------------------------------------------------
    async def create(self, instance: Instance) -> Instance:
        body = instance.evolve(resource_version=None, uid=None).to_dict()
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
                instance.to_dict(),
                request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            translated = _translate(error, f"instance {instance.key}")
            if isinstance(translated, ConflictError | NotFoundError):
                with contextlib.suppress(StoreError):
                    await self.get(instance.key)  # refresh the cache for the next decision
            raise translated from error
        self._instance_informer.apply_local(RawEvent("MODIFIED", obj))
        return Instance.from_dict(obj)

    async def delete(self, key: ObjectKey, *, resource_version: str | None = None) -> None:
        self.request_count += 1
        try:
            await self._client.delete(
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
        self._forget(key)

    # -- Secrets / ConfigMaps for discoveryProperties --------------------------------------
    async def read_object(self, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        plural = "secrets" if kind == "secret" else "configmaps"
        self.request_count += 1
        try:
            return await self._client.get(
                resource_path("", "v1", plural, namespace, name),
                request_timeout=self.settings.request_timeout,
            )
        except ApiError as error:
            if error.status == 404:
                return None
            if error.status == 403:
                raise PropertyResolutionError(
                    f"cannot read {kind} {namespace}/{name}: forbidden — the agent's "
                    f"ServiceAccount needs get, list and watch on {plural} in namespace "
                    f"{namespace}: kubectl apply -n {namespace} -f "
                    "deploy/properties-reader.yaml"
                ) from error
            what = f"HTTP {error.status}" if error.status else type(error).__name__
            raise PropertyResolutionError(
                f"cannot read {kind} {namespace}/{name}: {what}"
            ) from error

    def watch_objects(
        self, refs: Iterable[ObjectRef], on_change: Callable[[], None]
    ) -> Callable[[], None]:
        tasks = [
            asyncio.get_running_loop().create_task(
                self._watch_named(ref, on_change), name=f"watch-{ref.kind}-{ref.name}"
            )
            for ref in refs
        ]

        def stop() -> None:
            for task in tasks:
                task.cancel()

        return stop

    async def _watch_named(self, ref: ObjectRef, on_change: Callable[[], None]) -> None:
        """Watch one Secret/ConfigMap by name (field selector, so RBAC may use resourceNames)."""
        selector = f"metadata.name={ref.name}"
        plural = "secrets" if ref.kind == "secret" else "configmaps"
        path = resource_path("", "v1", plural, ref.namespace)
        initial = True

        async def list_fn() -> tuple[list[Obj], str]:
            self.request_count += 1
            try:
                return await self._client.list_all(
                    path,
                    params={"fieldSelector": selector},
                    request_timeout=self.settings.request_timeout,
                )
            except ApiError as error:
                if error.status == 0:
                    raise
                raise StoreUnavailableError(f"list {ref.kind}: HTTP {error.status}") from error

        def watch_fn(version: str) -> AsyncGenerator[tuple[str, Obj], None]:
            stream = self._client.watch(
                path, version, timeout_seconds=WATCH_TIMEOUT_SECONDS, field_selector=selector
            )
            return watch_events(stream, ref.kind)

        def changed(_event: RawEvent) -> None:
            if not initial:
                on_change()

        informer = Informer(f"{ref.kind} {ref.namespace}/{ref.name}", list_fn, watch_fn, changed)
        while True:
            try:
                await informer.initial_list()
                break
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("cannot list %s %s/%s: %s", ref.kind, ref.namespace, ref.name, error)
                await asyncio.sleep(5)
        initial = False
        await informer.run()

    # -- Kubernetes Events -----------------------------------------------------------------
    async def record_raw_configuration_event(
        self, raw: Mapping[str, Any], reason: str, message: str, *, warning: bool = True
    ) -> None:
        await self._event_for_raw(raw, "Configuration", reason, message, warning=warning)

    async def record_instance_event(
        self, instance: Instance, reason: str, message: str, *, warning: bool = True
    ) -> None:
        await self._event_for_raw(instance.to_dict(), "Instance", reason, message, warning=warning)

    async def _event_for_raw(
        self,
        obj: Mapping[str, Any],
        kind: str,
        reason: str,
        message: str,
        *,
        warning: bool = True,
    ) -> None:
        """Create a core/v1 Event about an akri.sh object; the same event at most every 5 min."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        namespace = str(meta.get("namespace") or "default")
        key = (f"{kind}/{namespace}/{name}", reason, message)
        now = time.monotonic()
        sent = self._events_sent
        while sent and (
            len(sent) >= MAX_EVENT_KEYS or now - next(iter(sent.values())) >= EVENT_REPEAT_INTERVAL
        ):
            sent.popitem(last=False)  # expired (or the oldest, when full)
        if key in sent:
            return  # sent less than EVENT_REPEAT_INTERVAL ago
        if self._events_in_flight >= MAX_EVENTS_IN_FLIGHT:
            if not self.events_dropped:
                log.warning(
                    "%d Events are being sent already: dropping new ones (counted in "
                    "events_dropped; logged once)",
                    self._events_in_flight,
                )
            self.events_dropped += 1
            return
        sent[key] = now
        timestamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": kind,
                "name": name,
                "namespace": namespace,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": "akri-agent", "host": self.settings.node_name},
            "reportingComponent": "akri.sh/agent",
            "reportingInstance": self.settings.node_name,
            "firstTimestamp": timestamp,
            "lastTimestamp": timestamp,
            "count": 1,
        }
        self.request_count += 1
        self._events_in_flight += 1
        try:
            await self._client.create(
                resource_path("", "v1", "events", namespace),
                body,
                request_timeout=self.settings.request_timeout,
            )
        except Exception as error:  # an Event is best effort; never fail the caller
            log.warning(
                "could not record event %s on %s %s/%s: %s", reason, kind, namespace, name, error
            )
        finally:
            self._events_in_flight -= 1


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


def delete_options(resource_version: str | None) -> dict[str, Any]:
    """A ``DeleteOptions`` body, with a resourceVersion precondition if one is given."""
    options: dict[str, Any] = {}
    if resource_version:
        options["preconditions"] = {"resourceVersion": resource_version}
    return options


def dumps(obj: Any) -> str:
    """Compact JSON (for logs)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)
