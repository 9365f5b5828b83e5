"""Prepare / unprepare decisions for claims allocated to driver ``akri.sh`` (the DRA
counterpart of ``plugins.py``: the gRPC layer in ``driver.py`` only translates).

Prepare, per claim (serialised):
1. already in the checkpoint → return the same answer (idempotent, also across restarts);
2. read the ResourceClaim; require ``status.allocation`` and a matching uid;
3. record the claim as *preparing* in the checkpoint (so its slots can always be traced to it);
4. for each result of our driver, resolve (pool, device) to (Instance, slot) and claim the slot
   for ``D:<claim-uid>:<node>`` through the slot ledger (CAS on the Instance);
   a slot held by anyone else fails the claim with a message naming the holder;
5. write the claim's CDI spec, record it as *prepared*, answer with the CDI ids.
If a later device fails, slots claimed earlier in this call are released again.

Unprepare: release the claim's slots, remove its CDI file, drop it from the checkpoint; an
unknown claim is success. A release the API refuses fails the unprepare (kubelet retries it:
kubelet's own record keeps it until it happens) — except while the agent is being uninstalled
(``releases_may_fail``, agent/node/leaving.py): no agent would answer kubelet's retries, and
the pod could never end. Then the unprepare completes on the node (the CDI spec goes: the
container is gone) and the release stays on record as a *pending release* in the checkpoint,
which the DRA reclaimer completes once the API answers — this agent while it stays, or the
next one on this node at its start (issue 39.2; DESIGN invariant 10).

At start, :meth:`DraState.restore` compares the checkpoint with the Instances: a prepared
claim's slot found free again (its Instance was re-created meanwhile) is taken back, one held
by someone else is reported. Instances only ever seen through :class:`ServedInstances` names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.ledger.decisions import Owner
from agent.core.ledger.ledger import SlotLedger, SlotRefusedError
from agent.core.model.device_usage import is_free, parse_usage
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import StorageError, StoreError
from agent.node.deviceplugin.container_env import container_edits
from agent.node.dra.cdi import CdiDevice, CdiWriter, cdi_device_name, qualified
from agent.node.dra.checkpoint import (
    Checkpoint,
    PendingClaim,
    PendingRelease,
    PreparedClaim,
    PreparedDevice,
)
from agent.node.dra.slices import DRIVER, consumable_instance, consumed_slots, slot_for_device
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
        # the agent is being uninstalled (agent/node/leaving.py): an unprepare whose slot
        # release the API refuses still completes here, or its pod would never end; the
        # release stays pending in the checkpoint
        self.releases_may_fail = False

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
            results = driver_results(claim)
            try:
                self.checkpoint.record_preparing(PendingClaim(ref.uid, ref.namespace, ref.name))
            except StorageError as error:
                raise PrepareError(f"DRA checkpoint unavailable: {error}") from error
            prepared: list[PreparedDevice] = []
            try:
                await self._claim_slots(ref, results, prepared)
                try:
                    self._write_cdi(ref, prepared)
                except (StorageError, OSError, ValueError) as error:
                    raise PrepareError(f"writing the CDI spec failed: {error}") from error
                claim_state = PreparedClaim(ref.uid, ref.namespace, ref.name, tuple(prepared))
                try:
                    self.checkpoint.record_prepared(claim_state)
                except StorageError as error:
                    # not recorded, so not answered: the slots go back (still traceable
                    # through the "preparing" entry if even that fails)
                    self._remove_cdi(ref.uid)
                    raise PrepareError(f"DRA checkpoint unavailable: {error}") from error
            except Exception as error:
                # whatever failed part-way: give back every slot this call claimed
                await self._release(ref.uid, prepared)
                self._forget_preparing(ref.uid)
                if isinstance(error, PrepareError):
                    raise
                raise PrepareError(f"internal error: {type(error).__name__}: {error}") from error
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
        self, ref: ClaimRef, results: list[Mapping[str, Any]], prepared: list[PreparedDevice]
    ) -> None:
        """Claim the slot of every result, appending each to ``prepared`` as it is claimed
        (the caller gives them back if anything fails)."""
        owner = Owner.claim(ref.uid, self.node)
        instances = {i.name: i for i in self._instances()}
        for result in results:
            pool, device = str(result.get("pool")), str(result.get("device"))
            resolved = slot_for_device(pool, device, instances, self.node)
            if resolved is None:
                consumable = consumable_instance(pool, device, instances, self.node)
                if consumable is not None:
                    await self._claim_consumed(ref, result, consumable, prepared)
                    continue
                raise PrepareError(f"device {pool}/{device} is not an akri.sh device of this node")
            instance, slot = resolved
            if self.node not in instance.nodes:
                raise PrepareError(f"device {pool}/{device} is not available on {self.node}")
            try:
                await self.ledger.claim(instance.key, slot, owner)
            except (SlotRefusedError, StoreError) as error:
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
                    namespace=instance.namespace,
                )
            )

    async def _claim_consumed(
        self,
        ref: ClaimRef,
        result: Mapping[str, Any],
        instance: Instance,
        prepared: list[PreparedDevice],
    ) -> None:
        """A consumable-capacity device (one per Instance): claim as many free slots as the
        allocation consumed (``consumedCapacity.slots``), each a ``D:<uid>:<node>`` value;
        one PreparedDevice per slot, sharing the allocation's CDI id."""
        pool, device = str(result.get("pool")), str(result.get("device"))
        if self.node not in instance.nodes:
            raise PrepareError(f"device {pool}/{device} is not available on {self.node}")
        try:
            wanted = consumed_slots(result)
        except ValueError as error:
            raise PrepareError(f"device {pool}/{device}: {error}") from error
        share = str(result["shareID"]) if result.get("shareID") else None
        name = cdi_device_name(ref.uid, f"{device}-{share}" if share else device)
        owner = Owner.claim(ref.uid, self.node)
        taken = {p.slot for p in prepared if p.instance == instance.name}
        got = 0
        for _ in range(2 * instance.capacity + 2):  # bounded: each round frees nothing
            if got == wanted:
                break
            current = {i.name: i for i in self._instances()}.get(instance.name, instance)
            free = [
                s for s in current.slot_ids() if not current.device_usage.get(s) and s not in taken
            ]
            if not free:
                break
            slot = free[0]
            try:
                await self.ledger.claim(current.key, slot, owner)
            except SlotRefusedError:
                taken.add(slot)  # someone took it meanwhile: try the next free one
                continue
            except StoreError as error:
                raise PrepareError(f"cannot prepare {pool}/{device} ({slot}): {error}") from error
            taken.add(slot)
            got += 1
            prepared.append(
                PreparedDevice(
                    request_names=(str(result.get("request", "")).split("/")[0],),
                    pool=pool,
                    device=device,
                    instance=instance.name,
                    slot=slot,
                    cdi_device_ids=(qualified(name),),
                    share_id=share,
                    namespace=instance.namespace,
                )
            )
        if got < wanted:
            raise PrepareError(
                f"cannot prepare {pool}/{device}: the allocation consumes {wanted} slot(s) of "
                f"{instance.name}, only {got} were free"
            )

    def _write_cdi(self, ref: ClaimRef, prepared: list[PreparedDevice]) -> None:
        if not prepared:
            return
        instances = {i.name: i for i in self._instances()}
        devices = []
        written: set[str] = set()
        for item in prepared:
            # the slots of one consumable-capacity allocation share one CDI device
            name = item.cdi_device_ids[0].split("=", 1)[1]
            if name in written:
                continue
            written.add(name)
            instance = instances.get(item.instance)
            edits = container_edits(
                [instance] if instance else [], {item.instance: self._device_for(item.instance)}
            )
            devices.append(CdiDevice(name, edits))
        self.cdi.write(ref.uid, devices)

    def _remove_cdi(self, claim_uid: str) -> None:
        try:
            self.cdi.remove(claim_uid)
        except (StorageError, ValueError) as error:
            log.warning("could not remove the CDI spec of claim %s: %s", claim_uid, error)

    def _forget_preparing(self, claim_uid: str) -> None:
        try:
            self.checkpoint.forget([claim_uid])
        except StorageError as error:
            # stays "preparing": the DRA reclaimer asks the API about it and frees what is left
            log.warning("could not drop claim %s from the DRA checkpoint: %s", claim_uid, error)

    async def _release(self, claim_uid: str, prepared: list[PreparedDevice]) -> None:
        value = Owner.claim(claim_uid, self.node).value
        for item in prepared:
            try:
                await self.ledger.release_values(ObjectKey(item.namespace, item.instance), {value})
            except Exception as error:
                log.warning("could not release %s for claim %s: %s", item.slot, claim_uid, error)

    async def unprepare(self, ref: ClaimRef) -> None:
        """Unprepare one claim (unknown claims are success)."""
        async with self._lock:
            known = self.checkpoint.claims.get(ref.uid)
            value = Owner.claim(ref.uid, self.node).value
            instances = (
                {ObjectKey(d.namespace, d.instance) for d in known.devices}
                if known is not None
                # not in the checkpoint (lost?): still free whatever the Instances say it holds
                else {i.key for i in self._instances() if value in i.device_usage.values()}
            )
            # each step can fail (API, disk) and raise: kubelet retries the unprepare, and the
            # checkpoint entry, changed last and only once written, makes the retry find
            # everything again
            refused: list[ObjectKey] = []
            for key in sorted(instances):
                try:
                    await self.ledger.release_values(key, {value})
                except StoreError as error:
                    if not self.releases_may_fail:
                        raise
                    refused.append(key)
                    log.warning(
                        "claim %s: slot release in Instance %s refused (%s); unprepared on "
                        "the node (the agent is being uninstalled), the release stays pending "
                        "in the DRA checkpoint until the API answers",
                        ref.uid,
                        key,
                        error,
                    )
            self.cdi.remove(ref.uid)
            if refused:
                self.checkpoint.record_release_pending(
                    PendingRelease(ref.uid, ref.namespace, ref.name, value, tuple(refused))
                )
            else:
                self.checkpoint.forget([ref.uid])
            if known is not None:
                self.unprepares += 1
                log.info("unprepared claim %s/%s (%s)", ref.namespace, ref.name, ref.uid)

    def lock(self) -> asyncio.Lock:
        """Held while a claim is prepared or unprepared (the DRA reclaimer takes it too)."""
        return self._lock

    def in_use(self, instance: Instance) -> dict[str, str]:
        """slot -> ``D:<uid>:<node>`` for the slots of ``instance`` (by name and namespace)
        that prepared claims in the checkpoint use: for an Instance being (re-)created."""
        result: dict[str, str] = {}
        for claim in self.checkpoint.claims.values():
            for device in claim.devices:
                if device.instance == instance.name and device.namespace == instance.namespace:
                    result[device.slot] = Owner.claim(claim.uid, self.node).value
        return result

    def prepared_devices(self) -> list[tuple[str, str, str]]:
        """``(pool, device, instance)`` of every device of a prepared claim (health.py)."""
        return [
            (device.pool, device.device, device.instance)
            for claim in self.checkpoint.claims.values()
            for device in claim.devices
        ]

    async def restore(self) -> None:
        """After a restart: every prepared claim's slot must still be held by it. A slot found
        free (its Instance was re-created) is taken back; one held by another owner is
        reported (it is in use twice: the claim's pod and that owner)."""
        async with self._lock:
            served = {i.key: i for i in self._instances()}
            for claim in list(self.checkpoint.claims.values()):
                owner = Owner.claim(claim.uid, self.node)
                for device in claim.devices:
                    key = ObjectKey(device.namespace, device.instance)
                    instance = served.get(key)
                    if instance is None:
                        continue  # re-created with this slot held once discovery finds it
                    value = instance.device_usage.get(device.slot, "")
                    if value == owner.value:
                        continue
                    if is_free(parse_usage(value)):
                        try:
                            await self.ledger.claim(key, device.slot, owner)
                            log.warning(
                                "claim %s/%s (%s): slot %s was free again after a restart; "
                                "taken back (its pod still uses it)",
                                claim.namespace,
                                claim.name,
                                claim.uid,
                                device.slot,
                            )
                        except (SlotRefusedError, StoreError) as error:
                            log.error(
                                "claim %s/%s (%s): cannot take slot %s back: %s",
                                claim.namespace,
                                claim.name,
                                claim.uid,
                                device.slot,
                                error,
                            )
                        continue
                    log.error(
                        "claim %s/%s (%s) is prepared on slot %s, but %s holds it: the device "
                        "is used twice; unprepare or delete one of them",
                        claim.namespace,
                        claim.name,
                        claim.uid,
                        device.slot,
                        value,
                    )


def driver_results(claim: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The allocation results of driver ``akri.sh`` in a ResourceClaim."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return [
        r
        for r in ((allocation.get("devices") or {}).get("results") or [])
        if r.get("driver") == DRIVER
    ]
