"""A small asyncio client for the Kubernetes API (standard library only).

* :mod:`agent.kube.kubeconfig` finds the connection settings (kubeconfig or in-cluster);
* :mod:`agent.kube.credentials` and :mod:`agent.kube.exec_credential` supply bearer tokens
  and client certificates (static, rotating token files, exec plugins);
* :mod:`agent.kube.tls` builds the ``ssl.SSLContext``;
* :mod:`agent.kube.http` speaks HTTP/1.1 on one connection;
* :mod:`agent.kube.client` is the :class:`KubeClient` (pool, timeouts, JSON, watch streams).

It replaces the ``kubernetes`` package at runtime: the agent uses about ten endpoints, and the
generated client cost about 58 MB of RSS plus pydantic validation on every call.
"""

from agent.kube.client import KubeClient, make_kube_client, resource_path
from agent.kube.errors import ApiError, ConfigError, ResponseTooLargeError, TransportError

__all__ = [
    "ApiError",
    "ConfigError",
    "KubeClient",
    "ResponseTooLargeError",
    "TransportError",
    "make_kube_client",
    "resource_path",
]
