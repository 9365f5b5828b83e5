"""This node's mode, followed: which path serves ``akri.sh/<name>`` limits here, decided at the
start (``extended.py``) and decided again, in place, when a DeviceClass appears or the Node
changes; and the ResourceClaims followed while a device plugin here serves a name whose slots
DRA also allocates (``allocated.py``).

The decisions are the pure functions at the top (:func:`after_node_change`,
:func:`switch_decision`, :func:`claims_step`); :class:`PathFollower` reads the API, runs the
followers and applies them to the slice publisher and the device-plugin manager. Nothing is
released by a switch: slots live in the Instances; the reclaimers free them when their pods
end (docs/dra.md, "Which path each name takes").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agent.core.aio.events import Subscription
from agent.core.kube import KubeClient
from agent.core.store.base import InstanceEvent
from agent.node.dra.extended import (
    DEVICE_PLUGINS,
    DRA,
    CdiNotice,
    NodeFacts,
    PathDecision,
    RuntimeCdi,
    announce,
    choose_path,
    decide_path,
    follow_device_classes,
    follow_node,
    kubelet_of,
    node_facts,
    path_inputs,
    read_classes,
    read_node,
)

if TYPE_CHECKING:
    from agent.core.ledger.ledger import SlotLedger
    from agent.core.model.instance import Instance
    from agent.node.deviceplugin.manager import DevicePluginManager
    from agent.node.dra.allocated import AllocatedClaims
    from agent.node.dra.claim_status import ClaimStatusWriter
    from agent.node.dra.publisher import SlicePublisher

log = logging.getLogger("agent")


@dataclasses.dataclass(frozen=True)
class NodeChangeStep:
    """What a change of the Node leads to: take the decision's path, follow the classes."""

    take: bool = False
    follow_classes: bool = False


def after_node_change(
    decision: PathDecision, *, classes_read: bool, current: str
) -> NodeChangeStep:
    """What to do with ``decision`` (taken on the Node's new facts) on a node in ``current``
    mode. Classes that cannot be read leave the path as it is; a node on DRA whose classes
    went (an uninstall) stays on DRA, as before."""
    if not classes_read:
        return NodeChangeStep()
    if decision.awaits_classes and current == DRA:
        return NodeChangeStep()
    return NodeChangeStep(take=decision.path != current, follow_classes=decision.awaits_classes)


def switch_decision(decision: PathDecision, current: str, cause: str) -> PathDecision:
    """``decision`` as said when it moves a node from ``current`` without a restart (one that
    keeps the path is said as it is)."""
    if decision.path == current:
        return decision
    return dataclasses.replace(
        decision,
        reason=f"{decision.reason} ({cause}: switched from {current} without a restart; "
        "slots held either way stay held)",
    )


class ClaimsStep(enum.Enum):
    """Whether to start or stop following ResourceClaims."""

    NONE = "none"
    FOLLOW = "follow"
    STOP = "stop"


def claims_step(*, needed: bool, following: bool, dra_present: bool, path: str) -> ClaimsStep:
    """On a node in ``dra`` mode the claims are followed only while a device plugin runs
    (issue 33.5: nothing else here could take a slot the scheduler allocated to a claim); a
    device-plugin node follows them from its start and never stops."""
    if needed and not following and dra_present:
        return ClaimsStep.FOLLOW
    if not needed and following and path != DEVICE_PLUGINS:
        return ClaimsStep.STOP
    return ClaimsStep.NONE


