"""The HTTP side: aiohttp routes that expose a
:class:`~tests.doubles.apiserver.store.Store` with the
URL layout, content negotiation and status codes of the Kubernetes API server, plus the
test-facing :class:`ApiServerDouble` (start/stop/restart, fault injection, request log,
kubeconfig)."""

from __future__ import annotations

import asyncio
import base64
import builtins
import collections
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from aiohttp import web

from tests.doubles.apiserver import discovery, errors, openapi, protobuf, tables
from tests.doubles.apiserver.authz import (
    CALLER,
    Attributes,
    Caller,
    User,
    allowed,
    forbidden_message,
    user_from_rules,
)
from tests.doubles.apiserver.errors import ApiError
from tests.doubles.apiserver.faults import Fault, FaultInjector, RecordedRequest, RequestInfo
from tests.doubles.apiserver.protobuf import ProtobufError
from tests.doubles.apiserver.resources import GroupResource, ResourceType
from tests.doubles.apiserver.selectors import (
    FieldRequirement,
    FieldSelector,
    LabelSelector,
    SelectorError,
)
from tests.doubles.apiserver.store import (
    APPLY_PATCH,
    APPLY_PATCH_CBOR,
    PATCH_TYPES,
    Store,
    Watcher,
)

logger = logging.getLogger(__name__)

JSON = dict[str, Any]
# how long a write's answer waits for its watch events to be written (watch_events_first)
EVENTS_FIRST_LIMIT = 0.2
# the field selectors a kind's list and watch accept, where the double knows them (the real
# API server's field-label conversion functions); other kinds accept any field path
SELECTABLE_FIELDS: dict[GroupResource, frozenset[str]] = {
    # pkg/apis/resource/v1/conversion.go (ResourceSlice); spec.pool.name is not one
    GroupResource("resource.k8s.io", "resourceslices"): frozenset(
        {"metadata.name", "spec.nodeName", "spec.driver"}
    ),
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# One value or several, for fault matching (verbs, resources).
Names = str | tuple[str, ...] | list[str] | None

_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})


def _truthy(value: str | None) -> bool:
    return value is not None and value in _TRUE


