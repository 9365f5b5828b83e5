"""deploy/base/resourceslice-policy.yaml: the ValidatingAdmissionPolicy's CEL, evaluated with
cel-python the way the API server evaluates it (matchConditions, then the variables in order,
then each validation) against the slices the agent's publisher really writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy.adapter import json_to_cel

from agent.dra.slices import Pool

POLICY = Path(__file__).resolve().parent.parent / "deploy" / "base" / "resourceslice-policy.yaml"
AGENT = "system:serviceaccount:akri:akri-agent"
ENV = celpy.Environment()


def policy() -> dict[str, Any]:
    documents = list(yaml.safe_load_all(POLICY.read_text()))
    found = next(d for d in documents if d["kind"] == "ValidatingAdmissionPolicy")
    assert isinstance(found, dict)
    return found


def evaluate(expression: str, activation: dict[str, Any]) -> Any:
    program = ENV.program(ENV.compile(expression))
    return program.evaluate(activation)


def admit(
    operation: str,
    slice_: dict[str, Any],
    *,
    user: str = AGENT,
    node: str | None = "node-a",
) -> tuple[bool, str]:
    """(allowed, message) as the API server decides for this request."""
    spec = policy()["spec"]
    extra = {"authentication.kubernetes.io/node-name": [node]} if node else {}
    request = {"operation": operation, "userInfo": {"username": user, "extra": extra}}
    activation: dict[str, Any] = {
        "request": json_to_cel(request),
        "object": json_to_cel(None if operation == "DELETE" else slice_),
        "oldObject": json_to_cel(slice_ if operation != "CREATE" else None),
    }
    for condition in spec["matchConditions"]:
        if not evaluate(condition["expression"], activation):
            return True, "not matched"
    variables: dict[str, Any] = {}
    for variable in spec["variables"]:
        activation["variables"] = (
            json_to_cel(None)
            if not variables
            else celpy.celtypes.MapType(
                {celpy.celtypes.StringType(k): v for k, v in variables.items()}
            )
        )
        variables[variable["name"]] = evaluate(variable["expression"], activation)
    activation["variables"] = celpy.celtypes.MapType(
        {celpy.celtypes.StringType(k): v for k, v in variables.items()}
    )
    for validation in spec["validations"]:
        if not evaluate(validation["expression"], activation):
            if "messageExpression" in validation:
                return False, str(evaluate(validation["messageExpression"], activation))
            return False, " ".join(validation["message"].split())
    return True, ""


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
