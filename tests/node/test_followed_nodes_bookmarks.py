"""A watch BOOKMARK is not a Node: it carries only a resourceVersion (no conditions, no
taints), so read as one it said a NotReady node served again about once a minute on a real
kube-apiserver (acceptance run of issue 39.1: the partitioned node's agent logged 'Ready again:
joining Instances again' while its Node was Ready=Unknown)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import agent.node.followed_nodes as followed_nodes
from agent.core.kube import make_kube_client
from agent.node.followed_nodes import FollowedNodes
from tests.controller.conftest import add_node, eventually, set_ready
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS, bookmark_interval=0.05) as server:
        yield server


async def test_bookmarks_do_not_make_a_not_ready_node_serve(
    api: ApiServerDouble, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bookmarks = 0
    real_watch_events = followed_nodes.watch_events

    async def counting(lines: Any, what: str) -> AsyncGenerator[tuple[str, Any], None]:
        nonlocal bookmarks
        async for kind, obj in real_watch_events(lines, what):
            bookmarks += kind == "BOOKMARK"
            yield kind, obj

    monkeypatch.setattr(followed_nodes, "watch_events", counting)
    add_node(api, "node-a")
    add_node(api, "node-b")
    client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
    nodes = FollowedNodes(client, "node-a")
    try:
        nodes.start()
        nodes.want({"node-b"})
        await eventually(lambda: nodes.known("node-b"), "node-b read")
        set_ready(api, "node-a", False)
        set_ready(api, "node-b", False)
        await eventually(lambda: not nodes.may_join(), "own Node NotReady")
        await eventually(lambda: nodes.unserving() == {"node-a", "node-b"}, "node-b NotReady")
        seen = bookmarks
        await eventually(lambda: bookmarks >= seen + 4, "bookmarks on both watches")
        assert not nodes.may_join()
        assert nodes.unserving() == {"node-a", "node-b"}
    finally:
        await nodes.close()
        await client.close()
