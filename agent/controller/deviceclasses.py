"""The controller's DeviceClasses for extended resources through DRA (KEP-5004): it keeps the
classes of ``agent/core/deviceclasses.py`` equal to the Configurations and Instances — one per
Configuration holding its names (``agent/core/name_claims.py``, the rule every agent applies),
one per Instance of it — creating what is missing and deleting what is no longer wanted (a
Configuration or Instance gone, a name now held by another Configuration).

Leader only, woken by every Configuration and Instance event and every ``resync`` seconds.
The managed classes are listed by label at each pass (a handful of objects, no watch). A class
whose content must change is deleted (with its resourceVersion) and created again rather than
updated: its content follows from its name, so only its labels can change (another namespace
took the Configuration name), and the controller's RBAC then needs no ``update``. Writes the
API server refuses (403, 422) are logged once per class and reason; a class the API server
stores without ``extendedResourceName`` (the ``DRAExtendedResource`` gate is off) is logged
once: node agents on ``auto`` then keep their device plugins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from agent.core.deviceclasses import (
    JSON,
    LABEL_SELECTOR,
    InstanceRef,
    class_changes,
    desired_device_classes,
    keeps_extended_resource_name,
)
from agent.core.kube import ApiError, KubeClient, resource_path
from agent.core.name_claims import DetailsProblem, decide_for_store
from agent.core.store.base import InstanceStore
from discovery_handlers.embedded import details_problem

log = logging.getLogger("agent.controller.deviceclasses")

PATH = resource_path("resource.k8s.io", "v1", "deviceclasses")
RESYNC = 300.0
REFUSED = frozenset({400, 403, 422})


class DeviceClassReconciler:
    """Keeps the managed DeviceClasses right while this replica leads."""

    def __init__(
        self,
        client: KubeClient,
        store: InstanceStore,
        *,
        resync: float = RESYNC,
        details: DetailsProblem = details_problem,
    ):
        self.client = client
        self.store = store
        self.details = details
        self.resync = resync
        self.wake = asyncio.Event()
        self.created = 0
        self.deleted = 0
        self._reported: set[tuple[str, str]] = set()

    async def run(self) -> None:
        """Follow the store's events; sync on each burst and every ``resync`` seconds."""
        followers = [
            asyncio.create_task(self._follow(self.store.subscribe_configurations())),
            asyncio.create_task(self._follow(self.store.subscribe_instances())),
        ]
        try:
            while True:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation
                # that arrives as the event is set (the leader's stop then never ends)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.resync):
                        await self.wake.wait()
                self.wake.clear()
                try:
                    await self.sync()
                except (ApiError, OSError) as error:
                    log.warning("DeviceClasses not reconciled (%s); retrying", error)
                    await asyncio.sleep(1.0)
                    self.wake.set()
        finally:
            for task in followers:
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)

    async def _follow(self, events: Any) -> None:
        async for _ in events:
            self.wake.set()

    async def sync(self) -> None:
        """One pass: desired classes vs the managed ones found."""
        desired = self.desired()
        stored, _ = await self.client.list_all(PATH, params={"labelSelector": LABEL_SELECTOR})
        changes = class_changes(desired, stored)
        for obj in (*changes.delete, *changes.update):
            await self._delete(obj)
        for obj in (*changes.update, *changes.create):
            await self._create(obj)

    def desired(self) -> dict[str, JSON]:
        """The classes that must exist: those of the Configurations holding their names as
        every agent decides (agent/core/name_claims.py), so that no two classes carry one
        ``extendedResourceName`` and each selects the devices the agents serve under it."""
        decision = decide_for_store(self.store, self.details)
        instances = [InstanceRef(i.name, i.configuration_key) for i in self.store.list_cached()]
        keys = [c.key for c in self.store.configurations()]
        return desired_device_classes(keys, instances, decision.holds)

    async def _delete(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        version = meta.get("resourceVersion")
        options = {"preconditions": {"resourceVersion": version} if version else {}}
        try:
            await self.client.delete(resource_path("resource.k8s.io", "v1", "deviceclasses",
                                                   name=meta["name"]), options)  # fmt: skip
            self.deleted += 1
            log.info("deleted DeviceClass %s", meta["name"])
        except ApiError as error:
            if error.status in (404, 409):
                self.wake.set()  # changed or gone meanwhile: decide again
                return
            self._refused(meta["name"], error)

    async def _create(self, obj: Mapping[str, Any]) -> None:
        body = {k: v for k, v in obj.items()}
        body["metadata"] = {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}
        name = body["metadata"]["name"]
        try:
            stored = await self.client.create(PATH, body)
        except ApiError as error:
            if error.status == 409:
                self.wake.set()  # exists (an operator's, or created meanwhile)
                return
            self._refused(name, error)
            return
        self.created += 1
        log.info(
            "created DeviceClass %s (extendedResourceName %s)",
            name,
            body["spec"]["extendedResourceName"],
        )
        if not keeps_extended_resource_name(body, stored):
            self._report(
                name,
                "dropped",
                "the API server dropped spec.extendedResourceName of DeviceClass %s: the "
                "DRAExtendedResource feature gate is off, pods' akri.sh/<name> limits stay on "
                "device plugins",
            )

    def _refused(self, name: str, error: ApiError) -> None:
        if error.status not in REFUSED:
            raise error
        self._report(name, str(error.status), f"DeviceClass %s not written: {error}")

    def _report(self, name: str, reason: str, message: str) -> None:
        if (name, reason) in self._reported:
            return
        self._reported.add((name, reason))
        log.warning(message, name)
