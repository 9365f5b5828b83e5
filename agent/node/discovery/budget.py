"""The Instance budget of a node: at most ``limit`` discovered devices become Instances here.

Every Instance this agent serves costs memory (its cached object, discovery bookkeeping, an
instance-level device plugin with its gRPC server) and two file descriptors (the plugin's
listening socket and kubelet's connection to it). One Configuration may report 10,000 devices
(``agent.node.discovery.limits.MAX_DEVICES``), and every Configuration may: without a bound,
the DaemonSet's memory limit is crossed and the agent is OOM-killed in a loop. So the node
serves at most ``limit`` devices over all its Configurations, chosen deterministically:
Configurations in order of (namespace, name), each one's devices in order of id, until the
limit is reached. The others are left out of discovery as if not reported (an Instance this
node served for one of them is left after its offline grace, draining first while its slots
are in use), with a log line, an Event ``OverBudget`` on the Configuration, the metrics
``akri_instance_budget`` / ``akri_instances_over_budget`` and a line in ``akri status``.

The default limit comes from the measured per-Instance cost (benchmarks/instance_cost.py,
docs/performance.md): see :data:`DEFAULT_MAX_INSTANCES`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence

from agent.core.model.keys import ObjectKey
from discovery_handlers.base import Device

log = logging.getLogger("agent.discovery")

# Measured (benchmarks/instance_cost.py, results-instance-cost.json, docs/performance.md "Instance
# budget"): RSS = 46 MiB + 98.6 KiB per served Instance, 2 fds per Instance; after kubelet
# restarts (every plugin gets a new gRPC server; the old ones' memory is not all given back)
# up to 161 KiB per Instance. 1500 keeps the steady RSS at half the DaemonSet's 384 MiB limit
# (46 + 1500 x 0.096 = 190 MiB) and the worst after restarts at three quarters (282 MiB).
DEFAULT_MAX_INSTANCES = 1500
FDS_PER_INSTANCE = 2  # the plugin's listening socket + kubelet's connection to it
BASE_FDS = 256  # API/kubelet connections, watches, inotify, logs, external handlers, CL plugins


def admit(
    reports: Mapping[ObjectKey, Collection[str]], limit: int | None
) -> dict[ObjectKey, frozenset[str]]:
    """Device ids each Configuration may serve (pure): Configurations by (namespace, name),
    devices by id, the first ``limit`` in that order; None: no limit."""
    admitted: dict[ObjectKey, frozenset[str]] = {}
    remaining = limit
    for key in sorted(reports):
        ids = sorted(set(reports[key]))
        if remaining is None:
            admitted[key] = frozenset(ids)
            continue
        taken = ids[:remaining]
        remaining -= len(taken)
        admitted[key] = frozenset(taken)
    return admitted


def needed_fds(limit: int | None) -> int | None:
    """File descriptors the agent may need at ``limit`` Instances (None: unbounded)."""
    return None if limit is None else BASE_FDS + FDS_PER_INSTANCE * limit


Notice = Callable[[ObjectKey, int, int, int], None]
"""``(configuration, left out, reported, limit)`` when a Configuration's count of devices left
out changes (0: none any more)."""


class InstanceBudget:
    """The node's budget, shared by every Configuration's runner: each filters its latest
    device list through :meth:`filter`; a change that moves the cut wakes the runners whose
    admitted devices changed (registered with :meth:`register`)."""

    def __init__(self, limit: int | None, on_notice: Notice = lambda *_: None) -> None:
        self.limit = limit
        self._on_notice = on_notice
        self._reports: dict[ObjectKey, frozenset[str]] = {}
        self._admitted: dict[ObjectKey, frozenset[str]] = {}
        self._wakers: dict[ObjectKey, Callable[[], None]] = {}
        self.left_out: dict[ObjectKey, int] = {}  # Configurations with devices left out

    @property
    def over(self) -> int:
        """Devices left out over all Configurations."""
        return sum(self.left_out.values())

    def reported(self, key: ObjectKey) -> frozenset[str]:
        """The device ids ``key`` last reported (all of them, admitted or not)."""
        return self._reports.get(key, frozenset())

    def register(self, key: ObjectKey, wake: Callable[[], None]) -> None:
        """``wake`` is called when ``key``'s admitted devices change because of another
        Configuration's report."""
        self._wakers[key] = wake

    def filter(self, key: ObjectKey, devices: Sequence[Device]) -> list[Device]:
        """``devices`` (``key``'s latest list) within the budget, in their order."""
        if self.limit is None:
            return list(devices)
        ids = frozenset(d.id for d in devices)
        if self._reports.get(key) != ids:
            self._reports[key] = ids
            self._recompute(key)
        admitted = self._admitted.get(key, frozenset())
        if len(admitted) == len(ids):
            return list(devices)
        return [d for d in devices if d.id in admitted]

    def forget(self, key: ObjectKey) -> None:
        """``key`` stopped (deleted, refused): its devices no longer count."""
        self._wakers.pop(key, None)
        if self._reports.pop(key, None) is not None:
            self._recompute(None)
        self._admitted.pop(key, None)
        self.left_out.pop(key, None)

    def _recompute(self, reporting: ObjectKey | None) -> None:
        before = self._admitted
        self._admitted = admit(self._reports, self.limit)
        assert self.limit is not None
        for key, ids in self._reports.items():
            admitted = self._admitted[key]
            left = len(ids) - len(admitted)
            if left != self.left_out.get(key, 0):
                if left:
                    self.left_out[key] = left
                    log.warning(
                        "configuration %s: %d of its %d devices are left out: this node "
                        "serves at most %d instances (--max-instances); Configurations are "
                        "served in order of namespace and name, devices in order of id",
                        key,
                        left,
                        len(ids),
                        self.limit,
                    )
                else:
                    self.left_out.pop(key, None)
                    log.info(
                        "configuration %s: all %d devices are within the instance budget again",
                        key,
                        len(ids),
                    )
                self._on_notice(key, left, len(ids), self.limit)
            if key != reporting and before.get(key) != admitted:
                wake = self._wakers.get(key)
                if wake is not None:
                    wake()


def plan_fd_limit(soft: int, hard: int, needed: int | None) -> tuple[int, str | None]:
    """The soft ``RLIMIT_NOFILE`` to set and what to warn about (pure). Raised to what the
    budget needs, but never above the hard limit (only root may raise that) — then a warning
    says how many Instances fit. ``RLIM_INFINITY`` is -1."""
    unlimited = -1
    if needed is None:
        # no budget: as many as allowed
        return (hard if hard != unlimited else soft), None
    if soft == unlimited or soft >= needed:
        return soft, None
    if hard == unlimited or hard >= needed:
        return needed, None
    fits = max(0, (hard - BASE_FDS) // FDS_PER_INSTANCE)
    return hard, (
        f"the open-file limit (RLIMIT_NOFILE) is {hard} (hard), but {needed} file descriptors "
        f"may be needed for the instance budget: about {fits} instances fit; raise the "
        "limit (e.g. the container runtime's ulimit) or lower --max-instances"
    )


def ensure_fd_limit(limit: int | None) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` for ``limit`` Instances (logged; a warning
    when the hard limit is too low). Returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target, warning = plan_fd_limit(soft, hard, needed_fds(limit))
    if target != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as error:
            log.warning(
                "could not raise the open-file limit from %d to %d: %s", soft, target, error
            )
            return soft
        log.info("open-file limit raised from %d to %d (hard %d)", soft, target, hard)
    if warning is not None:
        log.warning("%s", warning)
    return target
