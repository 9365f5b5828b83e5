"""Who sends a request, and what RBAC lets them do.

Requests without credentials are an administrator that may do everything (the double's
behaviour from the start). A test that cares registers identities with
:meth:`~tests.doubles.apiserver.ApiServerDouble.add_user`: a bearer token, a user name,
groups, ``extra`` (a pod's service-account token carries the pod's node as
``authentication.kubernetes.io/node-name``) and the RBAC rules bound to it (the ``rules`` of
ClusterRoles, as dicts; ``None``: everything). An unknown token is 401; a request its rules do
not allow is 403 with kube-apiserver's message.

Kubernetes 1.36 also authorizes *inside* a ResourceClaim status update (beta gate
``DRAResourceClaimGranularStatusAuthorization``, on by default), on synthetic subresources
that no request names (``pkg/registry/resource/utils.go``); a refusal there is a field error,
so the answer is **422 Invalid**, not 403:

* ``status.allocation`` / ``status.reservedFor`` changed: ``resourceclaims/binding`` with the
  request's verb, cluster-wide (``AuthorizedForBinding``);
* ``status.devices`` entries of a driver added, changed or removed (claim allocated):
  ``resourceclaims/driver`` named after the driver, in the claim's namespace, with the verb
  ``associated-node:<verb>`` or ``arbitrary-node:<verb>`` (``AuthorizedForDeviceStatus``). The
  ``associated-node:`` form counts only for a service account whose token names exactly one
  node, and only when the claim's allocation is pinned to that node: a ``nodeSelector`` of one
  term holding just ``matchFields metadata.name In [<node>]`` — what the allocator writes for
  devices of a slice with ``nodeName`` or a device with ``bindsToNode: true``. A device of a
  shared pool (a slice ``nodeSelector`` over several nodes) gives the claim that selector, so
  a node agent granted only ``associated-node:update`` is refused.
"""

from __future__ import annotations

import contextvars
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]
Cause = tuple[str, str, str]  # (reason, field, message)

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
ASSOCIATED_NODE = "associated-node:"
ARBITRARY_NODE = "arbitrary-node:"


@dataclass(frozen=True)
class User:
    """An authenticated identity and its RBAC rules (``None``: allowed everything)."""

    name: str
    groups: tuple[str, ...] = ()
    extra: Mapping[str, Sequence[str]] = field(default_factory=dict)
    rules: tuple[JSON, ...] | None = None


@dataclass(frozen=True)
class Attributes:
    """What authorization is asked about (``authorizer.Attributes``)."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str | None = None
    name: str = ""


@dataclass(frozen=True)
class Caller:
    """The request being served: who, and with which verb."""

    user: User | None  # None: no credentials, an administrator
    verb: str


CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("caller", default=None)
"""Set by the server for the request it serves; unset for the test's own store calls."""


def _rule_allows(rule: Mapping[str, Any], attrs: Attributes) -> bool:
    def has(values: Any, value: str) -> bool:
        values = list(values or [])
        return "*" in values or value in values

    resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    names = list(rule.get("resourceNames") or [])
    return (
        has(rule.get("apiGroups"), attrs.group)
        and has(rule.get("resources"), resource)
        and has(rule.get("verbs"), attrs.verb)
        and (not names or attrs.name in names)
    )


def allowed(user: User | None, attrs: Attributes) -> bool:
    """RBAC: whether any of the user's rules grants ``attrs``."""
    if user is None or user.rules is None:
        return True
    return any(_rule_allows(rule, attrs) for rule in user.rules)


def forbidden_message(user: User | None, attrs: Attributes) -> str:
    """kube-apiserver's ``forbiddenMessage`` wrapped by ``NewForbidden``."""
    name = user.name if user is not None else ""
    resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    qualified = f"{attrs.resource}.{attrs.group}" if attrs.group else attrs.resource
    where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    subject = f'{qualified} "{attrs.name}"' if attrs.name else qualified
    return (
        f'{subject} is forbidden: User "{name}" cannot {attrs.verb} resource "{resource}" '
        f'in API group "{attrs.group}" {where}'
    )


# --- inside a ResourceClaim status update -----------------------------------------------------


def _device_key(entry: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    return (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))


