"""Wiring: store + handlers + discovery manager + activity log, run until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from agent.core.aio.events import Subscription
from agent.core.ledger.ledger import SlotLedger
from agent.core.store.base import ConfigurationEvent, EventType, InstanceEvent
from agent.node.activity_log import log_instance_changes
from agent.node.discovery.budget import ensure_fd_limit
from agent.node.discovery.manager import DiscoveryManager, GraceSettings
from agent.node.discovery.offline_marks import OfflineMarks
from agent.node.discovery.ownership import Ownership, ServedInstances
from agent.node.finalizers import settle_finalizers
from agent.node.kubelet.evidence import NodeEvidence
from agent.node.kubelet.state import CHECKPOINT_FILE, KubeletState
from agent.node.local_notes import record_notes
from agent.ops.gc_tuning import freeze_long_lived, freeze_when_settled
from agent.ops.loop_monitor import LoopMonitor

if TYPE_CHECKING:
    from agent.core.store.kubernetes import KubernetesInstanceStore
    from agent.node.deviceplugin.manager import DevicePluginManager
    from agent.node.deviceplugin.reclaimer import SlotReclaimer
    from agent.node.dra.allocated import AllocatedClaims
    from agent.node.dra.driver import DraDriver
    from agent.node.dra.extended import RuntimeCdi
    from agent.node.dra.health import HealthReporter
    from agent.node.dra.options import DraOptions
    from agent.node.dra.path_follower import PathFollower
    from agent.node.dra.publisher import SlicePublisher
    from agent.node.dra.reclaim import DraReclaimer
    from agent.node.dra.state import DraState
    from agent.node.external.registration import RegistrationServer
    from agent.node.followed_agents import FollowedAgents
    from agent.node.followed_nodes import FollowedNodes
    from agent.ops.health import HealthServer
from agent.core.store.base import InstanceStore
from agent.node.settings import AgentSettings
from discovery_handlers.base import DiscoveryHandler
from discovery_handlers.debug_echo import DebugEchoHandler
from discovery_handlers.registry import HandlerRegistry, LazyHandler

log = logging.getLogger("agent")
NODE_FIRST_READ = 5.0  # seconds the start waits to know whether this node's Node serves
FIRST_FREEZE_DELAY = 0.5  # seconds after start (the second freeze follows when settled)
STOP_DEADLINE = 1.5  # seconds for a clean stop after SIGTERM (the process exits within 2 s)


def import_what_settings_need(settings: AgentSettings) -> None:
    """Import the modules this agent will use before its event loop starts: imported
    lazily inside ``Agent`` they held the running loop for ~140 ms (gRPC alone ~75 ms), and
    an import is no cheaper later. A local debugEcho agent without plugins still imports
    neither gRPC nor the DRA modules."""
    import importlib

    wanted = (
        ["agent.core.store.local"]
        if settings.local
        else ["agent.core.kube", "agent.core.store.kubernetes"]
    )
    if settings.device_plugin_dir is not None:
        wanted += ["agent.node.deviceplugin.manager", "agent.node.deviceplugin.reclaimer"]
    if settings.dra and not settings.local:
        wanted += [
            "agent.node.dra.cdi",
            "agent.node.dra.checkpoint",
            "agent.node.dra.driver",
            "agent.node.dra.publisher",
            "agent.node.dra.reclaim",
            "agent.node.dra.state",
        ]
    for module in wanted:
        importlib.import_module(module)


def build_handlers(settings: AgentSettings) -> HandlerRegistry:
    """The embedded handlers this agent runs."""
    registry = HandlerRegistry()

    def udev() -> DiscoveryHandler:
        from discovery_handlers.udev import UdevHandler

        return UdevHandler(monitor_source=settings.udev_monitor_source)

    # loaded (and run) only when a Configuration names "udev"
    registry.register(LazyHandler("udev", False, udev))

    def onvif() -> DiscoveryHandler:
        from discovery_handlers.onvif import OnvifHandler

        return OnvifHandler()

    # loaded only when a Configuration names "onvif" (then aiohttp/defusedxml are imported)
    registry.register(LazyHandler("onvif", True, onvif))

    def mqtt() -> DiscoveryHandler:
        from discovery_handlers.mqtt import MqttHandler

        return MqttHandler()

    registry.register(LazyHandler("mqtt", True, mqtt))

    def mdns() -> DiscoveryHandler:
        from discovery_handlers.mdns import MdnsHandler

        return MdnsHandler()

    registry.register(LazyHandler("mdns", True, mdns))

    def opcua() -> DiscoveryHandler:
        from discovery_handlers.opcua import OpcuaHandler

        return OpcuaHandler()

    # asyncua is imported (in a worker thread) only when an opcua Configuration runs
    registry.register(LazyHandler("opcua", True, opcua))
    if settings.debug_echo:
        registry.register(
            DebugEchoHandler(
                shared=settings.debug_echo_shared,
                availability_file=settings.debug_echo_availability_file,
                poll_interval=min(0.5, settings.poll_interval),
            )
        )
    return registry


class Agent:
    """One node's agent."""

    def __init__(
        self, settings: AgentSettings, store: InstanceStore, *, freeze_gc: bool = True
    ) -> None:
        self.settings = settings
        self.freeze_gc = freeze_gc
        self.store = store
        # POD_NAME / POD_NAMESPACE of the agent's Pod (downward API): stay_while_uninstalled
        self.pod_environ: Mapping[str, str] = os.environ
        # uninstalled with no DRA claim left prepared: stop() removes the empty DRA checkpoint
        self.leaving_for_good = False
        self.handlers = build_handlers(settings)
        node = settings.node_name
        self.kubelet: KubeletState | None = None
        if settings.device_plugin_dir is not None:
            self.kubelet = KubeletState(
                settings.pod_resources_socket, settings.device_plugin_dir / CHECKPOINT_FILE
            )
        self.evidence = NodeEvidence(node, self.kubelet)
        self.evidence.siblings = lambda instance: store.list_cached(instance.configuration_key)
        self.ledger = SlotLedger(
            store,
            node,
            evidence=self.evidence,
            # hot paths (Allocate, NodePrepareResources) bounded well under kubelet's waits
            claim_timeout=settings.slot_write_timeout or None,
        )
        # this node's Node (and, for the shared pools' publisher, those of the nodes that
        # decide who publishes them): whether each serves (agent/core/ledger/node_standing.py)
        self.followed_nodes: FollowedNodes | None = None
        self.followed_agents: FollowedAgents | None = None
        api_client = getattr(store, "api_client", None)
        if not settings.local and api_client is not None:
            # imported only in cluster mode: a local agent loads no Kubernetes client
            from agent.node.followed_agents import FollowedAgents
            from agent.node.followed_nodes import FollowedNodes

            self.followed_nodes = FollowedNodes(api_client, node)
            self.ledger.may_join = self.followed_nodes.may_join
            # and whether the agents of those nodes are there (Ready, not being deleted): a
            # shared pool's publisher is the first of its nodes that serves with its agent
            if settings.dra:
                self.followed_agents = FollowedAgents(api_client, node)
        self.ownership = Ownership(store)
        self.served = ServedInstances(store, self.ownership)
        self.discovery = DiscoveryManager(
            store,
            self.handlers,
            node,
            GraceSettings(settings.local_offline_grace, settings.shared_offline_grace),
            ledger=self.ledger,
            ownership=self.ownership,
            max_instances=settings.max_instances,
        )
        # what this node publishes as offline (damped), and its own offline mark on each
        # shared Instance, which the publishers of shared pools go by
        self.offline_marks = OfflineMarks(
            store,
            self.ledger,
            node,
            self.served.all,
            self.discovery.offline_instances,
            self.discovery.seen_instances,
            # not marked: Instances this node drains, and those of a deleted Configuration
            # (the collector deletes them a moment later; a mark would be a useless write)
            lambda: (
                {key.name for key in self.discovery.draining()}
                | self.discovery.retiring_instances()
            ),
        )
        self.discovery.add_offline_listener(self.offline_marks.changed)
        self.discovery.add_seen_listener(self.offline_marks.changed)
        if self.followed_nodes is not None:
            self.followed_nodes.listeners.append(self.discovery.wake_all)
        if settings.local:
            # local mode has no Events: `akri status --state-dir` reads this file instead
            self.discovery.notes_listeners.append(self._record_notes)
            self.discovery.add_offline_listener(self._record_notes)
        self._activity: asyncio.Task[None] | None = None
        self._finalizers: asyncio.Task[None] | None = None
        self.plugins: DevicePluginManager | None = None
        self.reclaimer: SlotReclaimer | None = None
        self._reclaim_task: asyncio.Task[None] | None = None
        self.dra: DraDriver | None = None
        self.dra_state: DraState | None = None
        self.dra_health: HealthReporter | None = None
        self.dra_options: DraOptions | None = None
        # which path serves akri.sh/<name> limits here, followed (cluster mode only: a local
        # agent serves them through device plugins)
        self.paths: PathFollower | None = None
        self.dra_reclaimer: DraReclaimer | None = None
        self._dra_reclaim_task: asyncio.Task[None] | None = None
        self.publisher: SlicePublisher | None = None
        self._slice_events: asyncio.Task[None] | None = None
        self._dra_options_task: asyncio.Task[None] | None = None
        self._gc_freeze: asyncio.Task[None] | None = None
        self.loop_monitor = LoopMonitor()
        self._loop_monitor_task: asyncio.Task[None] | None = None
        self.registration: RegistrationServer | None = None
        self.health: HealthServer | None = None
        self.store_synced = False
        self.started = False
        self._metrics_registry: Any = None
        if settings.device_plugin_dir is not None and self.kubelet is not None:
            # imported only when used: a local agent without device plugins needs no gRPC
            from agent.node.deviceplugin.manager import DevicePluginManager
            from agent.node.deviceplugin.reclaimer import SlotReclaimer

            plugins = DevicePluginManager(
                self.served, self.ledger, self.discovery, settings.device_plugin_dir
            )
            self.plugins = plugins
            self.discovery.add_offline_listener(plugins.offline_changed)
            reclaimer = SlotReclaimer(
                self.ledger,
                self.served.all,
                self.kubelet,
                interval=settings.reclaim_interval,
                grace=settings.reclaim_grace,
                events=store.subscribe_instances,
                served=self.served.served,
                nudge=plugins.nudge_kubelet,
            )
            self.reclaimer = reclaimer
            plugins.on_kubelet_restart(reclaimer.kubelet_restarted)
            self.ownership.add_listener(lambda _names: reclaimer.resync())

    def _build_dra(self) -> None:
        """DRA driver + slice publisher (cluster mode only: claims live in the API)."""
        from agent.core.store.kubernetes import KubernetesInstanceStore
        from agent.node.dra.cdi import CdiWriter
        from agent.node.dra.checkpoint import Checkpoint
        from agent.node.dra.claim_status import ClaimStatusWriter
        from agent.node.dra.driver import DraDriver
        from agent.node.dra.health import HealthReporter
        from agent.node.dra.options import DraOptions
        from agent.node.dra.publisher import SlicePublisher
        from agent.node.dra.reclaim import DraReclaimer
        from agent.node.dra.state import DraState

        if not isinstance(self.store, KubernetesInstanceStore):
            return
        checkpoint = Checkpoint(self.settings.dra_plugin_dir / "checkpoint.json")
        checkpoint.load()
        cdi = CdiWriter(self.settings.cdi_dir)
        cdi.remove_strays()  # before any prepare: what is there is a killed run's
        state = DraState(
            self.ledger,
            self.served.all,
            self.discovery.device_for,
            self.store.read_resource_claim,
            cdi,
            checkpoint,
        )
        self.dra_state = state
        self.evidence.dra = state
        health = HealthReporter(
            self.settings.node_name,
            self.served.all,
            self.discovery.offline_instances,
            state.prepared_devices,
        )
        self.dra_health = health
        # a device going offline reaches kubelet's NodeWatchResources stream at once
        self.discovery.add_offline_listener(health.changed)
        self.dra = DraDriver(
            state,
            self.settings.plugins_registry_dir,
            self.settings.dra_plugin_dir,
            health=health,
            claim_status=ClaimStatusWriter(self.store.api_client, self.served.all),
        )
        dra_reclaimer = DraReclaimer(
            state,
            self.store.subscribe_instances,
            self.store.read_resource_claim,
            self.store.get_cached,
            served=self.served.served,
            interval=self.settings.reclaim_interval,
            grace=self.settings.reclaim_grace,
        )
        self.dra_reclaimer = dra_reclaimer
        self.ownership.add_listener(lambda _names: dra_reclaimer.resync())
        # each Configuration's DRA opt-ins (consumable capacity, eviction), known before the
        # first publish so that slices do not change shape right after the start
        options = DraOptions()
        for configuration in self.store.configurations():
            options.apply(ConfigurationEvent(EventType.ADDED, configuration.key, configuration))
        self.dra_options = options
        self.publisher = SlicePublisher(
            self.store.api_client,
            self.settings.node_name,
            self.served.all,
            # damped (a blinking device does not rewrite slices at every blink); shared
            # pools also go by the other nodes' offline marks in the Instances
            self.offline_marks.offline,
            options_of=options.of,
            instance_exists=self.store.instance_exists,
            # a shared pool's publisher is the first of its nodes whose Node serves and
            # whose agent is there
            unready=self._unready_nodes,
            follow_nodes=self._follow_nodes,
        )
        self.offline_marks.add_listener(self.publisher.trigger)
        if self.followed_nodes is not None:
            self.followed_nodes.listeners.append(self.publisher.trigger)
        if self.followed_agents is not None:
            self.followed_agents.listeners.append(self.publisher.trigger)

    def _unready_nodes(self) -> frozenset[str]:
        """The nodes that may not publish or be selected by a shared pool: their Node does
        not serve, or their agent is not there (issue 39.4)."""
        unready = self.followed_nodes.unserving() if self.followed_nodes else frozenset()
        if self.followed_agents is not None:
            unready |= self.followed_agents.absent()
        return unready

    def _follow_nodes(self, nodes: Collection[str]) -> None:
        """Follow the Nodes and the agents of the nodes that decide this node's shared pools
        (the publisher names them: resource_slices.nodes_to_follow)."""
        if self.followed_nodes is not None:
            self.followed_nodes.want(nodes)
        if self.followed_agents is not None:
            self.followed_agents.want(nodes)

    async def start(self) -> None:
        """Load state (raises CorruptStateError), then start discovery."""
        self._loop_monitor_task = asyncio.create_task(self.loop_monitor.run(), name="loop-lag")
        # before the first plugin: every served Instance holds two descriptors
        ensure_fd_limit(self.settings.max_instances)
        if self.settings.local:  # nothing to say yet: no stale notes of a last run
            self._record_notes()
        if self.settings.health_port:
            # first: /healthz must answer while the store waits for the API and the CRDs (up
            # to 300 s), or the liveness probe restarts a starting agent; /readyz says
            # "starting" meanwhile
            await self._serve_health()
        await self.store.start()
        self.store_synced = True
        self.ownership.refresh()
        if self.settings.dra:
            self._build_dra()
        path = await self._decide_path()
        self._activity = asyncio.create_task(
            log_instance_changes(self.store.subscribe_instances()), name="activity-log"
        )
        self._finalizers = asyncio.create_task(
            settle_finalizers(self.store.subscribe_instances(), self.ledger), name="finalizers"
        )
        if self.followed_nodes is not None:
            # whether this node serves, before discovery writes itself into any Instance
            self.followed_nodes.start()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(NODE_FIRST_READ):
                    await self.followed_nodes.ready.wait()
        await self.discovery.start()
        self.offline_marks.start()
        if self.plugins is not None and self.reclaimer is not None:
            if path == "device-plugins" or self.plugins.paths is not None:
                # on DRA: the names shared with device-plugin nodes (name_paths.py)
                await self.plugins.start()
            # on the DRA path too: slots pods took through device plugins before a switch
            # stay held until those pods end, then this frees them
            self._reclaim_task = asyncio.create_task(self.reclaimer.run(), name="reclaimer")
        if self.dra is not None and self.publisher is not None:
            assert self.dra_state is not None and self.dra_reclaimer is not None
            await self.dra_state.restore()
            await self.dra.start()
            self._dra_reclaim_task = asyncio.create_task(
                self.dra_reclaimer.run(), name="dra-reclaimer"
            )
            if self.followed_agents is not None:
                # whether this node's agent (and each other's) is there, before the publisher
                # decides who publishes a shared pool: a restarting agent is not Ready yet,
                # and publishing on an unknown would contest the pool its successor holds
                self.followed_agents.start(self.pod_environ)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(NODE_FIRST_READ):
                        await self.followed_agents.ready.wait()
            await self.publisher.start()
            self.ownership.add_listener(lambda _names: self._wake_publisher())
            self._slice_events = asyncio.create_task(
                self._trigger_publisher(self.store.subscribe_instances()), name="slice-trigger"
            )
            if self.dra_options is not None:
                self._dra_options_task = asyncio.create_task(
                    self.dra_options.follow(
                        self.store.subscribe_configurations(), self._wake_publisher
                    ),
                    name="dra-options",
                )
        if self.paths is not None:
            self.paths.follow()
        if self.settings.external_handlers:
            # last: the embedded handlers and the plugins are not kept waiting for gRPC
            await self._serve_registration()
        self.started = True
        if self.freeze_gc:
            # soon, not now: the 6 ms it takes would delay the first device lists
            asyncio.get_running_loop().call_later(FIRST_FREEZE_DELAY, freeze_long_lived)
            changes = self.store.subscribe_instances()
            self._gc_freeze = asyncio.create_task(self._freeze_when_settled(changes), name="gc")
        log.info(
            "agent started on node %s (handlers: %s; %d configuration(s))",
            self.settings.node_name,
            ", ".join(self.handlers.names()) or "none",
            len(self.store.configurations()),
        )

    def _record_notes(self) -> None:
        """Local mode: the budget's left-out devices, the refused Configurations and the
        Instances in their offline grace, for ``akri status --state-dir``
        (:mod:`agent.node.local_notes`)."""
        now, wall = time.monotonic(), time.time()
        record_notes(
            self.settings.state_dir,
            self.settings.node_name,
            self.discovery.budget,
            self.discovery.refusals(),
            {key: wall + until - now for key, until in self.discovery.offline_until().items()},
        )

    def readiness(self) -> list[str]:
        """Why the agent is not ready (empty: ready): for ``/readyz``."""
        problems = []
        if not self.store_synced:
            problems.append(
                "starting: the store has not synced yet (waiting for the Kubernetes API "
                "and the CRDs)"
            )
        elif not self.started:
            problems.append("starting: discovery and plugins are starting")
        if self.plugins is not None:
            waiting = [
                e.resource_name for e in self.plugins.endpoints() if not e.registered.is_set()
            ]
            if waiting:
                problems.append(
                    f"{len(waiting)} device plugin(s) not registered with kubelet: "
                    + ", ".join(sorted(waiting)[:5])
                )
        if self.dra is not None and not self.dra.registration.registered.is_set():
            problems.append("DRA driver not registered with kubelet")
        return problems

    def metrics_text(self) -> bytes:
        """The Prometheus text of this agent's metrics (``prometheus_client`` is imported
        on the first scrape only)."""
        from prometheus_client import generate_latest

        from agent.node.metrics import NodeCollector
        from agent.ops.metrics import registry_for

        if self._metrics_registry is None:
            self._metrics_registry = registry_for(NodeCollector(self))
        return bytes(generate_latest(self._metrics_registry))

    async def _serve_health(self) -> None:
        from agent.ops.health import HealthServer

        server = HealthServer(
            self.settings.health_address,
            self.settings.health_port or 0,
            self.readiness,
            self.metrics_text,
        )
        try:
            await server.start()
        except OSError as error:
            where = f"{self.settings.health_address}:{self.settings.health_port}"
            reason = os.strerror(error.errno) if error.errno else str(error)
            if not self.settings.local:
                # in a pod the probes use this port: running without it would have kubelet
                # restart the agent forever; exiting names the cause (exit 5, docs/commands.md)
                raise OSError(
                    error.errno,
                    f"{reason} (another process on this node holds the port? with "
                    "hostNetwork the port is the node's: choose another with --health-port "
                    "/ AKRI_HEALTH_PORT and the DaemonSet's containerPort)",
                    f"health port {where}",
                ) from error
            log.warning(
                "cannot serve health and metrics on %s (%s): the agent runs without them",
                where,
                reason,
            )
            return
        self.health = server

    async def _serve_registration(self) -> None:
        from agent.node.external.endpoints import EndpointPolicy
        from agent.node.external.handler import ExternalHandler, ProblemReporter
        from agent.node.external.registration import RegistrationServer, RegistrationService

        settings = self.settings
        policy = EndpointPolicy(
            settings.discovery_handlers_dir,
            tuple(settings.discovery_handler_networks),
            settings.discovery_handler_sockets_anywhere,
        )

        def make_handler(name: str, shared: bool, report: ProblemReporter) -> ExternalHandler:
            timeout = settings.discovery_handler_first_list_timeout
            return ExternalHandler(name, shared, report, first_list_timeout=timeout)

        service = RegistrationService(
            policy,
            self.handlers,
            self.discovery.handler_registered,
            self.discovery.handler_problem,
            make_handler,
        )
        server = RegistrationServer(settings.discovery_handlers_dir, service)
        if await server.start():
            self.registration = server

    async def _freeze_when_settled(self, changes: Subscription[InstanceEvent]) -> None:
        try:
            await freeze_when_settled(changes)
        finally:
            changes.close()

    async def _decide_path(self) -> str:
        """This node's extended-resource path, decided and then followed
        (agent/node/dra/path_follower.py); a local agent serves through device plugins."""
        # a store of the Kubernetes backend exists only once its module is imported: a local
        # agent does not import it (7 ms of its start) for this check
        kubernetes = sys.modules.get("agent.core.store.kubernetes")
        backend: type[KubernetesInstanceStore] | None = (
            None if kubernetes is None else kubernetes.KubernetesInstanceStore
        )
        if backend is None or not isinstance(self.store, backend):
            return "device-plugins"  # local mode: no API, no DRA
        from agent.node.dra.path_follower import PathFollower

        self.paths = PathFollower(
            self.store.api_client,
            self.settings.node_name,
            self.settings.extended_resources,
            ledger=self.ledger,
            instances=self.served.all,
            instance_events=self.store.subscribe_instances,
            plugins=self.plugins,
        )
        return await self.paths.decide(
            dra_enabled=self.dra is not None,
            publisher=self.publisher,
            claim_status=self.dra.claim_status if self.dra is not None else None,
        )

    @property
    def extended_resource_path(self) -> str:
        """``dra`` or ``device-plugins``: this node's mode (dra/extended.py)."""
        return self.paths.path if self.paths is not None else "device-plugins"

    @property
    def extended_resource_reason(self) -> str:
        return self.paths.reason if self.paths is not None else ""

    @property
    def runtime_cdi(self) -> RuntimeCdi | None:
        """This node's runtime's CDI, once read."""
        return self.paths.runtime_cdi if self.paths is not None else None

    @property
    def allocated_claims(self) -> AllocatedClaims | None:
        """The ResourceClaims followed for this node's device plugins, while they are."""
        return self.paths.allocated_claims if self.paths is not None else None

    def _wake_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.trigger()
        if self.dra_health is not None:
            self.dra_health.changed()

    async def _trigger_publisher(self, events: Subscription[InstanceEvent]) -> None:
        async for _ in events:
            if self.publisher is not None:
                self.publisher.trigger()
            if self.dra_health is not None:
                self.dra_health.changed()

    async def stop(self) -> None:
        """Stop discovery; Instances and slots stay as they are for the next start."""
        if self._gc_freeze is not None:
            self._gc_freeze.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_freeze
        for events in (self._slice_events, self._dra_options_task):
            if events is not None:
                events.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await events
        if self.paths is not None:
            await self.paths.stop_following()
        if self.publisher is not None:
            await self.publisher.close()
        # before discovery: its runners clear their offline sets when they stop
        await self.offline_marks.close()
        if self.paths is not None:
            await self.paths.close_claims()
        if self._dra_reclaim_task is not None:
            self._dra_reclaim_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dra_reclaim_task
        if self.dra is not None:
            await self.dra.stop()
        if self._reclaim_task is not None:
            self._reclaim_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reclaim_task
        if self.health is not None:
            await self.health.stop()
        if self.registration is not None:
            await self.registration.stop()
        if self.plugins is not None:
            await self.plugins.close()
        await self.discovery.close()
        if self.followed_nodes is not None:
            await self.followed_nodes.close()
        if self.followed_agents is not None:
            await self.followed_agents.close()
        await self.ledger.close()
        for task in (self._activity, self._finalizers):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.store.close()
        if self._loop_monitor_task is not None:
            self._loop_monitor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_monitor_task
            self.loop_monitor.report()
        # after the DRA driver stopped: nothing prepares any more (acceptance F7: an empty
        # checkpoint.json was left on every node after the documented uninstall)
        if (
            self.leaving_for_good
            and self.dra is not None
            and self.dra.state.checkpoint.remove_if_empty()
        ):
            log.info("uninstalled: removed the empty DRA checkpoint %s",
                     self.dra.state.checkpoint.path)  # fmt: skip
        log.info("agent stopped")

    async def stay_while_uninstalled(self) -> None:
        """Asked to stop with DRA claims prepared here: leave at once when this agent is
        being replaced, stay to unprepare them while the install is removed
        (agent/node/leaving.py, issue 33.3)."""
        if self.dra is None:
            return
        checkpoint = self.dra.state.checkpoint
        from agent.core.store.kubernetes import KubernetesInstanceStore
        from agent.node.leaving import Departure, linger_while_prepared, why_stopping

        if not isinstance(self.store, KubernetesInstanceStore):
            return
        # asked also with no claim prepared: an uninstalled agent removes its empty checkpoint
        why = await why_stopping(self.store.api_client, self.pod_environ)
        if why.departure is Departure.UNKNOWN and checkpoint.claims:
            # a rollout is never taken for an uninstall (issue 39.3): on doubt, leave as one
            log.warning(
                "stopping with %d DRA claim(s) prepared on this node; cannot tell a rollout "
                "from an uninstall (%s): taken as a rollout, the next agent here unprepares "
                "them (if the install is being removed, their pods end once an agent runs "
                "here again: docs/install.md)",
                len(checkpoint.claims),
                why.reason,
            )
        elif why.departure is Departure.REPLACED and checkpoint.claims:
            log.info(
                "stopping with %d DRA claim(s) prepared on this node (%s): the next agent "
                "here unprepares them",
                len(checkpoint.claims),
                why.reason,
            )
        if why.departure is not Departure.UNINSTALLED:
            return
        if checkpoint.claims or checkpoint.releases:
            self.dra.state.releases_may_fail = True
            stop_needs = STOP_DEADLINE + 0.5
            left = await linger_while_prepared(
                lambda: len(checkpoint.claims),
                why,
                stop_needs=stop_needs,
                releasing=lambda: len(checkpoint.releases),
            )
            if left:
                log.error(
                    "leaving with %d DRA claim(s) prepared: their pods stay Terminating until "
                    "an agent runs on this node again (docs/install.md)",
                    left,
                )
                return
            if checkpoint.releases:
                log.error(
                    "leaving with %d slot release(s) the API refused: they stay pending in "
                    "the DRA checkpoint %s, which stays on this node; an agent that runs here "
                    "again completes them at its start (docs/install.md)",
                    len(checkpoint.releases),
                    checkpoint.path,
                )
            else:
                log.info("every DRA claim of this node is unprepared: leaving")
        self.leaving_for_good = True

    async def run(self, stop: asyncio.Event, *, stop_within: float = STOP_DEADLINE) -> None:
        """Start, wait for ``stop``, stop — within ``stop_within`` seconds: what is left
        then is cancelled (every write is atomic, so nothing is left half-written)."""
        starting = asyncio.ensure_future(self.start())
        waiting = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()  # start failures (corrupt state, API down) propagate
                await waiting
                await self.stay_while_uninstalled()
        finally:
            for task in (starting, waiting):
                task.cancel()
            try:
                async with asyncio.timeout(stop_within):
                    await self.stop()
            except TimeoutError:
                log.warning("agent stop took longer than %.0fs: leaving the rest", stop_within)
