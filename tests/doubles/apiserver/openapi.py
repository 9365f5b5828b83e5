"""A minimal OpenAPI v3 surface: enough for ``kubectl apply`` to learn that the server does
field validation itself (``fieldValidation`` query parameter on PATCH), so it neither needs
schemas for client-side validation nor falls back to ``/openapi/v2``."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tests.doubles.apiserver.resources import ResourceRegistry, ResourceType

JSON = dict[str, Any]

_PATCH_PARAMS = ("dryRun", "fieldManager", "fieldValidation", "force")


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def _object_path(rt: ResourceType, version: str) -> str:
    prefix = "/" + _gv_path(rt.group, version)
    if rt.namespaced:
        return f"{prefix}/namespaces/{{namespace}}/{rt.plural}/{{name}}"
    return f"{prefix}/{rt.plural}/{{name}}"


def group_version_doc(registry: ResourceRegistry, group: str, version: str) -> JSON | None:
    resources = registry.in_group_version(group, version)
    if not resources:
        return None
    paths: JSON = {}
    for rt in sorted(resources, key=lambda r: r.plural):
        gvk = {"group": rt.group, "version": version, "kind": rt.kind}
        paths[_object_path(rt, version)] = {
            "get": {
                "operationId": f"read{rt.kind}",
                "x-kubernetes-action": "get",
                "x-kubernetes-group-version-kind": gvk,
                "responses": {"200": {"description": "OK"}},
            },
            "patch": {
                "operationId": f"patch{rt.kind}",
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [
                    {"name": p, "in": "query", "schema": {"type": "string"}} for p in _PATCH_PARAMS
                ],
                "responses": {"200": {"description": "OK"}},
            },
        }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.37.0"},
        "paths": paths,
        "components": {"schemas": {}},
    }


def root_doc(registry: ResourceRegistry) -> JSON:
    paths: JSON = {}
    for group, versions in registry.groups():
        for version in versions:
            doc = group_version_doc(registry, group, version)
            digest = hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
            path = _gv_path(group, version)
            paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest.upper()}"}
    return {"paths": paths}
