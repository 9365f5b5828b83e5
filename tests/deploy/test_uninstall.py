"""The uninstall of docs/install.md, end to end (issue 33.3): the install applied with kubectl,
two nodes' agents and the controller running as the DaemonSet and the Deployment would run
them (each as its ServiceAccount, with deploy/base's RBAC; tokens refused once the
ServiceAccount is deleted), kubelet and the scheduler emulated per node
(tests/harness/node_pods.py; a deleted Pod ends only once kubelet has unprepared its claims),
and examples/debug-echo-broker.yaml's brokers holding every slot.

* In the documented order — the block of docs/install.md run as written — on a mixed cluster
  (node-a on DRA, node-b on device plugins: the shared devices are served through device
  plugins on both, node-a's through its instance-level plugins, agent/node/dra/name_paths.py)
  everything ends by itself: the brokers go with their terminating Instances, the slots are
  freed, the Instances, the CRDs, the agents and the controller go, and no Pod is left
  Terminating.
* Out of order — ``kubectl delete -k deploy/`` while the brokers run — with devices each node
  sees alone (node-a's brokers through DRA, node-b's through device plugins) the agent of the
  DRA node stays while their claims are prepared, so the broker Pods deleted then still end;
  node-b's Instances stay terminating (nobody removes their finalizer) until the documented
  loop does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.controller.app import Controller
from agent.core.kube import make_kube_client
from tests.controller.conftest import add_node, controller_settings, eventually
from tests.deploy.test_repo_commands import KUBECTL, VENV_BIN, block, commands
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.dra_kubelet import DraKubeletDouble
from tests.harness.agent_process import clean_env
from tests.harness.dp_nodes import DpNode, start_dp_node
from tests.harness.node_pods import NodePods
from tests.paths import REPO

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")

NS = "akri"
NODES = ("node-a", "node-b")
MIXED = {"node-a": "dra", "node-b": "device-plugins"}  # each node's --extended-resources
WITHIN = 60.0  # seconds: bound of every event-driven wait (a loaded machine)
INSTALL = (
    "kubectl apply -k deploy/overlays/debug-echo && kubectl wait --for condition=established "
    "crd/configurations.akri.sh crd/instances.akri.sh"
)  # the README's, with the broker example instead of examples/debug-echo.yaml


def rules_of(path: Path) -> list[dict[str, Any]]:
    """Every rule of the ClusterRoles and Roles in ``path`` (a Role's rules taken
    cluster-wide: the double binds rules to a token, not to namespaces)."""
    return [
        rule
        for document in yaml.safe_load_all(path.read_text())
        if document["kind"] in ("ClusterRole", "Role")
        for rule in document["rules"]
    ]


async def kubectl(env: dict[str, str], command: str, within: float = 120) -> str:
    """``command`` with bash from the repository root (kubectl against the double)."""
    process = await asyncio.create_subprocess_exec(
        "bash", "-c", command, cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(process.communicate(), within)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"{command!r} did not end within {within:g}s") from None
    text = output.decode()
    assert process.returncode == 0, f"{command!r} exited {process.returncode}:\n{text}"
    return text


@dataclass
class Cluster:
    api: ApiServerDouble
    env: dict[str, str]
    nodes: dict[str, DpNode] = field(default_factory=dict)
    pods: dict[str, NodePods] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=lambda: dict(MIXED))  # each node's mode
    dra: dict[str, DraKubeletDouble] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)  # agents (node names) and "controller"
    controller: Controller | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    def broker_pods(self) -> list[dict[str, Any]]:
        return self.api.list("pods", "default", label_selector="controller=akri.sh")

    def terminating(self) -> list[str]:
        return [name for pods in self.pods.values() for name in pods.terminating()]


def _pod(name: str, node: str, owner: dict[str, Any] | None, grace: int) -> dict[str, Any]:
    """A Pod as the DaemonSet / Deployment controllers would create it (not run by them)."""
    meta: dict[str, Any] = {"name": name, "namespace": NS}
    if owner is not None:
        meta["ownerReferences"] = [
            {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "controller": True,
             "blockOwnerDeletion": True,  # as the DaemonSet and ReplicaSet controllers set
             "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}
        ]  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": grace,
            "containers": [{"name": "main", "image": "ghcr.io/akri-py/akri-agent:0.1.0"}],
        },
    }


async def _revoke_tokens_of_deleted_accounts(
    api: ApiServerDouble, tokens: dict[str, list[str]]
) -> None:
    """The service-account token authenticator: a deleted ServiceAccount's tokens are refused
    (401), as for bound tokens on a real API server."""
    while True:
        for account, names in tokens.items():
            if api.get("serviceaccounts", account, NS) is None:
                for token in names:
                    api.revoke_user(token)
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def installed(tmp: Path, *, shared: bool = True) -> AsyncIterator[Cluster]:
    """The install (kubectl apply -k deploy/overlays/debug-echo), its agents and controller
    started as their Pods (node-a on DRA, with a DRA kubelet; node-b on device plugins;
    ``shared``: the agents' ``--debug-echo-shared``, off: each node sees its own devices), and
    examples/debug-echo-broker.yaml with its brokers running."""
    paths = MIXED
    async with ApiServerDouble() as api:
        home = tmp / "home"
        home.mkdir()
        path = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
        env = clean_env(
            {"KUBECONFIG": str(api.write_kubeconfig(home / "kubeconfig")), "HOME": str(home),
             "PATH": path}
        )  # fmt: skip
        cluster = Cluster(api, env, paths=dict(paths))
        await kubectl(env, INSTALL)
        daemonset = api.get("daemonsets.apps", "akri-agent", NS)
        deployment = api.get("deployments.apps", "akri-controller", NS)
        assert daemonset is not None and deployment is not None
        grace = daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        agent_rules = rules_of(REPO / "deploy" / "base" / "rbac.yaml")
        controller_rules = rules_of(REPO / "deploy" / "base" / "controller-rbac.yaml")
        tokens = {"akri-agent": [f"agent-{n}" for n in NODES], "akri-controller": ["controller"]}
        for node in NODES:
            add_node(api, node)
            api.add_user(f"agent-{node}", "system:serviceaccount:akri:akri-agent", agent_rules,
                         node=node)  # fmt: skip
        api.add_user("controller", "system:serviceaccount:akri:akri-controller", controller_rules)
        cluster.tasks.append(asyncio.create_task(_revoke_tokens_of_deleted_accounts(api, tokens)))
        try:
            for node in NODES:
                name = f"akri-agent-{node}"
                api.create(_pod(name, node, daemonset, grace))
                on_dra = paths[node] == "dra"
                started = await start_dp_node(
                    api, node, tmp, dra=on_dra, token=f"agent-{node}",
                    changes={"extended_resources": paths[node], "debug_echo_shared": shared},
                    pod_environ={"POD_NAME": name, "POD_NAMESPACE": NS},
                )  # fmt: skip
                cluster.nodes[node] = started
                kubelet = None
                if on_dra:
                    kubelet = DraKubeletDouble(started.registry_dir, node, api)
                    await kubelet.start()
                    await kubelet.wait_for_registration("akri.sh", timeout=WITHIN)
                    cluster.dra[node] = kubelet
                pods = NodePods(api, node, device_plugins=started.kubelet, dra=kubelet)
                pods.on_terminate(NS, name, _agent_sigterm(cluster, node))
                cluster.pods[node] = pods
                await pods.start()
            kubeconfig = api.write_kubeconfig(home / "controller-kubeconfig", token="controller")
            # a broker whose DRA claim lost its slot to node-b's device plugin (both created
            # at once) stays Pending: the controller replaces it after this grace
            settings = controller_settings(
                kubeconfig=str(kubeconfig), lease_namespace=NS, identity="akri-controller-0",
                pending_broker_grace=3.0,
            )  # fmt: skip
            controller = Controller(settings, make_kube_client(str(kubeconfig)))
            cluster.controller = controller
            stop = asyncio.Event()
            running = asyncio.create_task(controller.run(stop))
            cluster.tasks.append(running)
            api.create(_pod("akri-controller-0", "node-b", deployment, 30))

            async def controller_sigterm(_pod: dict[str, Any]) -> None:
                stop.set()
                await running
                cluster.stopped.add("controller")

            cluster.pods["node-b"].on_terminate(NS, "akri-controller-0", controller_sigterm)
            await asyncio.wait_for(controller.elector.leading.wait(), WITHIN)
            await kubectl(env, "kubectl apply -f examples/debug-echo-broker.yaml")
            try:
                await eventually(lambda: _brokers_hold_every_slot(cluster),
                                 "brokers hold every slot", within=WITHIN)  # fmt: skip
            except AssertionError as error:
                raise AssertionError(f"{error}\n{_describe(cluster)}") from None
            yield cluster
        finally:
            await _tear_down(cluster)


def _agent_sigterm(cluster: Cluster, node: str) -> Any:
    async def sigterm(_pod: dict[str, Any]) -> None:
        agent = cluster.nodes[node].agent
        await agent.stay_while_uninstalled()  # what Agent.run does between SIGTERM and stop
        await agent.stop()
        cluster.stopped.add(node)

    return sigterm


def _names(pods: list[dict[str, Any]]) -> list[str]:
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods]


def _brokers_hold_every_slot(cluster: Cluster) -> bool:
    """Two devices (cam0, cam1) of capacity 2 seen by both nodes — two shared Instances, or
    two Instances of each node when each sees its own — and on every node of each Instance a
    Running broker holding one slot: through DRA on node-a for an Instance of node-a alone
    (``D:<claim>:node-a``), else through device plugins (``<node>``): a device shared with a
    node on device plugins is served through device plugins on every node that sees it
    (agent/node/dra/name_paths.py). (node-a's broker may still hold a shared device's slot
    through DRA: scheduled while node-a alone saw the device, its claim keeps the slot after
    the name moved to the device plugins.)"""
    instances = cluster.api.list("instances.akri.sh")
    running = [p for p in cluster.broker_pods() if (p.get("status") or {}).get("phase") == "Running"
               and not p["metadata"].get("deletionTimestamp")]  # fmt: skip
    if len(instances) not in (2, 4) or len(running) != 4:
        return False
    for instance in instances:
        nodes = instance["spec"]["nodes"]
        on_dra = all(cluster.paths[n] == "dra" for n in nodes)
        holders: dict[str, str] = {}
        for value in instance["spec"]["deviceUsage"].values():
            if value:
                holders[value.rsplit(":", 1)[-1]] = "dra" if value.startswith("D:") else "plugin"
        if sorted(holders) != sorted(nodes) or len(nodes) * len(instances) != 4:
            return False
        for node, path in holders.items():
            if cluster.paths[node] != "dra" and path != "plugin":
                return False  # a device-plugin node never serves a pod through DRA
            if on_dra and path != "dra":
                return False  # every node of the Instance on DRA: through DRA
    return True


def _describe(cluster: Cluster) -> str:
    """The Instances' slots and the broker Pods (for a failure message)."""
    lines = [
        f"instance {i['metadata']['name']}: {i['spec'].get('nodes')} {i['spec']['deviceUsage']}"
        for i in cluster.api.list("instances.akri.sh")
    ]
    lines += [
        f"pod {p['metadata']['name']}: {(p.get('status') or {}).get('phase')} "
        f"deleting={bool(p['metadata'].get('deletionTimestamp'))}"
        for p in cluster.api.list("pods")
    ]
    lines += [f"claim {c['metadata']['name']}" for c in
              cluster.api.list("resourceclaims.resource.k8s.io")]  # fmt: skip
    return "\n".join(lines)


async def _tear_down(cluster: Cluster) -> None:
    for pods in cluster.pods.values():
        await pods.stop()
    if cluster.controller is not None and "controller" not in cluster.stopped:
        cluster.controller.elector.leading.clear()
    for task in cluster.tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    for kubelet in cluster.dra.values():
        await kubelet.stop()
    for name, node in cluster.nodes.items():
        if name in cluster.stopped:
            await node.kubelet.stop()
            shutil.rmtree(node.base, ignore_errors=True)
        else:
            await node.stop()


def _uninstall_block() -> list[str]:
    return commands(block("docs/install.md", "kubectl delete configurations.akri.sh --all -A"))


async def test_the_uninstall_in_the_documented_order_ends_by_itself(tmp_path: Path) -> None:
    steps = _uninstall_block()
    assert [s.split()[:2] for s in steps] == [["kubectl", "delete"], ["kubectl", "wait"],
                                              ["kubectl", "-n"], ["kubectl", "delete"]]  # fmt: skip
    async with installed(tmp_path) as cluster:
        api = cluster.api
        delete_configurations, wait_for_instances, delete_agents, delete_install = steps
        await kubectl(cluster.env, delete_configurations)
        # the Instances are terminating, their brokers hold every slot: only the controller
        # removing the brokers lets them go (before: they stayed, finalizer akri.sh/slots)
        await kubectl(cluster.env, wait_for_instances, within=WITHIN + 30)
        assert api.list("instances.akri.sh") == []
        assert cluster.broker_pods() == []
        assert cluster.terminating() == []
        # returns once every agent is gone; each saw its DaemonSet go while it could look
        # (issue 39.3: with its ServiceAccount already gone it could not tell a rollout)
        await kubectl(cluster.env, delete_agents, within=WITHIN)
        assert {"node-a", "node-b"} <= cluster.stopped
        assert api.get("daemonsets.apps", "akri-agent", NS) is None
        assert not cluster.nodes["node-a"].agent.settings.dra_plugin_dir.exists()
        await kubectl(cluster.env, delete_install)
        await eventually(lambda: cluster.stopped == {"node-a", "node-b", "controller"},
                         "the agents and the controller stopped", within=WITHIN)  # fmt: skip
        await eventually(lambda: api.list("pods") == [], "every Pod ended", within=WITHIN)
        assert api.get("customresourcedefinitions", "instances.akri.sh") is None
        assert api.get("customresourcedefinitions", "configurations.akri.sh") is None
        assert api.get("namespaces", NS) is None
        assert api.list("resourceclaims.resource.k8s.io") == []
        assert cluster.dra["node-a"].claims == {}  # kubelet holds no claim prepared
        # nothing prepared, the agent gone for good: its DRA checkpoint and directory too
        assert not cluster.nodes["node-a"].agent.settings.dra_plugin_dir.exists()
        ended = {n for pods in cluster.pods.values() for n in pods.ended}
        assert sum(n.startswith("default/") for n in ended) == 4  # the four brokers


async def test_deleting_the_install_first_releases_nothing_on_a_guess(tmp_path: Path) -> None:
    """Not the documented order: ``kubectl delete -k deploy/`` while the brokers run. It
    deletes the agents' ServiceAccount before their DaemonSet: an agent that can no longer
    read its Pod (401) cannot tell an uninstall from a rollout (issue 39.3), so it leaves as
    on a rollout — at once, its DRA checkpoint kept, nothing released on a guess. (The
    controller deletes the brokers of the Configurations the CRDs take with them as long as its
    own token works: zero, one or both of node-a's brokers end first, their claims released
    because kubelet asked; seen all three ways.) The brokers node-a still has prepared through
    DRA, deleted, then stay Terminating (kubelet cannot unprepare
    their claims without the driver) until an agent runs on node-a again; the Instances stay
    terminating until the docs' loop removes their finalizer (docs/install.md, "Out of
    order")."""
    async with installed(tmp_path, shared=False) as cluster:
        api = cluster.api
        kubelet_a = cluster.dra["node-a"]
        brokers = cluster.broker_pods()
        uids = dict(zip([p["metadata"]["uid"] for p in brokers], _names(brokers), strict=True))
        broker_of = {
            claim: uids[pod] for claim, info in kubelet_a.claims.items() for pod in info.pods
        }
        assert len(broker_of) == 2  # node-a's two brokers, each through its DRA claim
        # --wait=false: kubectl would wait for the CRDs, which stay terminating, see below
        await kubectl(cluster.env, "kubectl delete -k deploy/ --wait=false")
        await eventually(lambda: {"node-a", "node-b", "controller"} <= cluster.stopped,
                         "the agents and the controller stopped", within=WITHIN)  # fmt: skip
        checkpoint = cluster.nodes["node-a"].agent.settings.dra_plugin_dir / "checkpoint.json"
        # (no checkpoint: the controller's deletions won the race for both, see below)
        saved = json.loads(checkpoint.read_text()) if checkpoint.exists() else {}
        prepared = set(saved.get("preparedClaims", {}))
        # The CRDs' deletion takes the Configurations with it, and the controller deletes their
        # brokers as long as its token still works: a race with the ServiceAccounts' deletion.
        # A claim is released only when kubelet asked, its Pod deleted and ended; every other
        # one stays prepared, in the checkpoint, with kubelet and its slot held.
        released = set(broker_of) - prepared
        assert {broker_of[c] for c in released} <= set(cluster.pods["node-a"].ended)
        assert not {broker_of[c] for c in prepared} & set(cluster.pods["node-a"].ended)
        assert prepared <= set(broker_of) and set(kubelet_a.claims) == prepared
        held = [v for i in api.list("instances.akri.sh") for v in i["spec"]["deviceUsage"].values()
                if v.startswith("D:")]  # fmt: skip
        assert sorted(v.split(":")[1] for v in held) == sorted(prepared)  # nothing released
        for pod in cluster.broker_pods():  # the user deletes what still uses the devices
            api.delete("pods", pod["metadata"]["name"], "default")
        # node-b's brokers (device plugins) end; node-a's wait for a DRA driver
        left = sorted(broker_of[c] for c in prepared)
        await eventually(lambda: sorted(_names(cluster.broker_pods())) == left,
                         "node-b's brokers ended", within=WITHIN)  # fmt: skip
        assert all(p["metadata"].get("deletionTimestamp") for p in cluster.broker_pods())
        # nobody can remove the Instances' finalizer now (their slots stay held): they and
        # their CRD stay terminating until the docs' loop
        crd = api.get("customresourcedefinitions", "instances.akri.sh")
        assert crd is not None and crd["metadata"].get("deletionTimestamp")
        await kubectl(cluster.env, block("docs/install.md", "kubectl get akrii -A -o jsonpath"))
        await eventually(
            lambda: api.get("customresourcedefinitions", "instances.akri.sh") is None,
            "the Instances and their CRD gone",
            within=WITHIN,
        )
