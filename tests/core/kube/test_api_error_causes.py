"""A refusal names the fields the API server refused (issue 33.2): ``ApiError.causes`` carries
the Status's ``details.causes`` and ``str(error)`` names every one of them, so each warning the
agent logs about a 4xx says which field and why — also when a long ``Invalid value`` comes
first (the Status ``message`` lists the causes in one string that was cut at 300 characters,
which on a real cluster hid the field that mattered)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.core.kube import ApiError, KubeClient, make_kube_client, resource_path
from agent.core.kube.errors import Cause
from tests.doubles.apiserver import ApiServerDouble

SLICES = resource_path("resource.k8s.io", "v1", "resourceslices")


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble() as server:
        yield server


@pytest.fixture
async def client(api: ApiServerDouble, tmp_path: Path) -> AsyncIterator[KubeClient]:
    kube = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")), timeout=5)
    yield kube
    await kube.close()


def invalid_slice() -> dict[str, object]:
    """Two refusals: a string attribute over 64 bytes (its Invalid value is long) first, then
    a node name that is no DNS subdomain."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-akri.sh"},
        "spec": {
            "driver": "akri.sh",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "Node_A",
            "devices": [
                {"name": "d0", "attributes": {"description": {"string": "x" * 400}}},
            ],
        },
    }


async def test_a_422_names_every_refused_field_and_why(
    client: KubeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.core.kube.client")
    with pytest.raises(ApiError) as caught:
        await client.create(SLICES, invalid_slice())
    error = caught.value
    assert error.status == 422
    fields = [cause.field for cause in error.causes]
    assert "spec.nodeName" in fields
    assert any(f.startswith("spec.devices[0].attributes") for f in fields)
    text = str(error)
    # each cause is named with its field, even after the long Invalid value of the first
    assert text.startswith('HTTP 422 Invalid: ResourceSlice.resource.k8s.io "node-a-akri.sh"')
    for cause in error.causes:
        assert f"{cause.field}: " in text
    assert "spec.nodeName: Invalid value" in text
    assert len(text) < 1000  # each cause shortened on its own
    # the client says so itself: a validation refusal is never routine
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("spec.nodeName" in line and "POST" in line for line in logged)


async def test_an_answer_without_causes_reads_as_before(
    api: ApiServerDouble, client: KubeClient
) -> None:
    api.fail(403, verb="list", resource="resourceslices", message="nope")
    with pytest.raises(ApiError) as caught:
        await client.get(SLICES)
    assert caught.value.causes == ()
    assert str(caught.value) == "HTTP 403 Forbidden: nope"


def test_causes_come_from_the_status_details() -> None:
    body = {
        "kind": "Status",
        "status": "Failure",
        "message": 'ResourceClaim.resource.k8s.io "c" is invalid: status.devices: Forbidden: no',
        "reason": "Invalid",
        "details": {
            "name": "c",
            "causes": [
                {
                    "reason": "FieldValueForbidden",
                    "message": "Forbidden: no",
                    "field": "status.devices",
                }
            ],
        },
        "code": 422,
    }
    error = ApiError.from_response(422, "Unprocessable Entity", json.dumps(body).encode())
    assert error.causes == (Cause("status.devices", "Forbidden: no", "FieldValueForbidden"),)
    assert str(error) == (
        'HTTP 422 Invalid: ResourceClaim.resource.k8s.io "c" is invalid: '
        "status.devices: Forbidden: no"
    )
    # not a Status, or a Status without causes: none
    assert ApiError.from_response(400, "Bad Request", b"<html>").causes == ()
    assert ApiError(0, "refused").causes == ()
