"""agent.core.kube.KubeClient against the API-server double (real HTTP) and small raw HTTP servers:
CRUD, watch streams, status mapping, chunked decoding, keep-alive, timeouts, TLS."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from agent.core.kube import (
    ApiError,
    KubeClient,
    ResponseTooLargeError,
    TransportError,
    http,
    make_kube_client,
    resource_path,
)
from agent.core.kube import client as client_module
from agent.core.kube.credentials import Credentials, TokenFileCredentials
from agent.core.kube.kubeconfig import ClusterConfig
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import (
    AlreadyExistsError,
    ConflictError,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from agent.core.store.informer import WatchExpiredError, watch_events
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings, _translate
from tests.core.kube.test_kubeconfig import Certs, make_certs
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS

INSTANCES = resource_path("akri.sh", "v0", "instances", "default")
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


@pytest.fixture
async def client(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[KubeClient]:
    kube = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")), timeout=5)
    yield kube
    await kube.close()


def instance(name: str = "cfg-abcdef") -> dict[str, Any]:
    return Instance(name=name, configuration_name="cfg", capacity=1).to_dict()


async def next_event(events: AsyncIterator[tuple[str, Any]]) -> tuple[str, Any]:
    return await asyncio.wait_for(anext(events), 5)


# --- against the API-server double ------------------------------------------------------------


def test_resource_paths() -> None:
    assert resource_path("akri.sh", "v0", "instances", "ns", "a") == (
        "/apis/akri.sh/v0/namespaces/ns/instances/a"
    )
    assert resource_path("resource.k8s.io", "v1", "resourceslices") == (
        "/apis/resource.k8s.io/v1/resourceslices"
    )
    assert resource_path("", "v1", "secrets", "kube-system") == (
        "/api/v1/namespaces/kube-system/secrets"
    )
    assert resource_path("", "v1", "nodes", name="node/1") == "/api/v1/nodes/node%2F1"


async def test_crud_and_status_mapping(api: ApiServerDouble, client: KubeClient) -> None:
    created = await client.create(INSTANCES, instance())
    version = created["metadata"]["resourceVersion"]
    assert created["metadata"]["uid"]
    got = await client.get(f"{INSTANCES}/cfg-abcdef")
    assert got["metadata"]["resourceVersion"] == version
    listed = await client.get(INSTANCES)
    assert [o["metadata"]["name"] for o in listed["items"]] == ["cfg-abcdef"]
    assert int(listed["metadata"]["resourceVersion"]) >= int(version)

    with pytest.raises(ApiError) as exists:
        await client.create(INSTANCES, instance())
    assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")
    assert isinstance(_translate(exists.value, "x"), AlreadyExistsError)

    got["spec"]["nodes"] = ["node-a"]
    replaced = await client.replace(f"{INSTANCES}/cfg-abcdef", got)
    assert replaced["spec"]["nodes"] == ["node-a"]
    with pytest.raises(ApiError) as stale:  # the same resourceVersion again
        await client.replace(f"{INSTANCES}/cfg-abcdef", got)
    assert (stale.value.status, stale.value.reason) == (409, "Conflict")
    assert "the object has been modified" in str(stale.value)
    assert isinstance(_translate(stale.value, "x"), ConflictError)

    precondition = {"preconditions": {"resourceVersion": version}}
    with pytest.raises(ApiError) as old:
        await client.delete(f"{INSTANCES}/cfg-abcdef", precondition)
    assert old.value.status == 409
    current = replaced["metadata"]["resourceVersion"]
    await client.delete(f"{INSTANCES}/cfg-abcdef", {"preconditions": {"resourceVersion": current}})
    assert api.get("instances.akri.sh", "cfg-abcdef", "default") is None

    with pytest.raises(ApiError) as missing:
        await client.get(f"{INSTANCES}/cfg-abcdef")
    assert (missing.value.status, missing.value.reason) == (404, "NotFound")
    assert isinstance(_translate(missing.value, "x"), NotFoundError)
    # one connection served everything (keep-alive)
    assert client.connections_opened == 1


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (500, StoreUnavailableError),
        (503, StoreUnavailableError),
        (429, StoreUnavailableError),
        (403, StoreError),
    ],
)
async def test_server_errors_translate(
    api: ApiServerDouble, client: KubeClient, status: int, expected: type[StoreError]
) -> None:
    api.fail(status, verb="list", resource="instances")
    with pytest.raises(ApiError) as caught:
        # a 429 is sent again after 1 s, unless that would outlast the request's deadline
        await client.get(INSTANCES, request_timeout=0.5)
    assert caught.value.status == status
    translated = _translate(caught.value, "list")
    assert type(translated) is expected
    await client.get(INSTANCES)  # the connection is still usable


async def test_requests_are_the_ones_the_agent_always_sent(
    api: ApiServerDouble, client: KubeClient
) -> None:
    await client.create(INSTANCES, instance())
    stream = client.watch(
        "/api/v1/namespaces/default/secrets",
        "7",
        timeout_seconds=290,
        field_selector="metadata.name=creds",
    )
    events = watch_events(stream, "secret")
    task = asyncio.ensure_future(anext(events))
    for _ in range(500):  # until the watch reached the server (bounded: 5 s)
        if api.requests_for(verb="watch"):
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await task
    await events.aclose()
    [watch] = api.requests_for(verb="watch")
    assert watch.path == "/api/v1/namespaces/default/secrets"
    assert watch.query == {
        "fieldSelector": "metadata.name=creds",
        "watch": "true",
        "resourceVersion": "7",
        "timeoutSeconds": "290",
        "allowWatchBookmarks": "true",
    }
    [create] = api.requests_for(verb="create")
    assert create.content_type == "application/json"
    assert create.headers["Accept"] == "application/json"
    assert create.headers["User-Agent"] == "akri-py-agent"
    assert json.loads(create.body)["metadata"]["name"] == "cfg-abcdef"


async def test_store_delete_sends_a_precondition(api: ApiServerDouble, tmp_path: Path) -> None:
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc")))
    store = KubernetesInstanceStore(client, KubernetesSettings("node-a", request_timeout=5))
    await store.start()
    try:
        created = await store.create(
            Instance(name="cfg-abcdef", configuration_name="cfg", capacity=1)
        )
        with pytest.raises(ConflictError):
            await store.delete(ObjectKey("default", "cfg-abcdef"), resource_version="1")
        await store.delete(
            ObjectKey("default", "cfg-abcdef"), resource_version=created.resource_version
        )
        bodies = [json.loads(r.body) for r in api.requests_for(verb="delete")]
        assert bodies == [
            {"preconditions": {"resourceVersion": "1"}},
            {"preconditions": {"resourceVersion": created.resource_version}},
        ]
        with pytest.raises(NotFoundError):
            await store.get(ObjectKey("default", "cfg-abcdef"))
        assert await store.read_object("secret", "default", "nope") is None
        assert await store.read_resource_claim("default", "nope") is None
    finally:
        await store.close()


async def test_watch_streams_events_and_bookmarks(api: ApiServerDouble, tmp_path: Path) -> None:
    api.bookmark_interval = 0.2
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc")), timeout=5)
    try:
        listed = await client.get(INSTANCES)
        events = watch_events(
            client.watch(INSTANCES, listed["metadata"]["resourceVersion"], timeout_seconds=290),
            "instances",
        )
        api.create(instance("cfg-aaaaaa"))
        kind, obj = await next_event(events)
        assert (kind, obj["metadata"]["name"]) == ("ADDED", "cfg-aaaaaa")
        api.delete("instances.akri.sh", "cfg-aaaaaa", "default")
        kind, obj = await next_event(events)
        assert (kind, obj["metadata"]["name"]) == ("DELETED", "cfg-aaaaaa")
        kind, obj = await next_event(events)
        assert kind == "BOOKMARK" and obj["metadata"]["resourceVersion"]
        await events.aclose()  # closes the stream and its connection
        assert not client._busy
        await client.get(INSTANCES)
        assert client.connections_opened == 2  # the watch's connection was not reused
    finally:
        await client.close()


async def test_watch_ends_when_the_server_ends_it(api: ApiServerDouble, client: KubeClient) -> None:
    version = (await client.get(INSTANCES))["metadata"]["resourceVersion"]
    lines = [line async for line in client.watch(INSTANCES, version, timeout_seconds=1)]
    assert all(json.loads(line)["type"] == "BOOKMARK" for line in lines if line)
    # a complete chunked body leaves the connection reusable
    await client.get(INSTANCES)
    assert client.connections_opened == 1


async def test_watch_from_a_compacted_version_is_410(
    api: ApiServerDouble, client: KubeClient
) -> None:
    api.create(instance("cfg-aaaaaa"))
    api.create(instance("cfg-bbbbbb"))
    api.compact_history()
    events = watch_events(client.watch(INSTANCES, "1", timeout_seconds=290), "instances")
    with pytest.raises(WatchExpiredError):  # 200 + an ERROR event with code 410
        await next_event(events)
    api.fail(410, verb="watch")
    events = watch_events(client.watch(INSTANCES, "1", timeout_seconds=290), "instances")
    with pytest.raises(WatchExpiredError):  # an HTTP 410 answer
        await next_event(events)
    api.fail(403, verb="watch")
    events = watch_events(client.watch(INSTANCES, "1", timeout_seconds=290), "instances")
    with pytest.raises(ApiError) as caught:
        await next_event(events)
    assert caught.value.status == 403


async def test_a_throttled_watch_waits_retry_after_then_streams(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """Before: a 429 on a watch raised at once and the informer retried within 0.25-0.5 s,
    ignoring the server's Retry-After."""
    version = (await client.get(INSTANCES))["metadata"]["resourceVersion"]
    api.fail(429, verb="watch", resource="instances", retry_after=1, times=1)
    events = watch_events(client.watch(INSTANCES, version, timeout_seconds=290), "instances")
    try:
        first = asyncio.ensure_future(next_event(events))
        api.create(instance("cfg-aaaaaa"))
        kind, obj = await first
        assert (kind, obj["metadata"]["name"]) == ("ADDED", "cfg-aaaaaa")
    finally:
        await events.aclose()
    throttled, accepted = api.requests_for("watch", "instances")
    assert throttled.status == 429 and accepted.status != 429  # (None while it streamed)
    assert accepted.time - throttled.time >= 0.95  # the server's Retry-After: 1
    assert client.throttled == 1