class PathFollower:
    """The extended-resource path of one node (``path``, ``reason``), its runtime's CDI, and
    the ResourceClaims followed for its device plugins (``allocated_claims``)."""

    def __init__(
        self,
        client: KubeClient,
        node: str,
        setting: str,
        *,
        ledger: SlotLedger,
        instances: Callable[[], list[Instance]],
        instance_events: Callable[[], Subscription[InstanceEvent]],
        plugins: DevicePluginManager | None,
    ) -> None:
        self.client = client
        self.node = node
        self.setting = setting  # --extended-resources: auto / dra / device-plugins
        self.ledger = ledger
        self._instances = instances
        self._instance_events = instance_events
        self.plugins = plugins
        self.publisher: SlicePublisher | None = None
        self.path = DEVICE_PLUGINS
        self.reason = ""
        self.runtime_cdi: RuntimeCdi | None = None  # this node's, once read
        # slots allocated to ResourceClaims not prepared yet: held back from device plugins
        self.allocated_claims: AllocatedClaims | None = None
        self._facts: NodeFacts | None = None  # the Node's, the path was decided on
        self._awaits_classes = False  # auto: device plugins until a DeviceClass appears
        self._classes_task: asyncio.Task[None] | None = None
        # auto: the Node followed, so a label or runtime change needs no restart
        self._node_task: asyncio.Task[None] | None = None
        self._cdi_notice: CdiNotice | None = None  # once the runtime is known
        self._lock = asyncio.Lock()
        self._claims_lock = asyncio.Lock()

    async def decide(
        self,
        *,
        dra_enabled: bool,
        publisher: SlicePublisher | None,
        claim_status: ClaimStatusWriter | None,
    ) -> str:
        """Which path serves ``akri.sh/<name>`` limits on this node (``extended.py``):
        decided once per start, logged, exported as ``akri_extended_resource_path``; then
        the publisher and the device plugins are set up for it."""
        self.publisher = publisher
        facts = await read_node(self.client, self.node) if dra_enabled else None
        decision = await decide_path(
            self.client, self.node, self.setting, dra_enabled=dra_enabled, facts=facts
        )
        self.path = decision.path
        self.reason = decision.reason
        self._facts = facts
        self._awaits_classes = decision.awaits_classes and publisher is not None
        runtime = facts.runtime if facts is not None else None
        self.runtime_cdi = runtime
        if claim_status is not None and runtime is not None:
            # explicit claims are prepared here too: each gets a warning, not silence, while
            # the runtime is not known to inject CDI (the notice reads it as the Node changes)
            self._cdi_notice = CdiNotice(self.client, self.node, runtime)
            claim_status.listeners.append(self._cdi_notice.prepared)
        if publisher is not None:
            publisher.extended_path = decision.path  # its local slices say it; eligibility
            if self.plugins is not None:
                self._decide_names_per_node(publisher, self.plugins)
                if decision.path == DEVICE_PLUGINS:
                    # device plugins and DRA serve the same slots here: hold back the ones the
                    # scheduler allocated to claims (on DRA only once a name here needs its
                    # device plugin: claims_needed)
                    await self._follow_allocated_claims()  # before the plugins offer slots
                else:
                    # every node's mode, before the plugins decide which names they serve
                    await publisher.load()
        return decision.path

    def follow(self) -> None:
        """Once the plugins and the publisher run: ``auto`` follows the DeviceClasses (while
        it waits for one) and the Node."""
        if self._awaits_classes:
            self._classes_task = asyncio.create_task(
                self._follow_device_classes(), name="deviceclasses"
            )
        if self._facts is not None and self.setting == "auto":
            self._node_task = asyncio.create_task(self._follow_node(), name="node")

    async def stop_following(self) -> None:
        """End the followers of the DeviceClasses and of the Node."""
        for task in (self._classes_task, self._node_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def close_claims(self) -> None:
        """Stop following ResourceClaims."""
        if self.allocated_claims is not None:
            await self.allocated_claims.close()

    async def _follow_device_classes(self) -> None:
        """``auto`` took device plugins at the start because no DeviceClass of akri controller
        carried ``extendedResourceName`` yet (installed in the README's order, the agent starts
        before the controller has written any): follow the classes, and once one does, decide
        again and move to DRA in place (:meth:`_take_path`)."""
        decided: list[PathDecision] = []

        def seen(classes: list[Mapping[str, Any]]) -> bool:
            facts = self._facts  # the Node's, as _follow_node last read it
            decision = choose_path(
                self.setting,
                dra_enabled=True,
                kubelet=kubelet_of(facts),
                classes=classes,
                runtime=facts.runtime if facts is not None else None,
            )
            if decision.awaits_classes:
                return False
            decided.append(decision)
            return True

        await follow_device_classes(self.client, seen)
        if decided:
            async with self._lock:
                await self._take_path(decided[0], "a DeviceClass appeared after the start")

    async def _follow_node(self) -> None:
        """``auto``: follow this node's Node object; when its ``akri.sh/runtime-cdi`` label,
        its runtime or its kubelet changes, decide again and take the new path in place
        (:meth:`_take_path`), either way: an operator who labels a containerd 1.7 node after
        the install gets DRA without restarting the agent, and one who sets the label to
        ``false`` gets device plugins back."""
        facts = self._facts
        assert facts is not None
        await follow_node(self.client, self.node, path_inputs(facts.node), self._node_changed)

    async def _node_changed(self, node: Mapping[str, Any]) -> None:
        try:
            await self._decide_again(node)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the follower goes on; the path stays as it is
            log.error(
                "deciding the extended-resource path again after a change of Node %s failed "
                "(%s: %s); the node stays on %s",
                self.node,
                type(error).__name__,
                error,
                self.path,
            )

    async def _decide_again(self, node: Mapping[str, Any]) -> None:
        facts = node_facts(node)
        async with self._lock:
            self._facts = facts
            self.runtime_cdi = facts.runtime
            if self._cdi_notice is not None and facts.runtime is not None:
                self._cdi_notice.runtime = facts.runtime
            if self._classes_task is not None and not self._classes_task.done():
                return  # waiting for a DeviceClass: that follower decides with these facts
            classes = await read_classes(self.client)
            decision = choose_path(
                self.setting,
                dra_enabled=True,
                kubelet=kubelet_of(facts),
                classes=classes,
                runtime=facts.runtime,
            )
            step = after_node_change(decision, classes_read=classes is not None, current=self.path)
            if step.take:
                await self._take_path(decision, "the Node changed after the start")
            if step.follow_classes and self.publisher is not None:
                self._classes_task = asyncio.create_task(
                    self._follow_device_classes(), name="deviceclasses"
                )

    async def _take_path(self, decision: PathDecision, cause: str) -> None:
        """Move this node to ``decision``'s mode without a restart. Nothing is released: the
        names that now go through DRA stop their device plugins (kubelet keeps the pods that
        hold their slots; the reclaimer frees those slots when the pods end), the local
        slices say the new mode, the slots' attributes follow (name_paths.py), and the names
        still shared with device-plugin nodes keep their plugins. Said like the choice at the
        start: log line, ``ExtendedResourcePath`` Event, ``akri_extended_resource_path``."""
        decision = switch_decision(decision, self.path, cause)
        # all at once, before any await: the plugins read this node's mode from both
        self.path = decision.path
        self.reason = decision.reason
        if self.publisher is not None:
            self.publisher.extended_path = decision.path
            self.publisher.trigger()
        if self.plugins is not None:
            self.plugins.paths_changed()
        await announce(self.client, self.node, self._facts, decision)

    def _decide_names_per_node(
        self, publisher: SlicePublisher, plugins: DevicePluginManager
    ) -> None:
        """The device plugins serve, on a node in ``dra`` mode, only the names the rule of
        ``agent/node/dra/name_paths.py`` gives them (shared with a device-plugin node), and
        follow every node's mode as the slice publisher learns it."""
        from agent.node.dra.name_paths import NodeNamePaths

        plugins.paths = NodeNamePaths(self.node, lambda: self.path, publisher.node_paths)
        plugins.claims_needed = self._claims_needed
        publisher.paths_listeners.append(plugins.paths_changed)

    async def _claims_needed(self, needed: bool) -> None:
        """From the device-plugin manager: a plugin starts (``needed``), or none runs
        (:func:`claims_step`)."""
        async with self._claims_lock:
            step = claims_step(
                needed=needed,
                following=self.allocated_claims is not None,
                dra_present=self.publisher is not None,
                path=self.path,
            )
            if step is ClaimsStep.FOLLOW:
                if self.path != DEVICE_PLUGINS:
                    log.info(
                        "following ResourceClaims: a device plugin on this node serves a name "
                        "whose slots DRA also allocates"
                    )
                await self._follow_allocated_claims()
            elif step is ClaimsStep.STOP and self.allocated_claims is not None:
                from agent.core.ledger.reservations import DRA_ALLOCATED

                claims, self.allocated_claims = self.allocated_claims, None
                await claims.close()
                self.ledger.reservations.replace(DRA_ALLOCATED, {})
                log.info("no longer following ResourceClaims: no device plugin runs on this node")

    async def _follow_allocated_claims(self) -> None:
        """Hold back from the device plugins the slots allocated to ResourceClaims not
        prepared yet (agent/node/dra/allocated.py)."""
        from agent.node.dra.allocated import AllocatedClaims

        self.allocated_claims = AllocatedClaims(
            self.client, self.node, self._instances, self.ledger.reservations
        )
        await self.allocated_claims.start()
        self.allocated_claims.follow_instances(self._instance_events())