def _json_response(
    obj: JSON, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=json.dumps(obj, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _error_response(exc: ApiError) -> web.Response:
    return _json_response(exc.status(), exc.code, exc.headers)


def _manager(request: web.Request) -> str | None:
    """The field manager of a create, update or non-apply patch: ``fieldManager``, else the
    User-Agent up to its first ``/`` (printable characters, at most 128), as upstream
    (``managerOrUserAgent``): the agent's writes are owned by ``akri-py-agent``."""
    given = request.query.get("fieldManager")
    if given:
        return given
    head = (request.headers.get("User-Agent") or "").split("/")[0]
    return "".join(ch for ch in head if ch.isprintable())[:128] or None


def _media_type(request: web.Request) -> str:
    return (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()


NAMESPACE_CONTROLLER_PERIOD = 0.1  # seconds between two namespace controller passes


class _Target:
    """A parsed resource URL."""

    def __init__(
        self,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        name: str,
        subresource: str,
        legacy_watch: bool,
    ) -> None:
        self.rt = rt
        self.version = version
        self.namespace = namespace
        self.name = name
        self.subresource = subresource
        self.legacy_watch = legacy_watch


class ApiServerDouble:
    """A stateful Kubernetes API server double on ``http://127.0.0.1:<port>``.

    Use it as an async context manager (``async with ApiServerDouble() as api: api.url``), or
    call :meth:`start`/:meth:`stop`. State lives in :attr:`store` and survives
    :meth:`stop`/:meth:`start` (and :meth:`restart`), like an API server restart over the
    same etcd.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        crds: Iterable[str | Path] = (),
        history_size: int = 1000,
        bookmark_interval: float = 5.0,
        strict_strategic_merge: bool = False,
        require_namespace: bool = False,
        validate: bool = True,
        store: Store | None = None,
        watch_events_first: bool = True,
        admission_policies: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.store = store or Store(
            history_size=history_size, require_namespace=require_namespace, validate=validate
        )
        # the stored ValidatingAdmissionPolicies decide each CREATE and UPDATE (admission.py)
        self.store.admission_policies = admission_policies
        self.bookmark_interval = bookmark_interval
        self.strict_strategic_merge = strict_strategic_merge
        # a real API server gives no order between a write's answer and its watch events
        # (other goroutines write them): the double writes the events first, the order that
        # catches a client assuming its own answer always comes first
        self.watch_events_first = watch_events_first
        self.faults = FaultInjector()
        self._held_requests: set[asyncio.Future[web.StreamResponse]] = set()
        self.requests: builtins.list[RecordedRequest] = []
        # Unexpected exceptions raised while serving (answered with 500); tests may assert
        # that this stays empty.
        self.internal_errors: builtins.list[Exception] = []
        # watch events written to clients, by resource plural (benchmarks)
        self.watch_events_sent: collections.Counter[str] = collections.Counter()
        self._runner: web.AppRunner | None = None
        self._watchers: set[Watcher] = set()
        self._offline_task: asyncio.Task[None] | None = None
        self._namespace_task: asyncio.Task[None] | None = None
        # bearer token -> identity (add_user); requests without a token are an administrator
        self.users: dict[str, User] = {}
        # tokens are checked from the first add_user on, also once every user was removed
        # (a revoked token answers 401 on a real server, it does not become an administrator)
        self.authenticating = False
        if crds:
            self.load_crds(*crds)

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._runner is not None

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("the server has not been started yet")
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Listen (on the same port as before after a stop). Returns the URL."""
        if self._runner is not None:
            return self.url
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self._runner = runner
        if self._namespace_task is None:
            self._namespace_task = asyncio.create_task(self._namespace_controller())
        return self.url

    async def _namespace_controller(self) -> None:
        """kube-controller-manager's namespace controller (Store.namespace_controller_pass) and
        its garbage collector's delayed work (Store.collector_pass)."""
        while True:
            try:
                self.store.collector_pass()
                self.store.namespace_controller_pass()
            except Exception as error:  # a bug of the double: seen by the tests' fixture
                self.internal_errors.append(error)
            await asyncio.sleep(NAMESPACE_CONTROLLER_PERIOD)

    async def stop(self) -> None:
        """Stop listening and end all connections (watch streams end). State is kept."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        task, self._namespace_task = self._namespace_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for watcher in list(self._watchers):
            watcher.close()
        for held in list(self._held_requests):
            held.cancel()  # a stopped server never applies what it was holding
        await runner.cleanup()

    async def restart(self, downtime: float = 0.0) -> None:
        """Simulate an API-server restart: stop, stay down ``downtime`` seconds, start."""
        await self.stop()
        if downtime:
            await asyncio.sleep(downtime)
        await self.start()

    async def unreachable(self, seconds: float) -> None:
        """Refuse connections for ``seconds`` (returns when the server is back)."""
        await self.restart(downtime=seconds)

    def go_offline_for(self, seconds: float) -> asyncio.Task[None]:
        """Like :meth:`unreachable` but in the background; returns the task."""
        self._offline_task = asyncio.ensure_future(self.unreachable(seconds))
        return self._offline_task

    async def __aenter__(self) -> ApiServerDouble:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._offline_task is not None and not self._offline_task.done():
            self._offline_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._offline_task
        await self.stop()

    # --- client configuration ------------------------------------------------------------

    def add_user(
        self,
        token: str,
        name: str,
        rules: Iterable[JSON] | None = None,
        *,
        groups: Iterable[str] = (),
        node: str | None = None,
    ) -> User:
        """Requests with ``Authorization: Bearer <token>`` come from ``name``, allowed what
        the RBAC ``rules`` (ClusterRole rules) grant (``None``: everything); ``node`` is the
        node a pod's service-account token names (``authentication.kubernetes.io/node-name``
        in the user's extra). See :mod:`tests.doubles.apiserver.authz`."""
        user = user_from_rules(name, rules, groups=groups, node=node)
        self.users[token] = user
        self.authenticating = True
        return user

    def revoke_user(self, token: str) -> None:
        """Requests with ``token`` answer 401 from now on (a deleted ServiceAccount's token)."""
        self.users.pop(token, None)

    def kubeconfig(self, namespace: str = "default", token: str | None = None) -> JSON:
        """A kubeconfig (as a dict) pointing at this server, without credentials (an
        administrator), or with the bearer ``token`` of a user from :meth:`add_user`."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "apiserver-double", "cluster": {"server": self.url}}],
            "users": [{"name": "apiserver-double", "user": {"token": token} if token else {}}],
            "contexts": [
                {
                    "name": "apiserver-double",
                    "context": {
                        "cluster": "apiserver-double",
                        "user": "apiserver-double",
                        "namespace": namespace,
                    },
                }
            ],
            "current-context": "apiserver-double",
            "preferences": {},
        }

    def write_kubeconfig(
        self, path: str | Path, namespace: str = "default", token: str | None = None
    ) -> Path:
        """Write :meth:`kubeconfig` to ``path`` (for ``KUBECONFIG=`` / ``load_kube_config``)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(self.kubeconfig(namespace, token), sort_keys=False))
        return target

    # --- state helpers for tests ---------------------------------------------------------

    def resource(self, name: str) -> ResourceType:
        """Resolve ``pods``, ``instances.akri.sh``, ``Instance``, a short name..."""
        return self.store.registry.resolve(name)

    def load_crds(self, *paths: str | Path) -> builtins.list[ResourceType]:
        """Register the CRDs found in YAML files (served immediately)."""
        return self.store.load_crds(*paths)

    def create(self, obj: JSON, namespace: str | None = None) -> JSON:
        """Create an object directly in the store (``apiVersion``/``kind`` pick the resource;
        namespaced objects default to the ``default`` namespace)."""
        rt = self._rt_for(obj)
        version = str(obj["apiVersion"]).rsplit("/", 1)[-1]
        return self.store.create(rt, version, self._namespace(rt, obj, namespace), obj)

    def apply(self, obj: JSON, namespace: str | None = None) -> JSON:
        """Create, or unconditionally replace, an object directly in the store."""
        rt = self._rt_for(obj)
        return self.store.apply_object(rt, obj, self._namespace(rt, obj, namespace))

    def get(self, resource: str, name: str, namespace: str | None = None) -> JSON | None:
        """The stored object, or None. ``resource`` as for :meth:`resource`."""
        rt = self.resource(resource)
        try:
            return self.store.get(
                rt, rt.preferred_version, self._namespace(rt, {}, namespace), name
            )
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    def list(
        self, resource: str, namespace: str | None = None, label_selector: str | None = None
    ) -> builtins.list[JSON]:
        """Stored objects (all namespaces unless ``namespace`` is given)."""
        rt = self.resource(resource)
        items, _ = self.store.list_objects(
            rt, rt.preferred_version, namespace, LabelSelector.parse(label_selector)
        )
        return items

    def delete(self, resource: str, name: str, namespace: str | None = None) -> JSON:
        """Delete like an API client would (finalizers are honoured)."""
        rt = self.resource(resource)
        return self.store.delete(rt, rt.preferred_version, self._namespace(rt, {}, namespace), name)

    @staticmethod
    def _namespace(rt: ResourceType, obj: JSON, namespace: str | None) -> str | None:
        if not rt.namespaced:
            return None
        return namespace or (obj.get("metadata") or {}).get("namespace") or "default"

    def compact_history(self, keep: int = 0) -> int:
        """Drop old watch history; watches from older resourceVersions get 410 Gone."""
        return self.store.compact(keep)

    @property
    def resource_version(self) -> int:
        return self.store.resource_version

    def _rt_for(self, obj: JSON) -> ResourceType:
        api_version = str(obj.get("apiVersion") or "")
        group, _, version = api_version.rpartition("/")
        for rt in self.store.registry:
            if rt.group == group and rt.kind == obj.get("kind") and version in rt.versions:
                return rt
        raise KeyError(f"no served resource for {api_version} {obj.get('kind')}")

    # --- faults and request log ----------------------------------------------------------

    def fail(
        self,
        status: int,
        *,
        verb: Names = None,
        resource: Names = None,
        name: str | None = None,
        namespace: str | None = None,
        subresource: str | None = None,
        times: int | None = 1,
        duration: float | None = None,
        message: str | None = None,
        retry_after: int | None = None,
        after: bool = False,
    ) -> Fault:
        """The next ``times`` matching requests answer ``status`` (a proper Status object).
        ``verb`` is a Kubernetes verb (get, list, watch, create, update, patch, delete,
        deletecollection); ``resource`` a plural, optionally ``.group``-qualified."""
        return self.faults.add(
            verb=verb,
            resource=resource,
            name=name,
            namespace=namespace,
            subresource=subresource,
            status=status,
            message=message,
            retry_after=retry_after,
            times=times,
            duration=duration,
            after=after,
        )

    def drop(
        self,
        *,
        verb: Names = None,
        resource: Names = None,
        name: str | None = None,
        namespace: str | None = None,
        times: int | None = 1,
        duration: float | None = None,
        after: bool = False,
    ) -> Fault:
        """Close the connection of the next matching requests without an answer."""
        return self.faults.add(
            verb=verb,
            resource=resource,
            name=name,
            namespace=namespace,
            drop=True,
            times=times,
            duration=duration,
            after=after,
        )

    def delay(
        self,
        seconds: float,
        *,
        verb: Names = None,
        resource: Names = None,
        name: str | None = None,
        times: int | None = 1,
        duration: float | None = None,
    ) -> Fault:
        """Answer the next matching requests ``seconds`` late."""
        return self.faults.add(
            verb=verb, resource=resource, name=name, delay=seconds, times=times, duration=duration
        )

    def hang(
        self,
        *,
        verb: Names = None,
        resource: Names = None,
        name: str | None = None,
        namespace: str | None = None,
        times: int | None = None,
        seconds: float = 0.0,
    ) -> Fault:
        """Hold matching requests (all of them by default) until ``fault.release()`` — or for
        ``seconds`` each, if given — then process them: a hung API server whose writes still
        land after the client has given up (``fault.late`` counts those)."""
        return self.faults.add(
            verb=verb,
            resource=resource,
            name=name,
            namespace=namespace,
            hang=True,
            delay=seconds,
            times=times,
        )

    def clear_faults(self) -> None:
        self.faults.clear()

    def requests_for(
        self,
        verb: str | None = None,
        resource: str | None = None,
        name: str | None = None,
        method: str | None = None,
    ) -> builtins.list[RecordedRequest]:
        """Recorded requests filtered by Kubernetes verb, resource (plural or
        ``plural.group``), object name and/or HTTP method."""
        return [
            r
            for r in self.requests
            if (verb is None or r.info.verb == verb)
            and (resource is None or resource in (r.info.resource, r.info.qualified_resource))
            and (name is None or r.info.name == name)
            and (method is None or r.method == method.upper())
        ]

    def clear_requests(self) -> None:
        self.requests.clear()

    # --- HTTP plumbing -------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body = await request.read()
        info = self._request_info(request)
        record = RecordedRequest(
            method=request.method,
            path=request.path,
            query={k: v for k, v in request.query.items()},
            query_string=request.query_string,
            content_type=request.headers.get("Content-Type", ""),
            body=body,
            headers=dict(request.headers),
            info=info,
        )
        self.requests.append(record)
        fault = self.faults.take(info) if info.verb != "nonresource" else None
        if fault is not None and (fault.delay or fault.hang):
            # held, then processed even if the client gave up meanwhile (aiohttp may cancel
            # the handler of a closed connection): the write lands late, as on a real server
            held = asyncio.ensure_future(self._held(request, record, fault, handler))
            self._held_requests.add(held)
            held.add_done_callback(self._held_requests.discard)
            return await asyncio.shield(held)
        return await self._process(request, record, fault, handler)

    async def _held(
        self, request: web.Request, record: RecordedRequest, fault: Fault, handler: Handler
    ) -> web.StreamResponse:
        await fault.wait()
        # counted whether or not the client still listens: a client that closed its
        # connection shows only as a half-closed socket until the answer is written
        fault.late += 1
        return await self._process(request, record, fault, handler)

    async def _process(
        self,
        request: web.Request,
        record: RecordedRequest,
        fault: Fault | None,
        handler: Handler,
    ) -> web.StreamResponse:
        if fault is not None and not fault.after and (fault.drop or fault.status):
            return self._apply_fault(request, record, fault)
        try:
            self._authorize(request, record.info)
            response = await handler(request)
        except ApiError as exc:
            response = _error_response(exc)
        except web.HTTPException:
            raise
        except Exception as exc:  # a bug in the double: answer like the real server would
            logger.exception("internal error serving %s %s", request.method, request.path_qs)
            self.internal_errors.append(exc)
            response = _error_response(errors.internal(f"{type(exc).__name__}: {exc}"))
        if fault is not None and fault.after and (fault.drop or fault.status):
            return self._apply_fault(request, record, fault)
        record.status = response.status
        return response

    def _authorize(self, request: web.Request, info: RequestInfo) -> None:
        """Authenticate the bearer token (401 if unknown), apply the user's RBAC rules to a
        resource request (403), and remember the caller for checks made while serving it."""
        header = request.headers.get("Authorization", "")
        user: User | None = None
        if header.startswith("Bearer "):
            user = self.users.get(header.removeprefix("Bearer ").strip())
            if user is None and self.authenticating:
                raise ApiError(401)
        CALLER.set(Caller(user, info.verb))
        if user is None or info.verb == "nonresource":
            return
        attrs = Attributes(
            info.verb, info.group, info.resource, info.subresource, info.namespace, info.name
        )
        if not allowed(user, attrs):
            details: JSON = {"name": info.name} if info.name else {}
            details.update(group=info.group, kind=info.resource)
            raise ApiError(403, forbidden_message(user, attrs), "Forbidden", details)

    def _apply_fault(
        self, request: web.Request, record: RecordedRequest, fault: Fault
    ) -> web.StreamResponse:
        if fault.drop:
            record.status = 0
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError  # aiohttp closes the connection without writing
        assert fault.status is not None
        exc = errors.from_code(fault.status, fault.message, fault.retry_after)
        record.status = exc.code
        return _error_response(exc)

    def _request_info(self, request: web.Request) -> RequestInfo:
        try:
            target = self._parse_target(request.path)
        except ApiError:
            return RequestInfo("nonresource")
        if target is None:
            return RequestInfo("nonresource")
        verb = self._verb(request.method, target, request.query)
        return RequestInfo(
            verb=verb,
            group=target.rt.group,
            version=target.version,
            resource=target.rt.plural,
            subresource=target.subresource,
            namespace=target.namespace,
            name=target.name,
        )

    @staticmethod
    def _verb(method: str, target: _Target, query: Any) -> str:
        if method == "GET":
            if target.legacy_watch or (not target.name and _truthy(query.get("watch"))):
                return "watch"
            return "get" if target.name else "list"
        return {
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete" if target.name else "deletecollection",
        }.get(method, method.lower())

    def _parse_target(self, path: str) -> _Target | None:
        """Map a resource URL to its resource; None for non-resource paths. Raises 404 for
        resource-shaped URLs of unknown resources."""
        segs = [s for s in path.split("/") if s]
        if len(segs) >= 2 and segs[0] == "api":
            group, version, rest = "", segs[1], segs[2:]
        elif len(segs) >= 3 and segs[0] == "apis":
            group, version, rest = segs[1], segs[2], segs[3:]
        else:
            return None
        if not rest:
            return None
        legacy_watch = rest[0] == "watch"
        if legacy_watch:
            rest = rest[1:]
        registry = self.store.registry
        namespace: str | None = None
        if (
            len(rest) >= 3
            and rest[0] == "namespaces"
            and registry.lookup(group, version, rest[2]) is not None
        ):
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            raise errors.endpoint_not_found()
        rt = registry.lookup(group, version, rest[0])
        if rt is None or (namespace is not None and not rt.namespaced):
            raise errors.endpoint_not_found()
        name = rest[1] if len(rest) > 1 else ""
        subresource = rest[2] if len(rest) > 2 else ""
        if subresource and subresource not in rt.subresources:
            raise errors.endpoint_not_found()
        if rt.namespaced and name and namespace is None:
            raise errors.endpoint_not_found()
        return _Target(rt, version, namespace, name, subresource, legacy_watch)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path.rstrip("/") == "/version":
            return _json_response(discovery.VERSION_INFO)
        if path.rstrip("/") in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok", content_type="text/plain")
        if path.rstrip("/") == "/api":
            return _json_response(discovery.api_versions(f"{self.host}:{self.port}"))
        if path.rstrip("/") == "/apis":
            return _json_response(discovery.api_group_list(self.store.registry))
        if path.startswith("/openapi/"):
            return self._openapi(path)
        segs = [s for s in path.split("/") if s]
        with self.store.lock:
            if len(segs) == 2 and segs[0] == "api":
                doc = discovery.api_resource_list(self.store.registry, "", segs[1])
                if doc is None:
                    raise errors.endpoint_not_found()
                return _json_response(doc)
            if len(segs) == 2 and segs[0] == "apis":
                doc = discovery.api_group(self.store.registry, segs[1])
                if doc is None:
                    raise errors.endpoint_not_found()
                return _json_response(doc)
            if len(segs) == 3 and segs[0] == "apis":
                doc = discovery.api_resource_list(self.store.registry, segs[1], segs[2])
                if doc is None:
                    raise errors.endpoint_not_found()
                return _json_response(doc)
            target = self._parse_target(path)
        if target is None:
            raise errors.endpoint_not_found()
        verb = self._verb(request.method, target, request.query)
        if verb == "watch":
            return await self._watch(request, target)
        if verb == "get":
            return self._get(request, target)
        if verb == "list":
            return self._list(request, target)
        if verb == "create" and not target.name:
            return await self._create(request, target)
        if verb == "update" and target.name:
            return await self._update(request, target)
        if verb == "patch" and target.name:
            return await self._patch(request, target)
        if verb == "delete":
            return await self._delete(request, target)
        if verb == "deletecollection" and not target.subresource:
            return await self._delete_collection(request, target)
        raise errors.method_not_allowed()

    def _openapi(self, path: str) -> web.Response:
        segs = [s for s in path.split("/") if s]
        with self.store.lock:
            if segs == ["openapi", "v3"]:
                return _json_response(openapi.root_doc(self.store.registry))
            doc = None
            if len(segs) == 4 and segs[:3] == ["openapi", "v3", "api"]:
                doc = openapi.group_version_doc(self.store.registry, "", segs[3])
            elif len(segs) == 5 and segs[:3] == ["openapi", "v3", "apis"]:
                doc = openapi.group_version_doc(self.store.registry, segs[3], segs[4])
        if doc is None:
            raise errors.endpoint_not_found()
        return _json_response(doc)

    # --- body decoding -------------------------------------------------------------------

    @staticmethod
    async def _body(request: web.Request, allowed: tuple[str, ...]) -> Any:
        media = _media_type(request)
        raw = await request.read()
        if media == protobuf.MEDIA_TYPE and "application/json" in allowed:
            try:
                return protobuf.decode_object(raw)
            except ProtobufError as exc:
                raise errors.unsupported_media_type(f"{media}: {exc}", list(allowed)) from exc
        if media not in allowed:
            raise errors.unsupported_media_type(media, list(allowed))
        if not raw:
            raise errors.bad_request("the request body is empty")
        try:
            if media.endswith("yaml"):
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise errors.bad_request(
                f"the body of the request could not be decoded: {exc}"
            ) from exc

    @staticmethod
    def _selectors(
        request: web.Request, target: _Target | None = None
    ) -> tuple[LabelSelector, FieldSelector]:
        try:
            labels = LabelSelector.parse(request.query.get("labelSelector"))
            fields = FieldSelector.parse(request.query.get("fieldSelector"))
        except SelectorError as exc:
            raise errors.bad_request(str(exc)) from exc
        if target is not None:
            supported = SELECTABLE_FIELDS.get(target.rt.gr)
            for requirement in fields.requirements if supported is not None else ():
                if requirement.path not in supported:
                    # the real handler's field-label conversion (a 400, list and watch)
                    raise errors.bad_request(
                        f"field label not supported for {target.rt.group}/{target.version}, "
                        f"Kind={target.rt.kind}: {requirement.path}"
                    )
        return labels, fields

    def _render(
        self, request: web.Request, target: _Target, obj: JSON, status: int = 200
    ) -> web.Response:
        wanted = tables.negotiate(request.headers.get("Accept"))
        if wanted is not None and wanted[0] == "Table":
            doc = tables.table(
                target.rt,
                target.version,
                [obj],
                str(obj["metadata"].get("resourceVersion", "")),
                include_object=request.query.get("includeObject", "Metadata"),
                table_version=wanted[1],
            )
            return _json_response(doc, status)
        if wanted is not None and wanted[0] == "PartialObjectMetadata":
            return _json_response(tables.partial_metadata(obj, wanted[1]), status)
        return _json_response(obj, status)

    # --- verbs ---------------------------------------------------------------------------

    def _get(self, request: web.Request, target: _Target) -> web.Response:
        obj = self.store.get(target.rt, target.version, target.namespace, target.name)
        return self._render(request, target, obj)

    def _list(self, request: web.Request, target: _Target) -> web.Response:
        labels, fields = self._selectors(request, target)
        rt = target.rt
        rv_param = request.query.get("resourceVersion")
        if (
            request.query.get("resourceVersionMatch") == "Exact"
            and rv_param
            and rv_param.isdigit()
            and int(rv_param) < self.store.compacted_rv
        ):
            raise errors.gone(
                f"too old resource version: {rv_param} ({self.store.compacted_rv + 1})"
            )
        items, rv = self.store.list_objects(rt, target.version, target.namespace, labels, fields)
        meta: JSON = {"resourceVersion": str(rv)}
        token = request.query.get("continue")
        if token:
            try:
                state = json.loads(base64.urlsafe_b64decode(token.encode()))
                start = (state["start"][0], state["start"][1])
                rv = int(state["rv"])
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise errors.bad_request("continue key is not valid") from exc
            if rv < self.store.compacted_rv:
                # like etcd: the snapshot the pages come from was compacted away
                raise errors.gone(
                    "The provided continue parameter is too old to display a consistent "
                    "list result. You can start a new list without the continue parameter."
                )
            meta["resourceVersion"] = str(rv)
            items = [
                o
                for o in items
                if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start
            ]
        limit = request.query.get("limit")
        if limit and limit.isdigit() and 0 < int(limit) < len(items):
            page, rest = items[: int(limit)], items[int(limit) :]
            last = page[-1]["metadata"]
            meta["continue"] = base64.urlsafe_b64encode(
                json.dumps({"rv": rv, "start": [last.get("namespace", ""), last["name"]]}).encode()
            ).decode()
            meta["remainingItemCount"] = len(rest)
            items = page
        wanted = tables.negotiate(request.headers.get("Accept"))
        if wanted is not None and wanted[0] == "Table":
            doc = tables.table(
                rt,
                target.version,
                items,
                meta["resourceVersion"],
                include_object=request.query.get("includeObject", "Metadata"),
                table_version=wanted[1],
            )
            doc["metadata"] = meta
            return _json_response(doc)
        if wanted is not None and wanted[0].startswith("PartialObjectMetadata"):
            return _json_response(
                {
                    "kind": "PartialObjectMetadataList",
                    "apiVersion": f"meta.k8s.io/{wanted[1]}",
                    "metadata": meta,
                    "items": [tables.partial_metadata(o, wanted[1]) for o in items],
                }
            )
        return _json_response(
            {
                "kind": rt.list_kind,
                "apiVersion": rt.api_version(target.version),
                "metadata": meta,
                "items": items,
            }
        )

    async def _create(self, request: web.Request, target: _Target) -> web.Response:
        if target.subresource or (target.rt.namespaced and target.namespace is None):
            raise errors.method_not_allowed()
        body = await self._body(request, ("application/json", "application/yaml"))
        if not isinstance(body, dict):
            raise errors.bad_request("the body of the request must be an object")
        obj = self.store.create(
            target.rt,
            target.version,
            target.namespace,
            body,
            dry_run=request.query.get("dryRun") == "All",
            field_validation=request.query.get("fieldValidation", "Warn"),
            field_manager=_manager(request),
        )
        await self._events_out(obj)
        return self._render(request, target, obj, 201)

    async def _update(self, request: web.Request, target: _Target) -> web.Response:
        body = await self._body(request, ("application/json", "application/yaml"))
        obj = self.store.update(
            target.rt,
            target.version,
            target.namespace,
            target.name,
            body,
            subresource=target.subresource or None,
            dry_run=request.query.get("dryRun") == "All",
            field_validation=request.query.get("fieldValidation", "Warn"),
            field_manager=_manager(request),
        )
        await self._events_out(obj)
        return self._render(request, target, obj)

    async def _patch(self, request: web.Request, target: _Target) -> web.Response:
        media = _media_type(request)
        body = await self._body(request, PATCH_TYPES)
        force_param = request.query.get("force")
        obj, created = self.store.patch(
            target.rt,
            target.version,
            target.namespace,
            target.name,
            media,
            body,
            subresource=target.subresource or None,
            field_manager=(
                request.query.get("fieldManager")  # required for an apply: no default there
                if media in (APPLY_PATCH, APPLY_PATCH_CBOR)
                else _manager(request)
            ),
            force=_truthy(force_param) if force_param is not None else None,
            dry_run=request.query.get("dryRun") == "All",
            field_validation=request.query.get("fieldValidation", "Warn"),
            strict_strategic=self.strict_strategic_merge,
        )
        await self._events_out(obj)
        return self._render(request, target, obj, 201 if created else 200)

    async def _delete_options(self, request: web.Request) -> JSON:
        raw = await request.read()
        options: JSON = {}
        # like the real handler: DeleteOptions from the query, then from the body
        if "propagationPolicy" in request.query:
            options["propagationPolicy"] = request.query["propagationPolicy"]
        if "orphanDependents" in request.query:
            options["orphanDependents"] = _truthy(request.query["orphanDependents"])
        if raw:
            try:
                if _media_type(request) == protobuf.MEDIA_TYPE:
                    decoded = protobuf.decode_delete_options(raw)
                else:
                    decoded = json.loads(raw)
            except ValueError as exc:  # ProtobufError is one
                raise errors.bad_request(f"invalid DeleteOptions: {exc}") from exc
            if isinstance(decoded, dict):
                options.update({k: v for k, v in decoded.items() if v is not None})
        if request.query.get("dryRun") == "All":
            options["dryRun"] = ["All"]
        return options

    async def _delete(self, request: web.Request, target: _Target) -> web.Response:
        if target.subresource:
            raise errors.method_not_allowed()
        options = await self._delete_options(request)
        obj = self.store.delete(
            target.rt,
            target.version,
            target.namespace,
            target.name,
            options,
            dry_run="All" in (options.get("dryRun") or []),
        )
        status = 200
        if options.get("orphanDependents") is False and obj["metadata"].get("deletionTimestamp"):
            status = 202
        await self._events_out(obj)
        return self._render(request, target, obj, status)

    async def _delete_collection(self, request: web.Request, target: _Target) -> web.Response:
        if target.rt.namespaced and target.namespace is None:
            raise errors.method_not_allowed()
        labels, fields = self._selectors(request, target)
        options = await self._delete_options(request)
        items = self.store.delete_collection(
            target.rt,
            target.version,
            target.namespace,
            labels,
            fields,
            options,
            dry_run="All" in (options.get("dryRun") or []),
        )
        return _json_response(
            {
                "kind": target.rt.list_kind,
                "apiVersion": target.rt.api_version(target.version),
                "metadata": {"resourceVersion": str(self.store.resource_version)},
                "items": items,
            }
        )

    async def _events_out(self, written: JSON) -> None:
        """With :attr:`watch_events_first`: return once every watch that is to see the write
        of ``written`` has written its event (at most :data:`EVENTS_FIRST_LIMIT` seconds: a
        client that does not read its watch does not hold other clients' writes)."""
        if not self.watch_events_first:
            return
        version = str((written.get("metadata") or {}).get("resourceVersion") or "")
        if not version.isdigit():
            return
        rv = int(version)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EVENTS_FIRST_LIMIT
        while any(w.waits_to_send(rv) for w in list(self._watchers)):
            if loop.time() >= deadline:
                return
            await asyncio.sleep(0.0005)

    # --- watch ---------------------------------------------------------------------------

    async def _watch(self, request: web.Request, target: _Target) -> web.StreamResponse:
        labels, fields = self._selectors(request, target)
        if target.name:
            fields = FieldSelector(
                (*fields.requirements, FieldRequirement("metadata.name", "=", target.name))
            )
        query = request.query
        rt, version = target.rt, target.version
        timeout_param = query.get("timeoutSeconds")
        try:
            timeout = float(timeout_param) if timeout_param else None
        except ValueError as exc:
            raise errors.bad_request(f"invalid timeoutSeconds: {timeout_param}") from exc
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        send_initial = query.get("sendInitialEvents")
        initial_events = _truthy(send_initial) if send_initial is not None else None
        if initial_events is not None and query.get("resourceVersionMatch") != "NotOlderThan":
            raise errors.invalid(
                GroupResource("meta.k8s.io", "listoptions"),
                "ListOptions",
                "",
                [
                    (
                        "FieldValueForbidden",
                        "resourceVersionMatch",
                        "Forbidden: sendInitialEvents requires setting resourceVersionMatch to "
                        "NotOlderThan",
                    )
                ],
            )
        table_wanted = tables.negotiate(request.headers.get("Accept"))
        want_table = table_wanted is not None and table_wanted[0] == "Table"
        include_object = query.get("includeObject", "Metadata")
        table_v = table_wanted[1] if table_wanted else "v1"

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        headers_sent = False

        def render(obj: JSON) -> JSON:
            nonlocal headers_sent
            out = self.store.output(rt, version, obj)
            if not want_table:
                return out
            doc = tables.table(
                rt,
                version,
                [out],
                str(out["metadata"].get("resourceVersion", "")),
                include_object=include_object,
                table_version=table_v,
                no_headers=headers_sent,
            )
            headers_sent = True
            return doc

        async def send(event_type: str, obj: JSON) -> None:
            line = json.dumps({"type": event_type, "object": obj}, separators=(",", ":")) + "\n"
            await response.write(line.encode())
            self.watch_events_sent[rt.plural] += 1

        try:
            start = self.store.watch(
                rt,
                version,
                target.namespace,
                labels,
                fields,
                query.get("resourceVersion"),
                send_initial_events=initial_events,
            )
        except ApiError as exc:
            if exc.code != 410:
                raise
            await response.prepare(request)
            await send("ERROR", exc.status())
            await response.write_eof()
            return response
        watcher = start.watcher
        self._watchers.add(watcher)
        loop = asyncio.get_running_loop()
        try:
            await response.prepare(request)
            for event_type, obj in start.initial:
                await send(event_type, render(obj))
            if initial_events:
                await send("BOOKMARK", self._bookmark(rt, version, start.rv, initial_end=True))
            deadline = loop.time() + timeout if timeout else None
            next_bookmark = loop.time() + self.bookmark_interval if bookmarks else None
            while True:
                waits = [t - loop.time() for t in (deadline, next_bookmark) if t is not None]
                try:
                    item = await asyncio.wait_for(
                        watcher.queue.get(), max(0.0, min(waits)) if waits else None
                    )
                except TimeoutError:
                    now = loop.time()
                    if deadline is not None and now >= deadline:
                        break
                    if next_bookmark is not None and now >= next_bookmark:
                        self._queue_bookmark(watcher)
                        next_bookmark = now + self.bookmark_interval
                    continue
                if item is None:
                    break
                event_type, obj = item
                if event_type == "BOOKMARK":
                    await send("BOOKMARK", self._bookmark(rt, version, int(obj["rv"])))
                else:
                    await send(event_type, render(obj))
                    with contextlib.suppress(KeyError, TypeError, ValueError):
                        watcher.sent = int(obj["metadata"]["resourceVersion"])
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            self.store.unwatch(watcher)
            self._watchers.discard(watcher)
        return response

    def _queue_bookmark(self, watcher: Watcher) -> None:
        # Queued under the store lock so it lands after every event it claims to cover.
        with self.store.lock:
            watcher.push(("BOOKMARK", {"rv": self.store.resource_version}))

    @staticmethod
    def _bookmark(rt: ResourceType, version: str, rv: int, initial_end: bool = False) -> JSON:
        meta: JSON = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"kind": rt.kind, "apiVersion": rt.api_version(version), "metadata": meta}
