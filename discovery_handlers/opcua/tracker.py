"""Which URLs the opcua handler asks when, and which servers it offers (pure: the handler
does the calls and tells the tracker what came back).

Every URL asked is a *target*: the configured discovery URLs (asked what they list: FindServers
for ``standard``, FindServersOnNetwork for ``multicast``) and every server they listed (asked
FindServers itself: is it there, and — multicast — what is it). One URL is one target even when
it is both (a server whose own URL is configured answers once for both).

URLs are compared by :func:`~discovery_handlers.opcua.details.url_key` (scheme and host
without case, port 4840 written, no trailing slash): ``opc.tcp://plc:4840/`` and
``opc.tcp://plc`` are one target, asked once per period.

- A target that answers is asked again ``recheckIntervalSeconds`` later.
- One that cannot be reached (refused, no route, unresolvable, connect timeout) is asked again
  ``retryIntervalSeconds`` later, then twice as late after each further failure, up to
  :func:`max_backoff` (``recheckIntervalSeconds``, at least 60 s): a server that comes back is
  found within about that time, and hundreds of dead ones cost little. One that connects but
  answers nothing usable (garbage, too large, a fault, silence) is broken, not gone: asked
  again after ``recheckIntervalSeconds``.
- A server that answered is offered until it fails twice in a row (the second ask comes
  ``retryIntervalSeconds`` after the first failure), so one lost answer does not start the
  agent's offline grace; one never seen answering is not offered.
- A configured URL that fails keeps its last list for :data:`LIST_TRUST` seconds after its last
  answer (10 minutes, how long a discovery server keeps a registration): the servers it listed
  are still asked themselves, and stay offered while they answer. Then the list is dropped,
  and its servers with it. A server no longer listed is dropped.
- At most ``maxServers`` listed servers are tracked, the first ones in the order of the
  configured URLs and their answers.
- What is kept of each server is bounded: the fields of one ``ApplicationDescription`` that
  are used (:func:`~discovery_handlers.opcua.servers.trimmed`), never a whole answer.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from discovery_handlers.base import Device
from discovery_handlers.opcua.details import MULTICAST, OpcuaDetails, host_problem, url_key
from discovery_handlers.opcua.servers import (
    Application,
    Listed,
    device_of,
    own_application,
    trimmed,
    wanted,
)

FAILURES_BEFORE_GONE = 2
LIST_TRUST = 600.0  # seconds a discovery URL's last list is kept after its last answer
MIN_MAX_BACKOFF = 60.0  # an unreachable target is asked at least this often (or every period)


def trimmed_or_none(application: Application | None) -> Application | None:
    return trimmed(application) if application is not None else None


def max_backoff(details: OpcuaDetails) -> float:
    """The longest wait before an unreachable target is asked again."""
    return max(details.recheck_interval, MIN_MAX_BACKOFF, details.retry_interval)


class Failure(enum.Enum):
    """How a call failed, which decides when it is made again."""

    UNREACHABLE = "unreachable"  # no connection: asked again after the retry interval
    BROKEN = "broken"  # connected, nothing usable came back: after the recheck interval


class Call(enum.Enum):
    """What a target is asked."""

    FIND_SERVERS = "FindServers"
    FIND_SERVERS_ON_NETWORK = "FindServersOnNetwork"


@dataclass(eq=False)
class Target:
    """One URL and what it last said."""

    url: str
    configured: bool
    call: Call
    due: float
    up: bool | None = None  # None until its first answer or failure
    failures: int = 0  # in a row
    in_flight: bool = False
    listing: tuple[Listed, ...] | None = None  # configured: the servers of its last answer
    answered_at: float = -math.inf  # when it last answered
    backoff: float = 0.0  # seconds before the next ask while it cannot be reached
    # what it says of itself (multicast: what is offered), trimmed; not its whole answer
    itself: Application | None = None


class Tracker:
    """The targets of one ``discover()`` call."""

    def __init__(self, details: OpcuaDetails, now: float) -> None:
        self.details = details
        call = Call.FIND_SERVERS_ON_NETWORK if details.method == MULTICAST else Call.FIND_SERVERS
        # a configured URL whose host is not a host name costs itself (the handler warns)
        self.configured = [url for url in details.discovery_urls if host_problem(url) is None]
        self.targets: dict[str, Target] = {
            url_key(url): Target(url, configured=True, call=call, due=now)
            for url in self.configured
        }
        self.listed: list[Listed] = []  # the tracked servers, in order
        self.over_cap = 0  # listed servers beyond maxServers (not tracked)
        # bumped whenever what devices() returns may have changed (a server answering again
        # and again changes nothing: the list is not rebuilt for every answer)
        self.version = 0

    # -- scheduling ---------------------------------------------------------------------------
    def take_due(self, now: float) -> list[Target]:
        """The targets to ask now (marked in flight until :meth:`answered`/:meth:`failed`)."""
        due = [t for t in self.targets.values() if not t.in_flight and t.due <= now]
        for target in due:
            target.in_flight = True
        return due

    def next_due(self) -> float:
        """When the next target not in flight is due, or a kept list expires (``inf`` if
        neither)."""
        due = min((t.due for t in self.targets.values() if not t.in_flight), default=math.inf)
        return min(due, self._next_expiry())

    def _next_expiry(self) -> float:
        return min(
            (
                t.answered_at + LIST_TRUST
                for t in self.targets.values()
                if t.configured and t.listing and t.up is False
            ),
            default=math.inf,
        )

    def expire(self, now: float) -> None:
        """Drop the lists of configured URLs that have not answered for :data:`LIST_TRUST`
        seconds (and the servers only they listed)."""
        stale = [
            t
            for t in self.targets.values()
            if t.configured and t.listing and t.up is False and now >= t.answered_at + LIST_TRUST
        ]
        for target in stale:
            target.listing = None
        if stale:
            self.version += 1
            self._sync(now)

    def settled(self) -> bool:
        """Every target was asked at least once and nothing is in flight."""
        return all(t.up is not None and not t.in_flight for t in self.targets.values())

    def current(self, target: Target) -> bool:
        """Is ``target`` still tracked (a server no longer listed is dropped while asked)?"""
        return self.targets.get(url_key(target.url)) is target

    # -- results -------------------------------------------------------------------------------
    def answered(
        self,
        target: Target,
        now: float,
        *,
        own: Sequence[Application] = (),
        listing: Sequence[Listed] | None = None,
    ) -> None:
        """``target`` answered: ``own`` is its FindServers answer, ``listing`` (configured
        targets) the servers it lists."""
        target.in_flight = False
        if not self.current(target):
            return
        itself = own_application(target.url, own)
        itself = trimmed(itself) if itself is not None else None
        if target.up is not True or target.itself != itself:
            self.version += 1
        target.up = True
        target.failures = 0
        target.backoff = 0.0
        target.due = now + self.details.recheck_interval
        target.answered_at = now
        target.itself = itself
        if target.configured and listing is not None:
            self.relist(target, listing, now)

    def relist(self, target: Target, listing: Sequence[Listed], now: float) -> None:
        """A configured target's list is now ``listing`` (its answer, or the same answer
        once more of its host names resolved)."""
        if not target.configured or not self.current(target):
            return
        kept = tuple(
            Listed(item.url, trimmed_or_none(item.application), item.record) for item in listing
        )
        if target.listing != kept:
            target.listing = kept
            self.version += 1
            self._sync(now)

    def failed(self, target: Target, now: float, failure: Failure) -> bool:
        """``target`` did not answer usably. True if it is now gone (it was up before)."""
        target.in_flight = False
        if not self.current(target):
            return False
        target.failures += 1
        was_up = target.up is True
        if was_up and target.failures < FAILURES_BEFORE_GONE:
            target.due = now + self.details.retry_interval  # ask again soon before giving up
            return False
        if target.up is not False:
            self.version += 1
        target.up = False
        if failure is Failure.UNREACHABLE:
            # 1, 2, 4 … retry intervals after the failures in a row, up to max_backoff
            target.backoff = min(
                target.backoff * 2 if target.backoff else self.details.retry_interval,
                max_backoff(self.details),
            )
            target.due = now + target.backoff
        else:
            target.due = now + self.details.recheck_interval
        return was_up

    def _sync(self, now: float) -> None:
        """Recompute the listed servers from the configured targets' lists; track new ones,
        drop those no longer listed."""
        listed: dict[str, Listed] = {}  # by url_key
        over = 0
        for url in self.configured:
            for item in self.targets[url_key(url)].listing or ():
                key = url_key(item.url)
                if key in listed:
                    continue
                if len(listed) >= self.details.max_servers:
                    over += 1
                    continue
                listed[key] = item
        self.listed = list(listed.values())
        self.over_cap = over
        for key, item in listed.items():
            if key not in self.targets:
                self.targets[key] = Target(
                    item.url, configured=False, call=Call.FIND_SERVERS, due=now
                )
        for key in [k for k, t in self.targets.items() if not t.configured and k not in listed]:
            del self.targets[key]

    # -- what is offered -----------------------------------------------------------------------
    def devices(self) -> list[Device]:
        """The servers offered now: listed, passing the filters, and answering themselves."""
        devices: list[Device] = []
        for item in self.listed:
            target = self.targets.get(url_key(item.url))
            if target is None or target.up is not True:
                continue
            application = item.application
            if application is None:  # multicast: what the server says of itself
                application = target.itself
                if application is None or not wanted(application, self.details.application_names):
                    continue
            devices.append(device_of(item, application))
        return devices
