"""``HandlerFeed``: the handler task of one Configuration's discovery.

Split out of :mod:`agent.node.discovery.runner`, which keeps the other task (turning the
latest device list into Instance writes). This module's one job is to keep a current, accepted
device list coming from the handler: resolve ``discoveryProperties`` (and restart discovery
when a referenced Secret/ConfigMap changes what they resolve to), run the handler, check each
report, restart the handler with capped backoff when it fails or ends its stream, and record
its state (``starting``, ``ok``, ``failed``, ``invalid``) for metrics and status. It writes
no Instance; it tells the runner a new list is there through ``on_devices``.

A handler that fails is not a handler that reports no devices: its last successful list is
kept until it reports again, so an exception never starts the offline grace of a device that
may still be there. Only a successful report that lacks a device does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping

from agent.core import telemetry
from agent.core.model.configuration import Configuration
from agent.core.model.properties import (
    PropertyResolutionError,
    references,
    resolve_properties,
)
from agent.core.store.base import InstanceStore
from agent.node.discovery.limits import ReportRejectedError, check_report
from discovery_handlers.base import (
    Device,
    DiscoveryHandler,
    InvalidDiscoveryDetailsError,
    report_problems_to,
)

# the runner's logger: these lines were its own and log filters keep matching them
log = logging.getLogger("agent.discovery")

MAX_HANDLER_BACKOFF = 60.0


class HandlerFeed:
    """Runs one Configuration's discovery handler; ``devices`` is its latest accepted list.

    ``configuration`` returns the Configuration as it is now (edits apply to the next
    handler start and to the Events recorded from then on)."""

    def __init__(
        self,
        handler: DiscoveryHandler,
        store: InstanceStore,
        configuration: Callable[[], Configuration],
        on_devices: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.handler = handler
        self._store = store
        self._configuration = configuration
        self._on_devices = on_devices
        self._clock = clock
        self.devices: list[Device] | None = None  # None until the handler first reports
        # Configuration edits that restarted the handler, and how many of them the handler
        # had seen when it reported ``devices``: a list with ``devices_edit == edits`` newer
        # than the last one the runner planned with is the edited Configuration's first
        self.edits = 0
        self.devices_edit = 0
        self.task: asyncio.Task[None] | None = None
        self._stop_watching: Callable[[], None] = lambda: None
        self._properties_digest: str | None = None
        # for metrics and status: starting, ok, failed (last list kept), invalid
        self.state = "starting"

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Watch the referenced Secrets/ConfigMaps and start the handler task."""
        self.watch_property_sources()
        self.task = asyncio.create_task(self._run(), name=f"handler-{self._configuration().name}")

    def stop_watching(self) -> None:
        """Stop watching the referenced Secrets/ConfigMaps (the caller cancels ``task``)."""
        self._stop_watching()

    def restart(self, edited: bool = False) -> None:
        """Cancel the handler task and start a new one; the last device list stays.
        ``edited``: the Configuration's discovery part changed (what it selects may have)."""
        if edited:
            self.edits += 1
        if self.task is not None:
            self.task.cancel()
        self.task = asyncio.create_task(self._run(), name=f"handler-{self._configuration().name}")

    # -- discoveryProperties -----------------------------------------------------------------
    def watch_property_sources(self) -> None:
        """(Re)watch the Secrets/ConfigMaps the Configuration's properties refer to."""
        self._stop_watching()
        refs = references(self._configuration().discovery_handler.discovery_properties)
        if refs:
            self._stop_watching = self._store.watch_objects(refs, self._property_source_changed)
        else:
            self._stop_watching = lambda: None

    def _property_source_changed(self) -> None:
        asyncio.get_running_loop().create_task(self._recheck_properties())

    async def _recheck_properties(self) -> None:
        try:
            digest = _digest(await self._resolve())
        except PropertyResolutionError:
            digest = "unresolvable"
        if digest != self._properties_digest:
            log.info(
                "configuration %s: a referenced Secret/ConfigMap changed; restarting discovery",
                self._configuration().key,
            )
            self.restart()

    async def _resolve(self) -> dict[str, bytes | None]:
        return await resolve_properties(
            self._configuration().discovery_handler.discovery_properties,
            self._store.read_object,
        )

    # -- the handler task ----------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 1.0
        key = self._configuration().key
        edit = self.edits  # the Configuration this task discovers for
        # an embedded handler's problems with single devices (discovery_handlers.base.
        # ProblemReporter) become Events on this Configuration (this task's context only)
        report_problems_to(
            lambda reason, message: self._store.record_configuration_event(
                self._configuration(), reason, message
            )
        )
        while True:
            details = self._configuration().discovery_handler.discovery_details
            started = self._clock()
            try:
                properties = await self._resolve()
                self._properties_digest = _digest(properties)
                first = True
                async for devices in self.handler.discover(details, properties):
                    if first:
                        first = False
                        telemetry.DISCOVERY_RESPONSE_TIME.observe(str(key), self._clock() - started)
                    try:
                        check_report(devices)
                    except ReportRejectedError:
                        telemetry.DISCOVERY_RESULTS[(self.handler.name, "failure")] += 1
                        raise
                    telemetry.DISCOVERY_RESULTS[(self.handler.name, "success")] += 1
                    self.state = "ok"
                    shown = [device.id[:80] for device in devices[:10]]
                    ids = f"{shown} and {len(devices) - 10} more" if len(devices) > 10 else shown
                    log.info(
                        "configuration %s: %s reports %d device(s): %s",
                        key,
                        self.handler.name,
                        len(devices),
                        ids,
                    )
                    self.devices = list(devices)
                    self.devices_edit = edit
                    self._on_devices()
                log.warning(
                    "configuration %s: handler %s ended its stream; restarting",
                    key,
                    self.handler.name,
                )
            except asyncio.CancelledError:
                raise
            except PropertyResolutionError as error:
                self.state = "failed"
                # keep the last device list: a briefly missing Secret must not drop devices
                log.error("configuration %s: %s; retrying in %.0fs", key, error, backoff)
                await self._store.record_configuration_event(
                    self._configuration(), "DiscoveryPropertiesUnresolved", str(error)
                )
            except ReportRejectedError as error:
                self.state = "failed"
                log.error(
                    "configuration %s: handler %s reported %s; keeping its last accepted device "
                    "list (retrying in %.0fs)",
                    key,
                    self.handler.name,
                    error,
                    backoff,
                )
                await self._store.record_configuration_event(
                    self._configuration(), "DiscoveryReportRejected", str(error)
                )
            except InvalidDiscoveryDetailsError as error:
                self.state = "invalid"
                log.error(
                    "configuration %s: %s (keeping the last device list until it is edited)",
                    key,
                    error,
                )
                await self._store.record_configuration_event(
                    self._configuration(), "InvalidDiscoveryDetails", str(error)
                )
                return  # waits for an edited Configuration (the runner's update() restarts us)
            except Exception as error:
                telemetry.DISCOVERY_RESULTS[(self.handler.name, "failure")] += 1
                self.state = "failed"
                log.error(
                    "configuration %s: handler %s failed: %s: %s (keeping its last device "
                    "list until it reports again; retrying in %.0fs)",
                    key,
                    self.handler.name,
                    type(error).__name__,
                    error,
                    backoff,
                )
                await self._store.record_configuration_event(
                    self._configuration(), "DiscoveryFailed", f"{type(error).__name__}: {error}"
                )
            if self._clock() - started > 2 * MAX_HANDLER_BACKOFF:
                backoff = 1.0
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_HANDLER_BACKOFF)


def _digest(properties: Mapping[str, bytes | None]) -> str:
    """A fingerprint of resolved values (compared, never logged)."""
    hasher = hashlib.sha256()
    for key in sorted(properties):
        value = properties[key]
        hasher.update(key.encode() + b"\0" + (b"\1" + value if value is not None else b"\0"))
    return hasher.hexdigest()
