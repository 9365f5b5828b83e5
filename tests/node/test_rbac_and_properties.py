"""discoveryProperties from Secrets/ConfigMaps, and RBAC covering every agent request."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.core.model.configuration import parse_configuration
from agent.core.model.properties import PropertyResolutionError, resolve_properties
from discovery_handlers.base import Device, DiscoveryHandler, DiscoveryProperties
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import (
    CRDS,
    debug_echo_configuration,
    edited,
    eventually,
    instances,
    start_node,
)
from tests.paths import REPO

ROOT = REPO


class RecordingHandler(DiscoveryHandler):
    """Reports one device and records the properties each discovery run received."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[dict[str, bytes | None]] = []

    @property
    def shared(self) -> bool:
        return True

    def validate(self, discovery_details: str) -> None:
        return None

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        self.seen.append(dict(discovery_properties))
        yield [Device("dev")]
        await asyncio.Event().wait()


def recorder_configuration(properties: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "akri.sh/v0",
        "kind": "Configuration",
        "metadata": {"name": "rec", "namespace": "default"},
        "spec": {
            "discoveryHandler": {"name": "recorder", "discoveryProperties": properties},
            "capacity": 1,
        },
    }


def secret(name: str, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "default"},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


PROPS: list[dict[str, Any]] = [
    {"name": "literal", "value": "plain"},
    {"name": "user", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "user"}}},
    {"name": "mode", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
    {
        "name": "maybe",
        "valueFrom": {"secretKeyRef": {"name": "absent", "key": "x", "optional": True}},
    },
    {"name": "nothing"},
]


async def test_properties_resolved_and_re_resolved_on_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with ApiServerDouble(crds=CRDS) as api:
        api.create(secret("creds", user="admin-secret-value"))
        api.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "settings", "namespace": "default"},
                "data": {"mode": "fast"},
            }
        )
        api.create(recorder_configuration(PROPS))
        handler = RecordingHandler()
        with caplog.at_level(logging.DEBUG):
            node = await start_node(api, "node-a", tmp_path, extra_handlers=(handler,))
            try:
                await eventually(lambda: len(handler.seen) == 1, what="first discovery")
                assert handler.seen[0] == {
                    "literal": b"plain",
                    "user": b"admin-secret-value",
                    "mode": b"fast",
                    "nothing": None,
                }
                await eventually(lambda: len(instances(api)) == 1)
                # rotating the Secret restarts discovery with the new value
                api.apply(secret("creds", user="rotated-value"))
                await eventually(lambda: len(handler.seen) == 2, what="re-resolved")
                assert handler.seen[1]["user"] == b"rotated-value"
                # an unrelated write to the same Secret (same values) does not restart:
                reads_of_last = len(api.requests_for("get", "secrets", name="absent"))
                same = secret("creds", user="rotated-value")
                same["metadata"]["labels"] = {"x": "y"}
                api.apply(same)
                # the agent re-read the properties after that write ("absent" is read last)
                await eventually(
                    lambda: len(api.requests_for("get", "secrets", name="absent")) > reads_of_last,
                    what="the properties re-checked",
                )
                # ... and a later real change is the next restart, so that write made none
                api.apply(secret("creds", user="third-value"))
                await eventually(lambda: len(handler.seen) >= 3, what="re-resolved again")
                assert [seen["user"] for seen in handler.seen] == [
                    b"admin-secret-value",
                    b"rotated-value",
                    b"third-value",
                ]
            finally:
                await node.stop()
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for value in ("admin-secret-value", "rotated-value", "third-value"):
            assert value not in logged


async def test_missing_required_secret_is_an_event_and_retried(tmp_path: Path) -> None:
    async with ApiServerDouble(crds=CRDS) as api:
        api.create(
            recorder_configuration(
                [{"name": "user", "valueFrom": {"secretKeyRef": {"name": "late", "key": "u"}}}]
            )
        )
        handler = RecordingHandler()
        node = await start_node(api, "node-a", tmp_path, extra_handlers=(handler,))
        try:
            await eventually(
                lambda: any(
                    e["reason"] == "DiscoveryPropertiesUnresolved" for e in api.list("events")
                ),
                what="event for the missing Secret",
            )
            event = next(
                e for e in api.list("events") if e["reason"] == "DiscoveryPropertiesUnresolved"
            )
            assert "default/late does not exist" in event["message"]
            assert handler.seen == []
            api.create(secret("late", u="v"))
            await eventually(lambda: handler.seen == [{"user": b"v"}], within=8)
        finally:
            await node.stop()


