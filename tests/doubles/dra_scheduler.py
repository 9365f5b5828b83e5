"""A minimal structured-parameters allocator (the scheduler's DRA plugin) over the API double.

:func:`allocate_claim` does what the scheduler does for one ``ExactCount`` request of a
``resource.k8s.io/v1`` ResourceClaim (reference ``k8s-device-apis.md`` §4.1, §4.2, §4.4):

* it reads every ResourceSlice of the driver and keeps only **complete pools**: per pool the
  highest ``spec.pool.generation``, and only if the number of slices at that generation equals
  ``spec.pool.resourceSliceCount``;
* it keeps the slices (or, with ``perDeviceNodeSelection``, the devices) **available on the
  node**: ``nodeName == node``, ``allNodes: true``, or a ``nodeSelector`` whose terms match the
  node (``matchFields`` on ``metadata.name`` and ``matchExpressions`` on the node labels, which
  come from ``node_labels=`` or the Node object in the API double, with kubelet's
  ``kubernetes.io/hostname=<node>`` when the Node has none);
* it excludes devices **already allocated** to any claim (``status.allocation.devices.results``
  of all claims, by driver/pool/device) unless the device sets ``allowMultipleAllocations``,
  and devices with a ``NoSchedule``/``NoExecute`` taint;
* it picks the first fitting devices in slice-name order (first-fit, like the allocator's
  priority by slice name), then writes ``status.allocation`` (``devices.results[]`` and
  ``nodeSelector``) and ``status.reservedFor`` through the status subresource of the store,
  with a resourceVersion precondition.

An already allocated claim is only reserved for the additional pod (shared claims).
:func:`release_claim` is the resource-claim controller's counterpart: it removes a pod from
``reservedFor`` and deallocates the claim when nobody is left.

**Extended resources** (KEP-5004): :func:`schedule_extended_resources` turns a pod's
``akri.sh/<name>`` limits into the special ResourceClaim on a node that does not advertise
them, allocated through the backing DeviceClass's selectors (:func:`class_selector`).

**Taints and tolerations** (KEP-5055): a device with a ``NoSchedule``/``NoExecute`` taint is
skipped unless the request's ``exactly.tolerations`` (or ``tolerations=``) tolerate it
(:func:`tolerates`); the tolerations are copied into the result. **Consumable capacity**
(KEP-5075): a device with ``allowMultipleAllocations`` may be allocated again while its
capacity lasts: each allocation consumes the request's ``exactly.capacity.requests`` (else the
``requestPolicy`` default, rounded up to ``validRange.step``; all of it without a policy),
recorded as ``results[].consumedCapacity`` with a fresh ``shareID``; the sum over all claims
stays within ``capacity.<name>.value``.

DeviceClass selectors are evaluated as CEL with cel-python (:func:`cel_selector`: missing
domains read as empty maps, a missing attribute is a runtime error that fails the allocation,
versions compare as text); request selectors are Python callables (:func:`cel_like`). Not
emulated: ``allocationMode: All``, ``firstAvailable``, constraints, opaque config,
admin access, shared counters (``consumesCounters`` is ignored), ``distinctAttribute``, and
binding conditions (``bindsToNode`` only pins the allocation to the node, as the allocator
does).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import celpy
from celpy import celtypes

if TYPE_CHECKING:
    from tests.doubles.apiserver import ApiServerDouble

JSON = dict[str, Any]
Selector = Callable[[JSON, JSON], bool]
"""``selector(device, slice) -> bool``: does the device (an entry of ``spec.devices``) fit?"""

RESOURCE_CLAIMS = "resourceclaims.resource.k8s.io"
RESOURCE_SLICES = "resourceslices.resource.k8s.io"
API_VERSION = "resource.k8s.io/v1"
DEFAULT_DRIVER = "akri.sh"


class AllocationError(Exception):
    """Nothing (or not enough) fits: the scheduler would leave the pod unschedulable."""


# --------------------------------------------------------------------------------------------
# Objects
# --------------------------------------------------------------------------------------------


def claim_object(
    namespace: str,
    name: str,
    *,
    count: int = 1,
    request: str = "req",
    device_class: str = DEFAULT_DRIVER,
) -> JSON:
    """A ``resource.k8s.io/v1`` ResourceClaim with one ``exactly`` request."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": request,
                        "exactly": {
                            "deviceClassName": device_class,
                            "allocationMode": "ExactCount",
                            "count": count,
                        },
                    }
                ]
            }
        },
    }


