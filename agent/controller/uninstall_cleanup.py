"""``akri uninstall-cleanup``: the first step of an uninstall, as one command (the Helm chart's
pre-delete hook runs it; docs/install.md, "Uninstall").

It deletes every Configuration, then waits — bounded, saying what it waits for — until what
they made is gone: their Instances (each leaves once no pod holds a slot of it), the brokers
(Pods, Jobs and Services labelled ``controller=akri.sh``) and the DeviceClasses akri controller
manages. Only then may the agents, the controller and the CRDs go: removed earlier, they would
leave Instances terminating with their finalizer and brokers nobody deletes.

Only lists and deletes of Configurations: the hook's ServiceAccount may do nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.controller.brokers import BROKER_SELECTOR
from agent.core.deviceclasses import LABEL_SELECTOR as DEVICECLASS_SELECTOR
from agent.core.kube import ApiError, KubeClient, resource_path

log = logging.getLogger("agent.uninstall")

# (what, group, version, plural, label selector) — every kind the wait is for
WAITED_FOR: tuple[tuple[str, str, str, str, str | None], ...] = (
    ("Instance", "akri.sh", "v0", "instances", None),
    ("broker Pod", "", "v1", "pods", BROKER_SELECTOR),
    ("broker Job", "batch", "v1", "jobs", BROKER_SELECTOR),
    ("broker Service", "", "v1", "services", BROKER_SELECTOR),
    ("DeviceClass", "resource.k8s.io", "v1", "deviceclasses", DEVICECLASS_SELECTOR),
)
SHOWN = 5  # names shown per kind in a progress line


@dataclass(frozen=True)
class Remaining:
    """What is still there, per kind: the objects' ``namespace/name`` (or ``name``)."""

    found: tuple[tuple[str, tuple[str, ...]], ...]

    @property
    def empty(self) -> bool:
        return not any(names for _, names in self.found)

    def describe(self) -> str:
        parts = []
        for what, names in self.found:
            if names:
                shown = ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
                parts.append(f"{len(names)} {what}(s) ({shown})")
        return "; ".join(parts) if parts else "nothing"


def object_name(item: dict[str, object]) -> str:
    meta = item.get("metadata")
    if not isinstance(meta, dict):
        return "?"
    name = str(meta.get("name", "?"))
    namespace = meta.get("namespace")
    return f"{namespace}/{name}" if namespace else name


async def delete_configurations(client: KubeClient) -> list[str]:
    """Delete every Configuration (all namespaces); the names deleted. One already gone is
    not an error."""
    items, _ = await client.list_all(resource_path("akri.sh", "v0", "configurations"))
    deleted = []
    for item in items:
        meta = item.get("metadata") or {}
        path = resource_path("akri.sh", "v0", "configurations", meta.get("namespace"), meta["name"])
        try:
            await client.delete(path)
        except ApiError as error:
            if error.status != 404:
                raise
        deleted.append(object_name(item))
    return deleted


async def remaining(client: KubeClient) -> Remaining:
    found = []
    for what, group, version, plural, selector in WAITED_FOR:
        params = {"labelSelector": selector} if selector else None
        try:
            items, _ = await client.list_all(resource_path(group, version, plural), params=params)
        except ApiError as error:
            if error.status == 404:  # not served here (no DRA: no resource.k8s.io/v1)
                continue
            raise
        found.append((what, tuple(sorted(object_name(i) for i in items))))
    return Remaining(tuple(found))


async def run_cleanup(
    client: KubeClient,
    *,
    give_up_after: float,
    interval: float = 2.0,
    report_every: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Delete the Configurations and wait until nothing of :data:`WAITED_FOR` is left (True),
    or ``give_up_after`` seconds have passed (False, with what is left in the log)."""
    deleted = await delete_configurations(client)
    log.info(
        "deleted %d Configuration(s)%s",
        len(deleted),
        f": {', '.join(deleted[:SHOWN])}{', ...' if len(deleted) > SHOWN else ''}"
        if deleted
        else "",
    )
    deadline = clock() + give_up_after
    next_report = clock()
    while True:
        left = await remaining(client)
        if left.empty:
            log.info("no Instance, broker or akri DeviceClass is left: the uninstall can go on")
            return True
        now = clock()
        if now >= deadline:
            log.error(
                "gave up after %gs: still there: %s. An Instance stays while a pod holds one of "
                "its slots (kubectl get akrii -A -o yaml: deviceUsage names the holders): "
                "delete those pods, then uninstall again",
                give_up_after,
                left.describe(),
            )
            return False
        if now >= next_report:
            log.info("waiting for %s to go (%.0fs left)", left.describe(), deadline - now)
            next_report = now + report_every
        await asyncio.sleep(min(interval, max(0.0, deadline - now)))
