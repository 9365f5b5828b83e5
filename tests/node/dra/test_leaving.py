"""SIGTERM with DRA claims prepared on the node (issue 33.3): an agent that is being replaced
(rollout, Pod deleted) leaves at once and its claims stay prepared for the next agent; one that
is being uninstalled (DaemonSet deleted, or its access revoked with the RBAC) stays until
kubelet has unprepared them, so their pods can end — also when the API refuses to free the
slot."""

from __future__ import annotations

import asyncio
import datetime
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.node.leaving import Departure, Why, decide_departure, linger_while_prepared
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.doubles.dra_scheduler import allocate_claim, create_claim
from tests.harness.dp_nodes import DpNode, api_instances, start_dp_node
from tests.harness.k8s_nodes import CRDS, debug_echo_configuration, eventually
from tests.node.test_rbac_and_properties import allowed, grants

NS = "akri"
POD = "akri-agent-x7k2p"
ENV = {"POD_NAME": POD, "POD_NAMESPACE": NS}
SLICES = "resourceslices.resource.k8s.io"


def _daemonset(**meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": "akri-agent", "namespace": NS, "uid": "ds-1", **meta}}


def _pod(**meta: Any) -> dict[str, Any]:
    owner = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "akri-agent", "uid": "ds-1",
             "controller": True}  # fmt: skip
    return {"metadata": {"name": POD, "namespace": NS, "ownerReferences": [owner], **meta}}


def test_why_the_agent_stops() -> None:
    ending = "2026-11-27T10:00:30Z"
    replaced = decide_departure(_pod(deletionTimestamp=ending), None, _daemonset(), None)
    assert replaced.departure is Departure.REPLACED
    at = datetime.datetime(2026, 11, 27, 10, 0, 30, tzinfo=datetime.UTC)
    assert replaced.deadline == at.timestamp()
    deleting = _daemonset(deletionTimestamp=ending)
    assert decide_departure(_pod(), None, deleting, None).departure is Departure.UNINSTALLED
    assert decide_departure(_pod(), None, None, 404).departure is Departure.UNINSTALLED
    # anything it cannot tell is taken as a rollout: leave at once (issue 39.3: a refusal is
    # no evidence of an uninstall; it may be a token or webhook hiccup during a rollout)
    for status in (401, 403, 429, 500, 503, 0):  # 0: no answer (timeout, connection)
        assert decide_departure(_pod(), None, None, status).departure is Departure.UNKNOWN
        assert decide_departure(None, status, None, None).departure is Departure.UNKNOWN
    assert decide_departure(None, 404, None, None).departure is Departure.UNKNOWN
    assert decide_departure({"metadata": {}}, None, None, None).departure is Departure.UNKNOWN


async def test_lingering_ends_with_the_last_claim_or_at_the_deadline() -> None:
    left = [2]

    async def unprepare_soon() -> None:
        await asyncio.sleep(0.3)
        left[0] = 0

    task = asyncio.create_task(unprepare_soon())
    why = Why(Departure.UNINSTALLED, "test", deadline=time.time() + 60)
    assert await linger_while_prepared(lambda: left[0], why, stop_needs=2) == 0
    await task
    started = time.monotonic()
    soon = Why(Departure.UNINSTALLED, "test", deadline=time.time() + 2.5)
    assert await linger_while_prepared(lambda: 1, soon, stop_needs=2) == 1
    assert time.monotonic() - started < 30  # bounded by the deadline (0.5 s here)


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


