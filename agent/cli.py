"""The ``akri`` command: ``akri agent``, ``controller``, ``handler``, ``status``, ``version``."""

from __future__ import annotations

# Imports are deferred to the command that needs them: `akri --version` and `akri version`
# import nothing beyond ``agent`` (the version is a constant there, not an importlib.metadata
# scan of every installed distribution, 14-56 ms), and `akri status` imports neither gRPC nor
# the event loop's modules before it needs them.
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agent import __version__

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from agent.controller.settings import ControllerSettings
    from agent.core.store.base import InstanceStore
    from agent.node.settings import AgentSettings
    from agent.ops.flags import FlagParser

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_CORRUPT_STATE = 3
EXIT_UNAVAILABLE = 4
EXIT_UNUSABLE_PATH = 5
EXIT_INTERRUPTED = 130  # Ctrl-C before a command could stop cleanly (128 + SIGINT, as shells)
WAIT_STEP = 0.2  # seconds between two looks of `akri status --wait`
# the commands that run until SIGINT/SIGTERM: the signals are held until their loop takes them
RUN_UNTIL_STOPPED = ("agent", "controller", "handler")

DESCRIPTION = """\
akri: an Akri-compatible device discovery agent for Kubernetes. It finds devices near each node
(USB, serial, IP cameras, mDNS/MQTT/OPC UA devices) and offers them to pods as Akri Instances
with capacity slots.

Try it without a cluster: akri agent --local --config examples/debug-echo.yaml
"""
EPILOG = "akri COMMAND --help shows a command's flags and their defaults (docs/commands.md)."
AGENT_DESCRIPTION = (
    "The per-node agent (a DaemonSet): discovers devices with the handlers its Configurations "
    "name, keeps one Instance per device with its capacity slots, and offers the slots to "
    "kubelet (device plugins; DRA). With --local it needs no cluster: Configurations come from "
    "--config files and Instances are kept in --state-dir. Every flag has an AKRI_* variable "
    "(flag > environment > default)."
)
# what --poll-interval means to a handler process (the agent's help speaks of Configuration
# files, which a handler process does not read)
HANDLER_POLL_HELP = (
    "debugEcho: seconds between looks at --debug-echo-availability-file where inotify cannot "
    "be used (at most 0.5)"
)

# the agent flags that apply to ``akri handler``
HANDLER_FLAGS = {
    "--discovery-handlers-dir",
    "--log-level",
    "--debug-echo-shared",
    "--debug-echo-availability-file",
    "--udev-monitor-source",
    "--poll-interval",
}


