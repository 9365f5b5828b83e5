"""Which URLs the opcua handler asks when, and which servers it offers (pure: the handler
does the calls and tells the tracker what came back).

Every URL asked is a *target*: the configured discovery URLs (asked what they list: FindServers
for ``standard``, FindServersOnNetwork for ``multicast``) and every server they listed (asked
FindServers itself: is it there, and — multicast — what is it). One URL is one target even when
it is both (a server whose own URL is configured answers once for both).

- A target that answers is asked again ``recheckIntervalSeconds`` later.
- One that cannot be reached (refused, no route, unresolvable, connect timeout) is asked again
  ``retryIntervalSeconds`` later, so a server that comes back is found within about that time,
  not a full period later. One that connects but answers nothing usable (garbage, too large, a
  fault, silence) is broken, not gone: asked again after ``recheckIntervalSeconds``.
- A server that answered is offered until it fails twice in a row (the second ask comes
  ``retryIntervalSeconds`` after the first failure), so one lost answer does not start the
  agent's offline grace; one never seen answering is not offered.
- A configured URL that fails keeps its last list: the servers it listed are still asked
  themselves, and stay offered while they answer. A server no longer listed is dropped.
- At most ``maxServers`` listed servers are tracked, the first ones in the order of the
  configured URLs and their answers.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from discovery_handlers.base import Device
from discovery_handlers.opcua.details import MULTICAST, OpcuaDetails
from discovery_handlers.opcua.servers import (
    Application,
    Listed,
    device_of,
    own_application,
    wanted,
)

FAILURES_BEFORE_GONE = 2


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
    own: tuple[Application, ...] = field(default=())  # its last FindServers answer


class Tracker:
    """The targets of one ``discover()`` call."""

    def __init__(self, details: OpcuaDetails, now: float) -> None:
        self.details = details
        call = Call.FIND_SERVERS_ON_NETWORK if details.method == MULTICAST else Call.FIND_SERVERS
        self.targets: dict[str, Target] = {
            url: Target(url, configured=True, call=call, due=now) for url in details.discovery_urls
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
        """When the next target not in flight is due (``inf`` if none)."""
        return min((t.due for t in self.targets.values() if not t.in_flight), default=math.inf)

    def settled(self) -> bool:
        """Every target was asked at least once and nothing is in flight."""
        return all(t.up is not None and not t.in_flight for t in self.targets.values())

    def current(self, target: Target) -> bool:
        """Is ``target`` still tracked (a server no longer listed is dropped while asked)?"""
        return self.targets.get(target.url) is target

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
        if target.up is not True or target.own != tuple(own):
            self.version += 1
        target.up = True
        target.failures = 0
        target.due = now + self.details.recheck_interval
        target.own = tuple(own)
        if target.configured and listing is not None and target.listing != tuple(listing):
            target.listing = tuple(listing)
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
        target.due = now + (
            self.details.retry_interval
            if failure is Failure.UNREACHABLE
            else self.details.recheck_interval
        )
        return was_up

    def _sync(self, now: float) -> None:
        """Recompute the listed servers from the configured targets' lists; track new ones,
        drop those no longer listed."""
        listed: dict[str, Listed] = {}
        over = 0
        for url in self.details.discovery_urls:
            for item in self.targets[url].listing or ():
                if item.url in listed:
                    continue
                if len(listed) >= self.details.max_servers:
                    over += 1
                    continue
                listed[item.url] = item
        self.listed = list(listed.values())
        self.over_cap = over
        for url in listed:
            if url not in self.targets:
                self.targets[url] = Target(url, configured=False, call=Call.FIND_SERVERS, due=now)
        for url in [u for u, t in self.targets.items() if not t.configured and u not in listed]:
            del self.targets[url]

    # -- what is offered -----------------------------------------------------------------------
    def devices(self) -> list[Device]:
        """The servers offered now: listed, passing the filters, and answering themselves."""
        devices: list[Device] = []
        for item in self.listed:
            target = self.targets.get(item.url)
            if target is None or target.up is not True:
                continue
            application = item.application
            if application is None:  # multicast: what the server says of itself
                application = own_application(item.url, target.own)
                if application is None or not wanted(application, self.details.application_names):
                    continue
            devices.append(device_of(item, application))
        return devices
