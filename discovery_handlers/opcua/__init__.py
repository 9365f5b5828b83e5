"""The ``opcua`` discovery handler (Akri-compatible), see ``docs/opcua.md``.

``details``, ``servers`` and ``tracker`` are pure; ``transport`` (which imports ``asyncua``)
is imported by the handler in a worker thread when discovery starts, so loading this package
(to validate a Configuration) costs no ``asyncua`` import.
"""

from discovery_handlers.opcua.details import OpcuaDetails, parse_details
from discovery_handlers.opcua.handler import OpcuaHandler

__all__ = ["OpcuaDetails", "OpcuaHandler", "parse_details"]
