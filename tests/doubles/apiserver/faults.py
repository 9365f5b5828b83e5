"""Fault injection rules and the request log."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import yaml


@dataclass(frozen=True)
class RequestInfo:
    """What an API request addresses, parsed from its URL and method."""

    verb: str  # get, list, watch, create, update, patch, delete, deletecollection, or "nonresource"
    group: str = ""
    version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str | None = None
    name: str = ""

    @property
    def qualified_resource(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource


@dataclass
class RecordedRequest:
    """One request as the server saw it (for asserting what a client sent)."""

    method: str
    path: str
    query: dict[str, str]
    query_string: str
    content_type: str
    body: bytes
    headers: dict[str, str]
    info: RequestInfo
    time: float = field(default_factory=time.monotonic)
    status: int | None = None  # filled in when the response is known

    @property
    def verb(self) -> str:
        return self.info.verb

    @property
    def resource(self) -> str:
        return self.info.resource

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def namespace(self) -> str | None:
        return self.info.namespace

    def json(self) -> Any:
        """The decoded body (JSON, or YAML for apply patches); None when empty."""
        if not self.body:
            return None
        text = self.body.decode("utf-8")
        try:
            return json.loads(text)
        except ValueError:
            return yaml.safe_load(text)


def _as_set(value: str | tuple[str, ...] | list[str] | set[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset({value})
    return frozenset(value)


@dataclass(eq=False)
class Fault:
    """Make matching requests fail. ``None`` criteria match anything.

    Exactly one action applies: ``status`` (answer with that Status error), ``drop`` (close
    the connection without answering) or only ``delay`` (answer normally, late). ``delay`` can
    be combined with the others. With ``after=True`` the request is processed first (state
    changes!) and only its response is replaced, like a lost reply.

    ``hang=True`` holds matching requests until :meth:`release` (or ``delay`` seconds, if
    given), then processes them. A delayed or held request is processed even when its client
    has given up meanwhile (timed out, disconnected), like a real API server whose write
    reaches etcd after the client's deadline: ``late`` counts the requests processed after
    being held or delayed, ``held`` the requests waiting right now.
    """

    verb: frozenset[str] | None = None
    resource: frozenset[str] | None = None
    name: str | None = None
    namespace: str | None = None
    subresource: str | None = None
    status: int | None = None
    message: str | None = None
    retry_after: int | None = None
    drop: bool = False
    delay: float = 0.0
    after: bool = False
    times: int | None = 1  # None: unlimited
    until: float | None = None  # time.monotonic() deadline
    hits: int = 0
    hang: bool = False
    held: int = 0
    late: int = 0
    _released: threading.Event = field(default_factory=threading.Event, repr=False)
    _wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(
        default_factory=list, repr=False
    )

    def release(self) -> None:
        """Let the held requests through (they are processed, late) and stop holding new
        ones. Thread-safe."""
        self._released.set()
        for loop, event in list(self._wakers):
            loop.call_soon_threadsafe(event.set)

    @property
    def released(self) -> bool:
        return self._released.is_set()

    async def wait(self) -> None:
        """Hold a request for this fault's delay, or until released when it hangs."""
        if not self.hang:
            await asyncio.sleep(self.delay)
            return
        if self.released:
            return
        event = asyncio.Event()
        waker = (asyncio.get_running_loop(), event)
        self._wakers.append(waker)
        self.held += 1
        try:
            if self.released:
                return
            if self.delay:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), self.delay)
            else:
                await event.wait()
        finally:
            self.held -= 1
            self._wakers.remove(waker)

    @property
    def active(self) -> bool:
        if self.hang and self.released:
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        return self.until is None or time.monotonic() < self.until

    def matches(self, info: RequestInfo) -> bool:
        if not self.active:
            return False
        if self.verb is not None and info.verb not in self.verb:
            return False
        if self.resource is not None and not (
            {info.resource, info.qualified_resource} & self.resource
        ):
            return False
        if self.name is not None and info.name != self.name:
            return False
        if self.namespace is not None and info.namespace != self.namespace:
            return False
        return self.subresource is None or info.subresource == self.subresource


class FaultInjector:
    """The ordered fault rules of a server; the first active matching rule wins."""

    def __init__(self) -> None:
        self.rules: list[Fault] = []

    def add(
        self,
        *,
        verb: str | tuple[str, ...] | list[str] | None = None,
        resource: str | tuple[str, ...] | list[str] | None = None,
        name: str | None = None,
        namespace: str | None = None,
        subresource: str | None = None,
        status: int | None = None,
        message: str | None = None,
        retry_after: int | None = None,
        drop: bool = False,
        delay: float = 0.0,
        after: bool = False,
        times: int | None = 1,
        duration: float | None = None,
        hang: bool = False,
    ) -> Fault:
        if status is None and not drop and not delay and not hang:
            raise ValueError("a fault needs status=, drop=True, delay= or hang=True")
        fault = Fault(
            verb=_as_set(verb),
            resource=_as_set(resource),
            name=name,
            namespace=namespace,
            subresource=subresource,
            status=status,
            message=message,
            retry_after=retry_after,
            drop=drop,
            delay=delay,
            after=after,
            times=times,
            until=time.monotonic() + duration if duration is not None else None,
            hang=hang,
        )
        self.rules.append(fault)
        return fault

    def take(self, info: RequestInfo) -> Fault | None:
        """The first matching rule, counted as used."""
        for fault in self.rules:
            if fault.matches(info):
                fault.hits += 1
                return fault
        return None

    def clear(self) -> None:
        for fault in self.rules:
            if fault.hang:
                fault.release()  # nothing stays held by a rule nobody can reach any more
        self.rules.clear()
