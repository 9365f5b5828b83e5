"""The ``onvif`` discovery handler (Akri-compatible), see ``docs/onvif.md``.

``details``, ``filters``, ``wsdiscovery``, ``credentials`` and ``soap`` are pure; ``multicast``
(WS-Discovery sockets) and ``device_query`` (SOAP over aiohttp) do the I/O and are imported only
when discovery starts.
"""

from discovery_handlers.onvif.details import OnvifDetails, parse_details
from discovery_handlers.onvif.handler import OnvifHandler

__all__ = ["OnvifDetails", "OnvifHandler", "parse_details"]
