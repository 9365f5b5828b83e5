"""The API-server double authorizes a ResourceClaim status update like kube-apiserver 1.36
(``DRAResourceClaimGranularStatusAuthorization``, tests/doubles/apiserver/authz.py): a node
agent's service account, granted ``associated-node:update`` on ``resourceclaims/driver`` for
``akri.sh`` (deploy/base/rbac.yaml), may write ``status.devices`` of a claim whose allocation
is pinned to its own node, and is refused with **422 Invalid** (cause ``status.devices``,
``Forbidden``) for a claim allocated from a shared pool, whose allocation keeps the slice's
``kubernetes.io/hostname In [...]`` selector — what the real server answered the agent on
every claim of a shared device (issue 33.2). Also: tokens (401), RBAC on requests (403)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.core.kube import ApiError, KubeClient, make_kube_client
from tests.doubles.apiserver import ApiServerDouble
from tests.paths import REPO

JSON = dict[str, Any]
CLAIMS = "resourceclaims.resource.k8s.io"
AGENT = "system:serviceaccount:akri:akri-agent"
CLAIM = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c"


def agent_rules() -> list[JSON]:
    """The rules of the agent's ClusterRole in deploy/base/rbac.yaml."""
    documents = yaml.safe_load_all((REPO / "deploy/base/rbac.yaml").read_text())
    role = next(d for d in documents if d and d["kind"] == "ClusterRole")
    return list(role["rules"])


def by_name(node: str) -> JSON:
    return {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]
    }


def by_hostname(*nodes: str) -> JSON:
    return {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}
                ]
            }
        ]
    }


def allocated_claim(api: ApiServerDouble, node_selector: JSON) -> JSON:
    api.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "default"},
            "spec": {
                "devices": {"requests": [{"name": "req", "exactly": {"deviceClassName": "x"}}]}
            },
        }
    )
    claim = api.get(CLAIMS, "c", "default")
    assert claim is not None
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "req", "driver": "akri.sh", "pool": "cam-1", "device": "cam-1-0"}
                ]
            },
            "nodeSelector": node_selector,
        },
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u1"}],
    }
    rt = api.resource(CLAIMS)
    return api.store.update(rt, "v1", "default", "c", claim, subresource="status")


def with_devices(claim: JSON) -> JSON:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "c",
            "namespace": "default",
            "resourceVersion": claim["metadata"]["resourceVersion"],
        },
        "spec": claim["spec"],
        "status": dict(claim["status"]),
    }
    body["status"]["devices"] = [
        {"driver": "akri.sh", "pool": "cam-1", "device": "cam-1-0", "data": {"slot": "cam-1-0"}}
    ]
    return body


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble() as server:
        server.add_user("agent-a", AGENT, agent_rules(), node="node-a")
        server.add_user("agent-b", AGENT, agent_rules(), node="node-b")
        server.add_user("admin", "kubernetes-admin", None, groups=["system:masters"])
        yield server


async def client(api: ApiServerDouble, tmp_path: Path, token: str) -> KubeClient:
    path = api.write_kubeconfig(tmp_path / f"kubeconfig-{token}", token=token)
    return make_kube_client(str(path), timeout=5)


async def test_a_claim_pinned_to_the_agents_node_takes_its_status_devices(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    claim = allocated_claim(api, by_name("node-a"))
    kube = await client(api, tmp_path, "agent-a")
    try:
        await kube.replace(CLAIM + "/status", with_devices(claim))
    finally:
        await kube.close()
    stored = api.get(CLAIMS, "c", "default")
    assert stored is not None and stored["status"]["devices"][0]["device"] == "cam-1-0"


async def test_a_claim_from_a_shared_pool_refuses_the_node_agent_with_422(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    claim = allocated_claim(api, by_hostname("node-a", "node-b"))
    kube = await client(api, tmp_path, "agent-a")
    try:
        with pytest.raises(ApiError) as caught:
            await kube.replace(CLAIM + "/status", with_devices(claim))
    finally:
        await kube.close()
    error = caught.value
    assert (error.status, error.reason) == (422, "Invalid")
    assert [(c.field, c.reason) for c in error.causes] == [
        ("status.devices", "FieldValueForbidden")
    ]
    assert error.causes[0].message == (
        'Forbidden: changing status.devices requires resource="resourceclaims/driver", '
        'verb="[arbitrary-node:update]" permission: resourceclaims.resource.k8s.io "akri.sh" '
        f'is forbidden: User "{AGENT}" cannot arbitrary-node:update resource '
        '"resourceclaims/driver" in API group "resource.k8s.io" in the namespace "default"'
    )
    stored = api.get(CLAIMS, "c", "default")
    assert stored is not None and "devices" not in stored["status"]


async def test_another_nodes_agent_and_an_administrator(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    claim = allocated_claim(api, by_name("node-a"))
    other = await client(api, tmp_path, "agent-b")
    admin = await client(api, tmp_path, "admin")
    try:
        with pytest.raises(ApiError) as caught:
            await other.replace(CLAIM + "/status", with_devices(claim))
        assert caught.value.status == 422
        assert "associated-node:update arbitrary-node:update" not in str(caught.value)
        # kubectl as cluster-admin: the same body is accepted (what the issue saw)
        await admin.replace(CLAIM + "/status", with_devices(claim))
    finally:
        await other.close()
        await admin.close()


async def test_changing_the_allocation_needs_the_binding_subresource(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    claim = allocated_claim(api, by_name("node-a"))
    body = with_devices(claim)
    body["status"]["reservedFor"] = []
    kube = await client(api, tmp_path, "agent-a")
    try:
        with pytest.raises(ApiError) as caught:
            await kube.replace(CLAIM + "/status", body)
    finally:
        await kube.close()
    assert "status.allocation" in [c.field for c in caught.value.causes]
    assert 'resource="resourceclaims/binding", verb="update"' in str(caught.value)


async def test_tokens_and_rbac_on_requests(api: ApiServerDouble, tmp_path: Path) -> None:
    allocated_claim(api, by_name("node-a"))
    stranger = await client(api, tmp_path, "nobody")
    agent = await client(api, tmp_path, "agent-a")
    try:
        with pytest.raises(ApiError) as unknown:
            await stranger.get(CLAIM)
        assert unknown.value.status == 401
        await agent.get(CLAIM)  # get on resourceclaims: granted
        with pytest.raises(ApiError) as refused:
            await agent.delete(CLAIM)
        assert refused.value.status == 403
        assert str(refused.value) == (
            'HTTP 403 Forbidden: resourceclaims.resource.k8s.io "c" is forbidden: User '
            f'"{AGENT}" cannot delete resource "resourceclaims" in API group "resource.k8s.io" '
            'in the namespace "default"'
        )
    finally:
        await stranger.close()
        await agent.close()
    # the test's own calls (no request) are an administrator's
    assert api.get(CLAIMS, "c", "default") is not None


async def test_a_revoked_token_is_refused_also_when_no_user_is_left(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    """A deleted ServiceAccount's token answers 401 on a real server; the double made every
    request an administrator's once the last registered user was removed."""
    allocated_claim(api, by_name("node-a"))
    agent = await client(api, tmp_path, "agent-a")
    try:
        await agent.get(CLAIM)
        for token in list(api.users):
            api.revoke_user(token)
        assert api.users == {}
        with pytest.raises(ApiError) as revoked:
            await agent.get(CLAIM)
        assert revoked.value.status == 401
    finally:
        await agent.close()
