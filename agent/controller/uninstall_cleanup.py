"""``akri uninstall-cleanup``: the first step of an uninstall, as one command (the Helm chart's
pre-delete hook runs it; docs/install.md, "Uninstall").

It deletes every Configuration, then waits — bounded, saying what it waits for — until what
they made is gone: their Instances (each leaves once no pod holds a slot of it), the brokers
(Pods, Jobs and Services labelled ``controller=akri.sh``) and the DeviceClasses akri controller
manages. Only then may the agents, the controller and the CRDs go: removed earlier, they would
leave Instances terminating with their finalizer and brokers nobody deletes.

Then, given the release's workloads (:class:`Workloads`, names from the chart), it deletes the
agents' and discovery handlers' DaemonSets and the controller's Deployment in the foreground
and waits, within the same bound, until they — and so their pods — are gone: each agent then
stops while its RBAC still lets it see its DaemonSet being deleted, so it knows it is
uninstalled, not rolled, and removes its empty DRA checkpoint (agent/node/leaving.py; Helm
would delete the ServiceAccounts and RBAC at the same moment as the DaemonSet, and an agent
refused 401 keeps its checkpoint as on a rollout). Last, the controller's leader-election
Lease, which the controller releases on stop but leaves.

Lists, and deletes of Configurations and of the named workloads and Lease: the hook's
ServiceAccount may do nothing else.
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


@dataclass(frozen=True)
class Workloads:
    """The release's workloads the cleanup removes after the Configurations' objects: names
    from the chart, in ``namespace``."""

    namespace: str
    daemonsets: tuple[str, ...] = ()
    deployments: tuple[str, ...] = ()
    lease: str | None = None  # the controller's leader-election Lease

    def paths(self) -> list[tuple[str, str]]:
        """``(what, path)`` of each DaemonSet and Deployment."""
        found = [(f"DaemonSet {self.namespace}/{name}",
                  resource_path("apps", "v1", "daemonsets", self.namespace, name))
                 for name in self.daemonsets]  # fmt: skip
        found += [(f"Deployment {self.namespace}/{name}",
                   resource_path("apps", "v1", "deployments", self.namespace, name))
                  for name in self.deployments]  # fmt: skip
        return found


FOREGROUND: dict[str, object] = {
    "apiVersion": "v1",
    "kind": "DeleteOptions",
    "propagationPolicy": "Foreground",
}


async def delete_ignoring_absent(
    client: KubeClient, path: str, body: dict[str, object] | None = None
) -> bool:
    """DELETE ``path``; False when it was not there (404)."""
    try:
        await client.delete(path, body)
    except ApiError as error:
        if error.status != 404:
            raise
        return False
    return True


async def workloads_left(client: KubeClient, workloads: Workloads) -> list[str]:
    """The workloads still there (each stays, in foreground deletion, until its pods are
    gone), with how many pods their selector still matches."""
    left = []
    for what, path in workloads.paths():
        try:
            item = await client.get(path)
        except ApiError as error:
            if error.status == 404:
                continue
            raise
        left.append(f"{what}{await _pods_of(client, workloads.namespace, item)}")
    return left


async def _pods_of(client: KubeClient, namespace: str, item: dict[str, object]) -> str:
    spec = item.get("spec")
    selector = spec.get("selector") if isinstance(spec, dict) else None
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(labels, dict) or not labels:
        return ""
    text = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
    pods, _ = await client.list_all(
        resource_path("", "v1", "pods", namespace), params={"labelSelector": text}
    )
    return f" ({len(pods)} pod(s))"


async def remove_workloads(
    client: KubeClient,
    workloads: Workloads,
    *,
    deadline: float,
    give_up_after: float,
    interval: float,
    report_every: float,
    clock: Callable[[], float],
) -> bool:
    """Delete the DaemonSets and Deployments in the foreground, wait until they are gone
    (True) or ``deadline`` (False), then delete the Lease."""
    for what, path in workloads.paths():
        if await delete_ignoring_absent(client, path, FOREGROUND):
            log.info("deleting %s in the foreground (its pods first)", what)
    next_report = clock()
    while left := await workloads_left(client, workloads):
        now = clock()
        if now >= deadline:
            log.error(
                "gave up after %gs: still there: %s (kubectl get pods -n %s: a pod that does "
                "not end holds its DaemonSet or Deployment)",
                give_up_after,
                "; ".join(left),
                workloads.namespace,
            )
            return False
        if now >= next_report:
            log.info("waiting for %s to go (%.0fs left)", "; ".join(left), deadline - now)
            next_report = now + report_every
        await asyncio.sleep(min(interval, max(0.0, deadline - now)))
    if workloads.paths():
        log.info("the agents, discovery handlers and controller are gone")
    if workloads.lease:
        path = resource_path("coordination.k8s.io", "v1", "leases", workloads.namespace,
                             workloads.lease)  # fmt: skip
        if await delete_ignoring_absent(client, path):
            log.info("deleted the controller's Lease %s/%s", workloads.namespace, workloads.lease)
    return True


async def run_cleanup(
    client: KubeClient,
    *,
    give_up_after: float,
    workloads: Workloads | None = None,
    interval: float = 2.0,
    report_every: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Delete the Configurations and wait until nothing of :data:`WAITED_FOR` is left, then
    remove ``workloads`` (:func:`remove_workloads`): True once all is gone, False after
    ``give_up_after`` seconds in all (with what is left in the log)."""
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
            if workloads is None:
                return True
            return await remove_workloads(
                client, workloads, deadline=deadline, give_up_after=give_up_after,
                interval=interval, report_every=report_every, clock=clock,
            )  # fmt: skip
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