def modified_drivers(new_status: Mapping[str, Any], old_status: Mapping[str, Any]) -> set[str]:
    """``getModifiedDrivers``: drivers whose ``status.devices`` entries were added, changed or
    removed."""
    old = {_device_key(d): d for d in old_status.get("devices") or [] if isinstance(d, dict)}
    drivers: set[str] = set()
    for entry in new_status.get("devices") or []:
        if not isinstance(entry, dict):
            continue
        before = old.pop(_device_key(entry), None)
        if before is None or _canonical(before) != _canonical(entry):
            drivers.add(str(entry.get("driver") or ""))
    drivers.update(str(d.get("driver") or "") for d in old.values())
    return drivers


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def allocated_node(allocation: Mapping[str, Any] | None) -> str:
    """``nodeNameFromAllocation``: the node of a selector that is exactly one term with one
    ``matchFields metadata.name In [<node>]``; ``""`` otherwise."""
    selector = (allocation or {}).get("nodeSelector")
    if not isinstance(selector, dict):
        return ""
    terms = selector.get("nodeSelectorTerms") or []
    if len(terms) != 1 or not isinstance(terms[0], dict):
        return ""
    term = terms[0]
    fields = term.get("matchFields") or []
    if term.get("matchExpressions") or len(fields) != 1:
        return ""
    requirement = fields[0]
    values = requirement.get("values") or []
    if (
        requirement.get("key") != "metadata.name"
        or requirement.get("operator") != "In"
        or len(values) != 1
    ):
        return ""
    return str(values[0])


_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def associated_with(user: User | None, node: str) -> bool:
    """``saAssociatedWithAllocatedNode``: a service account whose token names exactly this
    (valid) node."""
    if user is None or not node:
        return False
    namespace, _, name = user.name.removeprefix(SERVICE_ACCOUNT_PREFIX).partition(":")
    if not user.name.startswith(SERVICE_ACCOUNT_PREFIX) or not namespace or not name:
        return False
    nodes = list(user.extra.get(NODE_NAME_EXTRA) or [])
    if len(nodes) != 1 or len(nodes[0]) > 253 or not _NODE_NAME.match(nodes[0]):
        return False
    return nodes[0] == node


def claim_status_causes(new: JSON, old: JSON) -> list[Cause]:
    """The authorization errors of a ResourceClaim status update by the current caller
    (``resourceclaimStatusStrategy.ValidateUpdate``, both 1.36 gates on)."""
    caller = CALLER.get()
    if caller is None or caller.user is None or caller.user.rules is None:
        return []
    user, verb = caller.user, caller.verb
    status = new.get("status") or {}
    old_status = old.get("status") or {}
    namespace = str((new.get("metadata") or {}).get("namespace") or "")
    causes: list[Cause] = []
    if _canonical(status.get("allocation")) != _canonical(old_status.get("allocation")) or (
        _canonical(status.get("reservedFor")) != _canonical(old_status.get("reservedFor"))
    ):
        attrs = Attributes(verb, "resource.k8s.io", "resourceclaims", "binding", None, "")
        if not allowed(user, attrs):
            causes.append(
                (
                    "FieldValueForbidden",
                    "status.allocation",
                    "Forbidden: changing status.allocation or status.reservedFor requires "
                    f'resource="resourceclaims/binding", verb="{verb}" permission: '
                    + forbidden_message(user, attrs),
                )
            )
    if status.get("allocation") is not None:
        if associated_with(user, allocated_node(status.get("allocation"))):
            verbs = [ASSOCIATED_NODE + verb, ARBITRARY_NODE + verb]
        else:
            verbs = [ARBITRARY_NODE + verb]
        for driver in sorted(modified_drivers(status, old_status)):
            tried = [
                Attributes(v, "resource.k8s.io", "resourceclaims", "driver", namespace, driver)
                for v in verbs
            ]
            if not any(allowed(user, attrs) for attrs in tried):
                causes.append(
                    (
                        "FieldValueForbidden",
                        "status.devices",
                        "Forbidden: changing status.devices requires "
                        f'resource="resourceclaims/driver", verb="[{" ".join(verbs)}]" '
                        "permission: " + forbidden_message(user, tried[0]),
                    )
                )
    return causes


def user_from_rules(
    name: str,
    rules: Iterable[Mapping[str, Any]] | None,
    *,
    groups: Iterable[str] = (),
    node: str | None = None,
) -> User:
    """A user; ``node`` adds the node-name extra a pod's service-account token carries."""
    extra = {NODE_NAME_EXTRA: [node]} if node else {}
    return User(
        name,
        tuple(groups),
        extra,
        None if rules is None else tuple(dict(r) for r in rules),
    )