async def test_a_throttled_write_mid_run_is_sent_again_after_retry_after(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """A 429 means the write was not acted on: the store's create is sent again after the
    server's Retry-After and succeeds (no StoreUnavailableError for the caller)."""
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc")), timeout=5)
    store = KubernetesInstanceStore(client, KubernetesSettings("node-a", request_timeout=5))
    await store.start()
    try:
        api.fail(429, verb="create", resource="instances", retry_after=1, times=1)
        created = await store.create(Instance.from_dict(instance("cfg-bbbbbb")))
        assert created.name == "cfg-bbbbbb"
    finally:
        await store.close()
    throttled, accepted = api.requests_for("create", "instances")
    assert (throttled.status, accepted.status) == (429, 201)
    assert accepted.time - throttled.time >= 0.95
    assert client.throttled == 1


async def test_connection_refused_is_unavailable(api: ApiServerDouble, tmp_path: Path) -> None:
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kc")), timeout=5)
    await api.stop()
    try:
        with pytest.raises(TransportError) as caught:
            await client.get(INSTANCES)
        assert caught.value.status == 0
        assert "ConnectionRefusedError" in str(caught.value)
        assert isinstance(_translate(caught.value, "list"), StoreUnavailableError)
        with pytest.raises(TransportError):
            await anext(client.watch(INSTANCES, "1", timeout_seconds=290))
    finally:
        await client.close()
    with pytest.raises(TransportError, match="closed"):
        await client.get(INSTANCES)


async def test_request_timeout(api: ApiServerDouble, client: KubeClient) -> None:
    api.delay(2.0, verb="list")
    with pytest.raises(TransportError, match=r"no answer within 0\.2s") as caught:
        await client.get(INSTANCES, request_timeout=0.2)
    assert isinstance(_translate(caught.value, "list"), StoreUnavailableError)
    assert not client._busy and not client._idle  # the timed-out connection was dropped
    await client.get(INSTANCES)


async def test_concurrent_requests_share_a_bounded_pool(
    api: ApiServerDouble, client: KubeClient
) -> None:
    api.delay(0.2, verb="list", times=30)
    results = await asyncio.gather(*(client.get(INSTANCES) for _ in range(30)))
    assert all(r["items"] == [] for r in results)
    assert client.connections_opened == 8  # at most 8 in flight, then reused
    assert len(client._idle) == 8 and not client._busy


async def test_dropped_connection(api: ApiServerDouble, client: KubeClient) -> None:
    api.drop(verb="create")
    with pytest.raises(TransportError):
        await client.create(INSTANCES, instance())
    assert len(api.requests_for(verb="create")) == 1  # a write is never sent twice
    await client.create(INSTANCES, instance())


async def test_no_kubernetes_package_at_runtime(tmp_path: Path) -> None:
    """The agent's runtime must not import the ``kubernetes`` package (about 58 MB)."""
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    code = f"""
import asyncio, sys
import agent.node.app, agent.cli, agent.core.store.kubernetes
import agent.node.dra.publisher, agent.core.kube
from agent.core.kube import make_kube_client
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from agent.node.dra.publisher import SlicePublisher
from agent.core.model.keys import ObjectKey

async def main():
    client = make_kube_client({str(kubeconfig)!r})
    store = KubernetesInstanceStore(client, KubernetesSettings("n"))
    SlicePublisher(store.api_client, "n", store.list_cached, lambda: ())
    await store.close()

asyncio.run(main())
loaded = sorted(m for m in sys.modules if m == "kubernetes" or m.startswith("kubernetes."))
print(loaded, "aiohttp" in sys.modules, "pydantic" in sys.modules)
"""
    result = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "False", "False"]