def create_claim(
    api: ApiServerDouble,
    namespace: str,
    name: str,
    uid: str | None = None,
    *,
    count: int = 1,
    request: str = "req",
    device_class: str = DEFAULT_DRIVER,
) -> JSON:
    """Create a ResourceClaim in the API double and return it.

    With ``uid`` the stored object gets that UID (set in the store after creation; the ADDED
    event in the watch history still carries the generated one)."""
    created = api.create(
        claim_object(namespace, name, count=count, request=request, device_class=device_class)
    )
    if uid is None:
        return created
    rt = api.resource(RESOURCE_CLAIMS)
    store = api.store
    with store.lock:
        stored = store._bucket(rt)[store._key(rt, namespace, name)]
        stored["metadata"]["uid"] = uid
    result = api.get(RESOURCE_CLAIMS, name, namespace)
    assert result is not None
    return result


def resource_slice(
    name: str,
    *,
    pool: str,
    devices: Iterable[JSON | str] = (),
    driver: str = DEFAULT_DRIVER,
    generation: int = 1,
    slice_count: int = 1,
    node_name: str | None = None,
    all_nodes: bool = False,
    node_selector: JSON | None = None,
    per_device_node_selection: bool = False,
) -> JSON:
    """A ``resource.k8s.io/v1`` ResourceSlice (devices given as dicts or plain names)."""
    spec: JSON = {
        "driver": driver,
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": slice_count},
        "devices": [{"name": d} if isinstance(d, str) else d for d in devices],
    }
    if node_name is not None:
        spec["nodeName"] = node_name
    if all_nodes:
        spec["allNodes"] = True
    if node_selector is not None:
        spec["nodeSelector"] = node_selector
    if per_device_node_selection:
        spec["perDeviceNodeSelection"] = True
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


# --------------------------------------------------------------------------------------------
# Node selection
# --------------------------------------------------------------------------------------------


