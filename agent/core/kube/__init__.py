"""A small asyncio client for the Kubernetes API (standard library only).

* :mod:`agent.core.kube.kubeconfig` finds the connection settings (kubeconfig or in-cluster);
* :mod:`agent.core.kube.credentials` and :mod:`agent.core.kube.exec_credential` supply bearer tokens
  and client certificates (static, rotating token files, exec plugins);
* :mod:`agent.core.kube.tls` builds the ``ssl.SSLContext``;
* :mod:`agent.core.kube.http` speaks HTTP/1.1 on one connection;
* :mod:`agent.core.kube.client` is the :class:`KubeClient` (pool, timeouts, JSON, watch streams).

It replaces the ``kubernetes`` package at runtime: the agent uses about ten endpoints, and the
generated client cost about 58 MB of RSS plus pydantic validation on every call.
"""

from agent.core.kube.client import KubeClient, make_kube_client, resource_path
from agent.core.kube.errors import (
    ApiError,
    Cause,
    ConfigError,
    ResponseTooLargeError,
    TransportError,
)

__all__ = [
    "ApiError",
    "Cause",
    "ConfigError",
    "KubeClient",
    "ResponseTooLargeError",
    "TransportError",
    "make_kube_client",
    "resource_path",
]
