"""The resource table: which (group, version, resource) triples are served, and how.

Objects are stored per :class:`GroupResource` (all served versions of a kind share one
storage, as with a CRD whose conversion strategy is ``None``); the version only changes the
``apiVersion`` written into responses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]

STANDARD_VERBS: tuple[str, ...] = (
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
)
SUBRESOURCE_VERBS: tuple[str, ...] = ("get", "patch", "update")


@dataclass(frozen=True, order=True)
class GroupResource:
    group: str
    resource: str

    def __str__(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    type: str
    json_path: str
    description: str = ""
    format: str = ""
    priority: int = 0


@dataclass
class ResourceType:
    """One served resource (a built-in or a CRD-defined kind)."""

    group: str
    versions: list[str]
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    subresources: set[str] = field(default_factory=set)
    # Per-version server-side printer columns (CRD additionalPrinterColumns). ``None`` means
    # the built-in NAME/AGE table.
    printer_columns: dict[str, list[PrinterColumn]] | None = None
    verbs: tuple[str, ...] = STANDARD_VERBS
    # The CRD's openAPIV3Schema per version (kept for documentation and optional validation).
    schemas: dict[str, JSON] = field(default_factory=dict)
    custom: bool = False

    def __post_init__(self) -> None:
        if not self.singular:
            self.singular = self.kind.lower()

    @property
    def gr(self) -> GroupResource:
        return GroupResource(self.group, self.plural)

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    @property
    def preferred_version(self) -> str:
        return self.versions[0]

    def api_version(self, version: str) -> str:
        return f"{self.group}/{version}" if self.group else version

    def columns(self, version: str) -> list[PrinterColumn] | None:
        if self.printer_columns is None:
            return None
        return self.printer_columns.get(version, [])


def _rt(
    group: str,
    version: str,
    plural: str,
    kind: str,
    namespaced: bool,
    short: Iterable[str] = (),
    categories: Iterable[str] = (),
    subresources: Iterable[str] = (),
) -> ResourceType:
    return ResourceType(
        group=group,
        versions=[version],
        plural=plural,
        kind=kind,
        namespaced=namespaced,
        short_names=list(short),
        categories=list(categories),
        subresources=set(subresources),
    )


def builtin_resources() -> list[ResourceType]:
    """The built-in kinds served without any CRD."""
    return [
        _rt("", "v1", "namespaces", "Namespace", False, ["ns"], subresources=["status"]),
        _rt("", "v1", "pods", "Pod", True, ["po"], ["all"], ["status"]),
        _rt("", "v1", "services", "Service", True, ["svc"], ["all"], ["status"]),
        _rt("batch", "v1", "jobs", "Job", True, [], ["all"], ["status"]),
        _rt("", "v1", "nodes", "Node", False, ["no"], subresources=["status"]),
        _rt("", "v1", "secrets", "Secret", True),
        _rt("", "v1", "configmaps", "ConfigMap", True, ["cm"]),
        _rt("", "v1", "events", "Event", True, ["ev"]),
        _rt("events.k8s.io", "v1", "events", "Event", True, ["ev"]),
        _rt("coordination.k8s.io", "v1", "leases", "Lease", True),
        # Stored, never acted on (no controller runs Pods for them here): what `kubectl apply -k
        # deploy/` sends besides the kinds above, so the README's install command runs as written.
        _rt("", "v1", "serviceaccounts", "ServiceAccount", True, ["sa"]),
        _rt("apps", "v1", "daemonsets", "DaemonSet", True, ["ds"], ["all"], ["status"]),
        _rt("apps", "v1", "deployments", "Deployment", True, ["deploy"], ["all"], ["status"]),
        _rt("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
        _rt("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
        _rt("rbac.authorization.k8s.io", "v1", "roles", "Role", True),
        _rt("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True),
        _rt(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicies",
            "ValidatingAdmissionPolicy",
            False,
            subresources=["status"],
        ),
        _rt(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicybindings",
            "ValidatingAdmissionPolicyBinding",
            False,
        ),
        _rt("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False),
        _rt(
            "resource.k8s.io",
            "v1",
            "resourceclaims",
            "ResourceClaim",
            True,
            subresources=["status"],
        ),
        _rt("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False),
        _rt("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True),
        _rt(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            False,
            ["crd", "crds"],
            ["api-extensions"],
            ["status"],
        ),
    ]


CRD_GR = GroupResource("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACES_GR = GroupResource("", "namespaces")


class CRDError(ValueError):
    """A CRD that cannot be served; ``causes`` are (reason, field, message) triples."""

    def __init__(self, causes: list[tuple[str, str, str]]) -> None:
        self.causes = causes
        super().__init__("; ".join(f"{f}: {m}" for _, f, m in causes))


def resource_type_from_crd(crd: JSON) -> ResourceType:
    """Translate an ``apiextensions.k8s.io/v1`` CRD into the resource it defines."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group") or ""
    plural = names.get("plural") or ""
    kind = names.get("kind") or ""
    causes: list[tuple[str, str, str]] = []
    if not group:
        causes.append(("FieldValueRequired", "spec.group", "Required value"))
    if not plural:
        causes.append(("FieldValueRequired", "spec.names.plural", "Required value"))
    if not kind:
        causes.append(("FieldValueRequired", "spec.names.kind", "Required value"))
    name = (crd.get("metadata") or {}).get("name", "")
    if plural and group and name != f"{plural}.{group}":
        causes.append(
            (
                "FieldValueInvalid",
                "metadata.name",
                f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group',
            )
        )
    scope = spec.get("scope")
    if scope not in ("Namespaced", "Cluster"):
        causes.append(
            (
                "FieldValueNotSupported",
                "spec.scope",
                f'Unsupported value: "{scope}": supported values: "Cluster", "Namespaced"',
            )
        )
    versions_spec = [v for v in spec.get("versions") or [] if isinstance(v, dict)]
    if not versions_spec:
        causes.append(("FieldValueRequired", "spec.versions", "Required value"))
    elif sum(1 for v in versions_spec if v.get("storage")) != 1:
        causes.append(
            (
                "FieldValueInvalid",
                "spec.versions",
                "Invalid value: must have exactly one version marked as storage version",
            )
        )
    if causes:
        raise CRDError(causes)

    served = _sort_versions([v["name"] for v in versions_spec if v.get("served", True)])
    subresources: set[str] = set()
    columns: dict[str, list[PrinterColumn]] = {}
    schemas: dict[str, JSON] = {}
    for v in versions_spec:
        if "status" in (v.get("subresources") or {}):
            subresources.add("status")
        if "scale" in (v.get("subresources") or {}):
            subresources.add("scale")
        cols = v.get("additionalPrinterColumns")
        if cols:
            columns[v["name"]] = [
                PrinterColumn(
                    name=c["name"],
                    type=c.get("type", "string"),
                    json_path=c.get("jsonPath", ""),
                    description=c.get("description", ""),
                    format=c.get("format", ""),
                    priority=int(c.get("priority", 0)),
                )
                for c in cols
            ]
        else:
            columns[v["name"]] = [
                PrinterColumn("Age", "date", ".metadata.creationTimestamp", "CreationTimestamp")
            ]
        schema = (v.get("schema") or {}).get("openAPIV3Schema")
        if schema:
            schemas[v["name"]] = schema
    subresources.discard("scale")  # not implemented
    return ResourceType(
        group=group,
        versions=served,
        plural=plural,
        kind=kind,
        namespaced=scope == "Namespaced",
        singular=names.get("singular") or kind.lower(),
        short_names=list(names.get("shortNames") or []),
        categories=list(names.get("categories") or []),
        subresources=subresources,
        printer_columns=columns,
        schemas=schemas,
        custom=True,
    )