# --- raw HTTP servers: framing, keep-alive, credentials --------------------------------------


@contextlib.asynccontextmanager
async def raw_server(
    handler: Handler, credentials: Credentials | None = None
) -> AsyncIterator[KubeClient]:
    """A TCP server running ``handler`` per connection, and a client for it."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = ClusterConfig("http", "127.0.0.1", port, credentials=credentials or Credentials())
    client = KubeClient(config, timeout=5)
    try:
        yield client
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> str:
    """The request head (the request's body, if any, is read and dropped)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    for line in head.split("\r\n"):
        if line.lower().startswith("content-length:"):
            await reader.readexactly(int(line.split(":")[1]))
    return head


async def test_chunked_stream_lines_are_reassembled() -> None:
    pieces = [
        b'{"type":"ADDED","object":{"a":1}}\n{"type":"MOD',
        b'IFIED","object":{"a":2}}\n',
        b"\n",
        b'{"type":"DELETED",',
        b'"object":{"a":3}}',  # the last line has no newline
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in pieces:
            writer.write(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\nX-Trailer: yes\r\n\r\n")
        await writer.drain()
        await read_request(reader)  # the connection is reused for the next request
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()

    async with raw_server(handler) as client:
        lines = [line async for line in client.stream_lines("/watch")]
        assert lines == [
            b'{"type":"ADDED","object":{"a":1}}',
            b'{"type":"MODIFIED","object":{"a":2}}',
            b"",
            b'{"type":"DELETED","object":{"a":3}}',
        ]
        assert await client.get("/next") == {}
        assert client.connections_opened == 1


async def test_large_chunked_json_and_close_delimited_bodies() -> None:
    big = {"items": [{"n": i, "pad": "x" * 100} for i in range(3000)]}  # about 350 KB
    payload = json.dumps(big).encode()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_request(reader)
        if head.startswith("GET /chunked"):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for start in range(0, len(payload), 100_000):
                piece = payload[start : start + 100_000]
                writer.write(b"%X\r\n%s\r\n" % (len(piece), piece))
            writer.write(b"0\r\n\r\n")
        else:  # HTTP/1.0 style: no length, the body ends when the server closes
            writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + payload)
            await writer.drain()
            writer.close()
            return
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + payload)
        await writer.drain()
        writer.close()

    async with raw_server(handler) as client:
        assert await client.get("/chunked") == big
        assert await client.get("/until-close") == big
        assert await client.get("/until-close") == big
        assert client.connections_opened == 2  # a close-delimited body ends the connection


async def test_a_pooled_connection_closed_by_the_server_is_replaced() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n" + b'{"n": 1 }')
        await writer.drain()
        writer.close()  # keep-alive was offered, but the server closes anyway

    async with raw_server(handler) as client:
        assert await client.get("/a") == {"n": 1}
        await asyncio.sleep(0.05)
        assert await client.get("/b") == {"n": 1}
        assert client.connections_opened == 2


async def test_garbage_and_truncated_answers_are_transport_errors() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_request(reader)
        if "/garbage" in head:
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        elif "/short" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}")
        elif "/badchunk" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        elif "/text" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        await writer.drain()
        writer.close()

    async with raw_server(handler) as client:
        for path, message in [
            ("/garbage", "bad status line"),
            ("/short", "IncompleteReadError"),
            ("/badchunk", "bad chunk size"),
            ("/text", "not JSON"),
        ]:
            with pytest.raises(TransportError, match=message) as caught:
                await client.get(path)
            assert caught.value.status == 0