async def _node_with_a_prepared_claim(
    api: ApiServerDouble, tmp: Path, *, pod_grace: int | None = None
) -> tuple[DpNode, DraKubeletDouble, str]:
    """A node whose agent runs as a DaemonSet's Pod (deleted at the end: its SIGTERM follows;
    ``pod_grace``: the Pod's terminationGracePeriodSeconds, the agent's deadline to stay)."""
    api.create(debug_echo_configuration("cam", ("foo0",), 2))
    daemonset = api.create(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "akri-agent", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "akri-agent"}}, "template": {}},
        }
    )
    pod = _pod(finalizers=["tests.akri.sh/kubelet"])  # terminating once deleted, like kubelet's
    pod["metadata"]["ownerReferences"][0]["uid"] = daemonset["metadata"]["uid"]
    spec: dict[str, Any] = {"nodeName": "node-a"}
    if pod_grace is not None:
        spec["terminationGracePeriodSeconds"] = pod_grace
    api.create({"apiVersion": "v1", "kind": "Pod", **pod, "spec": spec})
    node = await start_dp_node(api, "node-a", tmp, dra=True)
    node.agent.pod_environ = ENV
    kubelet = DraKubeletDouble(node.registry_dir, "node-a", api)
    await kubelet.start()
    await kubelet.wait_for_registration("akri.sh", timeout=30)
    await eventually(
        lambda: any(s["spec"]["pool"]["name"] == "cam-8120fe" for s in api.list(SLICES)),
        what="the shared pool published",
    )
    claim = create_claim(api, "default", "c1")
    uid = claim["metadata"]["uid"]
    allocate_claim(api, "default", "c1", "node-a", pod_name="app", pod_uid="app-uid")
    await kubelet.prepare("app-uid", [("default", uid, "c1")])
    assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == f"D:{uid}:node-a"
    api.delete("pods", POD, NS)  # SIGTERM follows
    return node, kubelet, uid


def _checkpoint(node: DpNode) -> Path:
    return node.agent.settings.dra_plugin_dir / "checkpoint.json"


class _Running:
    """A node's agent and DRA kubelet, stopped once: by the test (:meth:`stop`, as its Pod's
    end would, leaving the node's files to look at) or at the end; then any API fault is
    cleared first and the node's files go."""

    def __init__(self, api: ApiServerDouble, node: DpNode, kubelet: DraKubeletDouble) -> None:
        self.api = api
        self.node = node
        self.kubelet = kubelet
        self.stopped = False

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.kubelet.stop()
            await self.node.stop(keep_files=True)

    async def __aenter__(self) -> _Running:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.api.clear_faults()
        try:
            await self.stop()
        finally:
            shutil.rmtree(self.node.base, ignore_errors=True)


