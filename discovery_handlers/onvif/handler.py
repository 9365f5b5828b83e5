"""``onvif``: Akri's ONVIF camera discovery handler, asyncio and event-driven.

Every ``probeIntervalSeconds`` (default 10, Akri's fixed period) a WS-Discovery Probe for
``NetworkVideoTransmitter`` goes out; answers are collected for ``discoveryTimeoutSeconds``
and a camera not heard from during that window is gone. Between Probes, Hello adds or updates
a camera and Bye removes it at once. Each camera address passes Akri's filters (uuid and
scopes before any SOAP call, IP and MAC after GetNetworkInterfaces); a camera that does not
answer SOAP or rejects its credentials is logged and not offered, and asked again next round.
Devices are shared (IP cameras are visible from several nodes). See ``docs/onvif.md``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from discovery_handlers.base import (
    Device,
    DiscoveryHandler,
    DiscoveryProperties,
    ProblemReporter,
)
from discovery_handlers.onvif import filters
from discovery_handlers.onvif.credentials import CredentialStore
from discovery_handlers.onvif.details import NAME, OnvifDetails, parse_details, warnings
from discovery_handlers.onvif.devices import build_device
from discovery_handlers.onvif.wsdiscovery import (
    Endpoint,
    Kind,
    Message,
    build_probe,
    new_message_id,
)

if TYPE_CHECKING:
    from discovery_handlers.onvif.device_query import DeviceQuerier, QueryResult

log = logging.getLogger("discovery_handlers.onvif")

MAX_CAMERAS = 4096  # uuids tracked per Configuration (a flood of fake Hellos stops here)
MAX_PENDING_MESSAGES = 4096
MIN_WINDOW = 0.1
RECENT_PROBES = 4  # ProbeMatches may relate to this many of our latest Probes


@dataclass
class Camera:
    """A camera as WS-Discovery last described it."""

    xaddrs: tuple[str, ...]
    scopes: tuple[str, ...] | None
    metadata_version: str
    heard: float  # loop time


@dataclass
class Answer:
    """The SOAP query result for one (service URL, uuid), and what it was based on."""

    result: QueryResult
    metadata_version: str
    round: int


def scope_values(camera: Camera, answer: Answer | None) -> tuple[str, ...] | None:
    """The scopes to filter on: announced ones, else GetScopes' (None: unknown)."""
    if camera.scopes:
        return camera.scopes
    if answer is not None and answer.result.scopes is not None:
        return answer.result.scopes
    return camera.scopes


def offered_device(
    details: OnvifDetails, url: str, uuid: str, result: QueryResult
) -> Device | None:
    """The Device for an answered query, or None if the camera is not offered (no usable
    answer, rejected credentials, or filtered out by IP or MAC with Akri's rules)."""
    if not result.offered:
        return None
    ip_values = None if result.ip is None else [result.ip]
    if not filters.passes(details.ip_addresses, ip_values, filters.equal_ignoring_case):
        return None
    mac_values = None if result.mac is None else [result.mac]
    if not filters.passes(details.mac_addresses, mac_values, filters.mac_matches):
        return None
    return build_device(url, uuid, result.ip, result.mac)


class OnvifHandler(DiscoveryHandler):
    """Discovers ONVIF network video transmitters (shared devices)."""

    name = NAME

    def __init__(
        self,
        *,
        soap_timeout: float = 2.0,
        concurrency: int = 16,
        port: int | None = None,
        ipv6: bool = True,
    ) -> None:
        self.soap_timeout = soap_timeout
        self.concurrency = concurrency
        self.port = port
        self.ipv6 = ipv6

    @property
    def shared(self) -> bool:
        return True

    def validate(self, discovery_details: str) -> Sequence[str]:
        parse_details(discovery_details)
        return warnings(discovery_details)

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        from discovery_handlers.onvif.device_query import DeviceQuerier
        from discovery_handlers.onvif.multicast import WsDiscoverySockets
        from discovery_handlers.onvif.wsdiscovery import PORT

        details = parse_details(discovery_details)
        credentials = CredentialStore.from_properties(discovery_properties)
        session = _Session(details, ProblemReporter(log))
        sockets = WsDiscoverySockets(
            details.interfaces,
            session.receive,
            port=self.port if self.port is not None else PORT,
            ipv6=self.ipv6,
        )
        await sockets.start()
        log.info(
            "onvif: discovering on %s (probe every %gs, window %gs, %d credential(s))",
            ", ".join(sockets.interfaces),
            details.probe_interval,
            details.discovery_timeout,
            len(credentials),
        )
        try:
            async with DeviceQuerier(
                credentials, timeout=self.soap_timeout, concurrency=self.concurrency
            ) as querier:
                async for devices in session.run(sockets, querier):
                    yield devices
        finally:
            sockets.close()
            session.problems.close()  # no Events from a stopped discovery


