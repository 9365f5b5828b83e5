"""Command-line flags, each with a matching ``AKRI_*`` environment variable.

A flag given on the command line wins over the environment; the environment wins over the
default. Akri's own variable names are honoured as fallbacks where Akri has one
(``AGENT_NODE_NAME``, ``DEBUG_ECHO_INSTANCES_SHARED``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.node.discovery.budget import DEFAULT_MAX_INSTANCES
from agent.ops.flags import MIN_INTERVAL as MIN_INTERVAL
from agent.ops.flags import Option as Option
from agent.ops.flags import SettingsError as SettingsError
from agent.ops.flags import ValueProblem as ValueProblem
from agent.ops.flags import add_options as add_options
from agent.ops.flags import one_of as one_of
from agent.ops.flags import parse_bool as parse_bool
from agent.ops.flags import parse_interval as parse_interval
from agent.ops.flags import parse_log_level as parse_log_level
from agent.ops.flags import parse_port as parse_port
from agent.ops.flags import parse_seconds as parse_seconds
from agent.ops.flags import resolve as resolve

# The agent runs with the node's network (hostNetwork), so its port is the node's. Not 8080
# (Akri's metrics port, and the default of many web servers and proxies that may run on a
# node), not 8081 (controller-runtime's health probes), not 9100-9999 (the Prometheus
# exporters' allocations: node-exporter 9100 runs on most nodes), not Kubernetes' own
# 10248-10259 (kubelet, kube-proxy, control plane) nor 10000 (``akri handler --port``).
CLUSTER_HEALTH_PORT = 10280

# Sockets and directories shared with kubelet and external handlers: the system's in cluster
# mode; in local mode under the state directory unless given, so a local agent needs no root,
# reaches into no system path and never collides with another local agent (issue 23, item 10).
SYSTEM_PATHS = {
    "pod_resources_socket": Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
    "plugins_registry_dir": Path("/var/lib/kubelet/plugins_registry"),
    "dra_plugin_dir": Path("/var/lib/kubelet/plugins/akri.sh"),
    "cdi_dir": Path("/var/run/cdi"),
    "discovery_handlers_dir": Path("/var/lib/akri"),
}
LOCAL_PATHS = {  # relative to --state-dir
    "pod_resources_socket": Path("kubelet/pod-resources/kubelet.sock"),
    "plugins_registry_dir": Path("kubelet/plugins_registry"),
    "dra_plugin_dir": Path("kubelet/plugins/akri.sh"),
    "cdi_dir": Path("cdi"),
    # the state dir itself: unix socket paths are limited to 107 bytes, and handlers put
    # their own sockets beside the registration socket
    "discovery_handlers_dir": Path(),
}

# the directories and sockets the agent shares with kubelet and handler processes (gRPC
# addresses and paths others read): made absolute at start (AgentSettings.from_values)
SHARED_PATHS = ("state_dir", "device_plugin_dir", *SYSTEM_PATHS)


def _where(name: str) -> str:
    local = "STATE_DIR" if LOCAL_PATHS[name] == Path() else f"STATE_DIR/{LOCAL_PATHS[name]}"
    return f"{SYSTEM_PATHS[name]} in cluster mode, {local} in local mode"


def _networks(text: str) -> tuple[Any, ...]:
    from agent.node.external.endpoints import parse_networks

    try:
        return parse_networks(text)
    except ValueError as error:
        raise ValueProblem(str(error)) from None


def _paths(text: str) -> list[Path]:
    return [Path(part) for part in text.split(os.pathsep) if part]


def _instance_limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueProblem(f"must be a whole number of instances, got {text[:40]!r}") from None
    if value < 0:
        raise ValueProblem(f"must be ≥ 0 (0: no limit), got {value}")
    return value


AGENT_OPTIONS = (
    Option(
        "--local",
        "AKRI_LOCAL",
        parse_bool,
        False,
        "run with the local file-backed store instead of the Kubernetes API",
    ),
    Option(
        "--state-dir",
        "AKRI_STATE_DIR",
        Path,
        Path("/var/lib/akri/state"),
        "local mode: directory holding Instances",
    ),
    Option(
        "--config",
        "AKRI_CONFIG",
        _paths,
        [],
        "local mode: Configuration YAML file or directory (repeatable; env: "
        f"'{os.pathsep}'-separated)",
        repeat=True,
    ),
    Option(
        "--node-name",
        "AKRI_NODE_NAME",
        str,
        None,
        "this node's name (default: $AGENT_NODE_NAME, then the host name)",
        fallbacks=("AGENT_NODE_NAME",),
        metavar="NAME",
    ),
    Option(
        "--log-level",
        "AKRI_LOG_LEVEL",
        parse_log_level,
        "INFO",
        "log lines of this level and above",
    ),
    Option(
        "--local-offline-grace",
        "AKRI_LOCAL_OFFLINE_GRACE",
        parse_seconds,
        0.0,
        "seconds a vanished local (unshared) device keeps its Instance",
    ),
    Option(
        "--shared-offline-grace",
        "AKRI_SHARED_OFFLINE_GRACE",
        parse_seconds,
        300.0,
        "seconds a vanished shared device keeps this node in its Instance",
    ),
    Option(
        "--debug-echo",
        "AKRI_DEBUG_ECHO",
        parse_bool,
        None,
        "enable the embedded debugEcho handler (default: on in local mode)",
        fallbacks=("ENABLE_DEBUG_ECHO",),
    ),
    Option(
        "--debug-echo-shared",
        "AKRI_DEBUG_ECHO_SHARED",
        parse_bool,
        True,
        "debugEcho devices are shared",
        fallbacks=("DEBUG_ECHO_INSTANCES_SHARED",),
    ),
    Option(
        "--debug-echo-availability-file",
        "AKRI_DEBUG_ECHO_AVAILABILITY_FILE",
        Path,
        Path("/tmp/debug-echo-availability.txt"),
        "debugEcho reports no devices while this file contains OFFLINE",
    ),
    Option(
        "--kubeconfig",
        "AKRI_KUBECONFIG",
        str,
        None,
        "cluster mode: kubeconfig file (default: in-cluster config, then ~/.kube/config)",
        fallbacks=("KUBECONFIG",),
        metavar="PATH",
    ),
    Option(
        "--namespace",
        "AKRI_NAMESPACE",
        str,
        None,
        "cluster mode: only watch Configurations/Instances in this namespace (default: all)",
        metavar="NS",
    ),
    Option(
        "--device-plugin-dir",
        "AKRI_DEVICE_PLUGIN_DIR",
        Path,
        None,
        "kubelet device-plugin directory (default: /var/lib/kubelet/device-plugins/ in "
        "cluster mode; in local mode the plugins run only when this is given)",
    ),
    Option(
        "--pod-resources-socket",
        "AKRI_POD_RESOURCES_SOCKET",
        Path,
        None,
        "kubelet pod-resources socket, used to free slots of containers that are gone "
        f"(default: {_where('pod_resources_socket')})",
    ),
    Option(
        "--reclaim-interval",
        "AKRI_RECLAIM_INTERVAL",
        parse_interval,
        1.0,
        "seconds between pod-resources checks",
    ),
    Option(
        "--reclaim-grace",
        "AKRI_RECLAIM_GRACE",
        parse_seconds,
        3.0,
        "seconds a slot must be unused by any container before it is freed",
    ),
    Option(
        "--slot-write-timeout",
        "AKRI_SLOT_WRITE_TIMEOUT",
        parse_seconds,
        5.0,
        "seconds Allocate and NodePrepareResources wait for the API server to record a slot "
        "before they fail (kubelet waits much longer; a write that timed out is re-read "
        "before its slot is offered again; 0: the API client's own timeout)",
    ),
    Option(
        "--dra",
        "AKRI_DRA",
        parse_bool,
        None,
        "run the DRA kubelet plugin and publish ResourceSlices (default: on in cluster mode)",
    ),
    Option(
        "--extended-resources",
        "AKRI_EXTENDED_RESOURCES",
        one_of("auto", "dra", "device-plugins"),
        "auto",
        "how pods' limits: {akri.sh/<name>: N} are served on this node: 'dra' (ResourceSlices "
        "+ the DRA driver, KEP-5004), 'device-plugins', or 'auto': DRA when kubelet is 1.36+ "
        "and the API server keeps DeviceClass extendedResourceName (docs/dra.md)",
    ),
    Option(
        "--plugins-registry-dir",
        "AKRI_PLUGINS_REGISTRY_DIR",
        Path,
        None,
        "kubelet plugin watcher directory (DRA registration socket; default: "
        f"{_where('plugins_registry_dir')})",
    ),
    Option(
        "--dra-plugin-dir",
        "AKRI_DRA_PLUGIN_DIR",
        Path,
        None,
        f"DRA service socket and checkpoint directory (default: {_where('dra_plugin_dir')})",
    ),
    Option(
        "--cdi-dir",
        "AKRI_CDI_DIR",
        Path,
        None,
        f"where CDI spec files for prepared claims are written (default: {_where('cdi_dir')})",
    ),
    Option(
        "--udev-monitor-source",
        "AKRI_UDEV_MONITOR_SOURCE",
        one_of("udev", "kernel"),
        None,
        "udev hotplug events from 'udev' (needs udevd and hostNetwork) or 'kernel' "
        "(default: udev if /run/udev/control exists, else kernel)",
    ),
    Option(
        "--discovery-handlers-dir",
        "AKRI_DISCOVERY_HANDLERS_DIR",
        Path,
        None,
        "directory of the external handlers' registration socket (agent-registration.sock) "
        "and their sockets (Akri's $DISCOVERY_HANDLERS_DIRECTORY; default: "
        f"{_where('discovery_handlers_dir')}; akri handler: "
        f"{SYSTEM_PATHS['discovery_handlers_dir']})",
        fallbacks=("DISCOVERY_HANDLERS_DIRECTORY",),
    ),
    Option(
        "--external-handlers",
        "AKRI_EXTERNAL_HANDLERS",
        parse_bool,
        True,
        "accept external discovery handlers on the registration socket",
    ),
    Option(
        "--discovery-handler-networks",
        "AKRI_DISCOVERY_HANDLER_NETWORKS",
        _networks,
        (),
        "comma-separated CIDRs where network endpoints of external handlers may be, besides "
        "this node's own addresses (e.g. the node's pod CIDR)",
        metavar="CIDRS",
    ),
    Option(
        "--discovery-handler-sockets-anywhere",
        "AKRI_DISCOVERY_HANDLER_SOCKETS_ANYWHERE",
        parse_bool,
        False,
        "accept external handler sockets outside --discovery-handlers-dir",
    ),
    Option(
        "--discovery-handler-first-list-timeout",
        "AKRI_DISCOVERY_HANDLER_FIRST_LIST_TIMEOUT",
        parse_seconds,
        30.0,
        "seconds an external handler has to send its first device list before it is cut off",
    ),
    Option(
        "--health-port",
        "AKRI_HEALTH_PORT",
        parse_port,
        None,
        f"serve /healthz, /readyz and /metrics on this port (default: {CLUSTER_HEALTH_PORT} in "
        "cluster mode, off in local mode; 0: off)",
    ),
    Option(
        "--health-address",
        "AKRI_HEALTH_ADDRESS",
        str,
        "0.0.0.0",
        "address of the health and metrics port",
        metavar="ADDR",
    ),
    Option(
        "--log-format",
        "AKRI_LOG_FORMAT",
        one_of("text", "json"),
        "text",
        "text, or json (one object per line, with configuration/instance/slot/node fields)",
    ),
    Option(
        "--poll-interval",
        "AKRI_POLL_INTERVAL",
        parse_interval,
        1.0,
        "local mode: a changed Configuration file is read again this long after inotify "
        "reported it, and applied when both reads agree; without inotify, how often files "
        "and the state dir are re-checked",
    ),
    Option(
        "--max-instances",
        "AKRI_MAX_INSTANCES",
        _instance_limit,
        DEFAULT_MAX_INSTANCES,
        "the most devices that become Instances on this node, over all Configurations "
        "(Configurations by namespace and name, devices by id; the rest are left out with an "
        f"Event OverBudget); 0: no limit. Default {DEFAULT_MAX_INSTANCES}: fits the "
        "DaemonSet's 384Mi memory limit, also after kubelet restarts (docs/performance.md)",
        metavar="N",
    ),
)


@dataclass(frozen=True)
class AgentSettings:
    """Resolved settings of ``akri agent``."""

    local: bool
    state_dir: Path
    config: list[Path]
    node_name: str
    log_level: str
    local_offline_grace: float
    shared_offline_grace: float
    debug_echo: bool
    debug_echo_shared: bool
    debug_echo_availability_file: Path
    kubeconfig: str | None
    namespace: str | None
    device_plugin_dir: Path | None
    pod_resources_socket: Path
    reclaim_interval: float
    reclaim_grace: float
    dra: bool
    plugins_registry_dir: Path
    dra_plugin_dir: Path
    cdi_dir: Path
    udev_monitor_source: str | None
    poll_interval: float
    discovery_handlers_dir: Path = Path("/var/lib/akri")
    external_handlers: bool = True
    discovery_handler_networks: tuple[Any, ...] = ()
    discovery_handler_sockets_anywhere: bool = False
    discovery_handler_first_list_timeout: float = 30.0
    health_port: int | None = 0
    health_address: str = "0.0.0.0"
    max_instances: int | None = DEFAULT_MAX_INSTANCES
    log_format: str = "text"
    slot_write_timeout: float = 5.0
    extended_resources: str = "auto"

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> AgentSettings:
        data = dict(values)
        data["node_name"] = data["node_name"] or socket.gethostname()
        if data["debug_echo"] is None:
            data["debug_echo"] = bool(data["local"])
        source = data["udev_monitor_source"]
        if source not in (None, "udev", "kernel"):
            raise SettingsError(f"--udev-monitor-source: expected udev or kernel, got {source!r}")
        if data["dra"] is None:
            data["dra"] = not data["local"]
        if data["dra"] and data["local"]:
            raise SettingsError("--dra needs the Kubernetes API (ResourceClaims): not in --local")
        if data["device_plugin_dir"] is None and not data["local"]:
            data["device_plugin_dir"] = Path("/var/lib/kubelet/device-plugins/")
        for name, system in SYSTEM_PATHS.items():
            if data.get(name) is None:
                data[name] = data["state_dir"] / LOCAL_PATHS[name] if data["local"] else system
        for name in SHARED_PATHS:
            if data.get(name) is not None:
                # gRPC reads unix://state/agent-registration.sock as host "state": a relative
                # directory turned external handlers off. The agent never changes directory,
                # so the absolute path names the same place.
                data[name] = Path(data[name]).absolute()
        if data["health_port"] is None:
            data["health_port"] = 0 if data["local"] else CLUSTER_HEALTH_PORT
        if not data.get("max_instances"):
            data["max_instances"] = None  # 0: no limit
        if data.get("extended_resources", "auto") not in ("auto", "dra", "device-plugins"):
            raise SettingsError(
                "--extended-resources: expected auto, dra or device-plugins, got "
                f"{data['extended_resources']!r}"
            )
        if data["log_format"] not in ("text", "json"):
            raise SettingsError(f"--log-format: expected text or json, got {data['log_format']!r}")
        if data["log_level"] not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise SettingsError(f"--log-level: unknown level {data['log_level']!r}")
        return cls(**data)
