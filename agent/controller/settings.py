"""``akri controller`` flags, each with an ``AKRI_*`` environment variable (flag > environment >
default), like ``akri agent``'s (the controller does not import the node agent, so the few
parsers it needs are its own)."""

from __future__ import annotations

import argparse
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.controller.brokers import FAILED_GRACE, PENDING_GRACE
from agent.controller.leader import LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD
from agent.controller.nodes import NODE_GRACE

HEALTH_PORT = 10280  # the agent's port number too: one PodMonitor port name (``health``)


class ControllerSettingsError(ValueError):
    """A flag or environment variable has an unusable value."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        problem = f"must be a number of seconds, got {text[:40]!r}"
        raise argparse.ArgumentTypeError(problem) from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text[:40]}")
    return value


def _positive(text: str) -> float:
    value = _seconds(text)
    if value < 0.05:
        raise argparse.ArgumentTypeError(f"must be ≥ 0.05 seconds, got {text[:40]}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text[:40]!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be 0 (off) to 65535, got {value}")
    return value


def _level(text: str) -> str:
    value = text.upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise argparse.ArgumentTypeError(f"unknown level {text[:40]!r}")
    return value


def _log_format(text: str) -> str:
    value = text.lower()
    if value not in ("text", "json"):
        raise argparse.ArgumentTypeError(f"expected text or json, got {text[:40]!r}")
    return value


@dataclass(frozen=True)
class Flag:
    flag: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    fallbacks: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


CONTROLLER_FLAGS = (
    Flag("--kubeconfig", "AKRI_KUBECONFIG", str, None,
         "kubeconfig file (default: in-cluster config, then $KUBECONFIG, ~/.kube/config)",
         ("KUBECONFIG",)),
    Flag("--namespace", "AKRI_NAMESPACE", str, None,
         "only Configurations/Instances of this namespace (default: all)"),
    Flag("--lease-namespace", "AKRI_LEASE_NAMESPACE", str, None,
         "namespace of the leader-election Lease (default: the pod's, from the kubeconfig)",
         ("POD_NAMESPACE",)),
    Flag("--lease-name", "AKRI_LEASE_NAME", str, "akri-controller", "leader-election Lease name"),
    Flag("--identity", "AKRI_CONTROLLER_IDENTITY", str, None,
         "this replica's name in the Lease (default: $POD_NAME or the host name, plus a "
         "random suffix)", ("POD_NAME",)),
    Flag("--lease-duration", "AKRI_LEASE_DURATION", _positive, LEASE_DURATION,
         "seconds a standby waits on an unrenewed Lease before taking over"),
    Flag("--renew-deadline", "AKRI_RENEW_DEADLINE", _positive, RENEW_DEADLINE,
         "seconds the leader keeps leading without a successful renewal"),
    Flag("--retry-period", "AKRI_RETRY_PERIOD", _positive, RETRY_PERIOD,
         "seconds between Lease renewals / attempts"),
    Flag("--node-grace", "AKRI_NODE_GRACE", _seconds, NODE_GRACE,
         "seconds a NotReady node keeps its slots and its place in Instances"),
    Flag("--pending-broker-grace", "AKRI_PENDING_BROKER_GRACE", _seconds, PENDING_GRACE,
         "seconds a broker Pod may stay Pending before it is replaced (Akri: 300)"),
    Flag("--failed-broker-grace", "AKRI_FAILED_BROKER_GRACE", _seconds, FAILED_GRACE,
         "seconds before a Failed/Succeeded broker Pod is replaced (Akri: 0)"),
    Flag("--resync-interval", "AKRI_RESYNC_INTERVAL", _positive, 60.0,
         "seconds between full reconcile passes when nothing changes"),
    Flag("--health-port", "AKRI_HEALTH_PORT", _port, HEALTH_PORT,
         "serve /healthz, /readyz and /metrics on this port (0: off)"),
    Flag("--health-address", "AKRI_HEALTH_ADDRESS", str, "0.0.0.0",
         "address of the health and metrics port"),
    Flag("--log-level", "AKRI_LOG_LEVEL", _level, "INFO", "DEBUG, INFO, WARNING or ERROR"),
    Flag("--log-format", "AKRI_LOG_FORMAT", _log_format, "text",
         "text, or json (one object per line)"),
)  # fmt: skip


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The controller's flags, defaults left unset (see :meth:`ControllerSettings.resolve`)."""
    for flag in CONTROLLER_FLAGS:
        parser.add_argument(
            flag.flag,
            dest=flag.dest,
            default=None,
            type=flag.parse,
            help=f"{flag.help} [env {flag.env}]",
        )


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
    pending_broker_grace: float
    failed_broker_grace: float
    resync_interval: float
    health_port: int
    health_address: str
    log_level: str
    log_format: str

    @classmethod
    def resolve(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> ControllerSettings:
        values: dict[str, Any] = {}
        for flag in CONTROLLER_FLAGS:
            value = getattr(args, flag.dest, None)
            if value is None:
                for name in (flag.env, *flag.fallbacks):
                    if name in environ:
                        try:
                            value = flag.parse(environ[name])
                        except (argparse.ArgumentTypeError, ValueError) as error:
                            raise ControllerSettingsError(
                                f"environment variable {name} ({flag.flag}): {error}"
                            ) from error
                        break
            values[flag.dest] = flag.default if value is None else value
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