def _requirement_matches(req: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    key = req.get("key", "")
    operator = req.get("operator", "")
    wanted = [str(v) for v in req.get("values") or []]
    present = key in values
    value = values.get(key)
    if operator == "In":
        return present and value in wanted
    if operator == "NotIn":
        return not present or value not in wanted
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt"):
        if not present or len(wanted) != 1:
            return False
        try:
            have, bound = int(str(value)), int(wanted[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    raise ValueError(f"unknown node selector operator {operator!r}")


def node_selector_matches(
    selector: Mapping[str, Any], node_name: str, node_labels: Mapping[str, str] | None = None
) -> bool:
    """``v1.NodeSelector`` semantics: terms are ORed, requirements in a term ANDed, an empty
    term matches nothing. ``matchFields`` supports ``metadata.name``."""
    labels = dict(node_labels or {})
    fields = {"metadata.name": node_name}
    for term in selector.get("nodeSelectorTerms") or []:
        expressions = term.get("matchExpressions") or []
        match_fields = term.get("matchFields") or []
        if not expressions and not match_fields:
            continue
        if all(_requirement_matches(r, labels) for r in expressions) and all(
            _requirement_matches(r, fields) for r in match_fields
        ):
            return True
    return False


def _available_on_node(
    obj: Mapping[str, Any], node_name: str, node_labels: Mapping[str, str]
) -> tuple[bool, str]:
    """For a slice spec (or a device with per-device node selection): (available, kind)."""
    if obj.get("nodeName"):
        return obj["nodeName"] == node_name, "nodeName"
    if obj.get("allNodes"):
        return True, "allNodes"
    if obj.get("nodeSelector"):
        return node_selector_matches(obj["nodeSelector"], node_name, node_labels), "nodeSelector"
    return False, "none"


def _node_name_selector(node_name: str) -> JSON:
    return {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
        ]
    }


# --------------------------------------------------------------------------------------------
# Pools and allocation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolView:
    """One pool as the allocator sees it."""

    driver: str
    name: str
    generation: int
    slice_count: int
    slices: tuple[JSON, ...]  # the slices at ``generation``, by name

    @property
    def complete(self) -> bool:
        return len(self.slices) == self.slice_count


def gather_pools(api: ApiServerDouble, driver: str = DEFAULT_DRIVER) -> list[PoolView]:
    """All pools of ``driver``: the slices at each pool's highest generation."""
    by_pool: dict[str, list[JSON]] = {}
    for item in api.list(RESOURCE_SLICES):
        spec = item.get("spec") or {}
        if spec.get("driver") != driver:
            continue
        by_pool.setdefault((spec.get("pool") or {}).get("name", ""), []).append(item)
    pools = []
    for name, items in sorted(by_pool.items()):
        generation = max(int(s["spec"]["pool"].get("generation", 0)) for s in items)
        current = sorted(
            (s for s in items if int(s["spec"]["pool"].get("generation", 0)) == generation),
            key=lambda s: s["metadata"]["name"],
        )
        counts = {int(s["spec"]["pool"].get("resourceSliceCount", 0)) for s in current}
        pools.append(PoolView(driver, name, generation, max(counts), tuple(current)))
    return pools


def allocated_devices(
    api: ApiServerDouble, exclude_claim_uid: str | None = None
) -> set[tuple[str, str, str]]:
    """``(driver, pool, device)`` of every device allocated to any claim (all namespaces)."""
    taken: set[tuple[str, str, str]] = set()
    for claim in api.list(RESOURCE_CLAIMS):
        if exclude_claim_uid and claim["metadata"].get("uid") == exclude_claim_uid:
            continue
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            taken.add((result.get("driver", ""), result.get("pool", ""), result.get("device", "")))
    return taken


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """``DeviceToleration.ToleratesTaint`` (k8s.io/dynamic-resource-allocation): an empty key
    with ``Exists`` tolerates every taint; ``Equal`` (the default) needs the same value; an
    empty effect matches every effect."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return bool(key) and (toleration.get("value") or "") == (taint.get("value") or "")


def _tainted(device: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]] = ()) -> bool:
    """Whether a ``NoSchedule``/``NoExecute`` taint of the device is not tolerated (``None``
    taints never block)."""
    tolerations = list(tolerations)
    return any(
        t.get("effect") in ("NoSchedule", "NoExecute")
        and not any(tolerates(tol, t) for tol in tolerations)
        for t in device.get("taints") or []
    )


def _quantity(value: Any) -> int:
    """A whole-number Quantity (``"3"``); what the consumable-capacity tests use."""
    return int(str(value))


def consumed_capacity(api: ApiServerDouble, driver: str, pool: str, device: str) -> dict[str, int]:
    """Capacity of a multi-allocatable device consumed by all claims' allocations
    (``results[].consumedCapacity``)."""
    used: dict[str, int] = {}
    for claim in api.list(RESOURCE_CLAIMS):
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if (result.get("driver"), result.get("pool"), result.get("device")) != (
                driver,
                pool,
                device,
            ):
                continue
            for name, value in (result.get("consumedCapacity") or {}).items():
                used[name] = used.get(name, 0) + _quantity(value)
    return used


def request_consumption(device: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, int]:
    """What one allocation of a multi-allocatable device consumes (KEP-5075): per capacity,
    the request's ``capacity.requests`` entry, else the policy's ``default``, else all of it
    (no ``requestPolicy``); raises :class:`AllocationError` for a value outside the policy."""
    asked = ((request.get("capacity") or {}).get("requests")) or {}
    consumption: dict[str, int] = {}
    for name, capacity in (device.get("capacity") or {}).items():
        policy = capacity.get("requestPolicy")
        total = _quantity(capacity.get("value"))
        if policy is None:
            consumption[name] = total
            continue
        value = _quantity(asked[name]) if name in asked else _quantity(policy.get("default"))
        valid = policy.get("validRange")
        if valid is not None:
            low, step = _quantity(valid.get("min")), _quantity(valid.get("step") or 1)
            high = _quantity(valid["max"]) if valid.get("max") is not None else total
            if value < low:
                value = low
            if (value - low) % step:
                value += step - (value - low) % step  # rounded up to the next step
            if value > high:
                raise AllocationError(f"capacity {name}: {value} is above the policy's {high}")
        elif policy.get("validValues"):
            fits = sorted(_quantity(v) for v in policy["validValues"] if _quantity(v) >= value)
            if not fits:
                raise AllocationError(f"capacity {name}: no valid value holds {value}")
            value = fits[0]
        consumption[name] = value
    return consumption


def _node_labels(
    api: ApiServerDouble, node_name: str, node_labels: Mapping[str, str] | None
) -> dict[str, str]:
    if node_labels is not None:
        return dict(node_labels)
    node = api.get("nodes", node_name)
    labels = dict(((node or {}).get("metadata") or {}).get("labels") or {})
    # kubelet registers every Node with this label (= the node name without
    # --hostname-override); tests often have no Node object at all
    labels.setdefault("kubernetes.io/hostname", node_name)
    return labels


def _write_status(api: ApiServerDouble, claim: JSON, status: JSON) -> JSON:
    rt = api.resource(RESOURCE_CLAIMS)
    meta = claim["metadata"]
    body = {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "resourceVersion": meta["resourceVersion"],
        },
        "status": status,
    }
    return api.store.update(rt, "v1", meta["namespace"], meta["name"], body, subresource="status")


def _reserve(status: JSON, pod_name: str | None, pod_uid: str | None) -> None:
    if pod_uid is None:
        return
    reserved = status.setdefault("reservedFor", [])
    if any(r.get("uid") == pod_uid for r in reserved):
        return
    if len(reserved) >= 256:
        raise AllocationError("status.reservedFor is full (256 entries)")
    reserved.append({"resource": "pods", "name": pod_name or pod_uid, "uid": pod_uid})


def allocate_claim(
    api: ApiServerDouble,
    namespace: str,
    claim_name: str,
    node_name: str,
    *,
    count: int | None = None,
    request: str = "req",
    selector: Selector | None = None,
    driver: str = DEFAULT_DRIVER,
    node_labels: Mapping[str, str] | None = None,
    pod_name: str | None = None,
    pod_uid: str | None = None,
    tolerations: Iterable[Mapping[str, Any]] | None = None,
    all_requests: bool = False,
    class_selectors: Mapping[str, Selector | None] | None = None,
) -> JSON:
    """Allocate ``count`` devices (default: the request's ``exactly.count``, else 1) of
    ``driver`` on ``node_name`` to the claim and reserve it for the pod; returns the claim.

    An already allocated claim is only reserved for the pod (its allocation must be usable on
    the node). Raises :class:`AllocationError` when nothing fits, with the reasons.
    ``all_requests`` allocates every request of the claim with its own ``count``;
    ``class_selectors`` (DeviceClass name -> selector) then stands for each request's class."""
    claim = api.get(RESOURCE_CLAIMS, claim_name, namespace)
    if claim is None:
        raise AllocationError(f"ResourceClaim {namespace}/{claim_name} not found")
    labels = _node_labels(api, node_name, node_labels)
    status = dict(claim.get("status") or {})
    if status.get("allocation"):
        selector_ = status["allocation"].get("nodeSelector")
        if selector_ and not node_selector_matches(selector_, node_name, labels):
            raise AllocationError(
                f"ResourceClaim {namespace}/{claim_name} is allocated, but not usable on node "
                f"{node_name}"
            )
        _reserve(status, pod_name, pod_uid)
        return _write_status(api, claim, status)

    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    names = [str(r.get("name")) for r in requests] if all_requests else [request]
    taken = allocated_devices(api)
    picked: list[tuple[PoolView, JSON, JSON, str]] = []  # (pool, slice, device, placement)
    results: list[JSON] = []
    for name in names:
        spec_request = next((r for r in requests if r.get("name") == name), None)
        if requests and spec_request is None:
            raise AllocationError(
                f"ResourceClaim {namespace}/{claim_name} has no request named {name!r} "
                f"(requests: {[r.get('name') for r in requests]})"
            )
        wanted = count
        if wanted is None or all_requests:
            wanted = int(((spec_request or {}).get("exactly") or {}).get("count") or 1)
        if wanted < 1:
            raise AllocationError(f"count must be at least 1, got {wanted}")
        exactly = (spec_request or {}).get("exactly") or {}
        request_selector = selector
        if class_selectors is not None:
            request_selector = class_selectors.get(str(exactly.get("deviceClassName")))
        request_tolerations = list(
            tolerations if tolerations is not None else exactly.get("tolerations") or []
        )
        these, consumption = _pick(
            api,
            f"ResourceClaim {namespace}/{claim_name} request {name!r}",
            driver,
            node_name,
            labels,
            wanted,
            exactly,
            request_selector,
            request_tolerations,
            taken,
            picked,
        )
        picked.extend(these)
        for pool, _item, device, _placement in these:
            result: JSON = {
                "request": name,
                "driver": driver,
                "pool": pool.name,
                "device": device["name"],
            }
            if device.get("allowMultipleAllocations"):
                result["shareID"] = str(uuid.uuid4())
                used = consumption.get((pool.name, device["name"]))
                if used:
                    result["consumedCapacity"] = {n: str(v) for n, v in used.items()}
            if request_tolerations and device.get("taints"):
                # copied from the request, like the allocator
                result["tolerations"] = request_tolerations
            results.append(result)
    allocation: JSON = {"devices": {"results": results}}
    node_selector = _allocation_node_selector(picked, node_name)
    if node_selector is not None:
        allocation["nodeSelector"] = node_selector
    status["allocation"] = allocation
    _reserve(status, pod_name, pod_uid)
    return _write_status(api, claim, status)


def _pick(
    api: ApiServerDouble,
    what: str,
    driver: str,
    node_name: str,
    labels: Mapping[str, str],
    count: int,
    exactly: Mapping[str, Any],
    selector: Selector | None,
    tolerations: list[Mapping[str, Any]],
    taken: set[tuple[str, str, str]],
    earlier: list[tuple[PoolView, JSON, JSON, str]],
) -> tuple[list[tuple[PoolView, JSON, JSON, str]], dict[tuple[str, str], dict[str, int]]]:
    """First-fit ``count`` devices for one request (``earlier``: picked for other requests
    of the same claim, not picked again)."""
    consumption: dict[tuple[str, str], dict[str, int]] = {}
    over_capacity = 0
    picked: list[tuple[PoolView, JSON, JSON, str]] = []
    incomplete: list[str] = []
    elsewhere = 0
    already = 0
    rejected = 0
    tainted = 0
    candidates = 0
    pools = gather_pools(api, driver)
    slices: list[tuple[PoolView, JSON]] = []
    for pool in pools:
        if not pool.complete:
            incomplete.append(
                f"{pool.name} (generation {pool.generation}: {len(pool.slices)} of "
                f"{pool.slice_count} slices)"
            )
            continue
        slices.extend((pool, s) for s in pool.slices)
    slices.sort(key=lambda item: item[1]["metadata"]["name"])
    for pool, item in slices:
        spec = item["spec"]
        per_device = bool(spec.get("perDeviceNodeSelection"))
        if not per_device:
            available, placement = _available_on_node(spec, node_name, labels)
            if not available:
                elsewhere += len(spec.get("devices") or [])
                continue
        for device in spec.get("devices") or []:
            if len(picked) == count:
                break
            if per_device:
                available, placement = _available_on_node(device, node_name, labels)
                if not available:
                    elsewhere += 1
                    continue
            candidates += 1
            key = (driver, pool.name, device.get("name", ""))
            if key in taken and not device.get("allowMultipleAllocations"):
                already += 1
                continue
            if any(
                p[0].name == pool.name and p[2].get("name") == key[2] for p in (*earlier, *picked)
            ) and not device.get("allowMultipleAllocations"):
                continue
            if any(p[0].name == pool.name and p[2].get("name") == key[2] for p in picked):
                continue
            if _tainted(device, tolerations):
                tainted += 1
                continue
            if device.get("allowMultipleAllocations") and device.get("capacity"):
                try:
                    wanted = request_consumption(device, exactly)
                except AllocationError:
                    over_capacity += 1
                    continue
                used = consumed_capacity(api, driver, pool.name, key[2])
                totals = {n: _quantity(c.get("value")) for n, c in device["capacity"].items()}
                if any(used.get(n, 0) + v > totals[n] for n, v in wanted.items()):
                    over_capacity += 1
                    continue
                consumption[(pool.name, key[2])] = wanted
            if selector is not None and not selector(device, item):
                rejected += 1
                continue
            picked.append((pool, item, device, placement))
        if len(picked) == count:
            break
    if len(picked) < count:
        raise AllocationError(
            f"cannot allocate {count} device(s) of driver {driver} for {what} on node "
            f"{node_name}: {len(picked)} fit; {candidates} candidate(s) in complete pools "
            f"available on the node, {already} already allocated, {rejected} rejected by the "
            f"selector, {tainted} tainted, {over_capacity} without enough capacity left, "
            f"{elsewhere} not available on the node; incomplete pools: {incomplete or 'none'}"
        )
    return picked, consumption


def _allocation_node_selector(
    picked: list[tuple[PoolView, JSON, JSON, str]], node_name: str
) -> JSON | None:
    """Like the allocator (``createNodeSelector``): node-local devices and devices with
    ``bindsToNode: true`` pin the claim to the node; node selectors are intersected; devices
    available on all nodes add no constraint."""
    placements = [p[3] for p in picked]
    if "nodeName" in placements or any(p[2].get("bindsToNode") for p in picked):
        return _node_name_selector(node_name)
    expressions: list[JSON] = []
    match_fields: list[JSON] = []
    for _pool, item, device, placement in picked:
        if placement != "nodeSelector":
            continue
        source = device if item["spec"].get("perDeviceNodeSelection") else item["spec"]
        terms = source["nodeSelector"].get("nodeSelectorTerms") or []
        if len(terms) != 1:  # several ORed terms can't be intersected simply: pin to the node
            return _node_name_selector(node_name)
        for expression in terms[0].get("matchExpressions") or []:
            if expression not in expressions:
                expressions.append(expression)
        for match_field in terms[0].get("matchFields") or []:
            if match_field not in match_fields:
                match_fields.append(match_field)
    if not expressions and not match_fields:
        return None
    term: JSON = {}
    if expressions:
        term["matchExpressions"] = expressions
    if match_fields:
        term["matchFields"] = match_fields
    return {"nodeSelectorTerms": [term]}


def release_claim(
    api: ApiServerDouble, namespace: str, claim_name: str, pod_uid: str | None = None
) -> JSON:
    """Remove ``pod_uid`` (or everyone) from ``reservedFor``; deallocate when nobody is left."""
    claim = api.get(RESOURCE_CLAIMS, claim_name, namespace)
    if claim is None:
        raise AllocationError(f"ResourceClaim {namespace}/{claim_name} not found")
    status = dict(claim.get("status") or {})
    reserved = [
        r
        for r in status.get("reservedFor") or []
        if pod_uid is not None and r.get("uid") != pod_uid
    ]
    if reserved:
        status["reservedFor"] = reserved
    else:
        status.pop("reservedFor", None)
        status.pop("allocation", None)  # the API server drops the stale status.devices
    return _write_status(api, claim, status)


# --------------------------------------------------------------------------------------------
# Selectors
# --------------------------------------------------------------------------------------------

_SEMVER_RE = re.compile(
    r"^v?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?$"
)


def _semver_key(text: str) -> tuple[Any, ...]:
    match = _SEMVER_RE.match(text)
    if match is None:
        raise ValueError(f"not a semantic version: {text!r}")
    major, minor, patch, pre = match.groups()
    # A pre-release sorts before the release; identifiers compare numerically when numeric.
    pre_key: tuple[Any, ...] = (1,)
    if pre:
        pre_key = (
            0,
            tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")),
        )
    return (int(major), int(minor), int(patch), pre_key)


def attribute_value(device: Mapping[str, Any], slice_: Mapping[str, Any], name: str) -> Any:
    """The typed value of attribute ``name`` (``"model"`` in the driver's domain, or a
    qualified ``"domain/model"``) as a Python value; ``None`` when absent. Versions come back
    as comparable tuples."""
    attributes = device.get("attributes") or {}
    driver = (slice_.get("spec") or {}).get("driver", "")
    domain, _, ident = name.rpartition("/")
    keys = [name]
    if not domain:
        keys.append(f"{driver}/{name}")
    elif domain == driver:
        keys.append(ident)
    for key in keys:
        if key in attributes:
            typed = attributes[key]
            if "version" in typed:
                return _semver_key(str(typed["version"]))
            for kind in ("int", "bool", "string", "ints", "bools", "strings", "versions"):
                if kind in typed:
                    return typed[kind]
    return None


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda a, b: bool(a == b),
    "!=": lambda a, b: bool(a != b),
    "<": lambda a, b: bool(a < b),
    "<=": lambda a, b: bool(a <= b),
    ">": lambda a, b: bool(a > b),
    ">=": lambda a, b: bool(a >= b),
    "in": lambda a, b: a in b,
}


def cel_like(name: str, op: str = "exists", value: Any = None) -> Selector:
    """A selector standing for ``device.attributes["<domain>"].<name> <op> <value>``.

    ``name`` is an attribute of the driver's domain (``"model"``) or qualified
    (``"akri.sh/model"``). ``op`` is one of ``== != < <= > >= in exists``. Comparing with a
    version attribute parses ``value`` as a semantic version. A missing attribute or a type
    mismatch doesn't match (CEL would fail the allocation with an error instead)."""
    if op != "exists" and op not in _OPS:
        raise ValueError(f"unknown operator {op!r}")

    def select(device: JSON, slice_: JSON) -> bool:
        have = attribute_value(device, slice_, name)
        if op == "exists":
            return have is not None
        if have is None:
            return False
        want = value
        if isinstance(have, tuple):  # a version
            try:
                want = (
                    [_semver_key(str(v)) for v in value] if op == "in" else _semver_key(str(value))
                )
            except ValueError:
                return False
        elif op != "in" and (
            isinstance(have, bool) != isinstance(want, bool)
            or (isinstance(have, int) and not isinstance(want, int))
            or (isinstance(have, str) and not isinstance(want, str))
        ):
            return False
        try:
            return _OPS[op](have, want)
        except TypeError:
            return False

    select.__name__ = f"cel_like({name!r} {op} {value!r})"
    return select


def all_of(*selectors: Selector) -> Selector:
    """``a && b && ...``"""
    return lambda device, slice_: all(s(device, slice_) for s in selectors)


def any_of(*selectors: Selector) -> Selector:
    """``a || b || ...``"""
    return lambda device, slice_: any(s(device, slice_) for s in selectors)


# --------------------------------------------------------------------------------------------
# Extended resources backed by DRA (KEP-5004)
# --------------------------------------------------------------------------------------------

DEVICE_CLASSES = "deviceclasses.resource.k8s.io"
EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"


class _AttributeDomains(celtypes.MapType):
    """``device.attributes`` / ``device.capacity``: a domain without entries reads as an empty
    map (``newStringInterfaceMapWithDefault`` in dynamic-resource-allocation/cel), while a
    missing attribute of a domain stays a runtime error."""

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            return celtypes.MapType()


def _cel_value(value: Mapping[str, Any]) -> Any:
    if "bool" in value:
        return celtypes.BoolType(bool(value["bool"]))
    if "int" in value:
        return celtypes.IntType(int(value["int"]))
    if "string" in value:
        return celtypes.StringType(str(value["string"]))
    if "version" in value:  # a semver object in Kubernetes; compared as text here
        return celtypes.StringType(str(value["version"]))
    raise ValueError(f"attribute value not emulated: {value!r}")


def cel_device(device: Mapping[str, Any], slice_: Mapping[str, Any]) -> dict[str, Any]:
    """The CEL activation a DRA selector sees for ``device`` of ``slice_``: ``device.driver``,
    ``device.attributes[<domain>].<id>`` (unqualified names in the driver's domain),
    ``device.capacity`` (quantities as text), ``device.allowMultipleAllocations``."""
    driver = str((slice_.get("spec") or {}).get("driver") or "")
    domains: dict[str, dict[Any, Any]] = {}
    for name, value in (device.get("attributes") or {}).items():
        domain, _, ident = str(name).rpartition("/")
        domains.setdefault(domain or driver, {})[celtypes.StringType(ident)] = _cel_value(value)
    capacity: dict[str, dict[Any, Any]] = {}
    for name, value in (device.get("capacity") or {}).items():
        domain, _, ident = str(name).rpartition("/")
        quantity = celtypes.StringType(str((value or {}).get("value", "")))
        capacity.setdefault(domain or driver, {})[celtypes.StringType(ident)] = quantity
    return {
        "device": celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(driver),
                celtypes.StringType("attributes"): _AttributeDomains(
                    {celtypes.StringType(d): celtypes.MapType(a) for d, a in domains.items()}
                ),
                celtypes.StringType("capacity"): _AttributeDomains(
                    {celtypes.StringType(d): celtypes.MapType(c) for d, c in capacity.items()}
                ),
                celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(
                    bool(device.get("allowMultipleAllocations"))
                ),
            }
        )
    }


