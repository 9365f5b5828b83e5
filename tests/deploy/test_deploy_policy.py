"""deploy/base/resourceslice-policy.yaml: the ValidatingAdmissionPolicy's CEL, evaluated with
cel-python the way the API server evaluates it (matchConditions, then the variables in order,
then each validation) against the slices the agent's publisher really writes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.node.dra.slices import Pool
from tests.doubles.admission_policy import admit
from tests.paths import REPO

ROOT = REPO
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (kustomize) not installed")


def node_slice(node: str) -> dict[str, Any]:
    return {"spec": Pool(name=node, node_name=node).slice_specs()[0]}


def shared_slice(*nodes: str) -> dict[str, Any]:
    return {"spec": Pool(name="cam-8120fe", node_name=None, nodes=nodes).slice_specs()[0]}


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_the_agent_may_write_its_own_nodes_and_shared_pools(operation: str) -> None:
    assert admit(operation, node_slice("node-a")) == (True, "")
    assert admit(operation, shared_slice("node-a", "node-b")) == (True, "")


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_the_agent_may_not_write_other_nodes_slices(operation: str) -> None:
    allowed, message = admit(operation, node_slice("node-b"))
    assert not allowed
    assert (
        message == "the Akri agent on node 'node-a' may not modify ResourceSlices of node 'node-b'"
    )
    allowed, message = admit(operation, shared_slice("node-b", "node-c"))
    assert not allowed and "nodeSelector does not list its node" in message


def test_other_drivers_and_missing_node_names_are_refused() -> None:
    other = node_slice("node-a")
    other["spec"]["driver"] = "gpu.example.com"
    assert admit("CREATE", other) == (
        False,
        "the Akri agent may only write ResourceSlices of driver akri.sh",
    )
    allowed, message = admit("CREATE", node_slice("node-a"), node=None)
    assert not allowed and "ServiceAccountTokenPodNodeInfo" in message


def test_other_users_are_not_matched() -> None:
    assert admit("CREATE", node_slice("node-b"), user="system:serviceaccount:x:y") == (
        True,
        "not matched",
    )


def test_an_update_may_not_take_over_a_slice_the_agent_may_not_write() -> None:
    """Before: only the new object was checked, so an agent could rewrite another node's
    slice (or a shared slice it does not publish) into one of its own."""
    allowed, message = admit("UPDATE", node_slice("node-a"), old=node_slice("node-b"))
    assert not allowed
    assert message == (
        "the Akri agent on node 'node-a' may not take over a ResourceSlice of node 'node-b'"
    )
    # a node-local slice stays its node's, even rewritten into a shared pool node-a publishes
    allowed, message = admit("UPDATE", shared_slice("node-a"), old=node_slice("node-b"))
    assert not allowed and "a ResourceSlice of node 'node-b'" in message
    # node-d is listed in the new selector but node-a sorts before it: not the publisher
    allowed, message = admit(
        "UPDATE",
        shared_slice("node-a", "node-d"),
        old=shared_slice("node-b", "node-c"),
        node="node-d",
    )
    assert not allowed
    assert message == (
        "the Akri agent on node 'node-d' may not take over a shared ResourceSlice whose "
        "nodeSelector does not list its node, unless the new nodeSelector makes it the "
        "pool's publisher (its smallest node name)"
    )
    foreign = node_slice("node-a")
    foreign["spec"]["driver"] = "gpu.example.com"
    assert admit("UPDATE", node_slice("node-a"), old=foreign) == (
        False,
        "the Akri agent may only write ResourceSlices of driver akri.sh",
    )


def test_the_new_publisher_of_a_shared_pool_may_adopt_its_slices() -> None:
    """desired_pools makes min(nodes) the publisher: Instance nodes [node-b, node-c] were
    published by node-b; node-a discovers the device too, becomes the publisher, and adopts
    the slice with an UPDATE whose old version lists only node-b and node-c. Before: refused,
    so the pool was stuck at its old content."""
    assert admit(
        "UPDATE", shared_slice("node-a", "node-b", "node-c"), old=shared_slice("node-b", "node-c")
    ) == (True, "")
    # the old nodes all lost the device: the pool moves to node-a alone
    assert admit("UPDATE", shared_slice("node-a"), old=shared_slice("node-b", "node-c")) == (
        True,
        "",
    )
    # a DELETE has no new object: only a node the slice lists may delete it (the publisher
    # rewrites a surplus slice it adopted before deleting it)
    allowed, message = admit("DELETE", shared_slice("node-b", "node-c"))
    assert not allowed and "nodeSelector does not list its node" in message
    adopted = shared_slice("node-a", "node-b", "node-c")
    assert admit("DELETE", adopted) == (True, "")
    # the publisher rule does not let a CREATE through for a pool not listing the node
    allowed, _ = admit("CREATE", shared_slice("node-b", "node-c"))
    assert not allowed


def test_an_update_between_slices_the_agent_may_write_is_allowed() -> None:
    """The publisher's real updates: a shared pool changing its node list (still listing
    this node before and after), and a node-local pool with new content."""
    assert admit("UPDATE", shared_slice("node-a"), old=shared_slice("node-a", "node-b")) == (
        True,
        "",
    )
    assert admit("UPDATE", shared_slice("node-b", "node-a"), old=shared_slice("node-a")) == (
        True,
        "",
    )
    newer = node_slice("node-a")
    newer["spec"]["devices"] = [{"name": "slot-0"}]
    assert admit("UPDATE", newer, old=node_slice("node-a")) == (True, "")


@needs_kubectl
def test_the_policy_follows_the_namespace_an_overlay_chooses(tmp_path: Path) -> None:
    """The base puts the agent in namespace akri; an overlay's ``namespace:`` moves its
    ServiceAccount, and the policy must still apply to it (before: it matched only
    system:serviceaccount:akri:akri-agent, so a moved agent was not restricted at all)."""
    (tmp_path / "kustomization.yaml").write_text(
        f"namespace: edge\nresources:\n  - {os.path.relpath(ROOT / 'deploy' / 'base', tmp_path)}\n"
    )
    rendered = subprocess.run(
        [str(KUBECTL), "kustomize", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    documents = [d for d in yaml.safe_load_all(rendered) if d]
    daemonset = next(d for d in documents if d["kind"] == "DaemonSet")
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    user = f"system:serviceaccount:{daemonset['metadata']['namespace']}:{account}"
    assert user == "system:serviceaccount:edge:akri-agent"
    bindings = [d for d in documents if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert bindings and all(
        subject["namespace"] == "edge" for b in bindings for subject in b["subjects"]
    )
    moved = next(d for d in documents if d["kind"] == "ValidatingAdmissionPolicy")
    allowed, message = admit("CREATE", node_slice("node-b"), user=user, found=moved)
    assert not allowed and "may not modify ResourceSlices of node 'node-b'" in message
    assert admit("CREATE", node_slice("node-a"), user=user, found=moved) == (True, "")
