"""On SIGTERM with DRA claims prepared on this node: leave at once, or stay to unprepare them.

kubelet can finish a pod that holds a DRA claim only after the driver answered its
``NodeUnprepareResources``; once the driver is gone for good the pod stays ``Terminating``
for ever (issue 33.3). So when the agent is told to stop while claims are prepared here, it
asks why:

* **replaced** — its DaemonSet exists and is not being deleted: a rollout (``kubectl rollout
  restart``, an upgrade), its Pod deleted by hand, a node shutting down. The next agent on
  this node reads the same DRA checkpoint and answers kubelet's unprepare calls; the slots
  stay held meanwhile. It leaves at once, as fast as ever.
* **uninstalled** — only on positive evidence: its DaemonSet is gone (the API server answers
  404 for it) or being deleted (``deletionTimestamp``). No agent will come back: it
  **stays**, serving kubelet's unprepare calls, until no claim is prepared here or its Pod's
  deletion deadline (minus the time a clean stop needs) — at most :data:`LINGER_LIMIT` when
  that is unknown. Meanwhile an unprepare whose slot release the API refuses completes on the
  node (CDI spec removed, kubelet told it is done) and the release stays on record in the DRA
  checkpoint (``pendingReleases``, ``checkpoint.py``) for a later agent here (issue 39.2).
* **unknown** — anything it cannot tell: not in a Pod (no ``POD_NAME``/``POD_NAMESPACE``), no
  DaemonSet owner, or its Pod or DaemonSet not readable — 401/403 (the RBAC went with an
  out-of-order uninstall, or a token or webhook hiccup on a rollout), 5xx, a timeout, no
  connection. Taken as a rollout (issue 39.3): it leaves at once and keeps its checkpoint, so
  a rollout is never mistaken for an uninstall; after an uninstall that removed the RBAC
  first, the pods whose claims are still prepared end once an agent runs here again
  (docs/install.md, "Out of order").

It asks also when no claim is prepared: an agent uninstalled with none left (at once, or
after staying) removes its empty DRA checkpoint and plugin directory once stopped
(``Checkpoint.remove_if_empty``), which nothing else would ever remove from the node; a
replaced or unknown one keeps them for the next agent. A slot release still pending (the API
kept refusing until the Pod's deadline) keeps them too: the next agent installed on this node
completes it.

Why not a ``preStop`` hook: it would be another process, without the DRA state, asking the
same questions; the agent itself knows what is prepared and keeps serving kubelet meanwhile.
The DaemonSet's ``terminationGracePeriodSeconds`` (60) covers :data:`LINGER_LIMIT`, the two
looks and the stop.

Pure decision (:func:`decide_departure`), the look at the API (:func:`why_stopping`).
"""

from __future__ import annotations

import asyncio
import datetime
import enum
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.kube import ApiError, KubeClient, resource_path

log = logging.getLogger(__name__)

POD_NAME_ENV = "POD_NAME"  # the downward API's metadata.name (deploy/base/daemonset.yaml)
POD_NAMESPACE_ENV = "POD_NAMESPACE"  # metadata.namespace
POD_ENV = (POD_NAME_ENV, POD_NAMESPACE_ENV)
LOOK_TIMEOUT = 2.0  # seconds for the two GETs that tell a rollout from an uninstall
LINGER_LIMIT = 50.0  # seconds at most when the Pod's deletion deadline is unknown
CHECK_EVERY = 0.2  # seconds between two looks at the prepared claims while staying


class Departure(enum.Enum):
    REPLACED = "replaced"
    UNINSTALLED = "uninstalled"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Why:
    """Why the agent stops, as the API server tells it."""

    departure: Departure
    reason: str
    deadline: float | None = None  # epoch seconds: the Pod's deletionTimestamp


