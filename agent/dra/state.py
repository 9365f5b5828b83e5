"""Prepare / unprepare decisions for claims allocated to driver ``akri.sh`` (the DRA
counterpart of ``plugins.py``: the gRPC layer in ``driver.py`` only translates).

Prepare, per claim (serialised):
1. already in the checkpoint → return the same answer (idempotent, also across restarts);
2. read the ResourceClaim; require ``status.allocation`` and a matching uid;
3. for each result of our driver, resolve (pool, device) to (Instance, slot) and claim the slot
   for ``D:<claim-uid>:<node>`` through the slot ledger (CAS on the Instance);
   a slot held by anyone else fails the claim with a message naming the holder;
4. write the claim's CDI spec, checkpoint, answer with the CDI ids.
If a later device fails, slots claimed earlier in this call are released again.

Unprepare: release the claim's slots, remove its CDI file, drop it from the checkpoint; an
unknown claim is success.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.deviceplugin.container_env import container_edits
from agent.dra.cdi import CdiDevice, CdiWriter, cdi_device_name, qualified
from agent.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from agent.dra.slices import DRIVER, slot_for_device
from agent.ledger.decisions import Owner
from agent.ledger.ledger import SlotLedger, SlotRefusedError
from agent.model.instance import Instance
from agent.store.base import StoreError
from discovery_handlers.base import Device

log = logging.getLogger(__name__)

ClaimReader = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


@dataclass(frozen=True)
class ClaimRef:
    """What kubelet sends: namespace, uid, name."""

    namespace: str
    uid: str
    name: str


class PrepareError(Exception):
    """Preparing one claim failed; the message goes back to kubelet."""


class DraState:
    """Prepared claims of this node."""

    def __init__(
        self,
        ledger: SlotLedger,
        lookup_instances: Callable[[], list[Instance]],
        device_for: Callable[[str], Device | None],
        read_claim: ClaimReader,
        cdi: CdiWriter,
        checkpoint: Checkpoint,
    ) -> None:
        self.ledger = ledger
        self.node = ledger.node
        self._instances = lookup_instances
        self._device_for = device_for
        self._read_claim = read_claim
        self.cdi = cdi
        self.checkpoint = checkpoint
        self._lock = asyncio.Lock()
        self.prepares = 0
        self.unprepares = 0

    async def prepare(self, ref: ClaimRef) -> PreparedClaim:
        """Prepare one claim; raises :class:`PrepareError`."""
        async with self._lock:
            known = self.checkpoint.claims.get(ref.uid)
            if known is not None:
                return known
            claim = await self._read_claim(ref.namespace, ref.name)
            if claim is None:
                raise PrepareError(f"ResourceClaim {ref.namespace}/{ref.name} not found")
            uid = (claim.get("metadata") or {}).get("uid")
            if uid != ref.uid:
                raise PrepareError(
                    f"ResourceClaim {ref.namespace}/{ref.name} has uid {uid}, not {ref.uid} "
                    "(it was replaced)"
                )
            allocation = (claim.get("status") or {}).get("allocation")
            if not allocation:
                raise PrepareError(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
            results = [
                r
                for r in ((allocation.get("devices") or {}).get("results") or [])
                if r.get("driver") == DRIVER
            ]
            prepared = await self._claim_slots(ref, results)
            try:
                self._write_cdi(ref, prepared)
            except (OSError, ValueError) as error:
                await self._release(ref.uid, prepared)
                raise PrepareError(f"writing the CDI spec failed: {error}") from error
            claim_state = PreparedClaim(ref.uid, ref.namespace, ref.name, tuple(prepared))
            self.checkpoint.claims[ref.uid] = claim_state
            self.checkpoint.save()
            self.prepares += 1
            log.info(
                "prepared claim %s/%s (%s): %s",
                ref.namespace,
                ref.name,
                ref.uid,
                ", ".join(d.slot for d in prepared) or "no akri.sh devices",
            )
            return claim_state

    async def _claim_slots(
        self, ref: ClaimRef, results: list[Mapping[str, Any]]
    ) -> list[PreparedDevice]:
        owner = Owner.claim(ref.uid, self.node)
        instances = {i.name: i for i in self._instances()}
        prepared: list[PreparedDevice] = []
        for result in results:
            pool, device = str(result.get("pool")), str(result.get("device"))
            resolved = slot_for_device(pool, device, instances, self.node)
            if resolved is None:
                await self._release(ref.uid, prepared)
                raise PrepareError(f"device {pool}/{device} is not an akri.sh device of this node")
            instance, slot = resolved
            if self.node not in instance.nodes:
                await self._release(ref.uid, prepared)
                raise PrepareError(f"device {pool}/{device} is not available on {self.node}")
            try:
                await self.ledger.claim(instance.name, slot, owner)
            except (SlotRefusedError, StoreError) as error:
                await self._release(ref.uid, prepared)
                raise PrepareError(f"cannot prepare {pool}/{device} ({slot}): {error}") from error
            share = result.get("shareID")
            prepared.append(
                PreparedDevice(
                    request_names=(str(result.get("request", "")).split("/")[0],),
                    pool=pool,
                    device=device,
                    instance=instance.name,
                    slot=slot,
                    cdi_device_ids=(qualified(cdi_device_name(ref.uid, device)),),
                    share_id=str(share) if share else None,
                )
            )
        return prepared

    def _write_cdi(self, ref: ClaimRef, prepared: list[PreparedDevice]) -> None:
        if not prepared:
            return
        instances = {i.name: i for i in self._instances()}
        devices = []
        for item in prepared:
            instance = instances.get(item.instance)
            edits = container_edits(
                [instance] if instance else [], {item.instance: self._device_for(item.instance)}
            )
            devices.append(CdiDevice(cdi_device_name(ref.uid, item.device), edits))
        self.cdi.write(ref.uid, devices)

    async def _release(self, claim_uid: str, prepared: list[PreparedDevice]) -> None:
        value = Owner.claim(claim_uid, self.node).value
        for item in prepared:
            try:
                await self.ledger.release_values(item.instance, {value})
            except Exception as error:
                log.warning("could not release %s for claim %s: %s", item.slot, claim_uid, error)

    async def unprepare(self, ref: ClaimRef) -> None:
        """Unprepare one claim (unknown claims are success)."""
        async with self._lock:
            known = self.checkpoint.claims.get(ref.uid)
            value = Owner.claim(ref.uid, self.node).value
            instances = (
                {d.instance for d in known.devices}
                if known is not None
                # not in the checkpoint (lost?): still free whatever the Instances say it holds
                else {i.name for i in self._instances() if value in i.device_usage.values()}
            )
            for name in sorted(instances):
                await self.ledger.release_values(name, {value})
            self.cdi.remove(ref.uid)
            if known is not None:
                del self.checkpoint.claims[ref.uid]
                self.checkpoint.save()
                self.unprepares += 1
                log.info("unprepared claim %s/%s (%s)", ref.namespace, ref.name, ref.uid)