async def test_resolution_rules_without_a_server() -> None:
    configuration = parse_configuration(recorder_configuration(PROPS))
    objects: dict[tuple[str, str], dict[str, Any]] = {
        ("secret", "creds"): secret("creds", user="u"),
        ("configMap", "settings"): {"binaryData": {"mode": base64.b64encode(b"\x00b").decode()}},
    }

    async def read(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return objects.get((kind, name))

    values = await resolve_properties(configuration.discovery_handler.discovery_properties, read)
    assert values == {"literal": b"plain", "user": b"u", "mode": b"\x00b", "nothing": None}
    del objects[("secret", "creds")]
    with pytest.raises(PropertyResolutionError, match="user: Secret default/creds does not exist"):
        await resolve_properties(configuration.discovery_handler.discovery_properties, read)


Grant = tuple[str, str, str, str | None]  # (group, resource, verb, namespace or None: all)


def _documents(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((ROOT / "deploy" / name).read_text()))


def _rules() -> list[dict[str, Any]]:
    role = next(d for d in _documents("base/rbac.yaml") if d["kind"] == "ClusterRole")
    return list(role["rules"])


def grants(extra_namespaces: tuple[str, ...] = ()) -> set[Grant]:
    """What deploy/base/rbac.yaml (plus deploy/properties-reader.yaml applied in
    ``extra_namespaces``) allows the agent's ServiceAccount."""
    result: set[Grant] = set()

    def add(rules: list[dict[str, Any]], namespace: str | None) -> None:
        for rule in rules:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        result.add((group, resource, verb, namespace))

    for document in _documents("base/rbac.yaml"):
        if document["kind"] == "ClusterRole":
            add(document["rules"], None)
        elif document["kind"] == "Role":
            add(document["rules"], document["metadata"]["namespace"])
    reader = next(d for d in _documents("properties-reader.yaml") if d["kind"] == "Role")
    for namespace in extra_namespaces:
        add(reader["rules"], namespace)
    return result


def allowed(granted: set[Grant], group: str, resource: str, verb: str, ns: str | None) -> bool:
    return (group, resource, verb, None) in granted or (
        ns is not None and (group, resource, verb, ns) in granted
    )


def test_rbac_has_no_wildcards() -> None:
    for document in [*_documents("base/rbac.yaml"), *_documents("properties-reader.yaml")]:
        for rule in document.get("rules") or []:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            assert "*" not in rule["apiGroups"]


def test_secrets_are_readable_only_where_granted() -> None:
    """Before: every node's agent could read every Secret and ConfigMap of the cluster."""
    granted = grants()
    assert not allowed(granted, "", "secrets", "get", "default")
    assert allowed(granted, "", "secrets", "watch", "akri")
    assert allowed(grants(("cams",)), "", "configmaps", "list", "cams")
    # claims: read-only (list/watch hold allocated slots back from the device plugins)
    assert allowed(granted, "resource.k8s.io", "resourceclaims", "watch", None)
    for verb in ("create", "update", "patch", "delete", "deletecollection"):
        assert not allowed(granted, "resource.k8s.io", "resourceclaims", verb, None)
    binding = next(d for d in _documents("properties-reader.yaml") if d["kind"] == "RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "akri-agent", "namespace": "akri"}
    ]
    assert "namespace" not in binding["metadata"]  # kubectl apply -n <namespace> places it


async def test_an_unreadable_secret_names_the_missing_grant(tmp_path: Path) -> None:
    async with ApiServerDouble(crds=CRDS) as api:
        api.create(secret("creds", user="u"))
        api.fail(403, resource="secrets", namespace="default", times=None)
        api.create(recorder_configuration(PROPS[1:2]))
        handler = RecordingHandler()
        node = await start_node(api, "node-a", tmp_path, extra_handlers=(handler,))
        try:
            await eventually(
                lambda: any(
                    e["reason"] == "DiscoveryPropertiesUnresolved" for e in api.list("events")
                ),
                what="an Event about the Secret",
            )
            event = next(
                e for e in api.list("events") if e["reason"] == "DiscoveryPropertiesUnresolved"
            )
            assert "forbidden" in event["message"]
            assert "kubectl apply -n default -f deploy/properties-reader.yaml" in event["message"]
            assert handler.seen == []
        finally:
            await node.stop()


async def test_every_agent_request_is_allowed_by_rbac(tmp_path: Path) -> None:
    granted = grants(("default",))  # the test's Secret lives in "default"
    async with ApiServerDouble(crds=CRDS) as api:
        api.create(secret("creds", user="u"))
        api.create(recorder_configuration(PROPS[:2]))
        api.create(debug_echo_configuration())
        bad = debug_echo_configuration("bad")
        bad["spec"]["discoveryHandler"]["name"] = "nope"
        api.create(bad)
        api.clear_requests()
        node = await start_node(api, "node-a", tmp_path, extra_handlers=(RecordingHandler(),))
        # a second node joins the shared Instances (server-side apply) and leaves them again
        other = await start_node(api, "node-b", tmp_path)
        try:
            await eventually(
                lambda: sum(len(o["spec"]["nodes"]) == 2 for o in instances(api)) == 2,
                what="node-b joined the shared Instances",
            )
            await other.stop()
            other.offline()
            other = await start_node(api, "node-b", tmp_path)
            await eventually(
                lambda: all(o["spec"]["nodes"] == ["node-a"] for o in instances(api)),
                what="node-b left them",
            )
        finally:
            await other.stop()
        try:
            await eventually(lambda: len(instances(api)) == 3)
            await eventually(lambda: any(e["reason"] for e in api.list("events")))
            api.apply(edited(debug_echo_configuration(), capacity=3))
            await eventually(lambda: sum(o["spec"]["capacity"] == 3 for o in instances(api)) == 2)
            node.offline()
            await eventually(lambda: len(instances(api)) == 1)
            api.delete("configurations.akri.sh", "rec", "default")
            await eventually(lambda: instances(api) == [])
        finally:
            await node.stop()
        used = {
            (r.info.group or "", r.info.resource, r.info.verb, r.info.namespace)
            for r in api.requests
            if r.info.resource
        }
    assert used, "no requests recorded"
    denied = sorted(str(u) for u in used if not allowed(granted, *u))
    assert denied == []
    verbs = {(group, resource, verb) for group, resource, verb, _ in used}
    assert ("akri.sh", "instances", "update") in verbs
    assert ("akri.sh", "instances", "patch") in verbs  # membership applies
    assert ("", "secrets", "get") in verbs
