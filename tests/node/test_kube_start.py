"""Issue 12 item 1: at start, the agent waits out what heals by waiting (429 while new CRDs
initialise, 5xx, no answer, CRDs not yet installed) and stops only for what cannot (401/403,
CRDs still missing after the deadline)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.cli import EXIT_UNAVAILABLE, main
from agent.core.kube import ApiError, KubeClient, ResponseTooLargeError, http, make_kube_client
from agent.core.kube.client import MAX_RETRY_AFTER
from agent.core.store.base import StoreError
from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings, first_list
from agent.node.dra.publisher import SLICE_PAGE_SIZE, SlicePublisher
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.apiserver.threaded import ThreadedApiServer
from tests.harness.agent_process import AgentProcess
from tests.harness.k8s_nodes import CRDS


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def store(
    api: ApiServerDouble, tmp_path: Path, crd_deadline: float = 300.0
) -> KubernetesInstanceStore:
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    return KubernetesInstanceStore(client, KubernetesSettings("node-a", crd_deadline=crd_deadline))


async def test_429_while_crd_storage_initialises_is_waited_out(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found on a real cluster: right after `kubectl apply -f crds/` the first list answered
    429 "storage is (re)initializing" with retryAfterSeconds 1, and the agent exited 4."""
    api.fail(
        429,
        verb="list",
        resource="configurations",
        times=2,
        retry_after=1,
        message="storage is (re)initializing",
    )
    api.fail(503, verb="list", resource="instances", times=1)
    agent_store = store(api, tmp_path)
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        await agent_store.start()
    try:
        assert time.monotonic() - started >= 1.9  # honoured retryAfterSeconds twice
        # the client itself waits out each 429 (as on every request); the store the 503
        waits = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
        assert len(waits) == 3, waits
        assert "HTTP 429, the server asks to wait 1.0s" in waits[0]
        assert "503" in waits[2] and "retrying in" in waits[2]
    finally:
        await agent_store.close()


