"""The ``mdns`` discovery handler: DNS-SD services announced with multicast DNS."""

from discovery_handlers.mdns.handler import MdnsHandler

__all__ = ["MdnsHandler"]
