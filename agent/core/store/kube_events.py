"""Kubernetes Events about akri.sh objects (Configurations, Instances): the backend's second job.

Split out of :mod:`agent.core.store.kubernetes`, which keeps the Instance/Configuration caches
and the compare-and-swap writes. Events are a different kind of write: best effort, never
retried, never failing the caller, and bounded under a flood of distinct messages (a handler
reporting thousands of bad devices) — neither the de-duplication memory nor the requests in
flight may grow without bound. Over the bounds the oldest memory is forgotten, and new Events
are dropped and counted (``dropped``, exported as ``akri_events_dropped_total``).
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent.core.kube import KubeClient, resource_path
from agent.core.model.instance import API_VERSION

# the logger of the module these lines came from, so that log filters keep matching them
log = logging.getLogger("agent.core.store.kubernetes")

EVENT_REPEAT_INTERVAL = 300.0
MAX_EVENT_KEYS = 4096
MAX_EVENTS_IN_FLIGHT = 32


class EventRecorder:
    """Creates core/v1 Events; the same (object, reason, message) at most every 5 minutes."""

    def __init__(
        self,
        client: KubeClient,
        node_name: str,
        request_timeout: float,
        count_request: Callable[[], None] = lambda: None,
    ) -> None:
        self._client = client
        self._node_name = node_name
        self._request_timeout = request_timeout
        self._count_request = count_request  # the store's request counter
        # (object, reason, message) -> when last sent; oldest first (re-sent keys move to the
        # end), so expired entries are dropped from the front
        self.sent: collections.OrderedDict[tuple[str, str, str], float] = collections.OrderedDict()
        self._in_flight = 0
        self.dropped = 0  # Events not sent because MAX_EVENTS_IN_FLIGHT were pending
        self._tasks: set[asyncio.Task[None]] = set()

    def record_soon(self, obj: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
        """Send an Event from synchronous code (an informer callback) without waiting for it."""
        task = asyncio.get_running_loop().create_task(self.record(obj, kind, reason, message))
        # a reference, or the loop may collect the task before it runs
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def record(
        self,
        obj: Mapping[str, Any],
        kind: str,
        reason: str,
        message: str,
        *,
        warning: bool = True,
    ) -> None:
        """Create a core/v1 Event about an akri.sh object; the same event at most every 5 min."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        namespace = str(meta.get("namespace") or "default")
        key = (f"{kind}/{namespace}/{name}", reason, message)
        now = time.monotonic()
        sent = self.sent
        while sent and (
            len(sent) >= MAX_EVENT_KEYS or now - next(iter(sent.values())) >= EVENT_REPEAT_INTERVAL
        ):
            sent.popitem(last=False)  # expired (or the oldest, when full)
        if key in sent:
            return  # sent less than EVENT_REPEAT_INTERVAL ago
        if self._in_flight >= MAX_EVENTS_IN_FLIGHT:
            if not self.dropped:
                log.warning(
                    "%d Events are being sent already: dropping new ones (counted in "
                    "events_dropped; logged once)",
                    self._in_flight,
                )
            self.dropped += 1
            return
        sent[key] = now
        timestamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": kind,
                "name": name,
                "namespace": namespace,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": "akri-agent", "host": self._node_name},
            "reportingComponent": "akri.sh/agent",
            "reportingInstance": self._node_name,
            "firstTimestamp": timestamp,
            "lastTimestamp": timestamp,
            "count": 1,
        }
        self._count_request()
        self._in_flight += 1
        try:
            await self._client.create(
                resource_path("", "v1", "events", namespace),
                body,
                request_timeout=self._request_timeout,
            )
        except Exception as error:  # an Event is best effort; never fail the caller
            log.warning(
                "could not record event %s on %s %s/%s: %s", reason, kind, namespace, name, error
            )
        finally:
            self._in_flight -= 1
