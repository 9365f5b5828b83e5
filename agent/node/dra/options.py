"""Each Configuration's DRA opt-ins (annotations, ``slices.device_options``), followed from the
store's Configuration events so the slice publisher can ask per Instance without a lookup."""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey
from agent.core.store.base import ConfigurationEvent, EventType
from agent.node.dra.slices import DeviceOptions, device_options


class DraOptions:
    """``of(instance)``: the opt-ins of the Instance's Configuration (defaults when unknown)."""

    def __init__(self) -> None:
        self._by_key: dict[ObjectKey, DeviceOptions] = {}

    def of(self, instance: Instance) -> DeviceOptions:
        return self._by_key.get(instance.configuration_key, DeviceOptions())

    def apply(self, event: ConfigurationEvent) -> bool:
        """Take one event; whether any Configuration's opt-ins changed."""
        if event.key is None or (event.configuration is None and event.type != EventType.DELETED):
            return False  # an unreadable source: the last good version stays in force
        before = self._by_key.get(event.key)
        if event.type == EventType.DELETED or event.configuration is None:
            self._by_key.pop(event.key, None)
            return before is not None and before != DeviceOptions()
        after = device_options(event.configuration.annotations)
        self._by_key[event.key] = after
        return (before or DeviceOptions()) != after

    async def follow(
        self, events: AsyncIterable[ConfigurationEvent], changed: Callable[[], None]
    ) -> None:
        """Apply every event; call ``changed`` when an opt-in changed."""
        async for event in events:
            if self.apply(event):
                changed()