_CEL = celpy.Environment()


def cel_selector(expression: str) -> Selector:
    """A DRA CEL selector, evaluated with cel-python the way the allocator does: false for a
    device that does not match; a runtime error (a missing attribute looked up unguarded)
    raises :class:`AllocationError`, as it fails the real allocation."""
    program = _CEL.program(_CEL.compile(expression))

    def select(device: JSON, slice_: JSON) -> bool:
        try:
            result = program.evaluate(cel_device(device, slice_))
        except celpy.CELEvalError as error:
            raise AllocationError(f"CEL runtime error in {expression!r}: {error}") from error
        if isinstance(result, celpy.CELEvalError):
            raise AllocationError(f"CEL runtime error in {expression!r}: {result}")
        return bool(result)

    select.__name__ = f"cel({expression!r})"
    return select


def class_selector(device_class: Mapping[str, Any]) -> Selector:
    """A DeviceClass's CEL selectors (all must match) as a Python selector
    (:func:`cel_selector`)."""
    selectors = [
        cel_selector(str((selector.get("cel") or {}).get("expression", "")))
        for selector in (device_class.get("spec") or {}).get("selectors") or []
    ]
    return lambda device, slice_: all(select(device, slice_) for select in selectors)


def _is_extended(resource: str) -> bool:
    """``IsExtendedResourceName``: a domain-qualified name outside ``kubernetes.io`` (and not
    ``requests.``-prefixed)."""
    domain = resource.split("/", 1)[0] if "/" in resource else ""
    return (
        bool(domain)
        and not domain.endswith("kubernetes.io")
        and not resource.startswith("requests.")
    )


