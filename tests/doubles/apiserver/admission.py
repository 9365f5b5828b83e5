"""Validating admission policies in the API-server double (opt in: ``ApiServerDouble(
admission_policies=True)``): the ValidatingAdmissionPolicies and their bindings stored in it
decide each CREATE and UPDATE, after the schema validation, as kube-apiserver's
ValidatingAdmissionPolicy plugin does.

A binding applies its policy when the policy's ``matchConstraints.resourceRules`` match the
request (group, version, resource, operation; ``*`` wildcards); its ``validationActions``
containing ``Deny`` refuses a request the policy fails, with the API server's answer: the
validation's ``reason`` (default Forbidden) and its code, the message
``<resource> "<name>" is forbidden: ValidatingAdmissionPolicy '<policy>' with binding
'<binding>' denied request: <message>`` (the first failing validation's), the same text as a
cause. The CEL is evaluated by :mod:`tests.doubles.admission_policy` (cel-python). Not
modelled: DELETE and CONNECT, namespace and object selectors, binding ``matchResources``,
``paramRef``, ``auditAnnotations``, ``Warn``/``Audit`` actions, cost limits, the request's
user (it is the double's anonymous administrator).
"""

from __future__ import annotations

from typing import Any

from tests.doubles.apiserver.errors import ApiError
from tests.doubles.apiserver.resources import GroupResource, ResourceType

JSON = dict[str, Any]
POLICIES = GroupResource("admissionregistration.k8s.io", "validatingadmissionpolicies")
BINDINGS = GroupResource("admissionregistration.k8s.io", "validatingadmissionpolicybindings")
CODES = {"Unauthorized": 401, "Forbidden": 403, "Invalid": 422, "RequestEntityTooLarge": 413}


def _matches(values: list[str] | None, value: str) -> bool:
    return bool(values) and ("*" in values or value in values)  # type: ignore[operator]


def rule_matches(rule: JSON, rt: ResourceType, version: str, operation: str) -> bool:
    return (
        _matches(rule.get("apiGroups"), rt.group)
        and _matches(rule.get("apiVersions"), version)
        and _matches(rule.get("operations"), operation)
        and _matches(rule.get("resources"), rt.plural)
    )


def policy_matches(policy: JSON, rt: ResourceType, version: str, operation: str) -> bool:
    rules = ((policy.get("spec") or {}).get("matchConstraints") or {}).get("resourceRules") or []
    return any(rule_matches(rule, rt, version, operation) for rule in rules)


def admit(
    policies: list[JSON], bindings: list[JSON], rt: ResourceType, version: str,
    old: JSON | None, new: JSON,
) -> None:  # fmt: skip
    """Raise the API server's refusal when a bound policy denies this write."""
    operation = "CREATE" if old is None else "UPDATE"
    if rt.gr in (POLICIES, BINDINGS):
        return
    by_name = {p["metadata"]["name"]: p for p in policies}
    for binding in sorted(bindings, key=lambda b: b["metadata"]["name"]):
        spec = binding.get("spec") or {}
        policy = by_name.get(spec.get("policyName", ""))
        if policy is None or "Deny" not in (spec.get("validationActions") or []):
            continue
        if not policy_matches(policy, rt, version, operation):
            continue
        from tests.doubles.admission_policy import decide_request

        refusal = decide_request(policy["spec"], operation, new, old)
        if refusal is None:
            continue
        message, reason = refusal
        name = str((new.get("metadata") or {}).get("name", ""))
        text = (
            f"ValidatingAdmissionPolicy '{policy['metadata']['name']}' with binding "
            f"'{binding['metadata']['name']}' denied request: {message}"
        )
        details: JSON = {"name": name, "kind": rt.plural, "causes": [{"message": text}]}
        if rt.group:
            details["group"] = rt.group
        raise ApiError(
            CODES.get(reason, 403), f'{rt.gr} "{name}" is forbidden: {text}', reason, details
        )
