"""The API-server double's ValidatingAdmissionPolicy enforcement (admission.py), over HTTP:
the stored policies and bindings decide CREATE and UPDATE as kube-apiserver answers them; off
unless asked for."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.apiserver.threaded import ThreadedApiServer


def policy(name: str, reason: str | None = None) -> dict[str, Any]:
    validation: dict[str, Any] = {
        "expression": "!has(object.data) || !('bad' in object.data)",
        "messageExpression": "'no bad key in ' + object.metadata.name",
    }
    if reason:
        validation["reason"] = reason
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"],
                     "operations": ["CREATE", "UPDATE"], "resources": ["configmaps"]}
                ]
            },
            "validations": [validation],
        },
    }  # fmt: skip


def binding(name: str, actions: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": f"{name}-binding"},
        "spec": {"policyName": name, "validationActions": actions},
    }


def write(api: ApiServerDouble, method: str, data: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """POST (create) or PUT (replace) the ConfigMap ``cm``: (HTTP status, answer)."""
    path = "/api/v1/namespaces/default/configmaps" + ("/cm" if method == "PUT" else "")
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": data}
    request = urllib.request.Request(
        api.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"},
        method=method,
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


@pytest.mark.parametrize(("reason", "code"), [(None, 403), ("Invalid", 422)])
def test_a_bound_policy_refuses_create_and_update(reason: str | None, code: int) -> None:
    with ThreadedApiServer(admission_policies=True) as api:
        api.create(policy("no-bad", reason))
        api.create(binding("no-bad", ["Deny"]))
        status, answer = write(api, "POST", {"bad": "1"})
        text = (
            "ValidatingAdmissionPolicy 'no-bad' with binding 'no-bad-binding' denied request: "
            "no bad key in cm"
        )
        assert (status, answer["code"], answer["reason"]) == (code, code, reason or "Forbidden")
        assert answer["message"] == f'configmaps "cm" is forbidden: {text}'
        assert answer["details"]["causes"] == [{"message": text}]
        assert write(api, "POST", {"good": "1"})[0] == 201
        assert write(api, "PUT", {"bad": "1"})[0] == code
        stored = api.get("configmaps", "cm", "default")
        assert stored is not None and stored["data"] == {"good": "1"}


def test_no_deny_action_or_no_binding_or_not_asked_for_admits() -> None:
    for enforce, bound in ((True, ["Warn"]), (True, None), (False, ["Deny"])):
        with ThreadedApiServer(admission_policies=enforce) as api:
            api.create(policy("no-bad"))
            if bound:
                api.create(binding("no-bad", bound))
            assert write(api, "POST", {"bad": "1"})[0] == 201
