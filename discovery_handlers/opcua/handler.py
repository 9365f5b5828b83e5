"""``opcua``: Akri's OPC UA discovery handler, asyncio, bounded against servers that misbehave.

``standard`` (Akri's): FindServers on each configured discovery URL; a plain server answers
with itself, a discovery server (LDS) with every server registered with it. ``multicast``
(ours; Akri has only a TODO): FindServersOnNetwork on discovery servers with the multicast
extension (LDS-ME), which list the servers announced with mDNS on their network. Either way,
every server found is asked FindServers itself (is it there, and for multicast: what is it)
and offered while it answers. :mod:`discovery_handlers.opcua.tracker` decides when each URL is
asked; :mod:`discovery_handlers.opcua.servers` what is offered (Akri's rules);
:mod:`discovery_handlers.opcua.transport` makes the calls (``asyncua``'s codec, one deadline per
call, bounded answers). Devices are shared. See ``docs/opcua.md``.

A server that cannot be used costs a log line and an Event on the Configuration (rate-limited
per server), never the other servers nor the agent. ``asyncua`` is imported in a worker thread
when the first Configuration runs (about a second and 40 MB), never at the agent's start.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from discovery_handlers.base import (
    Device,
    DiscoveryHandler,
    DiscoveryProperties,
    ProblemReporter,
)
from discovery_handlers.opcua.details import (
    MULTICAST,
    NAME,
    OpcuaDetails,
    host_problem,
    parse_details,
    url_key,
    warnings,
)
from discovery_handlers.opcua.servers import (
    Application,
    Listed,
    bad_hosts,
    hosts_of,
    listed_by_find_servers,
    listed_by_find_servers_on_network,
    offered,
)
from discovery_handlers.opcua.tracker import Call, Failure, Target, Tracker
from discovery_handlers.resolver import BadHostName, LookupFailed, NoSuchHost, shared_resolver

log = logging.getLogger("discovery_handlers.opcua")

CONCURRENCY = 16  # calls in flight per Configuration
RESOLUTIONS = 16  # host-name lookups at a time per Configuration (on the resolver's own
# threads, discovery_handlers/resolver.py: never the loop's default executor)
MAX_RESOLVED = 4096  # host names whose last resolution is remembered
IDLE = 3600.0  # seconds to sleep when nothing is ever due (no discovery URL)
_TRANSPORT = "discovery_handlers.opcua.transport"


@dataclass(frozen=True)
class _Answer:
    own: Sequence[Application]
    listing: Sequence[Listed] | None
    # standard, configured: the applications of the answer that may be offered (trimmed, at
    # most maxServers + 1): relisted as their host names resolve
    offered: tuple[Application, ...] | None = None


@dataclass(frozen=True)
class _Failed:
    message: str
    unreachable: bool


class OpcuaHandler(DiscoveryHandler):
    """Discovers OPC UA servers (shared devices)."""

    name = NAME

    @property
    def shared(self) -> bool:
        return True

    def validate(self, discovery_details: str) -> Sequence[str]:
        parse_details(discovery_details)
        return warnings(discovery_details)

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        details = parse_details(discovery_details)
        # asyncua's import takes about a second: not on the event loop
        transport = await asyncio.to_thread(importlib.import_module, _TRANSPORT)
        session = _Session(details, transport, ProblemReporter(log))
        log.info(
            "opcua: %s discovery on %s (recheck every %gs, retry after %gs, timeout %gs)",
            details.method,
            ", ".join(details.discovery_urls) or "no URL",
            details.recheck_interval,
            details.retry_interval,
            details.timeout,
        )
        try:
            async for devices in session.run():
                yield devices
        finally:
            await session.close()


class _Session:
    """The state of one ``discover()`` call."""

    def __init__(
        self, details: OpcuaDetails, transport: ModuleType, problems: ProblemReporter
    ) -> None:
        self.details = details
        self.transport = transport
        self.problems = problems
        self.resolver = shared_resolver()
        self.tasks: dict[asyncio.Task[_Answer | _Failed], Target] = {}
        self.calls = asyncio.Semaphore(CONCURRENCY)
        self.resolved: dict[str, bool] = {}  # host -> it resolved when last asked
        self.lookups: dict[asyncio.Task[bool | None], str] = {}  # in flight -> host
        self.looking: set[str] = set()
        self.lookup_slots = asyncio.Semaphore(RESOLUTIONS)
        # configured standard targets (by url_key): what their last answer offers
        self.offered: dict[str, tuple[Application, ...]] = {}

    async def run(self) -> AsyncIterator[list[Device]]:
        loop = asyncio.get_running_loop()
        tracker = Tracker(self.details, loop.time())
        for url in self.details.discovery_urls:
            problem = host_problem(url)
            if problem is not None:
                self.problems.report(
                    url,
                    "OpcuaServerUnreachable",
                    f"opcua: discovery URL {url}: {problem}; skipped",
                )
        last: list[Device] | None = None
        seen = -1  # the tracker's version the last list was made at
        while True:
            tracker.expire(loop.time())
            for target in tracker.take_due(loop.time()):
                self.tasks[asyncio.create_task(self._ask(target))] = target
            due = tracker.next_due()
            wait = min(IDLE, max(0.0, due - loop.time()))
            waiting: set[asyncio.Task[Any]] = {*self.tasks, *self.lookups}
            if waiting:
                done, _ = await asyncio.wait(
                    waiting, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
            else:
                await asyncio.sleep(wait)
                done = set()
            resolved = False
            for task in done:
                if task in self.lookups:
                    resolved |= self._verdict(self.lookups.pop(task), task.result())
                else:
                    self._apply(tracker, self.tasks.pop(task), task.result(), loop.time())
            if resolved:
                self._relist(tracker, loop.time())
            if last is None and (not tracker.settled() or self.lookups):
                # the first list waits for every URL's first answer and the host names they
                # list (each bounded by the timeout); later lists wait for nothing
                continue
            if tracker.version == seen:
                continue
            seen = tracker.version
            devices = tracker.devices()
            if devices != last:
                last = devices
                yield devices

    async def close(self) -> None:
        tasks: list[asyncio.Task[Any]] = [*self.tasks, *self.lookups]
        self.tasks.clear()
        self.lookups.clear()
        for task in tasks:
            task.cancel()
        self.problems.close()  # no Events from a stopped discovery
        if tasks:  # their connections close as they end (a cancelled wait is not swallowed)
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- one call ------------------------------------------------------------------------------
    async def _ask(self, target: Target) -> _Answer | _Failed:
        details = self.details
        async with self.calls:
            try:
                if target.call is Call.FIND_SERVERS_ON_NETWORK:
                    records = await self.transport.find_servers_on_network(
                        target.url,
                        details.timeout,
                        details.server_capabilities,
                        details.max_servers,
                        details.recheck_interval,
                    )
                    listing, skipped = listed_by_find_servers_on_network(
                        records, details.server_capabilities
                    )
                    self._skipped(target.url, skipped)
                    return _Answer(own=(), listing=listing)
                # a listed server of ``standard`` is asked whether it answers, not what it
                # is (its discovery server said that): its answer is not decoded
                applications: list[Application] = await self.transport.find_servers(
                    target.url,
                    details.timeout,
                    details.recheck_interval,
                    describe=target.configured or details.method == MULTICAST,
                )
            except self.transport.CallError as error:
                return _Failed(str(error), error.unreachable)
            except Exception as error:  # an answer nobody foresaw: this URL only, not discovery
                log.debug("opcua: %s: unexpected failure", target.url, exc_info=True)
                return _Failed(f"unexpected {type(error).__name__}: {str(error)[:200]}", False)
        if not target.configured:
            return _Answer(own=applications, listing=None)
        names = details.application_names
        for url in bad_hosts(applications, names):
            self.problems.report(
                url,
                "OpcuaServerUnreachable",
                f"opcua: {target.url} lists {url[:200]}, which {host_problem(url)}; skipped",
            )
        return _Answer(
            own=applications,
            listing=None,
            offered=offered(applications, names, details.max_servers),
        )

    def _listing(self, target: Target) -> list[Listed]:
        """A configured standard target's servers, from its last answer and what is known of
        their host names (one not known yet is left out until it is)."""
        applications = self.offered.get(url_key(target.url), ())
        hosts = hosts_of(applications, self.details.application_names, self.details.max_servers)
        verdicts: dict[str, bool | None] = {host: self.resolved.get(host) for host in hosts}
        listing, skipped = listed_by_find_servers(
            target.url, applications, self.details.application_names, verdicts
        )
        self._skipped(target.url, skipped)
        return listing

    def _look_up(self, hosts: list[str]) -> None:
        """Resolve ``hosts`` in the background (a host already being resolved is not asked
        twice); :meth:`_verdict` takes each answer."""
        if len(self.resolved) > MAX_RESOLVED:
            self.resolved.clear()
        for host in hosts:
            if host not in self.looking:
                self.looking.add(host)
                self.lookups[asyncio.create_task(self._resolves(host))] = host

    def _verdict(self, host: str, verdict: bool | None) -> bool:
        """Note what ``host``'s lookup said; True if a list may change. No answer keeps the
        previous verdict (a DNS hiccup does not change device ids); never known, it counts as
        not resolving (Akri's rule)."""
        self.looking.discard(host)
        before = self.resolved.get(host)
        if verdict is None:
            verdict = False if before is None else before
        self.resolved[host] = verdict
        return before != verdict

    def _relist(self, tracker: Tracker, now: float) -> None:
        """The configured targets' lists again, now that a host name's verdict changed (not
        a list no longer trusted: it comes back with the next answer)."""
        for key in self.offered:
            target = tracker.targets.get(key)
            if target is not None and target.configured and target.listing is not None:
                tracker.relist(target, self._listing(target), now)

    async def _resolves(self, host: str) -> bool | None:
        """Does ``host`` resolve (None: no answer in time, or a temporary failure)? One that
        gives no answer is not asked again before the next recheck."""
        try:
            async with self.lookup_slots:
                await self.resolver.lookup(
                    host, seconds=self.details.timeout, quiet=self.details.recheck_interval
                )
        except (BadHostName, NoSuchHost):
            return False
        except LookupFailed:
            return None
        return True

    def _skipped(self, url: str, skipped: list[str]) -> None:
        if skipped:
            log.debug(
                "opcua: %s lists %d server(s) not offered: %s",
                url,
                len(skipped),
                "; ".join(skipped[:5]),
            )

    # -- results -------------------------------------------------------------------------------
    def _apply(self, tracker: Tracker, target: Target, result: Any, now: float) -> None:
        if not tracker.current(target):  # no longer listed while it was asked
            target.in_flight = False
            return
        if isinstance(result, _Answer):
            listing = result.listing
            if result.offered is not None:
                self.offered[url_key(target.url)] = result.offered
                self._look_up(
                    hosts_of(
                        result.offered, self.details.application_names, self.details.max_servers
                    )
                )
                listing = self._listing(target)
            tracker.answered(target, now, own=result.own, listing=listing)
            if self.problems.resolved(target.url):
                log.info("opcua: %s answers again", target.url)
            if tracker.over_cap:
                self.problems.report(
                    "cap",
                    "DeviceCapReached",
                    f"opcua: more servers are listed than maxServers "
                    f"({self.details.max_servers}): only the first ones are tracked",
                )
            return
        failure = Failure.UNREACHABLE if result.unreachable else Failure.BROKEN
        gone = tracker.failed(target, now, failure)
        kind = "discovery URL" if target.configured else "server"
        if failure is Failure.BROKEN:
            reason, level = "OpcuaServerBroken", logging.WARNING
        else:
            reason = "OpcuaServerUnreachable"
            level = logging.WARNING if target.configured else logging.INFO
        if gone:
            log.debug("opcua: %s %s is gone: %s", kind, target.url, result.message)
        if target.up is False:  # one failure of a server that answered is not news yet
            self.problems.report(
                target.url, reason, f"opcua: {kind} {target.url}: {result.message}", level=level
            )