def _parser(command: str | None = None) -> FlagParser:
    """The whole command line; the flags of ``akri controller`` only when ``command`` is
    ``controller``: they come from the controller's modules (broker, Lease and node
    settings, the Kubernetes client: 20-70 ms of imports) that no other command needs."""
    import argparse
    import dataclasses
    from pathlib import Path

    from agent.node.settings import AGENT_OPTIONS, add_options, parse_seconds
    from agent.ops.flags import FlagParser

    parser = FlagParser(
        prog="akri",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"akri {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("version", help="print the version", description="Print the version.")
    agent = commands.add_parser(
        "agent",
        help="run the node agent (the DaemonSet; --local: no cluster)",
        description=AGENT_DESCRIPTION,
    )
    add_options(agent, AGENT_OPTIONS)
    controller = commands.add_parser(
        "controller",
        help="run the cluster-wide controller (brokers, dead nodes' slots; leader-elected)",
        description="Broker Pods/Jobs and Services for Configurations that ask for them, and "
        "dead nodes' slots given back. Run two or more replicas: one holds the Lease and "
        "works, the others wait warm (docs/controller.md).",
    )
    if command == "controller":
        from agent.controller.settings import add_flags

        add_flags(controller)
    handler = commands.add_parser(
        "handler",
        help="run one of the embedded discovery handlers as an external handler process",
        description="Serve v0.DiscoveryHandler/Discover for NAME on <dir>/<NAME>.sock (or "
        "POD_IP:PORT when POD_IP is set) and register with the agent's "
        "<dir>/agent-registration.sock, again whenever the agent restarts.",
    )
    handler.add_argument("name", metavar="NAME", help="debugEcho, udev, ... (as in Configurations)")
    handler.add_argument(
        "--port",
        type=int,
        default=10000,
        metavar="PORT",
        help="port served when POD_IP is set (default: 10000, as Akri's handlers)",
    )
    add_options(
        handler,
        tuple(
            dataclasses.replace(o, help=HANDLER_POLL_HELP) if o.flag == "--poll-interval" else o
            for o in AGENT_OPTIONS
            if o.flag in HANDLER_FLAGS
        ),
    )
    status = commands.add_parser(
        "status",
        help="show Configurations, Instances and their slots (cluster or local state)",
        description="Reads the cluster when one is configured ($AKRI_KUBECONFIG, $KUBECONFIG, "
        "or the service account of a pod, e.g. `kubectl exec` into the agent) or asked for "
        "(--kubeconfig, --cluster); else the local state directory (--state-dir, default "
        "$AKRI_STATE_DIR or /var/lib/akri/state). --local, --state-dir, $AKRI_LOCAL=true or "
        "$AKRI_STATE_DIR in the environment (a local agent's settings) choose the state "
        "directory even when a cluster is configured.",
    )
    status.add_argument(
        "--local",
        action="store_true",
        help="read a local state directory even when a cluster is configured",
    )
    status.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="local state directory (implies --local; default: /var/lib/akri/state) "
        "[env AKRI_STATE_DIR]",
    )
    status.add_argument(
        "--output",
        "-o",
        choices=("table", "json"),
        default="table",
        help="table (default): aligned columns for people; json: CRD-shaped objects for scripts",
    )
    status.add_argument(
        "--kubeconfig",
        default=None,
        metavar="PATH",
        help="read the cluster with this kubeconfig (default: none, unless configured as "
        "above) [env AKRI_KUBECONFIG, then KUBECONFIG]",
    )
    status.add_argument(
        "--cluster",
        action="store_true",
        help="read the cluster even when none is configured in the environment (in a pod, "
        "$KUBECONFIG, ~/.kube/config)",
    )
    status.add_argument(
        "--namespace",
        "-n",
        default=None,
        metavar="NS",
        help="cluster: only this namespace (default: all)",
    )
    status.add_argument(
        "--wait",
        type=parse_seconds,
        default=0.0,
        metavar="SECONDS",
        help="an agent was just started: wait up to SECONDS for its first Instance (the state "
        "directory or the cluster may not be there yet) before printing; exit 1 if none came "
        "(default: 0: print at once)",
    )
    cleanup = commands.add_parser(
        "uninstall-cleanup",
        help="delete every Configuration and wait until their Instances and brokers are gone "
        "(the first step of an uninstall; the Helm chart's pre-delete hook)",
        description="Deletes every Configuration (all namespaces), then waits until no "
        "Instance, broker Pod/Job/Service (controller=akri.sh) or DeviceClass of akri "
        "controller is left; then deletes the --daemonset and --deployment workloads in the "
        "foreground and waits until they and their pods are gone; then deletes the --lease. "
        "Says what it waits for every 10 s. Exit 0 once all is gone, 1 after --timeout with "
        "what is left (docs/install.md, Uninstall).",
    )
    cleanup.add_argument(
        "--timeout",
        type=parse_seconds,
        default=120.0,
        metavar="SECONDS",
        help="give up after SECONDS (default: 120)",
    )
    cleanup.add_argument(
        "--namespace",
        default=None,
        metavar="NS",
        help="where --daemonset, --deployment and --lease are (default: the kubeconfig's or "
        "the pod's namespace)",
    )
    cleanup.add_argument(
        "--daemonset",
        action="append",
        default=[],
        metavar="NAME",
        help="then delete this DaemonSet in the foreground and wait until it and its pods are "
        "gone (repeatable: the agents', the discovery handlers')",
    )
    cleanup.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="NAME",
        help="the same for this Deployment (repeatable: the controller's)",
    )
    cleanup.add_argument(
        "--lease",
        default=None,
        metavar="NAME",
        help="last, delete this Lease (the controller's leader election)",
    )
    cleanup.add_argument(
        "--kubeconfig",
        default=None,
        metavar="PATH",
        help="kubeconfig (default: in-cluster config, then $KUBECONFIG, ~/.kube/config) "
        "[env AKRI_KUBECONFIG, then KUBECONFIG]",
    )
    return parser