class ResourceRegistry:
    """The set of served resources, indexed for URL routing, discovery and name lookup."""

    def __init__(self, resources: Iterable[ResourceType] = ()) -> None:
        self._by_gr: dict[GroupResource, ResourceType] = {}
        # Group registration order, used for the discovery order of /apis.
        self._group_order: list[str] = []
        for rt in resources:
            self.register(rt)

    def register(self, rt: ResourceType) -> None:
        self._by_gr[rt.gr] = rt
        if rt.group not in self._group_order:
            self._group_order.append(rt.group)

    def unregister(self, gr: GroupResource) -> ResourceType | None:
        rt = self._by_gr.pop(gr, None)
        if rt is not None and not any(r.group == rt.group for r in self._by_gr.values()):
            self._group_order.remove(rt.group)
        return rt

    def __iter__(self) -> Iterator[ResourceType]:
        return iter(list(self._by_gr.values()))

    def get(self, gr: GroupResource) -> ResourceType | None:
        return self._by_gr.get(gr)

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        rt = self._by_gr.get(GroupResource(group, plural))
        if rt is None or version not in rt.versions:
            return None
        return rt

    def groups(self) -> list[tuple[str, list[str]]]:
        """``(group, versions)`` in registration order; versions in preference order."""
        out: list[tuple[str, list[str]]] = []
        for group in self._group_order:
            versions: list[str] = []
            for rt in self._by_gr.values():
                if rt.group == group:
                    versions.extend(v for v in rt.versions if v not in versions)
            if versions:
                out.append((group, _sort_versions(versions)))
        return out

    def in_group_version(self, group: str, version: str) -> list[ResourceType]:
        return [rt for rt in self._by_gr.values() if rt.group == group and version in rt.versions]

    def resolve(self, name: str) -> ResourceType:
        """Find a resource the way ``kubectl`` does: plural, singular, short name or kind,
        optionally qualified with ``.group`` (``instances.akri.sh``)."""
        name_l = name.lower()
        for rt in self._by_gr.values():
            candidates = {rt.plural, rt.singular, rt.kind.lower(), *rt.short_names}
            qualified = {f"{c}.{rt.group}" for c in candidates} if rt.group else set()
            if name_l in qualified:
                return rt
        matches = [
            rt
            for rt in self._by_gr.values()
            if name_l in {rt.plural, rt.singular, rt.kind.lower(), *rt.short_names}
        ]
        if not matches:
            raise KeyError(name)
        # Prefer the core group, like kubectl does for "events".
        matches.sort(key=lambda rt: (rt.group != "", rt.group))
        return matches[0]


def _version_key(version: str) -> tuple[int, int, int]:
    """Kubernetes version priority: GA > beta > alpha, then higher numbers first."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (3, 0, 0)
    major = int(m.group(1))
    stage = {"alpha": 2, "beta": 1, None: 0}[m.group(2)]
    minor = int(m.group(3) or 0)
    return (stage, -major, -minor)


def _sort_versions(versions: list[str]) -> list[str]:
    return sorted(versions, key=_version_key)
