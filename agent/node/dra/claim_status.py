"""ResourceClaim ``status.devices`` for the devices this node prepared (KEP-4817,
``DRAResourceClaimDeviceStatus``): so ``kubectl get resourceclaim -o yaml`` says which camera a
claim got.

For every prepared device of driver ``akri.sh`` one ``AllocatedDeviceStatus``:

* ``driver``, ``pool``, ``device`` (and ``shareID`` when the allocation has one) — the API
  server accepts only allocated devices of the claim;
* ``data``: a JSON object ``{"configuration", "instance", "slot", "properties"}`` with the
  Instance's properties (the device's discovered properties and the Configuration's
  ``brokerProperties``, as in ``brokerProperties``), at most 10 KiB (``AllocatedDeviceStatus
  DataMaxLength``: the largest property values are left out, with ``"truncated": true``);
* ``networkData`` for network devices — ONVIF (``ONVIF_DEVICE_IP_ADDRESS``,
  ``ONVIF_DEVICE_MAC_ADDRESS``), mDNS (``MDNS_ADDRESSES``) and MQTT devices that announce an
  address (``MQTT_IP``, ``MQTT_IP_ADDRESS``, ``MQTT_ADDRESS``, ``MQTT_MAC``,
  ``MQTT_MAC_ADDRESS``): ``ips`` as host addresses in canonical CIDR form (``10.0.0.7/32``,
  ``fe80::1/128``; at most 16, duplicates dropped), ``hardwareAddress`` (≤ 128 characters).

Written after a successful prepare with a resourceVersion-checked ``PUT`` of the ``status``
subresource (RBAC: ``update`` on ``resourceclaims/status``, and on 1.36+ clusters with granular
status authorization ``associated-node:update`` on ``resourceclaims/driver`` for ``akri.sh``):
entries of other drivers are kept, ours replaced. A conflict re-reads and retries; a refusal
(403, 422) or an unreachable API is logged and never fails the prepare — the status only
informs.

On 1.36 the API server authorizes ``status.devices`` per node: ``associated-node:update``
counts only when the claim's allocation is pinned to the agent's node (:func:`pinned_node`),
otherwise the write needs ``arbitrary-node:update`` and is refused with a **422** whose cause
is ``status.devices: Forbidden``. A claim of a shared pool kept the pool's selector over all
its nodes, so every such write was refused on a real cluster (issue 33.2); shared devices are
therefore published with ``bindsToNode`` (``slices.py``), and a refusal names its causes and
what is missing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from agent.core.kube.errors import ApiError, TransportError
from agent.core.model.instance import Instance
from agent.node.dra.checkpoint import PreparedClaim
from agent.node.dra.slices import DRIVER

log = logging.getLogger(__name__)

DATA_MAX_LENGTH = 10 * 1024  # AllocatedDeviceStatusDataMaxLength
MAX_IPS = 16  # NetworkDeviceDataMaxIPs
HARDWARE_ADDRESS_MAX_LENGTH = 128  # NetworkDeviceDataHardwareAddressMaxLength
ATTEMPTS = 5

_IP_PROPERTIES = (
    "ONVIF_DEVICE_IP_ADDRESS",
    "MDNS_ADDRESSES",
    "MQTT_IP",
    "MQTT_IP_ADDRESS",
    "MQTT_ADDRESS",
)
_MAC_PROPERTIES = ("ONVIF_DEVICE_MAC_ADDRESS", "MQTT_MAC", "MQTT_MAC_ADDRESS")


class ClaimClient(Protocol):
    """The two calls the writer needs from the Kubernetes client."""

    async def get(self, path: str) -> dict[str, Any]: ...

    async def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]: ...


def host_address(text: str) -> str | None:
    """``text`` as a host address in canonical CIDR form (``/32``, ``/128``), or None."""
    try:
        address = ipaddress.ip_address(text.strip().split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # Go prints ::ffff:a.b.c.d as a.b.c.d
    return f"{address}/{address.max_prefixlen}"


def network_data(properties: Mapping[str, str]) -> dict[str, Any] | None:
    """``networkData`` for a device with an address (ONVIF, mDNS, MQTT), else None."""
    ips: list[str] = []
    for name in _IP_PROPERTIES:
        for part in properties.get(name, "").split(","):
            address = host_address(part) if part.strip() else None
            if address is not None and address not in ips and len(ips) < MAX_IPS:
                ips.append(address)
    mac = next((properties[n].strip() for n in _MAC_PROPERTIES if properties.get(n)), "")
    data: dict[str, Any] = {}
    if ips:
        data["ips"] = ips
    if mac and len(mac) <= HARDWARE_ADDRESS_MAX_LENGTH:
        data["hardwareAddress"] = mac
    return data or None


def device_data(instance: Instance, slot: str) -> dict[str, Any]:
    """``data`` for one device: which Instance and slot, and the device's properties, kept
    under 10 KiB of JSON by leaving out the largest values first."""
    properties = dict(sorted(instance.broker_properties.items()))
    data: dict[str, Any] = {
        "configuration": instance.configuration_name,
        "instance": instance.name,
        "slot": slot,
        "properties": properties,
    }
    while len(json.dumps(data, separators=(",", ":"))) > DATA_MAX_LENGTH and properties:
        largest = max(properties, key=lambda k: len(k) + len(properties[k]))
        del properties[largest]
        data["truncated"] = True
    return data


def device_statuses(
    claim: PreparedClaim, instances: Mapping[str, Instance]
) -> list[dict[str, Any]]:
    """Our ``status.devices`` entries for a prepared claim (devices whose Instance is gone
    get no ``data``)."""
    entries = []
    seen: set[tuple[str, str, str | None]] = set()
    for device in claim.devices:
        if (device.pool, device.device, device.share_id) in seen:
            continue  # the slots of one consumable-capacity allocation: one entry
        seen.add((device.pool, device.device, device.share_id))
        entry: dict[str, Any] = {"driver": DRIVER, "pool": device.pool, "device": device.device}
        if device.share_id is not None:
            entry["shareID"] = device.share_id
        instance = instances.get(device.instance)
        if instance is not None:
            entry["data"] = device_data(instance, device.slot)
            network = network_data(instance.broker_properties)
            if network is not None:
                entry["networkData"] = network
        entries.append(entry)
    return entries


def merged_devices(
    existing: Iterable[Mapping[str, Any]], ours: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``status.devices`` with our entries replaced and every other driver's kept."""
    kept = [dict(d) for d in existing if d.get("driver") != DRIVER]
    return kept + ours


