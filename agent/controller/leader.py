"""Leader election on a ``coordination.k8s.io/v1`` Lease (client-go's ``leaderelection``).

Every replica runs :class:`LeaderElector`; one holds the Lease and does the work:

* the holder renews ``spec.renewTime`` every ``retry_period`` with a resourceVersion-checked
  PUT; if it cannot renew for ``renew_deadline`` it stops leading (its work is cancelled)
  before anyone else may take over (``renew_deadline`` < ``lease_duration``);
* a candidate takes the Lease when it has seen the same record (holder, renewTime,
  transitions) unchanged for ``leaseDurationSeconds`` on **its own monotonic clock** — never by
  comparing ``renewTime`` with its wall clock, so clock skew between replicas cannot make two
  leaders — or when the holder released it (empty ``holderIdentity``). Two candidates racing
  for it: the resourceVersion precondition lets exactly one PUT through (409 for the other);
* on a clean stop the holder releases the Lease (holder cleared, duration 1 s), so the other
  replica takes over within one ``retry_period`` instead of a whole ``lease_duration``.

After a leader is killed, a standby takes over within ``lease_duration`` + ``retry_period`` of
its last renewal.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.core.kube import ApiError, KubeClient, TransportError, resource_path

log = logging.getLogger("agent.controller.leader")

LEASE_DURATION = 15.0
RENEW_DEADLINE = 10.0
RETRY_PERIOD = 2.0


@dataclass(frozen=True)
class LeaseSettings:
    """Where the Lease is and how long a holder keeps it (client-go's defaults)."""

    namespace: str
    name: str
    identity: str
    lease_duration: float = LEASE_DURATION
    renew_deadline: float = RENEW_DEADLINE
    retry_period: float = RETRY_PERIOD


def micro_time(when: float) -> str:
    """RFC 3339 with microseconds (``MicroTime``)."""
    moment = datetime.datetime.fromtimestamp(when, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _record(spec: dict[str, Any]) -> tuple[Any, ...]:
    return (
        spec.get("holderIdentity") or "",
        spec.get("renewTime"),
        spec.get("acquireTime"),
        spec.get("leaseTransitions"),
        spec.get("leaseDurationSeconds"),
    )


class LeaderElector:
    """Campaigns for, holds and releases one Lease. ``leading`` is set while this process
    leads; ``changed`` is set at every change of that (the caller clears it)."""

    def __init__(
        self,
        client: KubeClient,
        settings: LeaseSettings,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.settings = settings
        self._monotonic = monotonic
        self._wall = wall
        self.leading = asyncio.Event()
        self.changed = asyncio.Event()
        self.transitions = 0  # times this process started or stopped leading
        self.holder = ""  # the holder last seen in the Lease
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._renewed_at = 0.0

    @property
    def path(self) -> str:
        return resource_path("coordination.k8s.io", "v1", "leases", self.settings.namespace)

    def _lease_path(self) -> str:
        return resource_path(
            "coordination.k8s.io", "v1", "leases", self.settings.namespace, self.settings.name
        )

    def _set_leading(self, leading: bool, why: str = "Lease not renewed in time") -> None:
        if leading == self.leading.is_set():
            return
        self.transitions += 1
        if leading:
            self.leading.set()
            log.info(
                "leader election: %s now leads (Lease %s/%s)",
                self.settings.identity,
                self.settings.namespace,
                self.settings.name,
            )
        else:
            self.leading.clear()
            log.log(
                logging.INFO if why == "stopping" else logging.WARNING,
                "leader election: %s stopped leading (Lease %s/%s): %s",
                self.settings.identity,
                self.settings.namespace,
                self.settings.name,
                why,
            )
        self.changed.set()

    async def run(self) -> None:
        """Campaign and renew until cancelled."""
        while True:
            try:
                held = await self.try_acquire_or_renew()
            except (ApiError, TransportError) as error:
                log.warning("leader election: Lease request failed: %s", error)
                held = False
            except Exception:
                # e.g. a Lease someone wrote by hand with odd field types: never leave the
                # loop (a leader that stops renewing must stop leading at its deadline)
                log.exception("leader election: Lease round failed")
                held = False
            now = self._monotonic()
            if held:
                self._renewed_at = now
                self._set_leading(True)
            elif self.leading.is_set() and (
                now - self._renewed_at >= self.settings.renew_deadline
                or self.holder not in ("", self.settings.identity)  # taken over
            ):
                self._set_leading(False, f"held by {self.holder or 'nobody'} now")
            period = self.settings.retry_period
            # candidates spread their polls a little (client-go's JitterFactor 1.2)
            delay = period if self.leading.is_set() else period * random.uniform(1.0, 1.2)
            await asyncio.sleep(delay)

    async def try_acquire_or_renew(self) -> bool:
        """One round: True when this process holds the Lease afterwards."""
        me = self.settings.identity
        now_wall = self._wall()
        try:
            lease = await self.client.get(self._lease_path())
        except ApiError as error:
            if error.status != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.settings.name, "namespace": self.settings.namespace},
                "spec": {
                    "holderIdentity": me,
                    "leaseDurationSeconds": max(1, round(self.settings.lease_duration)),
                    "acquireTime": micro_time(now_wall),
                    "renewTime": micro_time(now_wall),
                    "leaseTransitions": 0,
                },
            }
            try:
                await self.client.create(self.path, body)
            except ApiError as create_error:
                if create_error.status == 409:
                    return False  # another replica created it first
                raise
            self.holder = me
            return True
        spec = dict(lease.get("spec") or {})
        record = _record(spec)
        now = self._monotonic()
        if record != self._observed:
            self._observed = record
            self._observed_at = now
        holder = str(spec.get("holderIdentity") or "")
        self.holder = holder
        duration = float(spec.get("leaseDurationSeconds") or self.settings.lease_duration)
        if holder and holder != me and now - self._observed_at < duration:
            return False  # held, and not expired as far as this process has seen
        new_spec = dict(spec)
        new_spec["holderIdentity"] = me
        new_spec["leaseDurationSeconds"] = max(1, round(self.settings.lease_duration))
        new_spec["renewTime"] = micro_time(now_wall)
        if holder != me:
            new_spec["acquireTime"] = micro_time(now_wall)
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        body = {**lease, "spec": new_spec}  # metadata.resourceVersion: the precondition
        try:
            stored = await self.client.replace(self._lease_path(), body)
        except ApiError as error:
            if error.status == 409:
                return False  # someone else wrote it since our read
            raise
        self._observed = _record(dict(stored.get("spec") or {}))
        self._observed_at = self._monotonic()
        self.holder = me
        return True

    async def release(self) -> None:
        """Give the Lease up (on a clean stop) when this process holds it."""
        if not self.leading.is_set():
            return
        self._set_leading(False, "stopping")
        try:
            lease = await self.client.get(self._lease_path())
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self.settings.identity:
                return
            spec.update(holderIdentity="", leaseDurationSeconds=1)
            spec["renewTime"] = micro_time(self._wall())
            await self.client.replace(self._lease_path(), {**lease, "spec": spec})
            log.info("leader election: %s released the Lease", self.settings.identity)
        except (ApiError, TransportError) as error:
            log.warning("leader election: could not release the Lease: %s", error)
