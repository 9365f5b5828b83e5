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

**Taints and tolerations** (KEP-5055): a device with a ``NoSchedule``/``NoExecute`` taint is
skipped unless the request's ``exactly.tolerations`` (or ``tolerations=``) tolerate it
(:func:`tolerates`); the tolerations are copied into the result. **Consumable capacity**
(KEP-5075): a device with ``allowMultipleAllocations`` may be allocated again while its
capacity lasts: each allocation consumes the request's ``exactly.capacity.requests`` (else the
``requestPolicy`` default, rounded up to ``validRange.step``; all of it without a policy),
recorded as ``results[].consumedCapacity`` with a fresh ``shareID``; the sum over all claims
stays within ``capacity.<name>.value``.

Not emulated: CEL (DeviceClass and request selectors are Python callables here, see
:func:`cel_like`), ``allocationMode: All``, ``firstAvailable``, constraints, opaque config,
admin access, shared counters (``consumesCounters`` is ignored), ``distinctAttribute``, and
binding conditions.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
) -> JSON:
    """Allocate ``count`` devices (default: the request's ``exactly.count``, else 1) of
    ``driver`` on ``node_name`` to the claim and reserve it for the pod; returns the claim.

    An already allocated claim is only reserved for the pod (its allocation must be usable on
    the node). Raises :class:`AllocationError` when nothing fits, with the reasons."""
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
    spec_request = next((r for r in requests if r.get("name") == request), None)
    if requests and spec_request is None:
        raise AllocationError(
            f"ResourceClaim {namespace}/{claim_name} has no request named {request!r} "
            f"(requests: {[r.get('name') for r in requests]})"
        )
    if count is None:
        count = int(((spec_request or {}).get("exactly") or {}).get("count") or 1)
    if count < 1:
        raise AllocationError(f"count must be at least 1, got {count}")
    exactly = (spec_request or {}).get("exactly") or {}
    if tolerations is None:
        tolerations = exactly.get("tolerations") or []
    tolerations = list(tolerations)
    consumption: dict[tuple[str, str], dict[str, int]] = {}
    over_capacity = 0

    taken = allocated_devices(api)
    picked: list[tuple[PoolView, JSON, JSON, str]] = []  # (pool, slice, device, placement)
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
            f"cannot allocate {count} device(s) of driver {driver} for ResourceClaim "
            f"{namespace}/{claim_name} request {request!r} on node {node_name}: "
            f"{len(picked)} fit; {candidates} candidate(s) in complete pools available on the "
            f"node, {already} already allocated, {rejected} rejected by the selector, "
            f"{tainted} tainted, {over_capacity} without enough capacity left, {elsewhere} not "
            f"available on the node; incomplete pools: "
            f"{incomplete or 'none'}"
        )

    results = []
    for pool, _item, device, _placement in picked:
        result: JSON = {
            "request": request,
            "driver": driver,
            "pool": pool.name,
            "device": device["name"],
        }
        if device.get("allowMultipleAllocations"):
            result["shareID"] = str(uuid.uuid4())
            used = consumption.get((pool.name, device["name"]))
            if used:
                result["consumedCapacity"] = {n: str(v) for n, v in used.items()}
        if tolerations and device.get("taints"):
            result["tolerations"] = tolerations  # copied from the request, like the allocator
        results.append(result)
    allocation: JSON = {"devices": {"results": results}}
    node_selector = _allocation_node_selector(picked, node_name)
    if node_selector is not None:
        allocation["nodeSelector"] = node_selector
    status["allocation"] = allocation
    _reserve(status, pod_name, pod_uid)
    return _write_status(api, claim, status)


def _allocation_node_selector(
    picked: list[tuple[PoolView, JSON, JSON, str]], node_name: str
) -> JSON | None:
    """Like the allocator: node-local devices pin the claim to the node; node selectors are
    intersected; devices available on all nodes add no constraint."""
    placements = [p[3] for p in picked]
    if "nodeName" in placements:
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
        status.pop("allocation", None)
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
