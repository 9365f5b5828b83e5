"""``akri controller`` flags, each with an ``AKRI_*`` environment variable (flag > environment >
default), with the same mechanism as ``akri agent``'s (``agent/ops/flags.py``)."""

from __future__ import annotations

import argparse
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from agent.controller.brokers import FAILED_GRACE, PENDING_GRACE
from agent.controller.leader import LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD
from agent.controller.nodes import NODE_GRACE
from agent.core.model.agent_pods import AGENT_SELECTOR
from agent.ops.flags import (
    Option,
    SettingsError,
    add_options,
    one_of,
    parse_interval,
    parse_log_level,
    parse_port,
    parse_seconds,
    resolve,
)

HEALTH_PORT = 10280  # the agent's port number too: one PodMonitor port name (``health``)


ControllerSettingsError = SettingsError  # a flag or environment variable has an unusable value


CONTROLLER_FLAGS = (
    Option("--kubeconfig", "AKRI_KUBECONFIG", str, None,
         "kubeconfig file (default: in-cluster config, then $KUBECONFIG, ~/.kube/config)",
         ("KUBECONFIG",), metavar="PATH"),
    Option("--namespace", "AKRI_NAMESPACE", str, None,
         "only Configurations/Instances of this namespace (default: all)", metavar="NS"),
    Option("--lease-namespace", "AKRI_LEASE_NAMESPACE", str, None,
         "namespace of the leader-election Lease (default: the pod's, from the kubeconfig)",
         ("POD_NAMESPACE",), metavar="NS"),
    Option("--lease-name", "AKRI_LEASE_NAME", str, "akri-controller", "leader-election Lease name",
         metavar="NAME"),
    Option("--identity", "AKRI_CONTROLLER_IDENTITY", str, None,
         "this replica's name in the Lease (default: $POD_NAME or the host name, plus a "
         "random suffix)", ("POD_NAME",), metavar="NAME"),
    Option("--lease-duration", "AKRI_LEASE_DURATION", parse_interval, LEASE_DURATION,
         "seconds a standby waits on an unrenewed Lease before taking over"),
    Option("--renew-deadline", "AKRI_RENEW_DEADLINE", parse_interval, RENEW_DEADLINE,
         "seconds the leader keeps leading without a successful renewal"),
    Option("--retry-period", "AKRI_RETRY_PERIOD", parse_interval, RETRY_PERIOD,
         "seconds between Lease renewals / attempts"),
    Option("--node-grace", "AKRI_NODE_GRACE", parse_seconds, NODE_GRACE,
         "seconds a NotReady node none of whose pods uses akri.sh devices keeps its place in "
         "Instances; a node (NotReady, deleted or out-of-service) whose pods that may use "
         "them still exist keeps its slots until they are gone, however long"),
    Option("--free-slots-of-unready-nodes-after", "AKRI_FREE_SLOTS_OF_UNREADY_NODES_AFTER",
         parse_seconds, None,
         "opt-in, unsafe: free the slots of a node not Ready for this many seconds even while "
         "its pods remain (their containers may still run: a device may be given to more "
         "consumers than its capacity); default: never on a timer", metavar="SECONDS"),
    Option("--pending-broker-grace", "AKRI_PENDING_BROKER_GRACE", parse_seconds, PENDING_GRACE,
         "seconds a broker Pod may stay Pending before it is replaced (Akri: 300)"),
    Option("--failed-broker-grace", "AKRI_FAILED_BROKER_GRACE", parse_seconds, FAILED_GRACE,
         "seconds before a Failed/Succeeded broker Pod is replaced (Akri: 0)"),
    Option("--agent-selector", "AKRI_AGENT_SELECTOR", str, AGENT_SELECTOR,
         "label selector of the agents' Pods (every namespace): a shared ResourceSlice none "
         "of whose nodes has its agent Ready is deleted (empty: not followed)",
         metavar="SELECTOR"),
    Option("--resync-interval", "AKRI_RESYNC_INTERVAL", parse_interval, 60.0,
         "seconds between full reconcile passes when nothing changes"),
    Option("--health-port", "AKRI_HEALTH_PORT", parse_port, HEALTH_PORT,
         "serve /healthz, /readyz and /metrics on this port (0: off)"),
    Option("--health-address", "AKRI_HEALTH_ADDRESS", str, "0.0.0.0",
         "address of the health and metrics port", metavar="ADDR"),
    Option("--log-level", "AKRI_LOG_LEVEL", parse_log_level, "INFO",
         "log lines of this level and above"),
    Option("--log-format", "AKRI_LOG_FORMAT", one_of("text", "json"), "text",
         "text, or json (one object per line)"),
)  # fmt: skip


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The controller's flags, defaults left unset (see :meth:`ControllerSettings.resolve`)."""
    add_options(parser, CONTROLLER_FLAGS)


@dataclass(frozen=True)
class ControllerSettings:
    """Resolved settings of ``akri controller``."""

    kubeconfig: str | None
    namespace: str | None
    lease_namespace: str | None
    lease_name: str
    identity: str
    lease_duration: float
    renew_deadline: float
    retry_period: float
    node_grace: float
    free_slots_of_unready_nodes_after: float | None
    pending_broker_grace: float
    failed_broker_grace: float
    agent_selector: str
    resync_interval: float
    health_port: int
    health_address: str
    log_level: str
    log_format: str

    @classmethod
    def resolve(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> ControllerSettings:
        values = resolve(args, CONTROLLER_FLAGS, environ)
        if values["identity"] is None:
            values["identity"] = f"{socket.gethostname()}_{secrets.token_hex(4)}"
        if values["renew_deadline"] >= values["lease_duration"]:
            raise ControllerSettingsError(
                "--renew-deadline must be shorter than --lease-duration (a leader must stop "
                "before a standby may take over)"
            )
        if values["retry_period"] >= values["renew_deadline"]:
            raise ControllerSettingsError("--retry-period must be shorter than --renew-deadline")
        return cls(**values)