def _container_requests(container: Mapping[str, Any]) -> dict[str, int]:
    """Extended resources a container asks for: ``requests``, else ``limits`` (the API server
    defaults requests to limits for extended resources)."""
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {k: int(str(v)) for k, v in merged.items() if _is_extended(k) and int(str(v)) > 0}


def device_class_for(api: ApiServerDouble, resource: str) -> JSON | None:
    """The DeviceClass backing ``resource``: ``spec.extendedResourceName`` or the implicit
    ``deviceclass.resource.kubernetes.io/<class>`` (the newest class wins on a tie)."""
    classes = api.list(DEVICE_CLASSES)
    explicit = [c for c in classes if (c.get("spec") or {}).get("extendedResourceName") == resource]
    if explicit:
        return max(explicit, key=lambda c: c["metadata"].get("creationTimestamp", ""))
    if resource.startswith(IMPLICIT_PREFIX):
        return next(
            (c for c in classes if c["metadata"]["name"] == resource[len(IMPLICIT_PREFIX) :]),
            None,
        )
    return None


def schedule_extended_resources(
    api: ApiServerDouble,
    namespace: str,
    pod_name: str,
    node_name: str,
    *,
    driver: str = DEFAULT_DRIVER,
) -> JSON | None:
    """What the scheduler's DRA plugin does for a pod's extended resources on ``node_name``
    (``filterExtendedResources``, ``createRequestsAndMappings``, the binder's claim create and
    pod status patch): a resource the Node's ``status.allocatable`` has (> 0: a device plugin
    advertises it) is left to the device plugin; one backed by a DeviceClass is requested
    through DRA. Creates the special claim (``generateName: <pod>-extended-resources-``,
    annotation ``resource.kubernetes.io/extended-resource-claim: "true"``, owned by the pod;
    one request ``container-<i>-request-<j>`` per container and resource: ``i`` the index among
    init containers + containers, ``j`` the resource's index in the container's sorted
    requests), allocates it on the node, reserves it for the pod and writes
    ``pod.status.extendedResourceClaimStatus``. Returns the claim, or None when nothing goes
    through DRA. Raises :class:`AllocationError` for a resource neither offered nor backed.

    Not emulated: reuse of long-lived containers' devices by init containers (each container
    gets its own request)."""
    pod = api.get("pods", pod_name, namespace)
    if pod is None:
        raise AllocationError(f"pod {namespace}/{pod_name} not found")
    node = api.get("nodes", node_name) or {}
    allocatable = ((node.get("status") or {}).get("allocatable")) or {}
    containers = [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]
    requests: list[JSON] = []
    mappings: list[JSON] = []
    selectors: dict[str, Selector | None] = {}
    for index, container in enumerate(containers):
        wanted = _container_requests(container)
        keys = sorted(
            {**((container.get("resources") or {}).get("limits") or {}),
             **((container.get("resources") or {}).get("requests") or {})}
        )  # fmt: skip
        for resource, quantity in sorted(wanted.items()):
            if int(str(allocatable.get(resource, "0"))) > 0:
                continue  # a device plugin offers it on this node
            device_class = device_class_for(api, resource)
            if device_class is None:
                raise AllocationError(
                    f"pod {namespace}/{pod_name}: cannot fit resource {resource} on node "
                    f"{node_name}: not in the node's allocatable and no DeviceClass backs it"
                )
            class_name = device_class["metadata"]["name"]
            selectors[class_name] = class_selector(device_class)
            name = f"container-{index}-request-{keys.index(resource)}"
            requests.append(
                {
                    "name": name,
                    "exactly": {
                        "deviceClassName": class_name,
                        "allocationMode": "ExactCount",
                        "count": quantity,
                    },
                }
            )
            mappings.append(
                {"containerName": container["name"], "resourceName": resource, "requestName": name}
            )
    if not requests:
        return None
    requests.sort(key=lambda r: r["name"])
    meta = pod["metadata"]
    claim = api.create(
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {
                "generateName": f"{pod_name}-extended-resources-",
                "namespace": namespace,
                "annotations": {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": pod_name,
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {"devices": {"requests": requests}},
        }
    )
    claim_name = claim["metadata"]["name"]
    try:
        claim = allocate_claim(
            api,
            namespace,
            claim_name,
            node_name,
            driver=driver,
            pod_name=pod_name,
            pod_uid=meta["uid"],
            all_requests=True,
            class_selectors=selectors,
        )
    except AllocationError:
        api.delete(RESOURCE_CLAIMS, claim_name, namespace)  # unreserveExtendedResourceClaim
        raise
    stored = api.get("pods", pod_name, namespace) or pod
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "namespace": namespace,
            "resourceVersion": stored["metadata"]["resourceVersion"],
        },
        "status": {
            **(stored.get("status") or {}),
            "extendedResourceClaimStatus": {
                "resourceClaimName": claim_name,
                "requestMappings": mappings,
            },
        },
    }
    api.store.update(api.resource("pods"), "v1", namespace, pod_name, body, subresource="status")
    return claim
