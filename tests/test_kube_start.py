"""Issue 12 item 1: at start, the agent waits out what heals by waiting (429 while new CRDs
initialise, 5xx, no answer, CRDs not yet installed) and stops only for what cannot (401/403,
CRDs still missing after the deadline)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.kube import make_kube_client
from agent.store.base import StoreError
from agent.store.kubernetes import KubernetesInstanceStore, KubernetesSettings
from tests.apiserver import ApiServerDouble
from tests.k8s_nodes import CRDS


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def store(api: ApiServerDouble, tmp_path: Path, **settings: float) -> KubernetesInstanceStore:
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    return KubernetesInstanceStore(client, KubernetesSettings("node-a", **settings))


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
