"""The discovery-handler interface.

A handler turns a Configuration's ``discoveryDetails`` (YAML text, opaque to the agent) and
resolved ``discoveryProperties`` into an async stream of **full** device lists: every item is
the complete current list (as in Akri's ``DiscoverResponse``), not a delta. The agent diffs
consecutive lists itself. Handlers are either embedded (a Python object implementing
:class:`DiscoveryHandler`) or external processes speaking Akri's gRPC discovery protocol;
both look the same to the agent.

A handler that skips a device it sees (a camera that does not answer, a device over the cap)
tells the user with a log line *and* a Kubernetes Event on the Configuration: it reports
through a :class:`ProblemReporter`, which reaches whatever sink the agent installed for the
task that iterates ``discover()`` (:func:`report_problems_to`), and limits the rate per device
and overall (at most :data:`BUDGET` reports a minute per Configuration, then one summary).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextvars
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field


class InvalidDiscoveryDetailsError(ValueError):
    """``discoveryDetails`` cannot be used by this handler (gRPC: InvalidArgument)."""


@dataclass(frozen=True)
class Mount:
    """A host path mounted into containers that use the device."""

    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class DeviceSpec:
    """A device node given to containers, with cgroup permissions (``r``, ``w``, ``m``)."""

    container_path: str
    host_path: str
    permissions: str = "rwm"


@dataclass(frozen=True)
class Device:
    """One discovered device. ``id`` is stable and hashed into the Instance name."""

    id: str
    properties: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    device_specs: tuple[DeviceSpec, ...] = ()


DiscoveryProperties = Mapping[str, bytes | None]


class DiscoveryHandler(abc.ABC):
    """An embedded discovery handler."""

    name: str
    """The name Configurations use in ``spec.discoveryHandler.name``."""

    @property
    @abc.abstractmethod
    def shared(self) -> bool:
        """True if devices are visible from several nodes (IP cameras), False for local ones."""

    @abc.abstractmethod
    def validate(self, discovery_details: str) -> Sequence[str] | None:
        """Raise :class:`InvalidDiscoveryDetailsError` with a clear message if unusable;
        return warnings (e.g. unknown fields that are ignored, as Akri's handlers do)."""

    @abc.abstractmethod
    def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        """Yield the full device list now and again whenever it changes."""


ProblemSink = Callable[[str, str], Awaitable[None]]
"""Records ``(reason, message)`` for the Configuration being discovered (a Kubernetes Event
with that reason, CamelCase; the message holds no secrets)."""

_problem_sink: contextvars.ContextVar[ProblemSink | None] = contextvars.ContextVar(
    "discovery_problem_sink", default=None
)


def report_problems_to(sink: ProblemSink) -> None:
    """Send the problems of handlers run by the *current task* (and the tasks it starts from
    now on) to ``sink``. The agent calls it in the task that iterates ``discover()``: a task
    has its own context, so each Configuration's problems reach its own sink."""
    _problem_sink.set(sink)


REPORT_EVERY = 300.0  # seconds: the same problem with the same device, at most this often
MAX_SUBJECTS = 4096  # devices remembered per reporter (a flood cannot grow it further)
BUDGET = 10  # problems logged (at their level) and sent as Events per reporter and window
BUDGET_WINDOW = 60.0  # seconds


class ProblemReporter:
    """A log line and an Event for a device a handler does not offer, rate-limited twice:

    - per ``subject`` (a camera, a service, "cap"): a new problem, or the same one after
      ``every`` seconds, is reported; repeats in between are logged at debug level only;
    - per reporter (one per ``discover()`` call, i.e. per Configuration): at most ``budget``
      problems are reported (logged at ``level`` and sent as Events) per ``window`` seconds.
      Beyond that they are logged at debug level, and when the window ends one summary line
      and Event (reason ``DeviceProblemsSuppressed``) says how many more devices had
      problems. So a host that floods the link with fake devices, each failing at once,
      costs at most ``budget + 1`` Events a minute, not one per fake device.

    Create it inside ``discover()`` (it takes the sink of the task that runs it) and
    :meth:`close` it when discovery stops. Never pass credentials in a message."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every: float = REPORT_EVERY,
        budget: int = BUDGET,
        window: float = BUDGET_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._label = logger.name.rsplit(".", 1)[-1]
        self._every = every
        self._budget = budget
        self._window = window
        self._clock = clock
        self._sink = _problem_sink.get()
        # subject -> (reason, message, when it was last reported), oldest first
        self._last: collections.OrderedDict[str, tuple[str, str, float]] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._window_start = -math.inf
        self._spent = 0  # problems reported in the current window
        self._held_back: set[str] = set()  # subjects not reported for want of budget
        self._summary: asyncio.TimerHandle | None = None
        self._closed = False

    def report(
        self, subject: str, reason: str, message: str, *, level: int = logging.WARNING
    ) -> bool:
        """Report a problem; True if it was logged at ``level`` and sent as an Event."""
        now = self._clock()
        last = self._last.get(subject)
        if last is not None and last[:2] == (reason, message) and now - last[2] < self._every:
            self._log.debug("%s", message)
            return False
        if now - self._window_start >= self._window:
            self._summarise()  # the window that ended (normally done by its timer already)
            self._window_start = now
            self._spent = 0
        if self._spent >= self._budget or self._closed:
            # not marked as reported: it gets its own line in a later window (if the flood
            # is over by then); counted once per subject for the summary
            self._log.debug("%s (over the budget of %d reports a window)", message, self._budget)
            if len(self._held_back) < MAX_SUBJECTS:
                self._held_back.add(subject)
            if self._summary is None and not self._closed:
                delay = max(0.0, self._window_start + self._window - now)
                self._summary = asyncio.get_running_loop().call_later(delay, self._summarise)
            return False
        self._spent += 1
        self._last[subject] = (reason, message, now)
        self._last.move_to_end(subject)
        while len(self._last) > MAX_SUBJECTS:
            self._last.popitem(last=False)
        self._log.log(level, "%s", message)
        self._send(reason, message)
        return True

    def resolved(self, subject: str) -> bool:
        """The problem with ``subject`` is over (True if there was one): the next one is
        reported at once."""
        self._held_back.discard(subject)
        return self._last.pop(subject, None) is not None

    def close(self) -> None:
        """Discovery stopped: no more Events (a pending summary is dropped, Events being
        sent are cancelled)."""
        self._closed = True
        if self._summary is not None:
            self._summary.cancel()
            self._summary = None
        for task in list(self._tasks):
            task.cancel()

    def _summarise(self) -> None:
        if self._summary is not None:
            self._summary.cancel()
            self._summary = None
        count = len(self._held_back)
        self._held_back.clear()
        if not count or self._closed:
            return
        message = (
            f"{self._label}: {count} more device(s) not offered in the last "
            f"{self._window:g} s (not reported one by one: at most {self._budget} reports "
            "a window; see the debug log)"
        )
        self._log.warning("%s", message)
        self._send("DeviceProblemsSuppressed", message)

    def _send(self, reason: str, message: str) -> None:
        if self._sink is None or self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._deliver(self._sink, reason, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, sink: ProblemSink, reason: str, message: str) -> None:
        try:
            await sink(reason, message)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # an Event is a courtesy: never fatal to discovery
            self._log.debug("could not record event %s: %r", reason, error)