def _uninstall_cleanup(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from agent.controller.uninstall_cleanup import Workloads, run_cleanup
    from agent.core.kube import ApiError, ConfigError, TransportError, make_kube_client

    _configure_logging("INFO")
    kubeconfig = args.kubeconfig or os.environ.get("AKRI_KUBECONFIG") or None

    async def run() -> bool:
        client = make_kube_client(kubeconfig)
        workloads = None
        if args.daemonset or args.deployment or args.lease:
            workloads = Workloads(
                namespace=args.namespace or client.namespace,
                daemonsets=tuple(args.daemonset),
                deployments=tuple(args.deployment),
                lease=args.lease,
            )
        try:
            return await run_cleanup(client, give_up_after=args.timeout, workloads=workloads)
        finally:
            await client.close()

    try:
        return 0 if asyncio.run(run()) else EXIT_FAILURE
    except (ApiError, TransportError) as error:
        print(f"akri uninstall-cleanup: {error}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ConfigError as error:
        print(f"akri uninstall-cleanup: {error}", file=sys.stderr)
        return EXIT_USAGE


def _configure_logging(level: str, log_format: str = "text", node: str = "") -> None:
    import logging

    if log_format == "json":
        from agent.ops.log_format import JsonFormatter

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(node))
        logging.basicConfig(level=getattr(logging, level), handlers=[handler])
        return
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _check_state_dir(path: Path) -> str | None:
    """Why ``path`` cannot hold the local state (None if it can): it is created if missing,
    and a file is written and removed to prove it is writable."""
    import tempfile

    from agent.core.store.files import ensure_directory

    try:
        ensure_directory(path)  # "Not a directory" for a file, not mkdir's "File exists"
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"{path}: {error.strerror or error}"
    return None


async def _run_agent(settings: AgentSettings) -> int:
    import asyncio
    import gc
    import logging

    from agent.core.store.base import CorruptStateError, StoreError
    from agent.core.store.local import LocalInstanceStore
    from agent.node.app import Agent
    from agent.stop_signals import take_stop_signals

    store: InstanceStore
    if settings.local:
        problem = _check_state_dir(settings.state_dir)
        if problem is not None:
            logging.getLogger("agent").error(
                "cannot use the state directory (--state-dir) %s", problem
            )
            return EXIT_UNUSABLE_PATH
        store = LocalInstanceStore(
            settings.state_dir, settings.config, poll_interval=settings.poll_interval
        )
    else:
        from agent.core.kube import make_kube_client
        from agent.core.store.kubernetes import KubernetesInstanceStore, KubernetesSettings

        try:
            api_client = make_kube_client(settings.kubeconfig)
        except Exception as error:
            logging.getLogger("agent").error(
                "cannot configure the Kubernetes client (%s: %s); use --kubeconfig, run "
                "in a pod, or use --local",
                type(error).__name__,
                error,
            )
            return EXIT_USAGE
        store = KubernetesInstanceStore(
            api_client,
            KubernetesSettings(settings.node_name, settings.namespace, settings.kubeconfig),
        )
    agent = Agent(settings, store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stop_the_process() -> None:
        # the process exits within 2 s: tearing down 1,000 gRPC servers made cyclic garbage
        # whose full collections held the loop (and the stop) 150-240 ms; exit frees it all
        gc.disable()
        stop.set()

    take_stop_signals(loop, stop_the_process)
    try:
        await agent.run(stop)
    except CorruptStateError as error:
        logging.getLogger("agent").error("refusing to start: %s", error)
        return EXIT_CORRUPT_STATE
    except StoreError as error:
        logging.getLogger("agent").error("cannot start: %s", error)
        return EXIT_UNAVAILABLE
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        logging.getLogger("agent").error("cannot start: %s%s", where, error.strerror or error)
        return EXIT_UNUSABLE_PATH
    except Exception as error:
        # an API failure the start-up code did not translate: a clean line, not a traceback
        from agent.core.kube import ApiError

        if not isinstance(error, ApiError):
            raise
        logging.getLogger("agent").error("cannot start: Kubernetes API: %s", error)
        return EXIT_UNAVAILABLE
    return 0


async def _run_controller(settings: ControllerSettings) -> int:
    import asyncio
    import logging

    from agent.controller.app import Controller
    from agent.core.kube import ApiError, make_kube_client
    from agent.core.store.base import StoreError
    from agent.stop_signals import take_stop_signals

    log = logging.getLogger("agent.controller")
    try:
        client = make_kube_client(settings.kubeconfig)
    except Exception as error:
        log.error(
            "cannot configure the Kubernetes client (%s: %s); use --kubeconfig or run in a pod",
            type(error).__name__,
            error,
        )
        return EXIT_USAGE
    controller = Controller(settings, client)
    stop = asyncio.Event()
    take_stop_signals(asyncio.get_running_loop(), stop.set)
    try:
        await controller.run(stop)
    except StoreError as error:
        log.error("cannot start: %s", error)
        return EXIT_UNAVAILABLE
    except ApiError as error:  # TransportError too (no answer)
        log.error("cannot start: Kubernetes API: %s", error)
        return EXIT_UNAVAILABLE
    except OSError as error:
        log.error("cannot start: %s", error.strerror or error)
        return EXIT_UNUSABLE_PATH
    return 0


def _controller(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from agent.controller.settings import ControllerSettings, ControllerSettingsError

    try:
        settings = ControllerSettings.resolve(args, os.environ)
    except ControllerSettingsError as error:
        print(f"akri controller: {error}", file=sys.stderr)
        return EXIT_USAGE
    _configure_logging(settings.log_level, settings.log_format, settings.identity)
    return asyncio.run(_run_controller(settings))


async def _cluster_objects(
    kubeconfig: str | None, namespace: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Configurations, Instances, and the agents' budget Events on Configurations (empty
    where Events may not be listed: the agent's own service account may only create them)."""
    from agent.core.kube import ApiError, make_kube_client, resource_path

    client = make_kube_client(kubeconfig)
    try:
        found = []
        for plural in ("configurations", "instances"):
            items, _version = await client.list_all(
                resource_path("akri.sh", "v0", plural, namespace)
            )
            found.append(items)
        try:
            events, _version = await client.list_all(
                resource_path("", "v1", "events", namespace),
                params={"fieldSelector": "involvedObject.kind=Configuration"},
            )
        except ApiError as error:
            if error.status not in (401, 403):
                raise
            events = []
        return found[0], found[1], events
    finally:
        await client.close()


def _cluster_status(args: argparse.Namespace, why: str) -> int:
    import asyncio
    import os
    import time

    from agent.core.kube import ApiError, ConfigError, TransportError
    from agent.core.model.instance import Instance
    from agent.node.status import cluster_json, configurations_table, to_table

    # $KUBECONFIG is read by the client itself (after the in-cluster service account)
    kubeconfig = args.kubeconfig or os.environ.get("AKRI_KUBECONFIG") or None
    deadline = time.monotonic() + args.wait
    while True:
        try:
            configurations, raw, events = asyncio.run(_cluster_objects(kubeconfig, args.namespace))
        except (ApiError, ConfigError, TransportError, OSError) as error:
            if time.monotonic() < deadline:  # --wait: the API server may be starting
                time.sleep(WAIT_STEP)
                continue
            print(f"akri status: cannot read the cluster ({why}): {error}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        if raw or time.monotonic() >= deadline:
            break
        time.sleep(WAIT_STEP)
    instances = []
    for obj in raw:
        try:
            instances.append(Instance.from_dict(obj))
        except (KeyError, TypeError, ValueError) as error:
            name = (obj.get("metadata") or {}).get("name", "?")
            print(f"akri status: skipping Instance {name}: {error}", file=sys.stderr)
    instances.sort(key=lambda i: (i.namespace, i.name))
    from agent.node.dra.extended import observed_paths
    from agent.node.status import cluster_offline

    nodes, slices = _nodes_and_slices(kubeconfig, instances)
    # which path serves akri.sh/<name> limits on each node, as the scheduler sees it
    paths = observed_paths(nodes, slices) if nodes is not None and slices is not None else None
    offline = cluster_offline(instances, nodes or [], slices or [])
    if args.output == "json":
        import json

        body = json.loads(cluster_json(configurations, instances))
        body["extendedResourcePaths"] = paths  # node -> "dra" | "device-plugins" (None: unread)
        if paths is not None and paths.plugin_names:
            # a node on DRA: the names of the devices it shares with device-plugin nodes
            body["extendedResourcesThroughDevicePlugins"] = paths.plugin_names
        body["offline"] = {str(key): parts for key, parts in sorted(offline.items())}
        text = json.dumps(body, indent=2, sort_keys=True)
    else:
        from agent.node.dra.extended import paths_table

        text = (
            configurations_table(configurations, instances, events)
            + "\n\n"
            + to_table(instances, offline)
            + "\n\n"
            + paths_table(paths)
        )
    return _print(text) or _nothing_came(args.wait, "in the cluster", raw)


NODE_READS_AT_ONCE = 16  # akri status reading Nodes one by one (no list permission)


def _nothing_came(wait: float, where: str, instances: Sequence[object]) -> int:
    """0, or 1 with a line saying so when ``--wait`` ran out without an Instance."""
    if not wait or instances:
        return 0
    print(f"akri status: no Instance {where} after waiting {wait:g} s", file=sys.stderr)
    return EXIT_FAILURE


def _nodes_and_slices(
    kubeconfig: str | None, instances: Sequence[Any] = ()
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """The Nodes and the ``akri.sh`` ResourceSlices (each None where it cannot be read: RBAC,
    DRA not served): which path each node is on, and what it shows of offline devices. Where
    Nodes may not be listed — the agent's own ServiceAccount, as ``kubectl exec ... akri
    status`` runs, may only get them — the nodes the Instances and the slices name are read
    one by one."""
    import asyncio

    from agent.core.kube import ApiError, ConfigError, TransportError, make_kube_client
    from agent.core.kube import resource_path as path
    from agent.core.model.resource_slices import selected_nodes

    async def read() -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
        client = make_kube_client(kubeconfig)
        try:
            slices: list[dict[str, Any]] | None
            try:
                slices, _version = await client.list_all(
                    path("resource.k8s.io", "v1", "resourceslices"),
                    params={"fieldSelector": "spec.driver=akri.sh"},
                )
            except ApiError as error:
                if error.status not in (401, 403, 404):
                    raise
                slices = None
            try:
                nodes, _version = await client.list_all(path("", "v1", "nodes"))
                return nodes, slices
            except ApiError as error:
                if error.status not in (401, 403):
                    raise
            named = {node for instance in instances for node in instance.nodes}
            for item in slices or []:
                spec = item.get("spec") or {}
                if spec.get("nodeName"):
                    named.add(str(spec["nodeName"]))
                named.update(selected_nodes(spec))
            limit = asyncio.Semaphore(NODE_READS_AT_ONCE)

            async def get(name: str) -> dict[str, Any] | None:
                async with limit:
                    try:
                        return await client.get(path("", "v1", "nodes", name=name))
                    except ApiError as error:
                        if error.status == 404:
                            return None  # gone: nothing to show of it
                        raise

            try:
                found = await asyncio.gather(*(get(name) for name in sorted(named)))
            except ApiError as error:
                if error.status not in (401, 403):
                    raise
                return None, slices
            return [node for node in found if node is not None], slices
        finally:
            await client.close()

    try:
        return asyncio.run(read())
    except (ApiError, ConfigError, TransportError, OSError):
        return None, None


def _print(text: str) -> int:
    import os

    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (``| head``): no traceback, and none at exit either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    return 0


def _status(args: argparse.Namespace) -> int:
    import os
    import time
    from pathlib import Path

    from agent.core.store.base import CorruptStateError, StoreError
    from agent.node.status import StatusUsageError, choose_source, to_json, to_table

    try:
        source = choose_source(
            kubeconfig=args.kubeconfig,
            cluster=args.cluster,
            local=args.local,
            state_dir=args.state_dir,
            environ=os.environ,
        )
    except StatusUsageError as error:
        print(f"akri status: {error}", file=sys.stderr)
        return EXIT_USAGE
    if source.kind == "cluster":
        return _cluster_status(args, source.reason)
    from agent.core.store.local import read_state_dir

    state_dir = args.state_dir or Path(os.environ.get("AKRI_STATE_DIR", "/var/lib/akri/state"))
    deadline = time.monotonic() + args.wait
    while True:
        # --wait: an agent started a moment ago may not have made its directory yet
        if state_dir.is_dir():
            try:
                instances = read_state_dir(state_dir)
            except CorruptStateError as error:
                print(f"akri status: {error}", file=sys.stderr)
                return EXIT_CORRUPT_STATE
            except StoreError as error:  # kept changing while read without its lock file
                print(f"akri status: {error}", file=sys.stderr)
                return EXIT_UNAVAILABLE
            if instances or time.monotonic() >= deadline:
                break
        elif time.monotonic() >= deadline:
            what = "is not a directory" if state_dir.exists() else "does not exist"
            waited = f" after waiting {args.wait:g} s" if args.wait else ""
            print(
                f"akri status: state directory {state_dir} {what}{waited} ({source.reason}; "
                "--kubeconfig or --cluster read a cluster)",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        time.sleep(WAIT_STEP)
    where = f"in {state_dir}"
    if args.output == "json":
        return _print(to_json(instances)) or _nothing_came(args.wait, where, instances)
    from agent.node.local_notes import note_lines, offline_until, read_notes
    from agent.node.status import local_offline

    # what local agents say about budgets, refusals and devices in their offline grace (local
    # mode has no Events, and no kubelet or ResourceSlices to ask)
    notes = read_notes(state_dir)
    offline = local_offline(offline_until(notes), time.time())
    text = "\n".join([to_table(instances, offline), *note_lines(notes)])
    return _print(text) or _nothing_came(args.wait, where, instances)


async def _run_handler(settings: AgentSettings, name: str, port: int) -> int:
    import asyncio
    import logging

    from agent.node.app import build_handlers
    from agent.node.external.serve import run_handler_process
    from agent.stop_signals import take_stop_signals

    handlers = build_handlers(settings)
    handler = handlers.get(name)
    if handler is None:
        print(
            f"akri handler: no handler named {name!r} (available: {', '.join(handlers.names())})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    stop = asyncio.Event()
    take_stop_signals(asyncio.get_running_loop(), stop.set)
    try:
        await run_handler_process(handler, settings.discovery_handlers_dir, port, stop)
    except OSError as error:
        logging.getLogger("agent.handler").error("cannot serve: %s", error)
        return EXIT_UNUSABLE_PATH
    return 0


def main(argv: Sequence[str] | None = None, *, signals_held: bool = False) -> int:
    """Entry point of the ``akri`` command (through ``agent/launch.py``, which holds SIGINT
    and SIGTERM before anything is imported: ``signals_held``)."""
    try:
        return _main(argv, signals_held)
    except KeyboardInterrupt:
        # Ctrl-C where Python still turns it into an exception (akri status --wait, a command
        # that is not a long-running one): an exit, not a traceback
        return EXIT_INTERRUPTED


def _main(argv: Sequence[str] | None, signals_held: bool) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # the first word that is not an option names the command (`akri` itself has no option
    # that takes a value)
    command = next((word for word in arguments if not word.startswith("-")), None)
    if command not in RUN_UNTIL_STOPPED:
        if signals_held:
            from agent.stop_signals import release_stop_signals

            release_stop_signals()  # a Ctrl-C held meanwhile arrives now (KeyboardInterrupt)
    elif not signals_held and argv is None:
        from agent.stop_signals import hold_stop_signals

        hold_stop_signals()  # `python -m agent.cli agent ...`
    if arguments in (["--version"], ["version"]):
        # before the parser: building it imports the agent's settings (and their modules)
        print(f"akri {__version__}")
        return 0
    import asyncio
    import os

    from agent.node.settings import (
        AGENT_OPTIONS,
        SYSTEM_PATHS,
        AgentSettings,
        SettingsError,
        resolve,
    )

    parser = _parser(command)
    args, unknown = parser.parse_known_args(arguments)
    if unknown:
        # said by the command's own parser: it knows the flags to suggest
        parser.subparser(args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "version":
        print(f"akri {__version__}")
        return 0
    if args.command == "status":
        return _status(args)
    if args.command == "controller":
        return _controller(args)
    if args.command == "uninstall-cleanup":
        return _uninstall_cleanup(args)
    if args.command == "handler":
        try:
            values = resolve(args, AGENT_OPTIONS, os.environ)
            values.update(local=True, debug_echo=True)  # no cluster; every handler offered
            if values["discovery_handlers_dir"] is None:
                # a handler process joins the node's agent: the system directory, not a
                # local agent's (give --discovery-handlers-dir for that)
                values["discovery_handlers_dir"] = SYSTEM_PATHS["discovery_handlers_dir"]
            settings = AgentSettings.from_values(values)
        except SettingsError as error:
            print(f"akri handler: {error}", file=sys.stderr)
            return EXIT_USAGE
        if not 0 < args.port < 65536:
            print(f"akri handler: --port must be 1 to 65535, got {args.port}", file=sys.stderr)
            return EXIT_USAGE
        _configure_logging(settings.log_level)
        return asyncio.run(_run_handler(settings, args.name, args.port))
    try:
        settings = AgentSettings.from_values(resolve(args, AGENT_OPTIONS, os.environ))
    except SettingsError as error:
        print(f"akri agent: {error}", file=sys.stderr)
        return EXIT_USAGE
    _configure_logging(settings.log_level, settings.log_format, settings.node_name)
    from agent.node.app import import_what_settings_need

    import_what_settings_need(settings)
    return asyncio.run(_run_agent(settings))


if __name__ == "__main__":
    # `python -m agent.cli`: main holds SIGINT/SIGTERM first thing for the commands that run
    # until stopped, as agent/launch.py does for the console script
    sys.exit(main())