async def test_oversized_answers_are_refused_before_they_fill_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: a body, a chunk or a watch line could be any size (all buffered whole)."""
    monkeypatch.setattr(http, "MAX_BODY", 1_000_000)  # a smaller cap: the test sends less
    monkeypatch.setattr(client_module, "MAX_WATCH_LINE", 100_000)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await read_request(reader)
        with contextlib.suppress(ConnectionError):  # the client hangs up when it refuses
            if "/announced" in head:  # only the head: refused on the Content-Length alone
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000001\r\n\r\n")
            elif "/hugechunk" in head:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                writer.write(b"FFFFFFFFFF\r\n")
            elif "/endless" in head:  # close-delimited, never ends
                writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
                for _ in range(200):
                    writer.write(b"x" * 65536)
                    await writer.drain()
            elif "/watch" in head:  # a line that never ends
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                writer.write(b"6\r\n{}\n{}\n\r\n")
                piece = b"y" * 10_000
                for _ in range(200):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
            await writer.drain()

    async with raw_server(handler) as client:
        for path, message in [
            ("/announced", "body of 1000001 bytes is over the limit of 1000000 bytes"),
            ("/hugechunk", "chunk of 1099511627775 bytes is over the limit"),
            ("/endless", "body is over the limit of 1000000 bytes"),
        ]:
            # the server did answer: not a TransportError (status 0, "retry later"), since
            # the same request would get the same answer
            with pytest.raises(ResponseTooLargeError, match=message) as caught:
                await client.get(path)
            assert caught.value.status == 200
            assert not isinstance(caught.value, TransportError)
        lines = client.stream_lines("/watch")
        assert [await anext(lines), await anext(lines)] == [b"{}", b"{}"]
        with pytest.raises(TransportError, match="a line of the stream is over the limit"):
            await anext(lines)
        assert not client._busy and not client._idle  # every refused connection was dropped


async def test_a_list_page_over_the_body_limit_is_asked_again_smaller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20 objects of ~100 KB under a 1 MB body limit (as 500 ResourceSlices of ~400 KB are
    under 64 MiB): the page size halves until a page fits, the same continue token kept.
    Before: the refused page was a TransportError, which the start treats as "no answer,
    retry" - for ever, since every retry got the same oversized page."""
    monkeypatch.setattr(http, "MAX_BODY", 1_000_000)
    items = [{"metadata": {"name": f"s{i:02d}"}, "pad": "x" * 100_000} for i in range(20)]
    limits: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await read_request(reader)
                query = parse_qs(urlsplit(head.split(" ")[1]).query)
                limit = int(query["limit"][0])
                start = int(query.get("continue", ["0"])[0])
                limits.append(limit)
                more = start + limit < len(items)
                page = {
                    "items": items[start : start + limit],
                    "metadata": {
                        "resourceVersion": "7",
                        "continue": str(start + limit) if more else "",
                    },
                }
                body = json.dumps(page).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                writer.write(body)
                await writer.drain()

    async with raw_server(handler) as client:
        listed, version = await client.list_all("/apis/resource.k8s.io/v1/resourceslices")
    assert [i["metadata"]["name"] for i in listed] == [f"s{i:02d}" for i in range(20)]
    assert version == "7"
    assert limits == [500, 250, 125, 62, 31, 15, 7, 7, 7]


