"""Host-name lookups for the discovery handlers, on threads of their own.

``loop.getaddrinfo`` (and everything built on it: ``asyncio.open_connection`` with a name,
aiohttp's default resolver, paho's ``connect``) runs the blocking ``getaddrinfo`` in the
loop's *default* executor, which the whole agent shares (store reads and writes, Allocate,
the slice publisher). ``asyncio.timeout`` cancels the await, not the thread: with a DNS server
that never answers, every lookup leaves a thread stuck for the C library's own timeout, and
the default executor fills with them. Here:

- lookups run on at most :data:`THREADS` daemon threads of their own (a stuck one never
  holds back the agent's other work, nor its exit), and at most :data:`MAX_QUEUED` wait for
  one while they are all busy: beyond that a lookup fails at once (:class:`LookupTimeout`)
  rather than queueing for ever;
- a host already being looked up is not looked up again: callers share the one answer;
- a host whose lookup gave no answer in time is not asked again for ``quiet`` seconds (the
  caller's recheck interval): callers get :class:`LookupTimeout` at once meanwhile;
- a name that cannot be a host name (not IDNA-encodable: an empty label as in
  ``plc..local``, a label over 63 characters) is :class:`BadHostName` before anything is
  asked (``getaddrinfo`` raises ``UnicodeError``, a ``ValueError``, for those).

Every failure is a :class:`LookupFailed`; nothing else escapes :meth:`Resolver.lookup`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

# lookups in flight at a time, process-wide (threads are started as needed, and stay): enough
# that names which answer are not queued behind the ones a silent DNS server holds (each
# holds a thread for the C library's timeout, resolv.conf's timeout times attempts)
THREADS = 64
MAX_QUEUED = 512  # lookups waiting for a thread
MAX_QUIET = 4096  # hosts remembered as not answering

Address = tuple[int, str]  # (family, address)


class LookupFailed(Exception):
    """A host name that gave no address; ``str()`` names it and says why (``reason``: why,
    without the name)."""

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"{host[:200]!r} {reason}")
        self.reason = reason


class BadHostName(LookupFailed):
    """Not a host name at all (not IDNA-encodable)."""


class NoSuchHost(LookupFailed):
    """The resolver answered: no such name (or no address for it)."""


class LookupTimeout(LookupFailed):
    """No answer in time (or the resolver is busy with names that do not answer)."""


def is_ip_literal(host: str) -> bool:
    """An IPv4 or IPv6 address (no lookup needed)."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def host_name_problem(host: str) -> str | None:
    """Why ``host`` cannot be looked up (None if it can): ``getaddrinfo`` would raise
    ``UnicodeError`` encoding it."""
    if is_ip_literal(host):
        return None
    try:
        host.encode("idna")
    except UnicodeError as error:
        return f"is not a valid host name ({error})"
    return None


_Job = tuple[str, int, "Future[list[Address]]"]


class Resolver:
    """``getaddrinfo`` on a few daemon threads of its own (see the module's docstring)."""

    def __init__(
        self,
        threads: int = THREADS,
        max_queued: int = MAX_QUEUED,
        lookup: Callable[[str, int], list[Address]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threads = threads
        self._max_queued = max_queued
        self._lookup = lookup or _getaddrinfo
        self._clock = clock
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._starting = 0  # threads started that have not taken a job yet
        self._idle = 0
        self._busy = 0  # threads running a lookup
        self._queued = 0  # lookups no thread has taken yet
        self._pending: dict[tuple[str, int], Future[list[Address]]] = {}
        self._quiet_until: dict[str, float] = {}  # host -> when it may be asked again

    def in_flight(self) -> int:
        """Lookups submitted and not yet answered (stuck ones included)."""
        with self._lock:
            return len(self._pending)

    async def lookup(
        self, host: str, *, seconds: float, quiet: float = 0.0, port: int = 0
    ) -> list[Address]:
        """The addresses of ``host`` (an IP literal is its own), within ``seconds``.
        A host that gives no answer in time is not asked again for ``quiet`` seconds."""
        if is_ip_literal(host):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return [(family, host)]
        problem = host_name_problem(host)
        if problem is not None:
            raise BadHostName(host, problem)
        now = self._clock()
        until = self._quiet_until.get(host)
        if until is not None:
            if now < until:
                raise LookupTimeout(
                    host,
                    f"did not resolve within {seconds:g} s when last asked "
                    f"(asked again in {until - now:.0f} s)",
                )
            del self._quiet_until[host]
        future = self._submit(host, port)
        if future is None:
            raise LookupTimeout(host, "waits behind too many host names being resolved")
        try:
            async with asyncio.timeout(seconds):
                return await _waiter(future)
        except TimeoutError:
            if quiet > 0:
                if len(self._quiet_until) >= MAX_QUIET:
                    self._quiet_until.clear()
                self._quiet_until[host] = self._clock() + quiet
            raise LookupTimeout(host, f"did not resolve within {seconds:g} s") from None
        except socket.gaierror as error:
            if error.errno == socket.EAI_AGAIN:
                raise LookupTimeout(host, f"did not resolve ({error.strerror or error})") from None
            raise NoSuchHost(host, f"does not resolve ({error.strerror or error})") from None
        except (OSError, ValueError) as error:
            raise LookupFailed(host, f"does not resolve ({error})") from None

    def _submit(self, host: str, port: int) -> Future[list[Address]] | None:
        with self._lock:
            key = (host, port)
            future = self._pending.get(key)
            if future is not None:
                return future
            # jobs the free and not yet started threads will take do not count as waiting
            if self._queued >= self._max_queued + self._threads - self._busy:
                return None
            future = Future()
            self._pending[key] = future
            self._queued += 1
            # one thread per job no idle (or starting) thread will take: an idle thread may
            # take an older job, and a job left without a thread behind stuck lookups would
            # wait for ever
            if self._queued > self._idle + self._starting and self._started < self._threads:
                self._started += 1
                self._starting += 1
                threading.Thread(target=self._work, name="akri-resolver", daemon=True).start()
        self._jobs.put((host, port, future))
        return future

    def _work(self) -> None:
        with self._lock:
            self._starting -= 1
            self._idle += 1
        while True:
            host, port, future = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
                self._busy += 1
            try:
                result = self._lookup(host, port)
            except BaseException as error:  # handed to the waiting coroutine
                outcome: list[Address] | BaseException = error
            else:
                outcome = result
            with self._lock:
                self._pending.pop((host, port), None)
                self._busy -= 1
                self._idle += 1
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)


def _waiter(future: Future[list[Address]]) -> asyncio.Future[list[Address]]:
    """An asyncio future with ``future``'s outcome; cancelling it leaves ``future`` (which
    others may share) alone."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[list[Address]] = loop.create_future()

    def copy(_: object) -> None:
        if waiter.done():
            return
        error = future.exception()
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(future.result())

    def done(_: Future[list[Address]]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(copy, None)

    future.add_done_callback(done)
    return waiter


def _getaddrinfo(host: str, port: int) -> list[Address]:
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[Address] = []
    for family, _type, _proto, _name, sockaddr in found:
        address = (int(family), str(sockaddr[0]))
        if address not in addresses:
            addresses.append(address)
    return addresses


_shared: Resolver | None = None


def shared_resolver() -> Resolver:
    """The process's resolver (its threads are started on first use)."""
    global _shared
    if _shared is None:
        _shared = Resolver()
    return _shared
