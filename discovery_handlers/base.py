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
task that iterates ``discover()`` (:func:`report_problems_to`), and limits the rate per device.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextvars
import logging
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


class ProblemReporter:
    """A log line and an Event for a device a handler does not offer, rate-limited per
    ``subject`` (a camera, a service, "cap"): a new problem, or the same one after
    ``every`` seconds, is logged at ``level`` and recorded as an Event; repeats in between
    are logged at debug level only. Create it inside ``discover()`` (it takes the sink of the
    task that runs it). Never pass credentials in a message."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every: float = REPORT_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._every = every
        self._clock = clock
        self._sink = _problem_sink.get()
        # subject -> (reason, message, when it was last reported), oldest first
        self._last: collections.OrderedDict[str, tuple[str, str, float]] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def report(
        self, subject: str, reason: str, message: str, *, level: int = logging.WARNING
    ) -> bool:
        """Report a problem; True if it was logged at ``level`` and sent as an Event."""
        now = self._clock()
        last = self._last.get(subject)
        if last is not None and last[:2] == (reason, message) and now - last[2] < self._every:
            self._log.debug("%s", message)
            return False
        self._last[subject] = (reason, message, now)
        self._last.move_to_end(subject)
        while len(self._last) > MAX_SUBJECTS:
            self._last.popitem(last=False)
        self._log.log(level, "%s", message)
        if self._sink is not None:
            task = asyncio.get_running_loop().create_task(self._send(reason, message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    def resolved(self, subject: str) -> bool:
        """The problem with ``subject`` is over (True if there was one): the next one is
        reported at once."""
        return self._last.pop(subject, None) is not None

    async def _send(self, reason: str, message: str) -> None:
        assert self._sink is not None
        try:
            await self._sink(reason, message)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # an Event is a courtesy: never fatal to discovery
            self._log.debug("could not record event %s: %r", reason, error)