class _Session:
    """The state of one ``discover()`` call."""

    def __init__(self, details: OnvifDetails, problems: ProblemReporter) -> None:
        self.details = details
        self.problems = problems
        self.cameras: dict[str, Camera] = {}
        self.answers: dict[tuple[str, str], Answer] = {}
        self.in_flight: dict[tuple[str, str], asyncio.Task[QueryResult]] = {}
        self.pending: collections.deque[Message] = collections.deque()
        self.wake = asyncio.Event()
        self.round = 0
        self.round_start = -math.inf
        self._overflow_warned = False
        self.probe_ids: collections.deque[str] = collections.deque(maxlen=RECENT_PROBES)

    # -- messages ----------------------------------------------------------------------

    def probed(self, message_id: str) -> None:
        """A Probe with ``message_id`` went out: ProbeMatches relating to it are accepted."""
        self.probe_ids.append(_message_key(message_id))

    def receive(self, message: Message, addr: Any) -> None:
        if message.kind is Kind.PROBE:
            return
        if (
            message.kind is Kind.PROBE_MATCHES
            and _message_key(message.relates_to) not in self.probe_ids
        ):
            # not an answer to one of our Probes (WS-Discovery requires RelatesTo): whoever
            # sends it cannot have seen a Probe, which goes out on the chosen interfaces only
            log.debug("onvif: ProbeMatches from %s not relating to our Probes; ignored", addr)
            return
        if len(self.pending) >= MAX_PENDING_MESSAGES:
            if not self._overflow_warned:
                log.warning("onvif: too many WS-Discovery messages; dropping some")
                self._overflow_warned = True
            return
        self.pending.append(message)
        self.wake.set()

    def _apply(self, message: Message, now: float) -> None:
        for endpoint in message.endpoints:
            if message.kind is Kind.BYE:
                if self.cameras.pop(endpoint.uuid, None) is not None:
                    log.info("onvif: Bye from %s", endpoint.uuid)
                continue
            known = endpoint.uuid in self.cameras
            if message.kind is Kind.HELLO and not (
                endpoint.is_video_transmitter or (known and not endpoint.types)
            ):
                continue  # a printer or other WS-Discovery device
            if not endpoint.xaddrs:
                if known:
                    self.cameras[endpoint.uuid].heard = now
                continue  # Akri needs XAddrs; a Resolve is not worth it
            if not known and len(self.cameras) >= MAX_CAMERAS:
                self.problems.report(
                    "cap",
                    "DeviceCapReached",
                    f"onvif: more than {MAX_CAMERAS} cameras announce themselves; "
                    "ignoring the others",
                )
                continue
            self._update(endpoint, now, message.kind)

    def _update(self, endpoint: Endpoint, now: float, kind: Kind) -> None:
        previous = self.cameras.get(endpoint.uuid)
        scopes = endpoint.scopes
        if scopes is None and previous is not None:
            scopes = previous.scopes
        self.cameras[endpoint.uuid] = Camera(
            xaddrs=endpoint.xaddrs,
            scopes=scopes,
            metadata_version=endpoint.metadata_version,
            heard=now,
        )
        if previous is None or previous.xaddrs != endpoint.xaddrs:
            log.info("onvif: %s from %s at %s", kind.value, endpoint.uuid, endpoint.xaddrs)

    # -- candidates and queries ----------------------------------------------------------

    def _candidates(self) -> list[tuple[str, str, Camera]]:
        """(url, uuid, camera) for every camera address that passes the uuid filter."""
        found = []
        for uuid, camera in self.cameras.items():
            if not filters.passes(self.details.uuids, [uuid], filters.equal_ignoring_case):
                continue
            for url in camera.xaddrs:
                found.append((url, uuid, camera))
        return found

    def _scopes_pass(self, camera: Camera, answer: Answer | None) -> bool:
        return filters.passes(self.details.scopes, scope_values(camera, answer), filters.equal)

    def _needs_query(self, key: tuple[str, str], camera: Camera) -> bool:
        if key in self.in_flight:
            return False
        answer = self.answers.get(key)
        if answer is None:
            return True
        if answer.metadata_version != camera.metadata_version:
            return True  # a Hello or ProbeMatch announced changed metadata
        return not answer.result.offered and answer.round < self.round

    def _start_queries(self, querier: DeviceQuerier) -> None:
        wanted = set()
        for url, uuid, camera in self._candidates():
            key = (url, uuid)
            wanted.add(key)
            # scopes announced: filter before any SOAP call (as Akri does)
            if camera.scopes and not self._scopes_pass(camera, None):
                continue
            if not url.lower().startswith(("http://", "https://")):
                continue
            if self._needs_query(key, camera):
                want_scopes = self.details.scopes is not None and not camera.scopes
                task = asyncio.create_task(querier.query(url, uuid, want_scopes=want_scopes))
                task.add_done_callback(lambda _task: self.wake.set())
                self.in_flight[key] = task
        for key in list(self.in_flight):
            if key not in wanted:
                self.in_flight.pop(key).cancel()
        for key in list(self.answers):
            if key not in wanted:
                del self.answers[key]
                self.problems.resolved(_subject(key))

    def _collect(self) -> None:
        for key, task in list(self.in_flight.items()):
            if not task.done():
                continue
            del self.in_flight[key]
            if task.cancelled():
                continue
            error = task.exception()
            if error is not None:
                log.error("onvif: querying %s failed: %r", key[0], error)
                continue
            result = task.result()
            camera = self.cameras.get(key[1])
            if camera is None:
                continue
            self.answers[key] = Answer(result, camera.metadata_version, self.round)
            self._report(key, result)

    def _report(self, key: tuple[str, str], result: QueryResult) -> None:
        url, uuid = key
        if result.offered:
            if self.problems.resolved(_subject(key)):
                log.info("onvif: %s (%s) answers again", url, uuid)
            info = result.information
            log.info(
                "onvif: %s (%s) %s %s ip=%s mac=%s",
                url,
                uuid,
                info.manufacturer if info else "",
                info.model if info else "",
                result.ip,
                result.mac,
            )
            return
        # a log line and an Event per camera, again only when the problem changes or after
        # a while (the camera is asked every Probe round); the problem text is the camera's
        # answer or the transport error, never a credential
        self.problems.report(
            _subject(key),
            result.reason or "OnvifCameraNotOffered",
            f"onvif: not offering camera {uuid} at {url}: {result.problem}",
        )

    def devices(self) -> list[Device]:
        """The current full device list (sorted by id)."""
        result = []
        for url, uuid, camera in self._candidates():
            answer = self.answers.get((url, uuid))
            if answer is None or not self._scopes_pass(camera, answer):
                continue
            device = offered_device(self.details, url, uuid, answer.result)
            if device is not None:
                result.append(device)
        return sorted(result, key=lambda d: d.id)

    # -- the loop -----------------------------------------------------------------------

    async def run(self, sockets: Any, querier: DeviceQuerier) -> AsyncIterator[list[Device]]:
        loop = asyncio.get_running_loop()
        window = max(self.details.discovery_timeout, MIN_WINDOW)
        interval = max(self.details.probe_interval, window)
        next_probe = loop.time()
        round_end: float | None = None
        first_round_done = False
        last: list[Device] | None = None
        try:
            while True:
                self.wake.clear()
                now = loop.time()
                while self.pending:
                    self._apply(self.pending.popleft(), loop.time())
                # the round that ends now is judged before the next one starts: with the probe
                # interval equal to the window both fall due together, and a new round first
                # would move round_end on, so a silent camera would never be found gone
                if round_end is not None and now >= round_end:
                    for uuid in [u for u, c in self.cameras.items() if c.heard < self.round_start]:
                        log.info("onvif: %s did not answer the Probe; gone", uuid)
                        del self.cameras[uuid]
                    round_end = None
                    first_round_done = True
                if now >= next_probe:
                    self.round += 1
                    self.round_start = now
                    message_id = new_message_id()
                    self.probed(message_id)
                    sockets.probe(build_probe(message_id))
                    round_end = now + window
                    next_probe = now + interval
                self._collect()
                self._start_queries(querier)
                devices = self.devices()
                if devices != last and (devices or first_round_done):
                    last = devices
                    yield devices
                deadline = next_probe if round_end is None else min(next_probe, round_end)
                timeout = max(0.0, deadline - loop.time())
                if timeout > 0:
                    # not wait_for: on Python 3.11 it returns, and the cancellation is lost,
                    # when the wake comes with it (a stopped discovery went on for ever)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(timeout):
                            await self.wake.wait()
        finally:
            for task in self.in_flight.values():
                task.cancel()
            if self.in_flight:
                await asyncio.gather(*self.in_flight.values(), return_exceptions=True)


def _message_key(message_id: str) -> str:
    """A MessageID/RelatesTo compared without case or ``urn:``/``uuid:`` prefixes."""
    return message_id.strip().lower().removeprefix("urn:").removeprefix("uuid:")


def _subject(key: tuple[str, str]) -> str:
    url, uuid = key
    return f"{uuid} {url}"
