"""Legacy (unaggregated) discovery documents: /version, /api, /api/v1, /apis, /apis/<g>[/<v>]."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from tests.doubles.apiserver.resources import SUBRESOURCE_VERBS, ResourceRegistry, ResourceType

JSON = dict[str, Any]

VERSION_INFO: JSON = {
    "major": "1",
    "minor": "37",
    "emulationMajor": "1",
    "emulationMinor": "37",
    "minCompatibilityMajor": "1",
    "minCompatibilityMinor": "36",
    "gitVersion": "v1.37.0",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.25.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def api_versions(server_address: str) -> JSON:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def _group(name: str, versions: list[str]) -> JSON:
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def api_group_list(registry: ResourceRegistry) -> JSON:
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group(g, vs) for g, vs in registry.groups() if g],
    }


def api_group(registry: ResourceRegistry, group: str) -> JSON | None:
    for g, versions in registry.groups():
        if g == group and g:
            return {"kind": "APIGroup", "apiVersion": "v1", **_group(g, versions)}
    return None


def _resource_entries(rt: ResourceType) -> list[JSON]:
    main: JSON = {
        "name": rt.plural,
        "singularName": rt.singular,
        "namespaced": rt.namespaced,
        "kind": rt.kind,
        "verbs": list(rt.verbs),
    }
    if rt.short_names:
        main["shortNames"] = list(rt.short_names)
    if rt.categories:
        main["categories"] = list(rt.categories)
    digest = hashlib.sha256(f"{rt.group}/{rt.preferred_version}/{rt.kind}".encode()).digest()
    main["storageVersionHash"] = base64.b64encode(digest[:8]).decode()
    entries = [main]
    for sub in sorted(rt.subresources):
        entries.append(
            {
                "name": f"{rt.plural}/{sub}",
                "singularName": "",
                "namespaced": rt.namespaced,
                "kind": rt.kind,
                "verbs": list(SUBRESOURCE_VERBS),
            }
        )
    return entries


def api_resource_list(registry: ResourceRegistry, group: str, version: str) -> JSON | None:
    resources = registry.in_group_version(group, version)
    if not resources:
        return None
    entries: list[JSON] = []
    for rt in sorted(resources, key=lambda r: r.plural):
        entries.extend(_resource_entries(rt))
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": entries,
    }