def pinned_node(allocation: Mapping[str, Any] | None) -> str | None:
    """The node an allocation is pinned to — a ``nodeSelector`` of one term holding only
    ``matchFields metadata.name In [<node>]``, what the scheduler writes for node-local
    devices and devices with ``bindsToNode`` — else None (the API server's
    ``nodeNameFromAllocation``: only then may a node's agent write ``status.devices`` with
    ``associated-node:update``)."""
    terms = ((allocation or {}).get("nodeSelector") or {}).get("nodeSelectorTerms") or []
    if len(terms) != 1 or terms[0].get("matchExpressions"):
        return None
    fields = terms[0].get("matchFields") or []
    if len(fields) != 1:
        return None
    requirement = fields[0]
    values = requirement.get("values") or []
    if requirement.get("key") != "metadata.name" or requirement.get("operator") != "In":
        return None
    return str(values[0]) if len(values) == 1 else None


def refusal_hint(error: ApiError, allocation: Mapping[str, Any] | None) -> str:
    """What to do about a refused write, when the refusal says (a ``status.devices`` cause
    ``Forbidden``: 1.36's per-node status authorization)."""
    forbidden = any(
        c.field == "status.devices" and c.reason == "FieldValueForbidden" for c in error.causes
    )
    if not forbidden:
        return ""
    if pinned_node(allocation) is None:
        return (
            "; the claim's allocation is not pinned to one node (allocated from a shared pool "
            "whose devices lacked bindsToNode, or the API server drops bindsToNode), so "
            "writing its status needs arbitrary-node:update on resourceclaims/driver, which "
            "deploy/base/rbac.yaml does not grant"
        )
    return (
        "; the agent needs associated-node:update on resourceclaims/driver for akri.sh "
        "(deploy/base/rbac.yaml) and a service-account token that names its node"
    )


def claim_path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


class ClaimStatusWriter:
    """Writes ``status.devices`` in the background after each prepare."""

    def __init__(self, client: ClaimClient, instances: Callable[[], Iterable[Instance]]) -> None:
        self._client = client
        self._instances = instances
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.written = 0
        self.refused = 0
        # told of every prepared claim first (the runtime's CDI notice, extended.py)
        self.listeners: list[Callable[[PreparedClaim], None]] = []

    def prepared(self, claim: PreparedClaim) -> None:
        """Schedule the status write for ``claim`` (a repeated prepare writes again only if
        the status lacks our entries)."""
        for listener in self.listeners:
            listener(claim)
        if claim.uid in self._tasks or not claim.devices:
            return
        instances = {i.name: i for i in self._instances()}
        ours = device_statuses(claim, instances)
        task = asyncio.get_running_loop().create_task(
            self._write(claim, ours), name=f"claim-status-{claim.uid}"
        )
        self._tasks[claim.uid] = task
        task.add_done_callback(lambda _t: self._tasks.pop(claim.uid, None))

    async def wait(self) -> None:
        """Until every scheduled write is done (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

    async def _write(self, claim: PreparedClaim, ours: list[dict[str, Any]]) -> None:
        path = claim_path(claim.namespace, claim.name)
        current: dict[str, Any] = {}
        for attempt in range(1, ATTEMPTS + 1):
            try:
                current = await self._client.get(path)
                meta = current.get("metadata") or {}
                if meta.get("uid") != claim.uid:
                    return  # deleted and re-created: not the claim we prepared
                status = dict(current.get("status") or {})
                devices = merged_devices(status.get("devices") or [], ours)
                if devices == (status.get("devices") or []):
                    return
                status["devices"] = devices
                await self._client.replace(
                    path + "/status",
                    {
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "ResourceClaim",
                        "metadata": {
                            "name": claim.name,
                            "namespace": claim.namespace,
                            "uid": claim.uid,
                            "resourceVersion": meta.get("resourceVersion"),
                        },
                        "spec": current.get("spec") or {},
                        "status": status,
                    },
                )
                self.written += 1
                log.info(
                    "ResourceClaim %s/%s: status.devices written for %d device(s)",
                    claim.namespace,
                    claim.name,
                    len(ours),
                )
                return
            except TransportError as error:
                log.warning(
                    "ResourceClaim %s/%s: status.devices not written: %s",
                    claim.namespace,
                    claim.name,
                    error,
                )
                return
            except ApiError as error:
                if error.status == 409 and attempt < ATTEMPTS:
                    continue  # someone else wrote the claim: read again
                if error.status == 404:
                    return
                self.refused += 1
                allocation = (current.get("status") or {}).get("allocation")
                log.warning(
                    "ResourceClaim %s/%s: status.devices not written (%s)%s; the claim is "
                    "prepared, only its status lacks the device details",
                    claim.namespace,
                    claim.name,
                    error,
                    refusal_hint(error, allocation),
                )
                return
