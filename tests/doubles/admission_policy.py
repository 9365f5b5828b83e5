"""A ValidatingAdmissionPolicy evaluator: what kube-apiserver's admission decides for one
request under ``deploy/base/resourceslice-policy.yaml``, ``deploy/base/configuration-policy.yaml``
(or rendered copies).

Stands for the API server's CEL admission: ``matchConditions`` first (a false one means not
matched: allowed), then ``variables`` in order (each sees the ones before it), then each
validation, with ``request``, ``object`` and ``oldObject`` bound as the server binds them (no
``object`` on DELETE, no ``oldObject`` on CREATE). Where it differs: cel-python instead of
cel-go (no cost limits, no type checking of the expressions before they run), and only the
request fields the policies read (operation, username, the node-name extra). Kubernetes' CEL
string library's ``<list>.join(<separator>)`` is added (cel-python lacks it). A request that
fails several validations is refused with the first one's message, as the API server words it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy.adapter import json_to_cel

from tests.paths import REPO

POLICY = REPO / "deploy" / "base" / "resourceslice-policy.yaml"
CONFIGURATION_POLICY = REPO / "deploy" / "base" / "configuration-policy.yaml"
AGENT = "system:serviceaccount:akri:akri-agent"
ENV = celpy.Environment()


def _join(items: Any, separator: Any = "") -> celpy.celtypes.StringType:
    """Kubernetes' ``<list(string)>.join(<string>)`` (ext.Strings)."""
    return celpy.celtypes.StringType(str(separator).join(str(item) for item in items))


FUNCTIONS = {"join": _join}


def policy(path: Path = POLICY) -> dict[str, Any]:
    documents = list(yaml.safe_load_all(path.read_text()))
    found = next(d for d in documents if d["kind"] == "ValidatingAdmissionPolicy")
    assert isinstance(found, dict)
    return found


@functools.cache
def _program(expression: str) -> Any:
    return ENV.program(ENV.compile(expression), functions=FUNCTIONS)


def evaluate(expression: str, activation: dict[str, Any]) -> Any:
    return _program(expression).evaluate(activation)


def admit(
    operation: str,
    slice_: dict[str, Any],
    *,
    old: dict[str, Any] | None = None,
    user: str = AGENT,
    node: str | None = "node-a",
    found: dict[str, Any] | None = None,
) -> tuple[bool, str]:
    """(allowed, message) as the API server decides for this request. ``slice_`` is the
    object sent (for a DELETE: the one deleted); ``old`` what an UPDATE replaces (default:
    the same slice); ``found`` the policy to use (default: the base's)."""
    spec = (found or policy())["spec"]
    extra = {"authentication.kubernetes.io/node-name": [node]} if node else {}
    request = {"operation": operation, "userInfo": {"username": user, "extra": extra}}
    activation: dict[str, Any] = {
        "request": json_to_cel(request),
        "object": json_to_cel(None if operation == "DELETE" else slice_),
        "oldObject": json_to_cel(None if operation == "CREATE" else (old or slice_)),
    }
    return decide(spec, activation)


def decide(spec: dict[str, Any], activation: dict[str, Any]) -> tuple[bool, str]:
    """matchConditions, then variables (each sees those before it), then validations."""
    allowed, message, _reason = _decide(spec, activation)
    return allowed, message


def _decide(spec: dict[str, Any], activation: dict[str, Any]) -> tuple[bool, str, str]:
    for condition in spec.get("matchConditions", []):
        if not evaluate(condition["expression"], activation):
            return True, "not matched", ""
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", []):
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
            reason = validation.get("reason", "Forbidden")
            if "messageExpression" in validation:
                return False, str(evaluate(validation["messageExpression"], activation)), reason
            return False, " ".join(validation["message"].split()), reason
    return True, "", ""


def decide_request(
    spec: dict[str, Any],
    operation: str,
    obj: dict[str, Any],
    old: dict[str, Any] | None,
    username: str = "system:admin",
) -> tuple[str, str] | None:
    """A policy's refusal of a request — (message, reason) — or None (the API-server double's
    admission, tests/doubles/apiserver/admission.py)."""
    request = {"operation": operation, "userInfo": {"username": username, "extra": {}}}
    activation: dict[str, Any] = {
        "request": json_to_cel(request),
        "object": json_to_cel(obj),
        "oldObject": json_to_cel(old),
    }
    allowed, message, reason = _decide(spec, activation)
    return None if allowed else (message, reason)


def admit_configuration(
    operation: str,
    configuration: dict[str, Any],
    *,
    old: dict[str, Any] | None = None,
    found: dict[str, Any] | None = None,
) -> tuple[bool, str]:
    """(allowed, message) for a CREATE or UPDATE of a Configuration under
    deploy/base/configuration-policy.yaml (``found``: another copy of it)."""
    spec = (found or policy(CONFIGURATION_POLICY))["spec"]
    request = {"operation": operation, "userInfo": {"username": "someone", "extra": {}}}
    activation: dict[str, Any] = {
        "request": json_to_cel(request),
        "object": json_to_cel(configuration),
        "oldObject": json_to_cel(old if operation == "UPDATE" else None),
    }
    return decide(spec, activation)
