"""A stateful Kubernetes API-server double over real HTTP (see docs/testing-apiserver-double.md).

Quick start::

    from tests.apiserver import ApiServerDouble

    async with ApiServerDouble(crds=["crds/instance-crd.yaml"]) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        ...  # point kubernetes.aio / kubectl at api.url
"""

from tests.apiserver.errors import ApiError
from tests.apiserver.faults import Fault, RecordedRequest, RequestInfo
from tests.apiserver.resources import GroupResource, PrinterColumn, ResourceType
from tests.apiserver.server import ApiServerDouble
from tests.apiserver.store import Event, Store
from tests.apiserver.threaded import ThreadedApiServer

__all__ = [
    "ApiError",
    "ApiServerDouble",
    "Event",
    "Fault",
    "GroupResource",
    "PrinterColumn",
    "RecordedRequest",
    "RequestInfo",
    "ResourceType",
    "Store",
    "ThreadedApiServer",
]
