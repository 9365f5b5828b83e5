"""``MdnsHandler``: browse DNS-SD service types with multicast DNS and yield the full list.

``zeroconf``'s asyncio API: an ``AsyncServiceBrowser`` tells us when a service instance is
added, updated (address or TXT changed) or removed (goodbye packet, or its PTR record's TTL
ran out); each added or updated instance is resolved (``AsyncServiceInfo``, under
``resolveTimeoutSeconds``) and kept while it passes the filters. zeroconf stretches PTR TTLs
to at least 1125 s, so a kept service is also asked again when its SRV or address records
expire, and is gone if it no longer answers; an update is resolved again after RFC 6762's 1 s
cache-flush delay, so a changed address replaces the old one (docs/mdns.md). No polling:
the browser's own re-queries follow RFC 6762's backoff. The first list waits a moment for
the answers to the first queries (quiet for :data:`SETTLE_QUIET` s, at most
:data:`SETTLE_MAX` s).

Under a flood of announcements what is kept stays bounded: a name that fails the
``instanceNames`` filter is never resolved, only services that pass every filter are kept,
and at most ``2 * maxDevices`` service instances are kept or being resolved
(:data:`MAX_RESOLVING` resolutions at a time); beyond that, new names wait in a backlog (at
most :data:`MAX_BACKLOG`, oldest first; a log line and an Event, ``DeviceCapReached``) and
are resolved when a slot frees (zeroconf reports a name only once). A kept service whose
records expired is gone only after :data:`RECHECK_ATTEMPTS` unanswered resolutions.

zeroconf's cache is read through calls outside its documented API (``DNSCache`` lookups,
record expiry, removing a record); if they change, a warning is logged once and a kept
service is asked again every :data:`FALLBACK_RECHECK` s instead.

``zeroconf`` is imported only when a Configuration uses this handler.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from discovery_handlers.base import (
    Device,
    DiscoveryHandler,
    DiscoveryProperties,
    ProblemReporter,
)
from discovery_handlers.mdns.details import MdnsDetails, parse_details, warnings
from discovery_handlers.mdns.services import Service, decode_txt, device_of, name_wanted, wanted

log = logging.getLogger("discovery_handlers.mdns")

SETTLE_QUIET = 0.5
SETTLE_MAX = 2.0
COALESCE = 0.05
LOG_EVERY = 10.0
MAX_LOG_KEYS = 1024  # rate-limit keys remembered (a flood of names cannot grow it further)
MAX_RESOLVING = 32  # resolutions at a time (each one sends mDNS queries)
CACHE_FLUSH_SECONDS = 1.1  # RFC 6762 §10.2: superseded records linger 1 s
EXPIRY_MARGIN = 0.2  # seconds after a record's expiry before asking again
MIN_RECHECK = 1.0  # seconds: never sooner (a record expired but not yet cleaned gives 0)
FALLBACK_RECHECK = 60.0  # seconds, when zeroconf's cache cannot tell (its API changed)
RECHECK_ATTEMPTS = 3  # unanswered resolutions before a service with expired records is gone
RECHECK_BACKOFF = 1.0  # seconds before the second attempt, doubled before each next one
MAX_BACKLOG = 1024  # names over the cap waiting for a slot (oldest first)


class MdnsHandler(DiscoveryHandler):
    """Services announced with mDNS (shared: every node on the link sees them)."""

    name = "mdns"

    def __init__(self) -> None:
        self._last_log: collections.OrderedDict[str, float] = collections.OrderedDict()

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
            self._last_log.move_to_end(key)
            while len(self._last_log) > MAX_LOG_KEYS:
                self._last_log.popitem(last=False)
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
        problems = ProblemReporter(log)
        # only services that pass the filters; with the ones being resolved, at most
        # ``tracked_limit`` names (the cap truncates by name, so keep some beyond it)
        services: dict[str, Service] = {}
        resolving: dict[str, asyncio.Task[None]] = {}
        # names seen while every slot was taken: zeroconf reports a name once ("Added"), so
        # they are resolved when a slot frees instead of being lost (name -> service type)
        backlog: collections.OrderedDict[str, str] = collections.OrderedDict()
        tracked_limit = 2 * details.max_devices
        resolved = asyncio.Event()
        resolutions = asyncio.Semaphore(MAX_RESOLVING)
        timeout_ms = int(details.resolve_timeout * 1000)

        rechecks: dict[str, asyncio.TimerHandle] = {}  # name -> when its records expire

        def forget(name: str) -> None:
            services.pop(name, None)
            timer = rechecks.pop(name, None)
            if timer is not None:
                timer.cancel()

        async def resolve_once(service_type: str, name: str) -> Any:
            async with resolutions:
                info = AsyncServiceInfo(service_type, name)
                answered = await info.async_request(zc.zeroconf, timeout_ms)
            return info if answered else None

        def keep(service_type: str, name: str, info: Any) -> None:
            service, dropped = _service(info, service_type, name)
            if dropped:
                self._rate_limited(
                    "txt", "mdns: %r: %s (dropped)", name[:200], "; ".join(dropped)[:500]
                )
            if service is None:
                self._rate_limited(
                    "bad", "mdns: %r has no host, port or address; skipped", name[:200]
                )
                forget(name)
            elif not wanted(service, details):
                forget(name)  # filtered out (now): not kept
            else:
                services[name] = service
                # zeroconf's browser reports a service gone only when its PTR record
                # expires, and it stretches that TTL to at least 1125 s; so when the SRV or
                # address records run out, ask again (RFC 6762 §5.2): no answer means gone
                timer = rechecks.pop(name, None)
                if timer is not None:
                    timer.cancel()
                expiry = _recheck_in(zc.zeroconf.cache, name, info.server)
                rechecks[name] = loop.call_later(
                    expiry + EXPIRY_MARGIN,
                    events.put_nowait,
                    (service_type, name, _EXPIRED),
                )

        def gone(service_type: str, name: str) -> None:
            log.info("mdns: %r does not answer now that its records expired; gone", name[:200])
            forget(name)
            # its PTR record would stay cached for up to 1125 s, and a re-announcement of
            # a cached record is no news to the browser: drop it, so a return is "Added"
            try:
                cache = zc.zeroconf.cache
                pointer = cache.current_entry_with_name_and_alias(service_type, name)
                if pointer is not None:
                    cache.async_remove_records([pointer])
            except (AttributeError, TypeError) as error:
                _private_api_failed(
                    "DNSCache.current_entry_with_name_and_alias/async_remove_records", error
                )
            except Exception as error:  # a courtesy to a returning service: never fatal
                log.debug("mdns: could not drop %r's cached PTR record: %r", name[:200], error)

        async def resolve(service_type: str, name: str, change: object) -> None:
            try:
                # a kept service whose records expired: one missed answer (a lost datagram,
                # a busy host) is not "gone"; ask again with backoff while it is still kept
                info = await answer_within(
                    RECHECK_ATTEMPTS if change is _EXPIRED else 1,
                    lambda: resolve_once(service_type, name),
                    lambda: name in services,
                )
                if info is None and change is _EXPIRED and name not in services:
                    return  # removed meanwhile (goodbye)
                if info is None:
                    if change is _EXPIRED:
                        gone(service_type, name)
                    else:
                        self._rate_limited("resolve", "mdns: %r did not resolve", name[:200])
                    return
                keep(service_type, name, info)
                if change is ServiceStateChange.Updated:
                    # RFC 6762 §10.2: records replaced by a cache-flush answer stay cached for
                    # one more second (zeroconf says nothing when they go): look again then,
                    # so a changed address replaces the old one instead of joining it
                    resolved.set()
                    await asyncio.sleep(CACHE_FLUSH_SECONDS)
                    info = await resolve_once(service_type, name)
                    if info is not None:
                        keep(service_type, name, info)
            finally:
                resolved.set()

        def tracked() -> int:
            return len(services) + sum(1 for other in resolving if other not in services)

        def track(service_type: str, name: str, change: object) -> None:
            if not name_wanted(name, service_type, details):
                return  # filtered out by its name: not worth a resolution or a slot
            previous = resolving.pop(name, None)
            if previous is not None:
                previous.cancel()
            elif change is _EXPIRED and name not in services:
                return  # removed meanwhile
            elif name not in services and tracked() >= tracked_limit:
                if name not in backlog and len(backlog) < MAX_BACKLOG:
                    backlog[name] = service_type
                problems.report(
                    "cap:announced",  # not the list's cap (below): alternating, each would
                    "DeviceCapReached",  # end the other's quiet time and both repeat
                    f"mdns: more than {tracked_limit} service instances (2 x maxDevices) are "
                    f"announced; new ones wait (at most {MAX_BACKLOG}) and are resolved when "
                    "a slot frees",
                )
                return
            backlog.pop(name, None)
            task = asyncio.create_task(resolve(service_type, name, change))
            resolving[name] = task

            def finished(done: asyncio.Task[None]) -> None:
                if resolving.get(name) is done:  # not replaced by a newer resolution
                    del resolving[name]
                    if backlog:
                        resolved.set()  # a slot may be free: the loop refills

            task.add_done_callback(finished)

        def refill() -> None:
            while backlog and tracked() < tracked_limit:
                name, service_type = backlog.popitem(last=False)
                track(service_type, name, ServiceStateChange.Added)

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
                            forget(name)
                            backlog.pop(name, None)
                            task = resolving.pop(name, None)
                            if task is not None:
                                task.cancel()
                        else:  # Added, Updated or its records expired: (re-)resolve
                            track(service_type, name, change)
                    refill()
                    wait = COALESCE
                if first:
                    # the services announced so far: their resolution (bounded) belongs in
                    # the first list too
                    pending = [t for t in resolving.values() if not t.done()]
                    if pending:
                        await asyncio.wait(pending, timeout=details.resolve_timeout)
                devices = self._devices(services, details, problems)
                if first or devices != last:
                    first = False
                    last = devices
                    yield devices
        finally:
            for task in list(resolving.values()):
                task.cancel()
            for timer in rechecks.values():
                timer.cancel()
            with contextlib.suppress(Exception):
                await browser.async_cancel()
            with contextlib.suppress(Exception):
                await zc.async_close()
            problems.close()  # no Events from a stopped discovery

    def _devices(
        self, services: dict[str, Service], details: MdnsDetails, problems: ProblemReporter
    ) -> list[Device]:
        kept = sorted((s for s in services.values() if wanted(s, details)), key=lambda s: s.name)
        if len(kept) > details.max_devices:
            # a log line and an Event (then again only every few minutes while it lasts)
            problems.report(
                "cap:offered",
                "DeviceCapReached",
                f"mdns: more services pass the filters than maxDevices ({details.max_devices}):"
                f" only the first {details.max_devices} by name are offered",
            )
            kept = kept[: details.max_devices]
        return [device_of(s) for s in kept]


_RESOLVED = object()
_EXPIRED = object()  # a kept service's SRV or address records ran out of TTL

# DNS record types and class (RFC 1035, RFC 3596, RFC 2782)
_TYPE_A, _TYPE_AAAA, _TYPE_SRV, _CLASS_IN = 1, 28, 33, 1


async def answer_within(
    attempts: int,
    ask: Callable[[], Awaitable[Any]],
    still_wanted: Callable[[], bool],
    backoff: float = RECHECK_BACKOFF,
) -> Any:
    """``ask()`` up to ``attempts`` times until it answers (not None), waiting ``backoff``
    seconds before the second attempt and twice as long before each next one; stops early
    (None) when ``still_wanted()`` turns false."""
    answer = await ask()
    for _ in range(attempts - 1):
        if answer is not None:
            break
        await asyncio.sleep(backoff)
        backoff *= 2
        if not still_wanted():
            return None
        answer = await ask()
    return answer


def recheck_delay(expiries_ms: Sequence[float], now_ms: float) -> float:
    """Seconds until a kept service is asked again: when the first of its cached SRV and
    address records that has not expired yet expires (records already expired but not yet
    cleaned from zeroconf's cache do not count), at least :data:`MIN_RECHECK`;
    :data:`FALLBACK_RECHECK` when nothing is cached for it."""
    if not expiries_ms:
        return FALLBACK_RECHECK
    future = [expiry for expiry in expiries_ms if expiry > now_ms]
    if not future:
        return MIN_RECHECK
    return max(MIN_RECHECK, (min(future) - now_ms) / 1000)


_private_api_warned: set[str] = set()


def _private_api_failed(what: str, error: Exception) -> None:
    """zeroconf changed an API outside its documented one: say so once per process."""
    level = logging.DEBUG if what in _private_api_warned else logging.WARNING
    _private_api_warned.add(what)
    log.log(
        level,
        "mdns: zeroconf's %s does not work as expected (%r): services are asked again every "
        "%g s instead of when their records expire, and one that left without goodbye may "
        "be found late",
        what,
        error,
        FALLBACK_RECHECK,
    )


def _recheck_in(cache: Any, name: str, server: str | None) -> float:
    """:func:`recheck_delay` for a service, from zeroconf's cache (outside its documented
    API: on AttributeError/TypeError, logged once, :data:`FALLBACK_RECHECK`)."""
    from zeroconf import current_time_millis

    try:
        records = [cache.get_by_details(name, _TYPE_SRV, _CLASS_IN)]
        if server:
            records += cache.get_all_by_details(server, _TYPE_A, _CLASS_IN)
            records += cache.get_all_by_details(server, _TYPE_AAAA, _CLASS_IN)
        expiries = [
            float(record.get_expiration_time(100)) for record in records if record is not None
        ]
    except (AttributeError, TypeError) as error:
        _private_api_failed("DNSCache.get_by_details/get_all_by_details", error)
        return FALLBACK_RECHECK
    return recheck_delay(expiries, float(current_time_millis()))


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


def _service(info: Any, service_type: str, name: str) -> tuple[Service | None, list[str]]:
    """The resolved service (None without host, port or address) and why TXT entries were
    dropped (the caller logs that, rate-limited)."""
    host = info.server or ""
    port = info.port
    addresses = tuple(info.parsed_addresses())
    if not host or not port or not addresses:
        return None, []
    txt, dropped = decode_txt(info.properties or {})
    service = Service(name, service_type, host.rstrip(".") + ".", int(port), addresses, txt)
    return service, list(dropped)


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
            try:
                ipaddress.ip_address(item)
            except ValueError:
                raise OSError(f"mdns: no interface named {item!r} on this node") from None
            addresses.append(item)  # an address
            continue
        addresses += [ip.ip for ip in adapter.ips if isinstance(ip.ip, str)]
    if not addresses:
        raise OSError(f"mdns: interfaces {list(details.interfaces)} have no IPv4 address")
    return addresses
