"""``MqttHandler``: subscribe to the announcement topics and yield the full device list.

Retained announcements arrive right after subscribing; the first list waits until they have
(no message for :data:`SETTLE_QUIET` seconds, at most :data:`SETTLE_MAX`), so a device whose
retained message comes last does not start its offline grace. Later changes are yielded as
they come (bursts coalesced).

A lost broker connection ends ``discover()`` with an error: the agent keeps the last device
list (a handler error is not an empty list: the slot-safety rule) and calls ``discover()``
again with backoff (1 s, doubling, at most 60 s) — that is the reconnect. On reconnect the
retained messages rebuild the list; a device whose announcement was removed meanwhile is then
missing from a successful list, and its offline grace starts.

``aiomqtt`` (the maintained successor of ``asyncio-mqtt``) is imported only when a
Configuration uses this handler.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from discovery_handlers.base import (
    Device,
    DiscoveryHandler,
    DiscoveryProperties,
    InvalidDiscoveryDetailsError,
    ProblemReporter,
)
from discovery_handlers.mqtt.announcements import DeviceCapReached, DeviceTable, RefusedMessage
from discovery_handlers.mqtt.details import MqttDetails, parse_details, warnings
from discovery_handlers.resolver import LookupFailed, shared_resolver

log = logging.getLogger("discovery_handlers.mqtt")

SETTLE_QUIET = 0.3
SETTLE_MAX = 3.0
COALESCE = 0.02  # seconds: messages this close together make one list
LOG_EVERY = 10.0  # seconds between two log lines about refused messages


MAX_BACKOFF_QUIET = 30.0  # a broker name that gave no answer is not asked again sooner
BROKER_LOOKUP_SECONDS = 10.0  # aiomqtt's connect timeout, which the lookup is part of


async def _broker_resolves(host: str, port: int) -> None:
    try:
        await shared_resolver().lookup(host, seconds=BROKER_LOOKUP_SECONDS, quiet=MAX_BACKOFF_QUIET)
    except LookupFailed as error:
        raise BrokerUnavailableError(f"mqtt broker {host}:{port}: {error}") from None


class BrokerUnavailableError(ConnectionError):
    """The broker cannot be reached or dropped the connection."""


class _RateLimitedLog:
    """At most one line per :data:`LOG_EVERY` seconds, with the number left out."""

    def __init__(self) -> None:
        self._last = 0.0
        self._skipped = 0

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < LOG_EVERY:
            self._skipped += 1
            return
        if self._skipped:
            message += f" ({self._skipped} more refused since the last line)"
        self._last, self._skipped = now, 0
        log.warning(message, *args)


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("utf-8", "replace")


class MqttHandler(DiscoveryHandler):
    """Devices announced with retained messages on an MQTT broker (shared: every node that
    reaches the broker sees them)."""

    name = "mqtt"

    @property
    def shared(self) -> bool:
        return True

    def validate(self, discovery_details: str) -> Sequence[str] | None:
        parse_details(discovery_details)
        return warnings(discovery_details)

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        import aiomqtt

        details = parse_details(discovery_details)
        username = _text(discovery_properties.get("username"))
        password = _text(discovery_properties.get("password"))
        if password is not None and username is None:
            raise InvalidDiscoveryDetailsError(
                "mqtt: discoveryProperties has a password but no username"
            )
        table = DeviceTable(details.max_devices, details.format)
        refused = _RateLimitedLog()
        problems = ProblemReporter(log)
        try:
            # the broker's name is resolved on the resolver's own threads first: paho resolves
            # it in the loop's default executor, which a DNS server that never answers would
            # fill with stuck lookups, one per reconnect (the agent shares that executor)
            await _broker_resolves(details.host, details.port)
            async with aiomqtt.Client(
                details.host,
                details.port,
                username=username,
                password=password,
                identifier=details.client_id or f"akri-{secrets.token_hex(6)}",
                keepalive=details.keepalive,
                tls_context=_tls_context(details),
                tls_insecure=details.tls.insecure if details.tls else None,
                timeout=10,
            ) as client:
                for topic in details.topics:
                    await client.subscribe(topic, qos=1)
                subscribed = set(details.topics)
                log.info(
                    "mqtt: connected to %s:%d, subscribed to %s",
                    details.host,
                    details.port,
                    ", ".join(details.topics),
                )
                messages = client.messages.__aiter__()
                deadline = time.monotonic() + SETTLE_MAX
                quiet = SETTLE_QUIET
                first = True
                while True:
                    changed = False
                    wait: float | None = quiet if first else None
                    while True:
                        if first:
                            wait = max(0.0, min(quiet, deadline - time.monotonic()))
                        try:
                            async with asyncio.timeout(wait):
                                message = await anext(messages)
                        except TimeoutError:
                            break
                        changed |= self._apply(table, message, refused, problems)
                        wait = COALESCE  # more of a burst, then yield
                    for topic in table.watched_availability_topics() - subscribed:
                        await client.subscribe(topic, qos=1)
                        subscribed.add(topic)
                    if first or changed:
                        first = False
                        yield table.devices()
        except aiomqtt.MqttError as error:
            raise BrokerUnavailableError(
                f"mqtt broker {details.host}:{details.port}: {error}"
            ) from None
        finally:
            problems.close()  # no Events from a stopped discovery

    @staticmethod
    def _apply(
        table: DeviceTable, message: Any, refused: _RateLimitedLog, problems: ProblemReporter
    ) -> bool:
        topic = str(message.topic)
        payload = message.payload
        if isinstance(payload, str):
            payload = payload.encode()
        elif not isinstance(payload, (bytes, bytearray)):
            payload = b"" if payload is None else str(payload).encode()
        try:
            return table.apply(topic, bytes(payload))
        except DeviceCapReached:
            # a log line and an Event (then again only every few minutes while it lasts)
            problems.report(
                "cap",
                "DeviceCapReached",
                f"mqtt: more than maxDevices ({table.max_devices}) devices are announced; "
                "the others are refused (raise maxDevices in discoveryDetails, or remove "
                "announcements)",
            )
            return False
        except RefusedMessage as why:
            refused.warning("mqtt: message on %r refused: %s", topic[:200], why)
            return False


def _tls_context(details: MqttDetails) -> ssl.SSLContext | None:
    if details.tls is None:
        return None
    context = ssl.create_default_context(cafile=details.tls.ca_file)
    if details.tls.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