async def test_one_object_over_the_body_limit_is_a_named_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http, "MAX_BODY", 1_000)
    limits: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await read_request(reader)
            limits.append(int(parse_qs(urlsplit(head.split(" ")[1]).query)["limit"][0]))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n")
            await writer.drain()

    async with raw_server(handler) as client:
        with pytest.raises(ResponseTooLargeError, match="over the limit of 1000 bytes"):
            await client.list_all("/api/v1/things", page_size=4)
    assert limits == [4, 2, 1]


def test_the_size_caps_are_generous_for_kubernetes_objects() -> None:
    assert http.MAX_BODY == 64 * 1024 * 1024
    assert client_module.MAX_WATCH_LINE == 16 * 1024 * 1024


async def test_stream_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab\n\r\n")
        await writer.drain()
        await asyncio.sleep(10)

    async with raw_server(handler) as client:
        lines = client.stream_lines("/watch", request_timeout=0.3)
        assert await anext(lines) == b"ab"
        with pytest.raises(TransportError, match="stream outlived its timeout"):
            await anext(lines)


async def test_401_rereads_the_token_file_and_retries(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old")
    seen: list[str] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            try:
                head = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            auth = next(h for h in head.split("\r\n") if h.startswith("Authorization:"))
            seen.append(auth)
            if auth.endswith("Bearer new"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            else:
                body = b'{"kind":"Status","reason":"Unauthorized","code":401}'
                writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n\r\n" % len(body))
                writer.write(body)
            await writer.drain()

    async with raw_server(handler, TokenFileCredentials(token)) as client:
        with pytest.raises(ApiError) as caught:  # re-read, still the old token: 401 stands
            await client.get("/x")
        assert (caught.value.status, caught.value.reason) == (401, "Unauthorized")
        assert seen == ["Authorization: Bearer old"] * 2
        token.write_text("new")  # rotated
        assert await client.get("/x") == {}
        assert seen[2:] == ["Authorization: Bearer old", "Authorization: Bearer new"]
        seen.clear()
        lines = [line async for line in client.stream_lines("/watch")]
        assert lines == [b"{}"] and seen == ["Authorization: Bearer new"]


# --- TLS: CA, server name, client certificate ------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@contextlib.asynccontextmanager
async def tls_proxy(api: ApiServerDouble, certs: Certs) -> AsyncIterator[int]:
    """A TLS front for the API double that requires a client certificate from our CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca))
    context.load_cert_chain(str(certs.server_cert), str(certs.server_key))
    context.verify_mode = ssl.CERT_REQUIRED
    clients: list[str] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peercert") or {}
        clients.append(dict(x[0] for x in peer.get("subject", ()))["commonName"])
        up_reader, up_writer = await asyncio.open_connection(api.host, api.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
    assert set(clients) <= {"client"}


def tls_kubeconfig(path: Path, port: int, certs: Certs, **cluster: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}", **cluster}}],
        "users": [
            {
                "name": "u",
                "user": {
                    "client-certificate": str(certs.client_cert),
                    "client-key-data": base64.b64encode(certs.client_key.read_bytes()).decode(),
                },
            }
        ],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_tls_with_ca_and_client_certificate(
    api: ApiServerDouble, certs: Certs, tmp_path: Path
) -> None:
    async with tls_proxy(api, certs) as port:
        path = tls_kubeconfig(tmp_path / "kc", port, certs, **{"certificate-authority": "ca.crt"})
        (tmp_path / "ca.crt").write_bytes(certs.ca.read_bytes())  # relative to the kubeconfig
        client = make_kube_client(str(path), timeout=5)
        try:
            await client.create(INSTANCES, instance())
            assert len((await client.get(INSTANCES))["items"]) == 1
            lines = client.watch(INSTANCES, "1", timeout_seconds=290)
            assert json.loads(await anext(lines))["type"] == "ADDED"
            await lines.aclose()
        finally:
            await client.close()

        # the certificate names 127.0.0.1 and apiserver.test; tls-server-name picks the latter
        named = tls_kubeconfig(
            tmp_path / "named",
            port,
            certs,
            **{"certificate-authority": str(certs.ca), "tls-server-name": "apiserver.test"},
        )
        client = make_kube_client(str(named), timeout=5)
        try:
            assert len((await client.get(INSTANCES))["items"]) == 1
        finally:
            await client.close()


async def test_tls_failures_are_transport_errors(
    api: ApiServerDouble, certs: Certs, tmp_path: Path
) -> None:
    async with tls_proxy(api, certs) as port:
        for name, cluster in [
            ("wrong-ca", {"certificate-authority": str(certs.other_ca)}),
            ("wrong-name", {"certificate-authority": str(certs.ca), "tls-server-name": "evil"}),
        ]:
            path = tls_kubeconfig(tmp_path / name, port, certs, **cluster)
            client = make_kube_client(str(path), timeout=5)
            try:
                with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED") as caught:
                    await client.get(INSTANCES)
                assert isinstance(_translate(caught.value, "list"), StoreUnavailableError)
            finally:
                await client.close()
        insecure = tls_kubeconfig(
            tmp_path / "insecure", port, certs, **{"insecure-skip-tls-verify": True}
        )
        client = make_kube_client(str(insecure), timeout=5)
        try:
            assert (await client.get(INSTANCES))["items"] == []
        finally:
            await client.close()
