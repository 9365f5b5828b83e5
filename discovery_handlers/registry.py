"""Embedded handlers by name."""

from __future__ import annotations

from discovery_handlers.base import DiscoveryHandler


class HandlerRegistry:
    """Maps ``discoveryHandler.name`` to an embedded handler."""

    def __init__(self) -> None:
        self._handlers: dict[str, DiscoveryHandler] = {}

    def register(self, handler: DiscoveryHandler) -> None:
        """Add ``handler`` under its name (replacing any previous one)."""
        self._handlers[handler.name] = handler

    def get(self, name: str) -> DiscoveryHandler | None:
        """The handler called ``name``, or None."""
        return self._handlers.get(name)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._handlers)
