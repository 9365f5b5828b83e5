"""Embedded handlers by name, and :class:`LazyHandler` for handlers that are costly to load."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from discovery_handlers.base import Device, DiscoveryHandler, DiscoveryProperties


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


class LazyHandler(DiscoveryHandler):
    """A handler whose module is imported only when a Configuration first needs it (the
    agent starts faster, and an agent that never runs, say, udev never loads it)."""

    def __init__(self, name: str, shared: bool, load: Callable[[], DiscoveryHandler]) -> None:
        self.name = name
        self._shared = shared
        self._load = load
        self._handler: DiscoveryHandler | None = None

    @property
    def handler(self) -> DiscoveryHandler:
        """The real handler (loaded on first use)."""
        if self._handler is None:
            self._handler = self._load()
            if self._handler.name != self.name or self._handler.shared != self._shared:
                raise RuntimeError(f"lazy handler {self.name} loaded a different handler")
        return self._handler

    @property
    def shared(self) -> bool:
        return self._shared

    def validate(self, discovery_details: str) -> Sequence[str] | None:
        return self.handler.validate(discovery_details)

    def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        return self.handler.discover(discovery_details, discovery_properties)