async def test_forbidden_stops_at_once_naming_verb_and_resource(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.fail(403, verb="list", resource="configurations", times=None)
    agent_store = store(api, tmp_path)
    with pytest.raises(StoreError, match=r"HTTP 403: the agent may not list configurations"):
        await agent_store.start()
    await agent_store.close()


async def test_missing_crds_are_waited_for_until_the_deadline(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.fail(404, verb="list", resource="configurations", times=None)
    agent_store = store(api, tmp_path, crd_deadline=0.3)
    with pytest.raises(StoreError, match=r"kubectl apply -f crds/"):
        await agent_store.start()
    await agent_store.close()
    api.clear_faults()
    api.fail(404, verb="list", resource="configurations", times=2)
    agent_store = store(api, tmp_path, crd_deadline=30)
    await agent_store.start()  # installed meanwhile
    await agent_store.close()


# -- the DRA slice publisher's first list (gap: it crashed the agent with a traceback) --------


@pytest.fixture
async def client(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[KubeClient]:
    kube = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig-dra")))
    yield kube
    await kube.close()


def publisher(client: KubeClient) -> SlicePublisher:
    return SlicePublisher(client, "node-a", lambda: [], lambda: ())


async def test_dra_slice_list_503_at_start_is_waited_out(
    api: ApiServerDouble, client: KubeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A 503 without Retry-After is not retried by the client: the publisher's start must
    (before: the ApiError ended the agent with a traceback, exit 1)."""
    api.fail(503, verb="list", resource="resourceslices", times=1)
    slices = publisher(client)
    with caplog.at_level(logging.INFO):
        await slices.start()
    try:
        waits = [r.getMessage() for r in caplog.records if "at start" in r.getMessage()]
        assert len(waits) == 1, waits
        assert "listing resourceslices.resource.k8s.io at start: HTTP 503" in waits[0]
        assert len(api.requests_for("list", "resourceslices")) == 2
    finally:
        await slices.close()


async def test_dra_slice_list_forbidden_names_verb_and_resource(
    api: ApiServerDouble, client: KubeClient
) -> None:
    api.fail(403, verb="list", resource="resourceslices", times=None)
    with pytest.raises(
        StoreError,
        match=r"HTTP 403: the agent may not list resourceslices.resource.k8s.io "
        r"\(verb list, resource resourceslices, group resource.k8s.io\)",
    ):
        await publisher(client).start()


async def test_a_cluster_without_dra_is_a_clear_error_naming_the_flag(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """No resource.k8s.io/v1 (DRA off, or Kubernetes older than 1.34): refused at once."""
    api.fail(404, verb="list", resource="resourceslices", times=None)
    with pytest.raises(StoreError, match=r"DRA is unavailable on this cluster.*--no-dra"):
        await publisher(client).start()
    assert len(api.requests_for("list", "resourceslices")) == 1  # not waited for


async def test_an_unreadable_node_is_logged_not_swallowed(
    api: ApiServerDouble, client: KubeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: any error reading the Node was dropped silently; the slices then lacked the
    owner reference that removes them with the Node, and nothing said why."""
    api.fail(403, verb="get", resource="nodes", times=None)
    slices = publisher(client)
    with caplog.at_level(logging.WARNING, logger="agent.node.dra.publisher"):
        await slices.start()
    try:
        (warning,) = [m for m in caplog.messages if "cannot read Node" in m]
        assert "cannot read Node node-a (ApiError: HTTP 403" in warning
        assert "without an owner reference" in warning
    finally:
        await slices.close()


# -- the store: no server at all, and credentials refused -----------------------------------------


async def test_connection_refused_at_start_is_waited_out(
    api: ApiServerDouble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent_store = store(api, tmp_path)
    await api.stop()  # the port is closed: connection refused
    retried = asyncio.Event()

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "at start" in record.getMessage() and "retrying" in record.getMessage():
                retried.set()

    spy = Spy()
    logging.getLogger("agent.core.store.kubernetes").addHandler(spy)
    try:
        starting = asyncio.create_task(agent_store.start())
        await asyncio.wait_for(retried.wait(), 10)
        assert not starting.done()
        await api.start()  # the same port again
        await asyncio.wait_for(starting, 10)
    finally:
        logging.getLogger("agent.core.store.kubernetes").removeHandler(spy)
        await agent_store.close()


async def test_unauthorized_stops_at_once_naming_verb_and_resource(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    api.fail(401, verb="list", resource="configurations", times=None)
    agent_store = store(api, tmp_path)
    with pytest.raises(StoreError, match=r"HTTP 401: the agent may not list configurations"):
        await agent_store.start()
    await agent_store.close()
    assert len(api.requests_for("list", "configurations")) == 1


# -- the agent process: a clean message and exit 4, never a traceback -------------------------


def cluster_agent_args(kubeconfig: Path, tmp: Path) -> list[str]:
    """``akri agent`` in cluster mode with every kubelet-facing directory under ``tmp``."""
    return [
        "--kubeconfig",
        str(kubeconfig),
        "--node-name",
        "node-a",
        "--device-plugin-dir",
        str(tmp / "device-plugins"),
        "--pod-resources-socket",
        str(tmp / "pod-resources" / "kubelet.sock"),
        "--plugins-registry-dir",
        str(tmp / "plugins_registry"),
        "--dra-plugin-dir",
        str(tmp / "dra"),
        "--cdi-dir",
        str(tmp / "cdi"),
        "--health-port",
        "0",
    ]


def test_the_agent_exits_4_when_it_may_not_list_resourceslices(tmp_path: Path) -> None:
    """Before: ``Traceback ... ApiError: HTTP 403`` and exit 1 (the DRA publisher's first list
    was not guarded like the store's)."""
    with ThreadedApiServer(crds=CRDS) as server:
        server.fail(403, verb="list", resource="resourceslices", times=None)
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        agent = AgentProcess(cluster_agent_args(kubeconfig, tmp_path))
        try:
            code = agent.wait_exit(30)
        finally:
            agent.cleanup()
    assert code == EXIT_UNAVAILABLE, agent.describe()
    assert agent.matching(r"cannot start: HTTP 403: the agent may not list resourceslices"), (
        agent.describe()
    )
    assert not agent.matching("Traceback"), agent.describe()


def test_an_untranslated_api_error_at_start_is_one_line_and_exit_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever start-up step lets an ApiError through, the agent ends with a clean line."""
    from agent.core.kube import ApiError
    from agent.node.app import Agent

    async def refused(self: Agent, stop: asyncio.Event, **_: float) -> None:
        raise ApiError(503, "ServiceUnavailable", '{"message": "etcd is down"}')

    monkeypatch.setattr(Agent, "run", refused)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    with caplog.at_level(logging.ERROR):
        code = main(["agent", "--no-dra", *cluster_agent_args(kubeconfig, tmp_path)[:4]])
    assert code == EXIT_UNAVAILABLE
    messages = [r.getMessage() for r in caplog.records]
    assert "cannot start: Kubernetes API: HTTP 503 ServiceUnavailable: etcd is down" in messages


# -- waits the server asks for, and answers waiting cannot change ----------------------------


class _ListOnly:
    """An informer whose list fails with ``errors`` in turn, then succeeds."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)

    async def initial_list(self) -> None:
        if self.errors:
            raise self.errors.pop(0)


async def test_a_huge_retry_after_at_start_is_capped() -> None:
    """Before: retryAfterSeconds was used as is; a bogus 3600 stalled the start an hour."""
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    hour = ApiError(503, "ServiceUnavailable", '{"details": {"retryAfterSeconds": 3600}}')
    await first_list(_ListOnly(hour), "instances", 300.0, sleep=record)  # type: ignore[arg-type]
    assert waits == [MAX_RETRY_AFTER]


async def test_an_answer_over_the_body_limit_stops_the_start() -> None:
    """Before: it was a TransportError (status 0), "no answer", retried for ever."""
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    huge = ResponseTooLargeError(200, "GET /x: response body is over the limit of 64 bytes")
    with pytest.raises(StoreError, match="over the client's size limit"):
        await first_list(_ListOnly(huge), "instances", 300.0, sleep=record)  # type: ignore[arg-type]
    assert waits == []


async def test_the_slice_publisher_lists_in_small_pages(
    api: ApiServerDouble, client: KubeClient
) -> None:
    """A ResourceSlice is up to ~400 KB: 500 a page (the default) could pass the 64 MiB body
    limit."""
    slices = publisher(client)
    await slices.start()
    try:
        (listed,) = api.requests_for("list", "resourceslices")
        assert listed.query["limit"] == str(SLICE_PAGE_SIZE)
        assert SLICE_PAGE_SIZE * 1.5 * 1024 * 1024 <= http.MAX_BODY  # etcd's object limit
    finally:
        await slices.close()