async def test_a_replaced_agent_leaves_at_once_and_its_claims_stay_prepared(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    node, kubelet, uid = await _node_with_a_prepared_claim(api, tmp_path)
    async with _Running(api, node, kubelet) as running:
        api.clear_requests()
        await asyncio.wait_for(node.agent.stay_while_uninstalled(), 10)
        assert node.dra is not None and uid in node.dra.state.checkpoint.claims
        assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == f"D:{uid}:node-a"
        # what it asked is what deploy/base/rbac.yaml lets its ServiceAccount read
        asked = {(r.info.group or "", r.info.resource, r.info.verb, r.info.namespace)
                 for r in api.requests if r.info.namespace == NS}  # fmt: skip
        assert asked == {("", "pods", "get", NS), ("apps", "daemonsets", "get", NS)}
        assert all(allowed(grants(), *request) for request in asked)
        await running.stop()
        assert uid in _checkpoint(node).read_text()  # for the next agent


async def test_an_uninstalled_agent_stays_until_kubelet_has_unprepared_its_claims(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    node, kubelet, _ = await _node_with_a_prepared_claim(api, tmp_path)
    async with _Running(api, node, kubelet) as running:
        api.delete("daemonsets.apps", "akri-agent", NS)
        staying = asyncio.create_task(node.agent.stay_while_uninstalled())
        await asyncio.sleep(1.0)
        assert not staying.done()  # a claim is prepared: kubelet still needs the driver
        await kubelet.remove_pod("app-uid")  # the app pod ends: kubelet unprepares
        await asyncio.wait_for(staying, 10)
        assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == ""
        assert _checkpoint(node).exists()  # empty, until the agent has stopped
        await running.stop()
        # leaving for good with nothing prepared: its checkpoint and plugin directory go
        # (acceptance F7: an empty checkpoint.json stayed on every node)
        assert not _checkpoint(node).parent.exists()


@pytest.mark.parametrize("daemonset_stays", [True, False])
async def test_the_empty_checkpoint_goes_only_with_the_install(
    api: ApiServerDouble, tmp_path: Path, daemonset_stays: bool
) -> None:
    """The documented uninstall: every claim unprepared before the agent is told to stop.
    Uninstalled, it removes its empty DRA checkpoint and its plugin directory (a file of
    someone else's there keeps the directory); replaced (a rollout), it keeps them."""
    node, kubelet, _ = await _node_with_a_prepared_claim(api, tmp_path)
    async with _Running(api, node, kubelet) as running:
        await kubelet.remove_pod("app-uid")  # unprepared while the agent runs
        assert node.dra is not None
        await eventually(lambda: node.dra is not None and not node.dra.state.checkpoint.claims)
        assert json.loads(_checkpoint(node).read_text())["preparedClaims"] == {}
        stranger = _checkpoint(node).parent / "notes.txt"
        if daemonset_stays:
            stranger.write_text("not the agent's")
        else:
            api.delete("daemonsets.apps", "akri-agent", NS)
        await asyncio.wait_for(node.agent.stay_while_uninstalled(), 10)
        await running.stop()
        if daemonset_stays:
            assert _checkpoint(node).exists() and stranger.exists()
        else:
            assert not _checkpoint(node).parent.exists()


# (status or "timeout" / "no answer", the resource whose GET fails)
LOOK_FAILURES = [
    (401, "pods"),
    (403, "pods"),
    (503, "pods"),
    ("no answer", "pods"),
    (401, "daemonsets"),
    (403, "daemonsets"),
    (500, "daemonsets"),
    (503, "daemonsets"),
    ("timeout", "daemonsets"),
]


@pytest.mark.parametrize(("failure", "resource"), LOOK_FAILURES)
async def test_a_rollout_is_never_taken_for_an_uninstall(
    api: ApiServerDouble, tmp_path: Path, failure: int | str, resource: str
) -> None:
    """Issue 39.3: a rollout (its DaemonSet stays) whose look at its own Pod or DaemonSet
    fails — refused (401/403), a server error, no answer, too slow — leaves at once as a
    replaced agent does: its claim stays prepared in the checkpoint, the slot stays held for
    the next agent, nothing of the uninstall runs (before: a 401/403 read as an uninstall,
    the agent stayed and completed unprepares whose releases failed)."""
    from agent.node.leaving import LOOK_TIMEOUT

    node, kubelet, uid = await _node_with_a_prepared_claim(api, tmp_path)
    name = POD if resource == "pods" else "akri-agent"
    if failure == "no answer":
        api.drop(verb="get", resource=resource, name=name, namespace=NS, times=None)
    elif failure == "timeout":
        api.hang(verb="get", resource=resource, name=name, namespace=NS, seconds=LOOK_TIMEOUT + 3)
    else:
        assert isinstance(failure, int)
        api.fail(failure, verb="get", resource=resource, name=name, namespace=NS, times=None)
    async with _Running(api, node, kubelet) as running:
        # at once: staying would last up to the Pod's deletion deadline (30 s on)
        await asyncio.wait_for(node.agent.stay_while_uninstalled(), 15)
        assert node.dra is not None and uid in node.dra.state.checkpoint.claims
        assert not node.agent.leaving_for_good and not node.dra.state.releases_may_fail
        assert api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == f"D:{uid}:node-a"
        await running.stop()
        assert uid in _checkpoint(node).read_text()  # for the next agent
        assert list(node.cdi_dir.glob("*.json"))  # its container keeps its device


INSTANCES = "instances.akri.sh"


def _pending_releases(node: DpNode) -> dict[str, Any]:
    """The pending releases the DRA checkpoint file holds (what a next agent would read)."""
    if not _checkpoint(node).exists():
        return {}
    releases = json.loads(_checkpoint(node).read_text()).get("pendingReleases") or {}
    assert isinstance(releases, dict)
    return releases


async def test_a_release_refused_for_a_moment_while_uninstalled_is_retried(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 39.2: the DaemonSet deleted alone, the API answering 503 for a moment just when
    kubelet unprepares the last claim. The pod ends (the unprepare completes on the node), the
    release stays on record in the DRA checkpoint and is done once the API answers; then the
    agent leaves and its checkpoint goes. Before: the release was only logged, the Instance
    kept ``D:<uid>:node-a`` for good."""
    node, kubelet, uid = await _node_with_a_prepared_claim(api, tmp_path)
    async with _Running(api, node, kubelet) as running:
        api.delete("daemonsets.apps", "akri-agent", NS)
        staying = asyncio.create_task(node.agent.stay_while_uninstalled())
        await eventually(lambda: node.dra is not None and node.dra.state.releases_may_fail,
                         what="the agent knows it is uninstalled")  # fmt: skip
        outage = api.fail(503, resource=INSTANCES, times=None)
        results = await kubelet.remove_pod("app-uid")  # the app pod ends: kubelet unprepares
        assert list(results) == [uid] and not results[uid].error, results  # success: it ends
        assert list(node.cdi_dir.glob("*.json")) == []  # its container is gone
        assert outage.hits > 0
        pending = _pending_releases(node)
        assert pending[uid]["value"] == f"D:{uid}:node-a"
        assert pending[uid]["instances"] == [{"namespace": "default", "name": "cam-8120fe"}]
        assert not staying.done()  # it stays to retry the release
        api.clear_faults()  # the API answers again
        await eventually(
            lambda: api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == "",
            what="the pending release done",
        )
        await asyncio.wait_for(staying, 15)
        assert _pending_releases(node) == {}
        await running.stop()
        assert not _checkpoint(node).parent.exists()  # nothing left on record: it goes


async def test_a_release_refused_after_the_rbac_went_is_done_by_the_next_agent(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """Issue 39.2, the docs' out-of-order uninstall: the agent sees its DaemonSet deleted and
    stays; then the RBAC goes, every request answers 403, and kubelet unprepares the claim.
    The pod ends; the release stays pending in the checkpoint, which outlives the agent (its
    directory too). The agent installed again (with its RBAC) completes the release at its
    start — the slot is no untraceable one — and deleting the Configuration then ends.
    Before: the checkpoint was deleted with the agent, the next agent kept the slot as
    untraceable for ever and the Instance stayed Terminating."""
    node, kubelet, uid = await _node_with_a_prepared_claim(api, tmp_path, pod_grace=6)
    second: DpNode | None = None
    async with _Running(api, node, kubelet) as running:
        try:
            api.delete("daemonsets.apps", "akri-agent", NS)
            staying = asyncio.create_task(node.agent.stay_while_uninstalled())
            await eventually(lambda: node.dra is not None and node.dra.state.releases_may_fail,
                             what="the agent knows it is uninstalled")  # fmt: skip
            api.fail(403, times=None)  # every request of every client: the RBAC is gone
            results = await kubelet.remove_pod("app-uid")
            assert list(results) == [uid] and not results[uid].error, results
            assert uid in _pending_releases(node)
            assert b"akri_dra_pending_releases 1.0" in node.agent.metrics_text()
            await asyncio.wait_for(staying, 30)  # until its Pod's deadline: no API answers
            await running.stop()
            assert _checkpoint(node).exists()  # the release stays on record on the node
            assert uid in _pending_releases(node)
            api.clear_faults()
            slot = api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"]
            assert slot == f"D:{uid}:node-a"
            # installed again: a new agent on the same node, its RBAC back
            second = await start_dp_node(api, "node-a", tmp_path, dra=True, base=node.base)
            await eventually(
                lambda: api_instances(api)["cam-8120fe"].device_usage["cam-8120fe-0"] == "",
                what="the pending release done by the next agent",
            )
            await eventually(lambda: _pending_releases(second) == {}, what="its record dropped")
            api.delete("configurations.akri.sh", "cam", "default")
            await eventually(lambda: api.list(INSTANCES) == [], what="the delete ends")
        finally:
            if second is not None:
                api.clear_faults()
                await second.stop(keep_files=True)
