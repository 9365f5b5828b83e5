"""A stateful Kubernetes API-server double over real HTTP (see docs/testing-apiserver-double.md).

Quick start::

    from tests.doubles.apiserver import ApiServerDouble

    async with ApiServerDouble(crds=["crds/instance-crd.yaml"]) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        ...  # point kubernetes.aio / kubectl at api.url
"""

from tests.doubles.apiserver.errors import ApiError
from tests.doubles.apiserver.faults import Fault, RecordedRequest, RequestInfo
from tests.doubles.apiserver.resources import GroupResource, PrinterColumn, ResourceType
from tests.doubles.apiserver.server import ApiServerDouble
from tests.doubles.apiserver.store import Event, Store
from tests.doubles.apiserver.threaded import ThreadedApiServer

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
