"""The handlers every agent embeds, and whether one accepts a Configuration's discoveryDetails,
decided without a node: the agents and the controller ask it alike which Configurations any
agent can run (``agent/core/name_claims.py``: a Configuration that none can run claims no
kubelet name until it serves).

A handler is loaded only when a Configuration names it (as the agent's lazy handlers are);
its validation needs no node setting, so a default instance validates.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from discovery_handlers.base import DiscoveryHandler, InvalidDiscoveryDetailsError

EMBEDDED: dict[str, tuple[str, str]] = {
    "debugEcho": ("discovery_handlers.debug_echo", "DebugEchoHandler"),
    "mdns": ("discovery_handlers.mdns", "MdnsHandler"),
    "mqtt": ("discovery_handlers.mqtt", "MqttHandler"),
    "onvif": ("discovery_handlers.onvif", "OnvifHandler"),
    "opcua": ("discovery_handlers.opcua", "OpcuaHandler"),
    "udev": ("discovery_handlers.udev", "UdevHandler"),
}
"""``discoveryHandler.name`` -> (module, class) of every embedded handler (the agent's
``build_handlers`` registers the same names; a test keeps them equal)."""


def _handler(name: str) -> DiscoveryHandler:
    module, cls = EMBEDDED[name]
    handler: DiscoveryHandler = getattr(importlib.import_module(module), cls)()
    return handler


@lru_cache(maxsize=1024)
def details_problem(handler: str, discovery_details: str) -> str | None:
    """Why no agent runs a Configuration with this handler and these details (None when
    one can): a handler no agent embeds (an external one may register later), or
    discoveryDetails its embedded handler refuses. Cached: every agent and the controller
    ask for every Configuration whenever the catalog changes."""
    if handler not in EMBEDDED:
        return f"no agent embeds a discovery handler named {handler!r}"
    try:
        _handler(handler).validate(discovery_details)
    except InvalidDiscoveryDetailsError as error:
        return f"spec.discoveryHandler.discoveryDetails: {error}"
    except Exception as error:  # hostile details: a problem, never a crash
        return f"spec.discoveryHandler.discoveryDetails: {type(error).__name__}: {error}"
    return None
