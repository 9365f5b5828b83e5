"""``MdnsHandler``: browse DNS-SD service types with multicast DNS and yield the full list.

``zeroconf``'s asyncio API: an ``AsyncServiceBrowser`` tells us when a service instance is
added, updated (address or TXT changed) or removed (goodbye packet, or its records' TTL ran
out); each added or updated instance is resolved (``AsyncServiceInfo``, under
``resolveTimeoutSeconds``) and kept while it passes the filters. No polling: the browser's own
re-queries follow RFC 6762's backoff. The first list waits a moment for the answers to the
first queries (quiet for :data:`SETTLE_QUIET` s, at most :data:`SETTLE_MAX` s).

``zeroconf`` is imported only when a Configuration uses this handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from discovery_handlers.base import Device, DiscoveryHandler, DiscoveryProperties
from discovery_handlers.mdns.details import MdnsDetails, parse_details, warnings
from discovery_handlers.mdns.services import Service, decode_txt, device_of, wanted

log = logging.getLogger("discovery_handlers.mdns")

SETTLE_QUIET = 0.5
SETTLE_MAX = 2.0
COALESCE = 0.05
LOG_EVERY = 10.0


class MdnsHandler(DiscoveryHandler):
    """Services announced with mDNS (shared: every node on the link sees them)."""

    name = "mdns"

    def __init__(self) -> None:
        self._last_log: dict[str, float] = {}

    @property
    def shared(self) -> bool:
        return True

    def validate(self, discovery_details: str) -> Sequence[str] | None:
        parse_details(discovery_details)
        return warnings(discovery_details)

    def _rate_limited(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -LOG_EVERY) >= LOG_EVERY:
            self._last_log[key] = now
            log.warning(message, *args)

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        from zeroconf import IPVersion, ServiceStateChange
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

        details = parse_details(discovery_details)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, str, Any]] = asyncio.Queue()

        def on_change(zeroconf: Any, service_type: str, name: str, state_change: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (service_type, name, state_change))

        interfaces = _interfaces(details)
        zc = AsyncZeroconf(
            interfaces=interfaces,
            ip_version=IPVersion.V4Only if details.interfaces else IPVersion.All,
        )
        services: dict[str, Service] = {}
        resolving: dict[str, asyncio.Task[None]] = {}
        resolved = asyncio.Event()

        async def resolve(service_type: str, name: str) -> None:
            info = AsyncServiceInfo(service_type, name)
            timeout_ms = int(details.resolve_timeout * 1000)
            if not await info.async_request(zc.zeroconf, timeout_ms):
                self._rate_limited(f"resolve {name}", "mdns: %r did not resolve", name[:200])
                return
            service = _service(info, service_type, name)
            if service is None:
                self._rate_limited(
                    f"bad {name}", "mdns: %r has no host, port or address; skipped", name[:200]
                )
                services.pop(name, None)
            else:
                services[name] = service
            resolved.set()

        browser = AsyncServiceBrowser(
            zc.zeroconf, list(details.service_types), handlers=[on_change]
        )
        try:
            first = True
            deadline = time.monotonic() + SETTLE_MAX
            last: list[Device] | None = None
            while True:
                wait: float | None = SETTLE_QUIET if first else None
                while True:
                    if first:
                        wait = max(0.0, min(SETTLE_QUIET, deadline - time.monotonic()))
                    got = await _next_event(events, resolved, wait)
                    if got is None:
                        break
                    if got is not _RESOLVED:
                        service_type, name, change = got
                        if change is ServiceStateChange.Removed:
                            services.pop(name, None)
                            task = resolving.pop(name, None)
                            if task is not None:
                                task.cancel()
                        else:  # Added or Updated: (re-)resolve
                            previous = resolving.get(name)
                            if previous is not None:
                                previous.cancel()
                            resolving[name] = asyncio.create_task(resolve(service_type, name))
                    wait = COALESCE
                if first:
                    # the services announced so far: their resolution (bounded) belongs in
                    # the first list too
                    pending = [t for t in resolving.values() if not t.done()]
                    if pending:
                        await asyncio.wait(pending, timeout=details.resolve_timeout)
                devices = self._devices(services, details)
                if first or devices != last:
                    first = False
                    last = devices
                    yield devices
        finally:
            for task in resolving.values():
                task.cancel()
            with contextlib.suppress(Exception):
                await browser.async_cancel()
            with contextlib.suppress(Exception):
                await zc.async_close()

    def _devices(self, services: dict[str, Service], details: MdnsDetails) -> list[Device]:
        kept = sorted((s for s in services.values() if wanted(s, details)), key=lambda s: s.name)
        if len(kept) > details.max_devices:
            self._rate_limited(
                "cap",
                "mdns: %d services pass the filters, more than maxDevices (%d): only the first "
                "%d (by name) are offered",
                len(kept),
                details.max_devices,
                details.max_devices,
            )
            kept = kept[: details.max_devices]
        return [device_of(s) for s in kept]


_RESOLVED = object()


async def _next_event(
    events: asyncio.Queue[tuple[str, str, Any]], resolved: asyncio.Event, wait: float | None
) -> Any:
    """The next browser event, :data:`_RESOLVED` when a resolution finished, or None when
    ``wait`` seconds passed without either."""
    if not events.empty():
        return events.get_nowait()
    if resolved.is_set():
        resolved.clear()
        return _RESOLVED
    getter = asyncio.ensure_future(events.get())
    flag = asyncio.ensure_future(resolved.wait())
    try:
        done, _pending = await asyncio.wait(
            {getter, flag}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        flag.cancel()
        if not getter.done():
            getter.cancel()
    if getter in done:
        return getter.result()
    if flag in done:
        resolved.clear()
        return _RESOLVED
    return None


def _service(info: Any, service_type: str, name: str) -> Service | None:
    host = info.server or ""
    port = info.port
    addresses = tuple(info.parsed_addresses())
    if not host or not port or not addresses:
        return None
    txt, dropped = decode_txt(info.properties or {})
    for why in dropped:
        log.warning("mdns: %r: %s (dropped)", name[:200], why)
    return Service(name, service_type, host.rstrip(".") + ".", int(port), addresses, txt)


def _interfaces(details: MdnsDetails) -> Any:
    """zeroconf's ``interfaces``: every interface, or the IPv4 addresses of those named."""
    from zeroconf import InterfaceChoice

    if not details.interfaces:
        return InterfaceChoice.All
    import ifaddr

    by_name = {a.nice_name: a for a in ifaddr.get_adapters()}
    addresses: list[str] = []
    for item in details.interfaces:
        adapter = by_name.get(item)
        if adapter is None:
            addresses.append(item)  # an address (checked by parse_details)
            continue
        addresses += [ip.ip for ip in adapter.ips if isinstance(ip.ip, str)]
    if not addresses:
        raise OSError(f"mdns: interfaces {list(details.interfaces)} have no IPv4 address")
    return addresses
