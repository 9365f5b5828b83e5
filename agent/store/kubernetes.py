"""Kubernetes backend: Instances and Configurations on the API server (``kubernetes.aio``).

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
import contextlib
import datetime
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.discovery.properties import ObjectRef, PropertyResolutionError
from agent.model.configuration import Configuration, ConfigurationError, parse_configuration
from agent.model.instance import Instance, InstanceFormatError
from agent.store.base import (
    AlreadyExistsError,
    ConfigurationEvent,
    ConflictError,
    EventType,
    InstanceEvent,
    InstanceStore,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from agent.store.informer import Informer, Obj, RawEvent, watch_events

log = logging.getLogger(__name__)

GROUP = "akri.sh"
VERSION = "v0"
INSTANCES = "instances"
CONFIGURATIONS = "configurations"
WATCH_TIMEOUT_SECONDS = 290
EVENT_REPEAT_INTERVAL = 300.0


@dataclass(frozen=True)
class KubernetesSettings:
    """Where to find the API server and what to watch."""

    node_name: str
    namespace: str | None = None  # None: all namespaces
    kubeconfig: str | None = None
    request_timeout: float = 30.0


async def make_api_client(kubeconfig: str | None) -> Any:
    """An ``ApiClient`` from a kubeconfig file, else in-cluster config, else ~/.kube/config."""
    from kubernetes.aio import client
    from kubernetes.aio import config as kube_config

    config: Any = kube_config  # untyped module
    configuration = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            await config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


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

    def __init__(self, api_client: Any, settings: KubernetesSettings) -> None:
        super().__init__()
        from kubernetes.aio import client

        self._api_client = api_client
        # kept as Any: the generated client types custom objects as ``object``
        self._custom: Any = client.CustomObjectsApi(api_client)
        self._core: Any = client.CoreV1Api(api_client)
        self.settings = settings
        self._instances: dict[str, Instance] = {}
        self._configurations: dict[str, Configuration] = {}
        self._config_errors: dict[str, str] = {}
        self._instance_informer = Informer(
            "instances", self._lister(INSTANCES), self._watcher(INSTANCES), self._on_instance
        )
        self._config_informer = Informer(
            "configurations",
            self._lister(CONFIGURATIONS),
            self._watcher(CONFIGURATIONS),
            self._on_configuration,
        )
        self._events_sent: dict[tuple[str, str, str], float] = {}
        self.request_count = 0

    @property
    def api_client(self) -> Any:
        """The shared ``kubernetes.aio`` ApiClient (for the DRA slice publisher)."""
        return self._api_client

    async def read_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """A ``resource.k8s.io/v1`` ResourceClaim, or None if it does not exist."""
        self.request_count += 1
        try:
            claim: Mapping[str, Any] = await self._custom.get_namespaced_custom_object(
                "resource.k8s.io",
                "v1",
                namespace,
                "resourceclaims",
                name,
                _request_timeout=self.settings.request_timeout,
            )
            return claim
        except Exception as error:
            if _status_of(error) == 404:
                return None
            raise

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._config_informer.initial_list()
            await self._instance_informer.initial_list()
        except Exception as error:
            raise _translate(error, "initial list of Configurations and Instances") from error
        self._tasks = [
            asyncio.create_task(self._config_informer.run(), name="watch-configurations"),
            asyncio.create_task(self._instance_informer.run(), name="watch-instances"),
        ]

    async def close(self) -> None:
        await self._stop_watching()
        await self._api_client.close()

    # -- list / watch plumbing -------------------------------------------------------------
    def _lister(self, plural: str) -> Any:
        async def list_fn() -> tuple[list[Obj], str]:
            self.request_count += 1
            if self.settings.namespace:
                result = await self._custom.list_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    self.settings.namespace,
                    plural,
                    _request_timeout=self.settings.request_timeout,
                )
            else:
                result = await self._custom.list_cluster_custom_object(
                    GROUP, VERSION, plural, _request_timeout=self.settings.request_timeout
                )
            items = list(result.get("items") or [])
            return items, str((result.get("metadata") or {}).get("resourceVersion") or "")

        return list_fn

    def _watcher(self, plural: str) -> Any:
        async def watch_fn(version: str) -> AsyncIterator[tuple[str, Obj]]:
            kwargs: dict[str, Any] = {
                "watch": True,
                "resource_version": version,
                "timeout_seconds": WATCH_TIMEOUT_SECONDS,
                "allow_watch_bookmarks": True,
                "_request_timeout": WATCH_TIMEOUT_SECONDS + 30,
            }
            if self.settings.namespace:
                response = await self._custom.list_namespaced_custom_object_without_preload_content(
                    GROUP, VERSION, self.settings.namespace, plural, **kwargs
                )
            else:
                response = await self._custom.list_cluster_custom_object_without_preload_content(
                    GROUP, VERSION, plural, **kwargs
                )
            async for item in watch_events(response, plural):
                yield item

        return watch_fn

    # -- events from the informers ---------------------------------------------------------
    def _on_instance(self, event: RawEvent) -> None:
        try:
            instance = Instance.from_dict(event.obj)
        except InstanceFormatError as error:
            log.warning("ignoring malformed Instance: %s", error)
            return
        previous = self._instances.get(instance.name)
        if event.type == "DELETED":
            self._instances.pop(instance.name, None)
            self._publish_instance(InstanceEvent(EventType.DELETED, instance, previous))
            return
        self._instances[instance.name] = instance
        kind = EventType.ADDED if previous is None else EventType.MODIFIED
        self._publish_instance(InstanceEvent(kind, instance, previous))

    def _on_configuration(self, event: RawEvent) -> None:
        meta = event.obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if event.type == "DELETED":
            old = self._configurations.pop(name, None)
            self._config_errors.pop(name, None)
            self._publish_configuration(ConfigurationEvent(EventType.DELETED, name, old))
            return
        try:
            configuration = parse_configuration(event.obj)
        except ConfigurationError as error:
            message = "; ".join(error.problems)
            source = f"configuration {meta.get('namespace', 'default')}/{name}"
            if self._config_errors.get(name) != message:
                self._config_errors[name] = message
                log.error("invalid %s: %s", source, message)
                asyncio.get_running_loop().create_task(
                    self._event_for_raw(event.obj, "InvalidConfiguration", message)
                )
            self._publish_configuration(
                ConfigurationEvent(EventType.MODIFIED, name, None, message, source)
            )
            return
        self._config_errors.pop(name, None)
        old = self._configurations.get(name)
        self._configurations[name] = configuration
        kind = EventType.ADDED if old is None else EventType.MODIFIED
        if old is not None and old.raw.get("spec") == configuration.raw.get("spec"):
            return  # metadata-only change (Akri #372): nothing to do
        self._publish_configuration(ConfigurationEvent(kind, name, configuration))

    # -- reads -----------------------------------------------------------------------------
    def get_cached(self, name: str) -> Instance | None:
        return self._instances.get(name)

    def list_cached(self, configuration: str | None = None) -> list[Instance]:
        return [
            inst
            for _, inst in sorted(self._instances.items())
            if configuration is None or inst.configuration_name == configuration
        ]

    def configurations(self) -> list[Configuration]:
        return [self._configurations[n] for n in sorted(self._configurations)]

    def _namespace_of(self, name: str, instance: Instance | None = None) -> str:
        if instance is not None:
            return instance.namespace
        cached = self._instances.get(name)
        if cached is not None:
            return cached.namespace
        return self.settings.namespace or "default"

    async def get(self, name: str) -> Instance:
        namespace = self._namespace_of(name)
        self.request_count += 1
        try:
            obj = await self._custom.get_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                INSTANCES,
                name,
                _request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            translated = _translate(error, f"instance {namespace}/{name}")
            if isinstance(translated, NotFoundError):
                cached = self._instances.get(name)
                if cached is not None:
                    self._instance_informer.apply_local(RawEvent("DELETED", cached.to_dict()))
            raise translated from error
        self._instance_informer.apply_local(RawEvent("MODIFIED", obj))
        return Instance.from_dict(obj)

    # -- writes ----------------------------------------------------------------------------
    async def create(self, instance: Instance) -> Instance:
        body = instance.evolve(resource_version=None, uid=None).to_dict()
        self.request_count += 1
        try:
            obj = await self._custom.create_namespaced_custom_object(
                GROUP,
                VERSION,
                instance.namespace,
                INSTANCES,
                body,
                _request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            raise _translate(error, f"instance {instance.name}") from error
        self._instance_informer.apply_local(RawEvent("ADDED", obj))
        return Instance.from_dict(obj)

    async def update(self, instance: Instance) -> Instance:
        if instance.resource_version is None:
            raise ConflictError(f"{instance.name}: update needs the resourceVersion it is based on")
        self.request_count += 1
        try:
            obj = await self._custom.replace_namespaced_custom_object(
                GROUP,
                VERSION,
                instance.namespace,
                INSTANCES,
                instance.name,
                instance.to_dict(),
                _request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            translated = _translate(error, f"instance {instance.name}")
            if isinstance(translated, ConflictError | NotFoundError):
                with contextlib.suppress(StoreError):
                    await self.get(instance.name)  # refresh the cache for the next decision
            raise translated from error
        self._instance_informer.apply_local(RawEvent("MODIFIED", obj))
        return Instance.from_dict(obj)

    async def delete(self, name: str, *, resource_version: str | None = None) -> None:
        from kubernetes.aio import client

        namespace = self._namespace_of(name)
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version=resource_version)
            if resource_version
            else None
        )
        self.request_count += 1
        try:
            await self._custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace,
                INSTANCES,
                name,
                body=options,
                _request_timeout=self.settings.request_timeout,
            )
        except Exception as error:
            translated = _translate(error, f"instance {namespace}/{name}")
            if isinstance(translated, ConflictError):
                with contextlib.suppress(StoreError):
                    await self.get(name)
            if isinstance(translated, NotFoundError):
                cached = self._instances.get(name)
                if cached is not None:
                    self._instance_informer.apply_local(RawEvent("DELETED", cached.to_dict()))
            raise translated from error
        cached = self._instances.get(name)
        if cached is not None:
            self._instance_informer.apply_local(RawEvent("DELETED", cached.to_dict()))

    # -- Secrets / ConfigMaps for discoveryProperties --------------------------------------
    async def read_object(self, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        reader = (
            self._core.read_namespaced_secret_without_preload_content
            if kind == "secret"
            else self._core.read_namespaced_config_map_without_preload_content
        )
        self.request_count += 1
        try:
            response = await reader(name, namespace, _request_timeout=self.settings.request_timeout)
        except Exception as error:
            raise PropertyResolutionError(
                f"cannot read {kind} {namespace}/{name}: {type(error).__name__}"
            ) from error
        try:
            if response.status == 404:
                return None
            if response.status >= 400:
                raise PropertyResolutionError(
                    f"cannot read {kind} {namespace}/{name}: HTTP {response.status}"
                )
            obj: Mapping[str, Any] = json.loads(await response.read())
            return obj
        finally:
            response.release()

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
        if ref.kind == "secret":
            list_call = self._core.list_namespaced_secret_without_preload_content
        else:
            list_call = self._core.list_namespaced_config_map_without_preload_content
        initial = True

        async def list_fn() -> tuple[list[Obj], str]:
            self.request_count += 1
            response = await list_call(
                ref.namespace,
                field_selector=selector,
                _request_timeout=self.settings.request_timeout,
            )
            try:
                if response.status >= 400:
                    raise StoreUnavailableError(f"list {ref.kind}: HTTP {response.status}")
                body = json.loads(await response.read())
            finally:
                response.release()
            items = list(body.get("items") or [])
            return items, str((body.get("metadata") or {}).get("resourceVersion") or "")

        async def watch_fn(version: str) -> AsyncIterator[tuple[str, Obj]]:
            response = await list_call(
                ref.namespace,
                field_selector=selector,
                watch=True,
                resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
                allow_watch_bookmarks=True,
                _request_timeout=WATCH_TIMEOUT_SECONDS + 30,
            )
            async for item in watch_events(response, ref.kind):
                yield item

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
    async def record_configuration_event(
        self, configuration: Configuration, reason: str, message: str, *, warning: bool = True
    ) -> None:
        await self._event_for_raw(dict(configuration.raw), reason, message, warning=warning)

    async def _event_for_raw(
        self, obj: Mapping[str, Any], reason: str, message: str, *, warning: bool = True
    ) -> None:
        """Create a core/v1 Event about a Configuration; the same event at most every 5 min."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        namespace = str(meta.get("namespace") or "default")
        key = (f"{namespace}/{name}", reason, message)
        now = time.monotonic()
        if now - self._events_sent.get(key, -EVENT_REPEAT_INTERVAL) < EVENT_REPEAT_INTERVAL:
            return
        self._events_sent[key] = now
        timestamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "Configuration",
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
        try:
            await self._core.create_namespaced_event(
                namespace, body, _request_timeout=self.settings.request_timeout
            )
        except Exception as error:  # an Event is best effort; never fail the caller
            log.warning("could not record event %s on %s/%s: %s", reason, namespace, name, error)


def dumps(obj: Any) -> str:
    """Compact JSON (for logs)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)