def decide_departure(
    pod: Mapping[str, Any] | None,
    pod_error: int | None,
    daemonset: Mapping[str, Any] | None,
    daemonset_error: int | None,
) -> Why:
    """From what the GETs of this agent's Pod and of its DaemonSet answered (an object, or
    the HTTP status of the failure; 0: no answer; None/None: not asked). Uninstalled only on
    the API server's word that the DaemonSet is gone or going; any doubt reads as unknown,
    which leaves as a rollout does."""
    if pod is None:
        return Why(Departure.UNKNOWN, f"this Pod cannot be read ({_failure(pod_error)})")
    deadline = parse_time((pod.get("metadata") or {}).get("deletionTimestamp"))
    owner = daemonset_owner(pod)
    if owner is None:
        return Why(Departure.UNKNOWN, "this Pod belongs to no DaemonSet", deadline)
    if daemonset_error == 404:
        return Why(Departure.UNINSTALLED, f"DaemonSet {owner} is deleted", deadline)
    if daemonset is None:
        why = f"DaemonSet {owner} cannot be read ({_failure(daemonset_error)})"
        return Why(Departure.UNKNOWN, why, deadline)
    meta = daemonset.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return Why(Departure.UNINSTALLED, f"DaemonSet {owner} is being deleted", deadline)
    # (one of that name created again after a delete is replaced too: it starts an agent here)
    return Why(Departure.REPLACED, f"DaemonSet {owner} stays", deadline)


def _failure(status: int | None) -> str:
    if not status:
        return "no answer from the API server"
    if status in (401, 403):
        return f"{status}: the API server refuses; its RBAC may be gone, or it is a hiccup"
    return f"{status}"


def daemonset_owner(pod: Mapping[str, Any]) -> str | None:
    """The name of the DaemonSet that owns ``pod`` (its controller reference)."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "DaemonSet" and ref.get("name"):
            return str(ref["name"])
    return None


def parse_time(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


async def _get(client: KubeClient, path: str) -> tuple[dict[str, Any] | None, int | None]:
    try:
        return await client.get(path, request_timeout=LOOK_TIMEOUT), None
    except ApiError as error:  # TransportError (no answer, a timeout): status 0
        return None, error.status
    except (OSError, TimeoutError):
        return None, 0


async def why_stopping(client: KubeClient, environ: Mapping[str, str] = os.environ) -> Why:
    """Ask the API server whether this agent's DaemonSet stays (bounded by LOOK_TIMEOUT
    each; any failure but a 404 of the DaemonSet reads as unknown)."""
    name, namespace = environ.get(POD_NAME_ENV), environ.get(POD_NAMESPACE_ENV)
    if not name or not namespace:
        return Why(Departure.UNKNOWN, f"not in a Pod (no {POD_NAME_ENV}/{POD_NAMESPACE_ENV})")
    pod, pod_error = await _get(client, resource_path("", "v1", "pods", namespace, name))
    daemonset: dict[str, Any] | None = None
    daemonset_error: int | None = None
    owner = daemonset_owner(pod) if pod is not None else None
    if owner is not None:
        path = resource_path("apps", "v1", "daemonsets", namespace, owner)
        daemonset, daemonset_error = await _get(client, path)
    return decide_departure(pod, pod_error, daemonset, daemonset_error)


async def linger_while_prepared(
    prepared: Callable[[], int],
    why: Why,
    *,
    stop_needs: float,
    wall: Callable[[], float] = time.time,
    limit: float = LINGER_LIMIT,
    releasing: Callable[[], int] = lambda: 0,
) -> int:
    """Stay while claims are prepared, or slot releases are pending (``releasing``: unprepared
    claims whose slots the API has not freed yet; the DRA reclaimer retries them), until the
    Pod's deletion deadline less ``stop_needs`` seconds (``limit`` from now when there is
    none). Returns how many claims are left prepared."""
    until = wall() + limit
    if why.deadline is not None:
        until = min(until, why.deadline - stop_needs)
    left = prepared()
    reported = -1
    waiting_releases = False
    while (left or releasing()) and wall() < until:
        if left and left != reported:
            log.warning(
                "the agent is being uninstalled (%s) while %d DRA claim(s) are prepared on "
                "this node: it stays %.0fs more at most, so that kubelet can unprepare them "
                "and their pods can end (delete them now; after that they stay Terminating "
                "until an agent runs here again, docs/install.md)",
                why.reason,
                left,
                max(0.0, until - wall()),
            )
            reported = left
        elif not left and not waiting_releases:
            log.warning(
                "the agent is being uninstalled (%s): %d slot release(s) of unprepared DRA "
                "claims are pending (the API refused them); it stays %.0fs more at most to "
                "retry them",
                why.reason,
                releasing(),
                max(0.0, until - wall()),
            )
            waiting_releases = True
        await asyncio.sleep(CHECK_EVERY)
        left = prepared()
    return left
