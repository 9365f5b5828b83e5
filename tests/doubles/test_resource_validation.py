"""The API-server double's ``resource.k8s.io/v1`` validation, one test per ported rule
(tests/doubles/apiserver/resource_validation.py; the list is in docs/testing-apiserver-double.md),
and the same refusals over HTTP with the upstream message shapes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from agent.core.kube import ApiError
from agent.node.dra.slices import Pool
from tests.doubles.apiserver import ApiServerDouble
from tests.doubles.apiserver.resource_validation import validate_resource
from tests.paths import REPO

JSON = dict[str, Any]
SLICES = "resourceslices.resource.k8s.io"


def a_slice(**spec: Any) -> JSON:
    body: JSON = {
        "driver": "akri.sh",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        "nodeName": "node-a",
        "devices": [{"name": "cam-0", "attributes": {"slot": {"int": 0}}}],
    }
    body.update(spec)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {k: v for k, v in body.items() if v is not None},
    }


def shared(selector: JSON) -> JSON:
    return a_slice(nodeName=None, nodeSelector=selector)


def fields(*requirements: JSON) -> JSON:
    return {"nodeSelectorTerms": [{"matchFields": list(requirements)}]}


def expressions(*requirements: JSON) -> JSON:
    return {"nodeSelectorTerms": [{"matchExpressions": list(requirements)}]}


def a_class(**spec: Any) -> JSON:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "akri.sh"},
        "spec": spec,
    }


def a_claim(*requests: JSON, **devices: Any) -> JSON:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {"devices": {"requests": list(requests), **devices}},
    }


def exact(name: str = "req", **exactly: Any) -> JSON:
    return {"name": name, "exactly": {"deviceClassName": "akri.sh", **exactly}}


def allocated(claim: JSON, **status: Any) -> JSON:
    new = copy.deepcopy(claim)
    new["status"] = status
    return new


RESULT = {"request": "req", "driver": "akri.sh", "pool": "cam-1", "device": "cam-1-0"}
ALLOCATION = {"devices": {"results": [RESULT]}}
POD = {"resource": "pods", "name": "p", "uid": "u1"}


def check(plural: str, new: JSON, old: JSON | None = None) -> list[tuple[str, str, str]]:
    return validate_resource("resource.k8s.io", plural, copy.deepcopy(new), old)


# (rule, plural, new, old, field, message fragment)
Case = tuple[str, str, JSON, JSON | None, str, str]
CASES: list[Case] = [
    # ResourceSlice (validateResourceSliceSpec and below)
    ("driver required", "resourceslices", a_slice(driver=""), None, "spec.driver", "Required"),
    ("driver is a DNS subdomain", "resourceslices", a_slice(driver="akri_sh"), None,
     "spec.driver", "RFC 1123 subdomain"),
    ("driver at most 63", "resourceslices", a_slice(driver="a" * 64), None, "spec.driver",
     "may not be more than 63"),
    ("pool name required", "resourceslices",
     a_slice(pool={"name": "", "generation": 1, "resourceSliceCount": 1}), None,
     "spec.pool.name", "Required"),
    ("pool name parts are DNS subdomains", "resourceslices",
     a_slice(pool={"name": "a/B_", "generation": 1, "resourceSliceCount": 1}), None,
     "spec.pool.name", "RFC 1123 subdomain"),
    ("pool name at most 253", "resourceslices",
     a_slice(pool={"name": "a" * 254, "generation": 1, "resourceSliceCount": 1}), None,
     "spec.pool.name", "may not be more than 253"),
    ("resourceSliceCount > 0", "resourceslices",
     a_slice(pool={"name": "p", "generation": 1, "resourceSliceCount": 0}), None,
     "spec.pool.resourceSliceCount", "must be greater than zero"),
    ("generation >= 0", "resourceslices",
     a_slice(pool={"name": "p", "generation": -1, "resourceSliceCount": 1}), None,
     "spec.pool.generation", "greater than or equal to zero"),
    ("pool name immutable", "resourceslices",
     a_slice(pool={"name": "other", "generation": 2, "resourceSliceCount": 1}), a_slice(),
     "spec.pool.name", "field is immutable"),
    ("driver immutable", "resourceslices", a_slice(driver="other.sh"), a_slice(),
     "spec.driver", "field is immutable"),
    ("nodeName immutable", "resourceslices", a_slice(nodeName="node-b"), a_slice(),
     "spec.nodeName", "field is immutable"),
    ("nodeName not empty", "resourceslices", a_slice(nodeName=""), None, "spec.nodeName",
     "must be either unset or set to a non-empty string"),
    ("nodeName a node name", "resourceslices", a_slice(nodeName="Node_A"), None,
     "spec.nodeName", "RFC 1123 subdomain"),
    ("allNodes only true", "resourceslices", a_slice(nodeName=None, allNodes=False), None,
     "spec.allNodes", "must be either unset or set to true"),
    ("perDeviceNodeSelection only true", "resourceslices",
     a_slice(nodeName=None, perDeviceNodeSelection=False), None,
     "spec.perDeviceNodeSelection", "must be either unset or set to true"),
    ("one placement required", "resourceslices", a_slice(nodeName=None), None, "spec",
     "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection`"),
    ("only one placement", "resourceslices", a_slice(allNodes=True), None, "spec",
     "but multiple fields are set"),
    ("slice selector has exactly one term", "resourceslices",
     shared({"nodeSelectorTerms": [
         {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}]},
         {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["b"]}]},
     ]}), None, "spec.nodeSelector.nodeSelectorTerms", "must have exactly one node selector term"),
    ("sharedCounters or devices", "resourceslices",
     a_slice(sharedCounters=[{"name": "c", "counters": {"m": {"value": "1"}}}]), None, "spec",
     "only one of `sharedCounters` or `devices` is allowed"),
    ("at most 128 devices", "resourceslices",
     a_slice(devices=[{"name": f"d-{i}"} for i in range(129)]), None, "spec.devices",
     "must have at most 128 items"),
    ("at most 64 devices with taints", "resourceslices",
     a_slice(devices=[{"name": f"d-{i}", "taints": [{"key": "k", "effect": "NoSchedule"}]}
                      for i in range(65)]), None, "spec.devices", "must have at most 64 items"),
    ("device names unique", "resourceslices", a_slice(devices=[{"name": "d"}, {"name": "d"}]),
     None, "spec.devices[1]", 'Duplicate value: "d"'),
    ("device name a DNS label", "resourceslices", a_slice(devices=[{"name": "cam.0"}]), None,
     "spec.devices[0].name", "RFC 1123 label"),
    ("at most 32 attributes and capacities", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {f"a{i}": {"int": i} for i in range(33)}}]),
     None, "spec.devices[0]", "must not exceed 32"),
    ("attribute name a C identifier", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"a-b": {"int": 1}}}]), None,
     "spec.devices[0].attributes", "C identifier"),
    ("attribute name at most 32", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"a" * 33: {"int": 1}}}]), None,
     "spec.devices[0].attributes", "may not be more than 32"),
    ("attribute domain a driver name", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"Bad_Domain/x": {"int": 1}}}]), None,
     "spec.devices[0].attributes", "RFC 1123 subdomain"),
    ("attribute name one slash", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"a.sh/b/c": {"int": 1}}}]), None,
     "spec.devices[0].attributes", "must not contain more than one slash"),
    ("attribute exactly one value", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"a": {"int": 1, "bool": True}}}]), None,
     "spec.devices[0].attributes[a]", "exactly one value must be specified"),
    ("attribute needs a value", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"a": {}}}]), None,
     "spec.devices[0].attributes[a]", "exactly one value must be specified"),
    ("string attribute at most 64", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"a": {"string": "x" * 65}}}]), None,
     "spec.devices[0].attributes[a].string", "may not be more than 64"),
    ("version attribute semver", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"a": {"version": "1.2"}}}]), None,
     "spec.devices[0].attributes[a].version", "semver.org spec 2.0.0"),
    ("list attribute not empty", "resourceslices",
     a_slice(devices=[{"name": "d", "attributes": {"a": {"ints": []}}}]), None,
     "spec.devices[0].attributes[a].ints", "must not be empty if specified"),
    ("per-device placement needs perDeviceNodeSelection", "resourceslices",
     a_slice(devices=[{"name": "d", "nodeName": "node-a"}]), None, "spec.devices[0]",
     "can only be set if `perDeviceNodeSelection` is set to true"),
    ("per-device placement exactly one", "resourceslices",
     a_slice(nodeName=None, perDeviceNodeSelection=True, devices=[{"name": "d"}]), None,
     "spec.devices[0]", "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required"),
    ("capacity requestPolicy needs allowMultipleAllocations", "resourceslices",
     a_slice(devices=[{"name": "d", "capacity": {"m": {"value": "1", "requestPolicy": {}}}}]),
     None, "spec.devices[0].capacity[m].requestPolicy", "allowMultipleAllocations must be true"),
    ("taint effect required", "resourceslices",
     a_slice(devices=[{"name": "d", "taints": [{"key": "k"}]}]), None,
     "spec.devices[0].taints[0].effect", "Required"),
    ("taint effect supported", "resourceslices",
     a_slice(devices=[{"name": "d", "taints": [{"key": "k", "effect": "Evict"}]}]), None,
     "spec.devices[0].taints[0].effect", "Unsupported value"),
    ("taint key a label name", "resourceslices",
     a_slice(devices=[{"name": "d", "taints": [{"key": "-k", "effect": "None"}]}]), None,
     "spec.devices[0].taints[0].key", "name part must consist of"),
    # core/v1 NodeSelector (ValidateNodeSelector and its requirements)
    ("selector needs a term", "resourceslices", shared({"nodeSelectorTerms": []}), None,
     "spec.nodeSelector.nodeSelectorTerms", "must have at least one node selector term"),
    ("field In exactly one value", "resourceslices",
     shared(fields({"key": "metadata.name", "operator": "In", "values": ["a", "b"]})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].values",
     "must be only one value when `operator` is 'In' or 'NotIn' for node field selector"),
    ("field operator In or NotIn", "resourceslices",
     shared(fields({"key": "metadata.name", "operator": "Exists"})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].operator",
     "not a valid selector operator"),
    ("field key metadata.name", "resourceslices",
     shared(fields({"key": "metadata.uid", "operator": "In", "values": ["a"]})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].key",
     "not a valid field selector key"),
    ("field value a node name", "resourceslices",
     shared(fields({"key": "metadata.name", "operator": "In", "values": ["Node_A"]})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].values[0]", "RFC 1123 subdomain"),
    ("label In needs values", "resourceslices",
     shared(expressions({"key": "zone", "operator": "In", "values": []})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values",
     "must be specified when `operator` is 'In' or 'NotIn'"),
    ("label Exists takes no values", "resourceslices",
     shared(expressions({"key": "zone", "operator": "Exists", "values": ["a"]})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values",
     "may not be specified when `operator` is 'Exists' or 'DoesNotExist'"),
    ("label Gt exactly one value", "resourceslices",
     shared(expressions({"key": "cpus", "operator": "Gt", "values": ["1", "2"]})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values",
     "must be specified single value when `operator` is 'Lt' or 'Gt'"),
    ("label operator known", "resourceslices",
     shared(expressions({"key": "zone", "operator": "Equals", "values": ["a"]})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].operator",
     "not a valid selector operator"),
    ("label key a label name", "resourceslices",
     shared(expressions({"key": "bad key", "operator": "Exists"})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].key", "name part must consist"),
    ("label values label values", "resourceslices",
     shared(expressions({"key": "zone", "operator": "In", "values": ["a b"]})), None,
     "spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values[0]",
     "a valid label must be an empty string"),
    # DeviceClass (validateDeviceClassSpec)
    ("class selector needs cel", "deviceclasses", a_class(selectors=[{}]), None,
     "spec.selectors[0].cel", "Required"),
    ("class CEL at most 10 KiB", "deviceclasses",
     a_class(selectors=[{"cel": {"expression": "x" * (10 * 1024 + 1)}}]), None,
     "spec.selectors[0].cel.expression", "may not be more than 10240"),
    ("class at most 32 selectors", "deviceclasses",
     a_class(selectors=[{"cel": {"expression": "true"}}] * 33), None, "spec.selectors",
     "must have at most 32 items"),
    ("class config needs opaque", "deviceclasses", a_class(config=[{}]), None,
     "spec.config[0].opaque", "Required"),
    ("class opaque driver valid", "deviceclasses",
     a_class(config=[{"opaque": {"driver": "Bad_Driver", "parameters": {}}}]), None,
     "spec.config[0].opaque.driver", "RFC 1123 subdomain"),
    ("class opaque parameters an object", "deviceclasses",
     a_class(config=[{"opaque": {"driver": "akri.sh", "parameters": [1]}}]), None,
     "spec.config[0].opaque.parameters", "must be a valid JSON object"),
    ("class extendedResourceName valid", "deviceclasses",
     a_class(extendedResourceName="cameras"), None, "spec.extendedResourceName",
     "must be a valid extended resource name"),
    ("class extendedResourceName not kubernetes.io", "deviceclasses",
     a_class(extendedResourceName="kubernetes.io/cams"), None, "spec.extendedResourceName",
     "must be a valid extended resource name"),
    # ResourceClaim (validateDeviceClaim and below)
    ("request name a DNS label", "resourceclaims", a_claim(exact("Req")), None,
     "spec.devices.requests[0].name", "RFC 1123 label"),
    ("request names unique", "resourceclaims", a_claim(exact(), exact()), None,
     "spec.devices.requests[1]", 'Duplicate value: "req"'),
    ("at most 32 requests", "resourceclaims", a_claim(*[exact(f"r{i}") for i in range(33)]),
     None, "spec.devices.requests", "must have at most 32 items"),
    ("exactly or firstAvailable", "resourceclaims", a_claim({"name": "req"}), None,
     "spec.devices.requests[0]", "exactly one of `exactly` or `firstAvailable` is required"),
    ("not both exactly and firstAvailable", "resourceclaims",
     a_claim({**exact(), "firstAvailable": [{"name": "a", "deviceClassName": "akri.sh"}]}),
     None, "spec.devices.requests[0]", "but multiple fields are set"),
    ("deviceClassName required", "resourceclaims",
     a_claim({"name": "req", "exactly": {"deviceClassName": ""}}), None,
     "spec.devices.requests[0].exactly.deviceClassName", "Required"),
    ("count > 0 for ExactCount", "resourceclaims", a_claim(exact(count=0)), None,
     "spec.devices.requests[0].exactly.count", "must be greater than zero"),
    ("no count for All", "resourceclaims", a_claim(exact(allocationMode="All", count=2)), None,
     "spec.devices.requests[0].exactly.count", "must not be specified when allocationMode"),
    ("allocationMode supported", "resourceclaims", a_claim(exact(allocationMode="Some")), None,
     "spec.devices.requests[0].exactly.allocationMode", "Unsupported value"),
    ("toleration operator supported", "resourceclaims",
     a_claim(exact(tolerations=[{"operator": "In"}])), None,
     "spec.devices.requests[0].exactly.tolerations[0].operator", "Unsupported value"),
    ("subrequest names unique", "resourceclaims",
     a_claim({"name": "req", "firstAvailable": [
         {"name": "a", "deviceClassName": "akri.sh"}, {"name": "a", "deviceClassName": "akri.sh"}
     ]}), None, "spec.devices.requests[0].firstAvailable[1]", 'Duplicate value: "a"'),
    ("constraint requests exist", "resourceclaims",
     a_claim(exact(), constraints=[{"requests": ["other"], "matchAttribute": "akri.sh/x"}]),
     None, "spec.devices.constraints[0].requests[0]", "must be the name of a request"),
    ("constraint matchAttribute required", "resourceclaims",
     a_claim(exact(), constraints=[{}]), None, "spec.devices.constraints[0].matchAttribute",
     "Required"),
    ("constraint attribute fully qualified", "resourceclaims",
     a_claim(exact(), constraints=[{"matchAttribute": "x"}]), None,
     "spec.devices.constraints[0].matchAttribute", "a fully qualified name must be a domain"),
    ("claim spec immutable", "resourceclaims", a_claim(exact(count=2)), a_claim(exact()),
     "spec", "field is immutable"),
    # ResourceClaim status (validateResourceClaimStatusUpdate)
    ("reservedFor needs an allocation", "resourceclaims",
     allocated(a_claim(exact()), reservedFor=[POD]), a_claim(exact()), "status.reservedFor",
     "may not be specified when `allocated` is not set"),
    ("reservedFor entries complete", "resourceclaims",
     allocated(a_claim(exact()), allocation=ALLOCATION, reservedFor=[{"resource": "pods"}]),
     a_claim(exact()), "status.reservedFor[0].name", "Required"),
    ("reservedFor uids unique", "resourceclaims",
     allocated(a_claim(exact()), allocation=ALLOCATION, reservedFor=[POD, POD]),
     a_claim(exact()), "status.reservedFor[1]", 'Duplicate value: "u1"'),
    ("allocation immutable", "resourceclaims",
     allocated(a_claim(exact()), allocation={"devices": {"results": [{**RESULT, "device": "x"}]}}),
     allocated(a_claim(exact()), allocation=ALLOCATION), "status.allocation",
     "field is immutable"),
    ("result request exists", "resourceclaims",
     allocated(a_claim(exact()), allocation={"devices": {"results": [{**RESULT, "request": "x"}]}}),
     a_claim(exact()), "status.allocation.devices.results[0].request",
     "must be the name of a request"),
    ("result device a DNS label", "resourceclaims",
     allocated(a_claim(exact()), allocation={"devices": {"results": [{**RESULT, "device": "A"}]}}),
     a_claim(exact()), "status.allocation.devices.results[0].device", "RFC 1123 label"),
    ("allocation node selector valid", "resourceclaims",
     allocated(a_claim(exact()), allocation={**ALLOCATION, "nodeSelector": fields(
         {"key": "metadata.name", "operator": "In", "values": ["a", "b"]})}),
     a_claim(exact()), "status.allocation.nodeSelector.nodeSelectorTerms[0].matchFields[0].values",
     "must be only one value"),
    ("status devices allocated", "resourceclaims",
     allocated(a_claim(exact()), allocation=ALLOCATION,
               devices=[{"driver": "akri.sh", "pool": "cam-1", "device": "cam-1-1"}]),
     a_claim(exact()), "status.devices[0]", "must be an allocated device in the claim"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "plural", "new", "old", "field", "fragment"), CASES, ids=[c[0] for c in CASES]
)
def test_rule(
    rule: str, plural: str, new: JSON, old: JSON | None, field: str, fragment: str
) -> None:
    causes = check(plural, new, old)
    matching = [c for c in causes if c[1] == field and fragment in c[2]]
    assert matching, f"{rule}: expected {field}: …{fragment}…, got {causes}"


def test_valid_objects_pass() -> None:
    """What the agent and the deployment really send is valid: every pool form the publisher
    writes, the DeviceClasses of deploy/ (base and debugEcho's), the example claim, an
    allocation by the DRA scheduler emulator's shape, and a status update that only adds a
    reservation."""
    for pool in (
        Pool("node-a", "node-a", devices=({"name": "cam-0", "attributes": {"slot": {"int": 0}}},)),
        Pool("cam-1", None, nodes=tuple(f"node-{i}" for i in range(50))),
    ):
        for spec in pool.slice_specs():
            spec["pool"] = {"name": pool.name, "generation": 1, "resourceSliceCount": 1}
            body = {"metadata": {"name": "s"}, "spec": spec}
            assert check("resourceslices", body) == []
    for classes in ("deploy/base", "deploy/components/debug-echo"):
        for document in yaml.safe_load_all((REPO / classes / "deviceclass.yaml").read_text()):
            assert check("deviceclasses", document) == []
    for document in yaml.safe_load_all((REPO / "examples/dra-claim.yaml").read_text()):
        if document and document.get("kind") == "ResourceClaimTemplate":
            claim = {"metadata": {"name": "c"}, "spec": document["spec"]["spec"]}
            assert check("resourceclaims", claim) == []
    claim = a_claim(exact())
    assert check("resourceclaims", claim) == []
    first = allocated(claim, allocation=ALLOCATION, reservedFor=[POD])
    assert check("resourceclaims", first, claim) == []
    second = allocated(claim, allocation=ALLOCATION, reservedFor=[POD, {**POD, "uid": "u2"}])
    assert check("resourceclaims", second, first) == []


def test_claims_get_the_v1_defaults() -> None:
    """``allocationMode: ExactCount`` and ``count: 1`` are defaulted (the scheduler and the
    driver read them), so an update that omits them is not a spec change."""
    claim = a_claim(exact())
    assert check("resourceclaims", claim) == []
    stored = copy.deepcopy(claim)
    validate_resource("resource.k8s.io", "resourceclaims", stored, None)
    assert stored["spec"]["devices"]["requests"][0]["exactly"] == {
        "deviceClassName": "akri.sh",
        "allocationMode": "ExactCount",
        "count": 1,
    }
    assert check("resourceclaims", claim, stored) == []


async def _refused(api: ApiServerDouble, write: Callable[[], Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await write()
    return caught.value


async def test_the_double_answers_422_as_the_real_server_did(tmp_path: Any) -> None:
    """Over HTTP with the agent's client: the slice the issue's cluster refused (all nodes in
    one ``metadata.name In``) gets the same 422 message; the agent's current form is stored."""
    from agent.core.kube import make_kube_client, resource_path

    async with ApiServerDouble() as api:
        client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            path = resource_path("resource.k8s.io", "v1", "resourceslices")
            old_form = shared(
                fields({"key": "metadata.name", "operator": "In", "values": ["node-a", "node-b"]})
            )
            old_form["metadata"] = {"generateName": "akri.sh-cam-"}
            error = await _refused(api, lambda: client.create(path, old_form))
            assert error.status == 422
            assert (
                "spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].values: Required value: "
                "must be only one value when `operator` is 'In' or 'NotIn' for node field "
                "selector" in str(error)
            )
            spec = Pool("cam-1", None, nodes=("node-a", "node-b")).slice_specs()[0]
            spec["pool"] = {"name": "cam-1", "generation": 1, "resourceSliceCount": 1}
            created = await client.create(
                path, {**old_form, "spec": spec, "metadata": {"generateName": "akri.sh-cam-"}}
            )
            assert created["spec"]["nodeSelector"] == spec["nodeSelector"]
            # an update may not move the pool
            moved = copy.deepcopy(created)
            moved["spec"]["pool"]["name"] = "cam-2"
            name = created["metadata"]["name"]
            error = await _refused(
                api,
                lambda: client.replace(
                    resource_path("resource.k8s.io", "v1", "resourceslices", name=name), moved
                ),
            )
            assert error.status == 422 and "spec.pool.name: Invalid value" in str(error)
            assert len(api.list(SLICES)) == 1
        finally:
            await client.close()


async def test_slices_are_selected_by_the_real_servers_field_labels_only(tmp_path: Any) -> None:
    """A ResourceSlice list or watch may select on ``metadata.name``, ``spec.nodeName`` and
    ``spec.driver`` only; any other field is a 400 with the real handler's message
    (``pkg/apis/resource/v1/conversion.go``). Before: the double filtered on any path."""
    from agent.core.kube import make_kube_client, resource_path

    async with ApiServerDouble() as api:
        client = make_kube_client(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        path = resource_path("resource.k8s.io", "v1", "resourceslices")
        try:
            listed, _ = await client.list_all(
                path, params={"fieldSelector": "spec.driver=akri.sh,spec.nodeName=node-a"}
            )
            assert listed == []
            error = await _refused(
                api, lambda: client.list_all(path, params={"fieldSelector": "spec.pool.name=x"})
            )
            assert error.status == 400
            assert (
                "field label not supported for resource.k8s.io/v1, Kind=ResourceSlice: "
                "spec.pool.name" in str(error)
            )
        finally:
            await client.close()
