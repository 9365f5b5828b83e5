"""``ConfigurationRunner``: discovery for one Configuration on this node.

Two tasks: the *handler task* (:class:`~agent.node.discovery.handler_feed.HandlerFeed`, its own
module: handler runs, restarts with capped backoff, ``discoveryProperties``) keeps the latest
full device list, and the *reconcile task* — this module's job — turns that list into Instance
writes. Reconciling is sequential and idempotent: it is woken by a new device list, a
Configuration change, an Instance change of this Configuration, or a grace deadline, and
writes nothing when the store already matches.

Every write goes through the slot ledger (creation with the slots already in use, joins that
take the free slots this node's containers already use, spec changes that carry the slots
over, departures that wait while this node holds slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping

from agent.core.ledger.ledger import EvidenceUnavailableError, NodeNotServingError, SlotLedger
from agent.core.model.configuration import Configuration
from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import (
    AlreadyExistsError,
    InstanceStore,
    NotFoundError,
    StoreError,
)
from agent.node.discovery.budget import InstanceBudget
from agent.node.discovery.handler_feed import HandlerFeed
from agent.node.discovery.plan import (
    DesiredInstance,
    DiscoveryPlan,
    join_instance,
    new_instance,
    plan_discovery,
)
from discovery_handlers.base import Device, DiscoveryHandler

log = logging.getLogger("agent.discovery")

MAX_RECONCILE_BACKOFF = 30.0
EVIDENCE_RETRY = (0.5, 30.0)  # first and longest wait before retrying unreadable evidence
EVIDENCE_LOG_INTERVAL = 60.0  # one log line per Instance at most this often
# an Instance this node drains that left its view (deleted; re-created, maybe, by a node that
# could not see this node's slots, so it carries no label of this node): read by name, with
# this backoff, for this long after it left
UNSEEN_RETRY = (0.5, 30.0)
UNSEEN_FOLLOW_LIMIT = 300.0


class NameTakenError(Exception):
    """The Instance of a planned name is another device's or another Configuration's."""

    def __init__(self, instance: Instance) -> None:
        super().__init__(f"instance {instance.key} belongs to another device")
        self.instance = instance


class NamespaceInstances(Mapping[str, Instance]):
    """The cached Instances of one namespace, by name (lookups without copying the cache),
    and ``taken``: Instances this node's watch does not show that it found holding a name
    another device's digest gave (read by name when it tried to join them)."""

    def __init__(
        self, store: InstanceStore, namespace: str, taken: Mapping[str, Instance] | None = None
    ) -> None:
        self._store = store
        self._namespace = namespace
        self._taken = taken or {}

    def __getitem__(self, name: str) -> Instance:
        found = self._store.get_cached(ObjectKey(self._namespace, name))
        if found is None:
            found = self._taken.get(name)
        if found is None:
            raise KeyError(name)
        return found

    def __iter__(self) -> Iterator[str]:
        return (i.name for i in self._store.list_cached() if i.namespace == self._namespace)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class ConfigurationRunner:
    """Runs one Configuration's discovery and keeps this node's Instances of it current."""

    def __init__(
        self,
        configuration: Configuration,
        handler: DiscoveryHandler,
        store: InstanceStore,
        node: str,
        grace_for: Callable[[Configuration, bool], float],
        clock: Callable[[], float] = time.monotonic,
        on_offline_change: Callable[[], None] = lambda: None,
        ledger: SlotLedger | None = None,
        budget: InstanceBudget | None = None,
        on_seen_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._on_offline_change = on_offline_change
        self._on_seen_change = on_seen_change
        # the node's Instance budget (agent/node/discovery/budget.py): devices beyond it are
        # planned as if not reported
        self._budget = budget
        if budget is not None:
            budget.register(configuration.key, self.wake)
        self.configuration = configuration
        self.store = store
        self.node = node
        self.ledger = ledger or SlotLedger(store, node)
        self._grace_for = grace_for
        self._clock = clock
        self._feed = HandlerFeed(handler, store, lambda: self.configuration, self.wake, clock)
        self._missing_since: dict[str, float] = {}
        # the Configuration edits whose first device list has been planned with (a device
        # missing from that list is no longer selected: left without the offline grace)
        self._selection_planned = 0
        self._unselected: set[str] = set()  # left (or draining) as no longer selected
        self._wake = asyncio.Event()
        self._reconcile_task: asyncio.Task[None] | None = None
        self.offline: frozenset[str] = frozenset()  # names: in grace, or draining
        self.draining: dict[str, tuple[str, ...]] = {}  # name -> slots this node still holds
        self.devices_by_instance: dict[str, Device] = {}
        # name -> (what the last upsert found nothing to change in, the inputs it was decided
        # on): the same inputs again decide the same no-op, so a list that changed one device
        # of thousands costs one write and not thousands of pure passes
        self._settled: dict[str, tuple[Instance, DesiredInstance, Configuration, bool]] = {}
        self.reconciled = asyncio.Event()
        # name -> uid of the Instance this runner last joined checking kubelet's evidence
        self._evidence_checked: dict[str, str | None] = {}
        # name -> when its unreadable evidence was last logged; the names whose create or
        # join waits for evidence in this pass, and the wait before the next try
        self._evidence_logged: dict[str, float] = {}
        self._evidence_waiting: set[str] = set()
        self._evidence_retry = EVIDENCE_RETRY[0]
        # name -> an Instance of another device or Configuration holding a name this node's
        # digests gave, read by name (its watch shows only this node's Instances)
        self._taken_elsewhere: dict[str, Instance] = {}
        # name -> uid of an Instance this node is not in whose slots its evidence was checked
        # for (:meth:`_adopt_unseen`): once per Instance version
        self._unseen_checked: dict[str, str | None] = {}
        # name -> (when to read it next, the backoff after that, when it left the view) of
        # an Instance this node drains that its view does not show (:meth:`_follow_drained`)
        self._unseen_drained: dict[str, tuple[float, float, float]] = {}

    @property
    def key(self) -> ObjectKey:
        """The Configuration's key."""
        return self.configuration.key

    @property
    def handler(self) -> DiscoveryHandler:
        """The handler discovering for this Configuration."""
        return self._feed.handler

    @property
    def handler_state(self) -> str:
        """For metrics and status: starting, ok, failed (last list kept), invalid."""
        return self._feed.state

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start discovery and reconciliation."""
        self._feed.start()
        self._reconcile_task = asyncio.create_task(
            self._reconcile_loop(), name=f"reconcile-{self.configuration.name}"
        )

    async def stop(self) -> None:
        """Stop discovery. The Instances stay as they are (a retirement or a new runner takes
        them over)."""
        self._feed.stop_watching()
        if self._budget is not None:
            self._budget.forget(self.key)
        tasks = (self._feed.task, self._reconcile_task)
        for task in tasks:
            if task is not None:
                task.cancel()
        for task in tasks:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.offline:
            self.offline = frozenset()
            self._on_offline_change()

    def update(self, configuration: Configuration) -> None:
        """Apply an edited Configuration; restarts the handler if what it sees changed."""
        restart = configuration.discovery_hash != self.configuration.discovery_hash
        self.configuration = configuration
        if restart and self._feed.task is not None:
            log.info(
                "configuration %s: discovery details changed, restarting discovery",
                configuration.key,
            )
            self._feed.watch_property_sources()
            self._feed.restart(edited=True)
        self.wake()

    def replace_handler(self, handler: DiscoveryHandler) -> None:
        """Discover with ``handler`` from now on (an external handler registered under the
        name of the embedded one); the last device list stays until it reports."""
        log.info(
            "configuration %s: discovery moves to the newly registered %s handler",
            self.configuration.key,
            handler.name,
        )
        self._feed.handler = handler
        self._feed.restart()

    def wake(self) -> None:
        """Ask for a reconcile (cheap; coalesces)."""
        self._wake.set()

    # -- reconcile ---------------------------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        backoff = 0.5
        deadline: float | None = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # (wait_for may lose a cancellation)
                    await self._wake.wait()
            self._wake.clear()
            if self._feed.devices is None:
                deadline = None
                continue  # the handler has not reported yet
            try:
                deadline = await self.reconcile_once()
                backoff = 0.5
                self.reconciled.set()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # API errors: retry, never die
                log.error(
                    "configuration %s: reconcile failed (%s: %s); retrying in %.1fs",
                    self.configuration.key,
                    type(error).__name__,
                    error,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_RECONCILE_BACKOFF)
                self.wake()

    def _admitted_devices(self) -> list[Device]:
        """The latest device list within the node's Instance budget (the budget records it:
        a list that moves the cut wakes the other Configurations' runners)."""
        devices = self._feed.devices or []
        if self._budget is None:
            return devices
        return self._budget.filter(self.key, devices)

    def offline_until(self) -> dict[str, float]:
        """Instances in their offline grace here (the device is not seen; their slots are
        Unhealthy): name -> when the grace ends (this runner's clock). Draining ones are not
        here: their stored mark says so."""
        grace = self._grace_for(self.configuration, self.handler.shared)
        return {
            name: since + grace
            for name, since in self._missing_since.items()
            if name in self.offline and name not in self.draining
        }

    def _reselected(self) -> bool:
        """Is the latest device list the first one of an edited Configuration (one that may
        select other devices: a filter, its URLs)? Not when the node's Instance budget left
        devices out of it (those are not unselected, only over the budget)."""
        feed = self._feed
        if feed.devices_edit <= self._selection_planned or feed.devices_edit != feed.edits:
            return False
        devices = feed.devices or []
        return len(self._admitted_devices()) == len(devices)

    def current_plan(self) -> DiscoveryPlan:
        """The plan for the latest device list against the cache (pure)."""
        shared = self.handler.shared
        return plan_discovery(
            self.configuration,
            self.node,
            shared,
            self._admitted_devices(),
            NamespaceInstances(self.store, self.configuration.namespace, self._taken_elsewhere),
            self._missing_since,
            self._clock(),
            self._grace_for(self.configuration, shared),
            own=self.store.list_cached(self.configuration.key),
            reselected=self._reselected(),
        )

    async def reconcile_once(self) -> float | None:
        """Apply one plan; returns the next grace deadline (monotonic) or None."""
        plan = self.current_plan()
        self._selection_planned = max(self._selection_planned, self._feed.devices_edit)
        for name in plan.unselected:
            log.info(
                "instance %s/%s: its device is not in the first list of the edited "
                "configuration %s: no longer selected, %s leaves it (no offline grace)",
                self.configuration.namespace,
                name,
                self.configuration.key,
                self.node,
            )
        for device_id in plan.duplicate_ids:
            log.warning(
                "configuration %s: handler reported device id %r twice; using the first",
                self.configuration.key,
                device_id,
            )
        self._missing_since = dict(plan.missing_since)
        newly_offline = set(plan.offline) - self.offline
        for name in sorted(newly_offline):
            log.info(
                "instance %s/%s: device not seen by %s; slots Unhealthy for up to %.0fs",
                self.configuration.namespace,
                name,
                self.node,
                self._grace_for(self.configuration, self.handler.shared),
            )
        # nothing is written when the grace starts: the Instance is left once, when it is over
        # (a stored offline mark cost every departing node a second write, and the conflicts
        # with it); the slots are Unhealthy here meanwhile (``self.offline``)
        settled: dict[str, tuple[Instance, DesiredInstance, Configuration, bool]] = {}
        self._evidence_waiting = set()
        for desired in plan.upserts:
            was_draining = self.draining.pop(desired.name, None)
            self._unselected.discard(desired.name)  # selected again
            if self._is_settled(desired):
                settled[desired.name] = self._settled[desired.name]
                continue
            stored = await self._upsert(desired)
            if desired.name in self._evidence_waiting and was_draining is not None:
                self.draining[desired.name] = was_draining  # untouched: still draining
            if stored is not None:
                settled[desired.name] = (
                    stored,
                    desired,
                    self.configuration,
                    self.handler.shared,
                )
            # a write that needs no I/O (nothing changed) does not yield: without this,
            # thousands of upserts could hold the loop (and a SIGTERM) for their whole run
            await asyncio.sleep(0)
        self._settled = settled
        seen_before = self.devices_by_instance.keys()
        self.devices_by_instance = {d.name: d.device for d in plan.upserts}
        if self.devices_by_instance.keys() != seen_before:
            # an offline mark this node left (before a restart, say) is cleared only once the
            # device is reported: that moment must wake the marks, not their next recheck
            self._on_seen_change()
        unselected = set(plan.unselected)
        for name in plan.leave:
            await self._leave(name, unselected=name in unselected)
            await asyncio.sleep(0)
        await self._adopt_unseen({d.name for d in plan.upserts})
        deadline = plan.next_deadline
        for due, _, _ in self._unseen_drained.values():
            deadline = due if deadline is None else min(deadline, due)
        offline = frozenset(plan.offline) | frozenset(self.draining)
        if offline != self.offline:
            self.offline = offline
            self._on_offline_change()
        for name in [n for n in self._evidence_logged if n not in self._evidence_waiting]:
            del self._evidence_logged[name]
        if not self._evidence_waiting:
            self._evidence_retry = EVIDENCE_RETRY[0]
            return deadline
        retry = self._clock() + self._evidence_retry
        self._evidence_retry = min(self._evidence_retry * 2, EVIDENCE_RETRY[1])
        return retry if deadline is None else min(retry, deadline)

    def _is_settled(self, desired: DesiredInstance) -> bool:
        """True when the cached Instance, the device and the Configuration are the very ones
        the last upsert of ``desired.name`` found nothing to change in."""
        last = self._settled.get(desired.name)
        if last is None:
            return False
        instance, previous, configuration, shared = last
        current = self.store.get_cached(ObjectKey(self.configuration.namespace, desired.name))
        return (
            current is instance
            and configuration is self.configuration
            and shared == self.handler.shared
            and previous == desired
        )

    async def _upsert(self, desired: DesiredInstance) -> Instance | None:
        """Create or join the Instance; returns it when this node's part is now as
        ``desired`` and nothing was written (a no-op worth remembering), else None.

        When this node's evidence (what its containers use) cannot be read, the Instance is
        left untouched — no create, no join, no slot change — the other Instances go on, and
        this one is tried again after a backoff (logged at most once a minute)."""
        try:
            return await self._create_or_join(desired)
        except EvidenceUnavailableError as error:
            self._evidence_unavailable(desired.name, error)
            return None
        except NodeNotServingError as error:
            # said once per episode (agent/node/followed_nodes.py); tried again when the
            # Node serves again (the manager wakes every runner)
            log.debug("%s", error)
            return None

    async def _create_or_join(self, desired: DesiredInstance) -> Instance | None:
        shared = self.handler.shared
        key = ObjectKey(self.configuration.namespace, desired.name)
        for _ in range(5):
            before = self.store.get_cached(key)
            expected: Instance | None = None
            if before is None:
                expected = new_instance(self.configuration, desired, self.node, shared)
                try:
                    await self.ledger.create_instance(expected)
                    return None
                except AlreadyExistsError:
                    # another node created it first (all nodes see a shared device at once),
                    # or it does not list this node (yet): its watch event is often here
                    # already; if not — this node's view shows only its own Instances — it is
                    # joined by name, without reading it first when that is all there is
                    before = self.store.get_cached(key)
            try:
                # the first join of each Instance (by uid) since this runner started also
                # takes the slots kubelet shows this node's containers using: whoever wrote
                # the Instance meanwhile could not see them (the ledger checks the evidence
                # anyway whenever this node is not yet in ``nodes``)
                result = await self.ledger.join_instance(
                    key,
                    lambda inst: self._join_change(inst, desired, shared),
                    check_evidence=(
                        before is None
                        or desired.name not in self._evidence_checked
                        or self._evidence_checked[desired.name] != before.uid
                    ),
                    expected=expected if before is None else None,
                )
            except NotFoundError:
                continue  # deleted meanwhile (another node left last): create it again
            except NameTakenError as taken:
                # the name is another device's (a digest collision with an Instance this
                # node's view does not show): planned again with it known
                self._taken_elsewhere[desired.name] = taken.instance
                self.wake()
                return None
            if result.checked:
                self._evidence_checked[desired.name] = result.instance.uid
            stored = result.instance
            # the identical cached object: nothing was written (a write caches a new one)
            return stored if stored is before else None
        raise StoreError(f"could not upsert instance {key}")

    async def _adopt_unseen(self, discovered: set[str]) -> None:
        """Instances of this Configuration that do not list this node and whose device it
        does not report: once per Instance version, if this node's containers still use some
        of their slots (the Instance was re-created meanwhile by a node that could not see
        them), join it draining with exactly those slots (:meth:`SlotLedger.adopt_draining`):
        they are recorded, nothing new is offered here, and this node leaves once the
        reclaimers have freed them."""
        seen: set[str] = set()
        for instance in self.store.list_cached(self.configuration.key):
            name = instance.name
            seen.add(name)
            if self.node in instance.nodes or name in discovered:
                continue
            if self._unseen_checked.get(name, "") == instance.uid:
                continue

            def offline_now(name: str = name) -> None:
                # offline before the write, not at the end of the pass: nothing may offer
                # its free slots meanwhile (the plugins and the DRA publisher also read the
                # stored draining mark; this covers views computed from the offline set)
                if name not in self.offline:
                    self.offline = self.offline | {name}
                    self._on_offline_change()

            try:
                result = await self.ledger.adopt_draining(instance.key, offline_now)
            except NotFoundError:
                continue
            except EvidenceUnavailableError as error:
                self._evidence_unavailable(name, error)
                continue
            except NodeNotServingError as error:
                log.debug("%s", error)
                continue
            self._unseen_checked[name] = instance.uid
            if result is not None and result.adopted:
                slots = tuple(slot for slot, _ in result.adopted)
                self.draining[name] = slots
                await report_draining(
                    self.store,
                    instance.key,
                    self.node,
                    slots,
                    "its containers use slots of an instance re-created without them while "
                    "this node does not see the device",
                )
                self._missing_since[name] = float("-inf")  # no grace: it never saw the device
            await asyncio.sleep(0)
        for name in [n for n in self._unseen_checked if n not in seen]:
            del self._unseen_checked[name]
        await self._follow_drained(seen | discovered)

    async def _follow_drained(self, visible: set[str]) -> None:
        """Instances this node drains (its containers use their slots) that its view no longer
        shows: deleted — and maybe re-created by a node that could not see those slots, so
        without this node's label. Each is read by name (with backoff, for
        :data:`UNSEEN_FOLLOW_LIMIT` seconds after it left the view) and joined draining with
        the slots still in use (:meth:`SlotLedger.adopt_draining`), as one in view would be;
        found holding nothing of this node's, it is no longer followed."""
        now = self._clock()
        for name in [n for n in self._unseen_drained if n not in self.draining or n in visible]:
            del self._unseen_drained[name]
        for name in sorted(self.draining):
            if name in visible:
                continue
            due, backoff, since = self._unseen_drained.get(name, (now, UNSEEN_RETRY[0], now))
            if due > now:
                continue
            key = ObjectKey(self.configuration.namespace, name)
            try:
                result = await self.ledger.adopt_draining(key, lambda: None)
            except NotFoundError:
                if now - since >= UNSEEN_FOLLOW_LIMIT:
                    del self.draining[name]
                    self._unseen_drained.pop(name, None)
                    continue
                self._unseen_drained[name] = (
                    now + backoff,
                    min(backoff * 2, UNSEEN_RETRY[1]),
                    since,
                )
                continue
            except EvidenceUnavailableError as error:
                self._evidence_unavailable(name, error)
                continue
            self._unseen_drained.pop(name, None)
            if result is None or not result.adopted:
                del self.draining[name]  # nothing of this node's is in use there any more
                continue
            slots = tuple(slot for slot, _ in result.adopted)
            self.draining[name] = slots
            await report_draining(
                self.store,
                key,
                self.node,
                slots,
                "its containers use slots of an instance re-created without them while "
                "this node does not see the device",
            )
            self._missing_since[name] = float("-inf")

    def _evidence_unavailable(self, name: str, error: EvidenceUnavailableError) -> None:
        self._evidence_waiting.add(name)
        now = self._clock()
        last = self._evidence_logged.get(name)
        if last is None or now - last >= EVIDENCE_LOG_INTERVAL:
            self._evidence_logged[name] = now
            log.error(
                "%s; not creating or joining it (no slot changed) until it can be read: "
                "retrying in %.1fs",
                error,
                self._evidence_retry,
            )

    def _join_change(
        self, instance: Instance, desired: DesiredInstance, shared: bool
    ) -> Instance | None:
        """Discovery's change of ``instance`` for this node (:func:`join_instance`). A change
        the Configuration alone drives (capacity, properties...) of a shared Instance this
        node is already in is written by one node, the one that sorts first in ``nodes`` (as
        for its DRA pool): all nodes learn of an edit at once, and each writing it cost N-1
        conflicts and re-reads per Instance; the others' caches then show it done. (If that
        node's agent is down, the change waits until it is back or the controller's dead-node
        cleanup takes it out of ``nodes``.) This node's own part (joining, its marks) it
        always writes itself."""
        if instance.configuration_name != self.configuration.name or (
            instance.device_fingerprint not in (None, desired.fingerprint)
        ):
            raise NameTakenError(instance)
        target = join_instance(instance, self.configuration, desired, self.node, shared)
        if (
            target is None
            or not shared
            or self.node not in instance.nodes
            or min(instance.nodes) == self.node
        ):
            return target
        if target.nodes == instance.nodes and target.annotations == instance.annotations:
            return None  # the node that sorts first writes it
        return target

    async def _leave(self, name: str, unselected: bool = False) -> None:
        key = ObjectKey(self.configuration.namespace, name)
        if unselected:
            self._unselected.add(name)
        result = await self.ledger.leave(key)
        self.devices_by_instance.pop(name, None)
        if result.left:
            self.draining.pop(name, None)
            self._missing_since.pop(name, None)
            self._evidence_checked.pop(name, None)
            self._unselected.discard(name)
            return
        if self.draining.get(name) != result.slots:
            if name in self._unselected:
                why, asked = "its Configuration no longer selects the device", True
            else:
                why, asked = "its device is gone", False
            await report_draining(self.store, key, self.node, result.slots, why, asked)
        self.draining[name] = result.slots
        # its grace is over: the next pass (woken by the release of a slot) tries to leave
        # again at once rather than starting a new grace
        self._missing_since[name] = float("-inf")


async def report_draining(
    store: InstanceStore,
    key: ObjectKey,
    node: str,
    slots: tuple[str, ...],
    why: str,
    asked: bool = False,
) -> None:
    """Log line + Event: ``node`` keeps Instance ``key`` until its ``slots`` are released.
    ``asked``: the operator's own step caused it (its Configuration was deleted), logged at
    INFO — every documented uninstall goes through it; otherwise (a device gone while pods
    use it) at WARNING."""
    message = (
        f"draining: {len(slots)} slot(s) in use on {node} ({', '.join(slots)}); {why}, so the "
        f"instance stops offering free slots and {node} leaves it once they are released"
    )
    log.log(logging.INFO if asked else logging.WARNING, "instance %s: %s", key, message)
    instance = store.get_cached(key)
    if instance is not None:
        await store.record_instance_event(instance, "Draining", message, warning=False)
