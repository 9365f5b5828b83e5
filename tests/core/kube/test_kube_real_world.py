"""Issue 12 items 3 and 4: agent.core.kube against real-world clusters — large lists are paged
(and restarted when a continue token expires), a silent watch connection is presumed dead,
and sockets have TCP keepalive."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.kube import KubeClient, TransportError, make_kube_client, resource_path
from agent.core.model.instance import Instance
from tests.core.kube.test_kube_client import raw_server, read_request
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS

INSTANCES = resource_path("akri.sh", "v0", "instances", "default")


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


@pytest.fixture
async def client(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[KubeClient]:
    kube = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")), timeout=5)
    yield kube
    await kube.close()


def instance(index: int) -> dict[str, object]:
    return Instance(name=f"cfg-{index:06d}", configuration_name="cfg", capacity=1).to_dict()


async def test_large_lists_are_paged(api: ApiServerDouble, client: KubeClient) -> None:
    for index in range(25):
        api.create(instance(index))
    items, version = await client.list_all(INSTANCES, page_size=10)
    assert [i["metadata"]["name"] for i in items] == [f"cfg-{i:06d}" for i in range(25)]
    assert version.isdigit()
    pages = api.requests_for(verb="list", resource="instances")
    assert len(pages) == 3 and all(r.query.get("limit") == "10" for r in pages)


async def test_an_expired_continue_token_restarts_the_list(
    api: ApiServerDouble, client: KubeClient
) -> None:
    for index in range(12):
        api.create(instance(index))
    original = client.get
    pages = 0

    async def get_compacting(path: str, **kwargs: object) -> dict[str, object]:
        nonlocal pages
        pages += 1
        if pages == 2:  # the snapshot is compacted while we page through it
            api.create(instance(99))
            api.compact_history()
        return await original(path, **kwargs)  # type: ignore[arg-type]

    client.get = get_compacting  # type: ignore[method-assign]
    items, _ = await client.list_all(INSTANCES, page_size=5)
    assert len(items) == 13  # a consistent list from the restart, the new one included
    statuses = [r.status for r in api.requests_for(verb="list", resource="instances")]
    assert 410 in statuses


async def test_a_silent_watch_is_presumed_dead() -> None:
    """Before: a half-open watch kept the caches stale for up to timeoutSeconds + 30 s."""

    async def headers_then_silence(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        await asyncio.sleep(30)

    async with raw_server(headers_then_silence) as client:
        stream = client.watch(INSTANCES, "1", timeout_seconds=290, idle_timeout=0.3)
        with pytest.raises(TransportError, match=r"no data for 0\.3s"):
            await asyncio.wait_for(anext(stream), 10)


async def test_connections_have_tcp_keepalive(api: ApiServerDouble, client: KubeClient) -> None:
    await client.get(INSTANCES)
    conn = client._idle[0]
    sock = conn._writer.get_extra_info("socket")
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    if hasattr(socket, "TCP_KEEPIDLE"):
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
