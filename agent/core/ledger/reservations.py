"""Slots held back from the device plugins although ``deviceUsage`` shows them free.

Two things make a free slot not this node's device plugins' to give:

* ``dra-allocated``: the scheduler allocated it to a ResourceClaim that is not prepared yet.
  The claim's allocation is fixed — its pod can only ever run on that slot — while a
  device-plugin pod can be admitted with any other: if both race for the slot, the DRA pod
  must win, so the device plugins stop offering it and refuse it (issue 30, 2);
* ``unsettled``: a claim write timed out (the API server hung) and may still land: until its
  outcome is known, the slot is not handed to anyone else (issue 30, 3).

A reservation never changes what is stored, and the compare-and-swap stays the arbiter: it
only keeps the device plugins from offering and taking the slot (a DRA prepare of the
reserving claim is not affected). Views see it through :meth:`Reservations.overlay`, which
shows reserved free slots as held by :data:`RESERVED` — a value that parses as no known
holder, so every view already treats it as held (never offered, never counted free).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from agent.core.model.instance import Instance
from agent.core.model.keys import ObjectKey

RESERVED = "reserved"  # never written: only in overlaid views

DRA_ALLOCATED = "dra-allocated"
UNSETTLED = "unsettled"


class Reservations:
    """Reserved slots per Instance, from several sources; listeners hear of every change."""

    def __init__(self) -> None:
        self._by_source: dict[str, dict[ObjectKey, frozenset[str]]] = {}
        self._merged: dict[ObjectKey, frozenset[str]] = {}
        self._listeners: list[Callable[[set[ObjectKey]], None]] = []

    def add_listener(self, listener: Callable[[set[ObjectKey]], None]) -> None:
        """``listener(keys)`` after the reserved slots of ``keys`` changed."""
        self._listeners.append(listener)

    def replace(self, source: str, slots: Mapping[ObjectKey, Collection[str]]) -> None:
        """``source``'s reservations are now exactly ``slots``."""
        new = {key: frozenset(s) for key, s in slots.items() if s}
        old = self._by_source.get(source, {})
        if new == old:
            return
        self._by_source[source] = new
        self._changed({k for k in set(old) | set(new) if old.get(k) != new.get(k)})

    def add(self, source: str, key: ObjectKey, slot: str) -> None:
        current = self._by_source.get(source, {})
        self.replace(source, {**current, key: current.get(key, frozenset()) | {slot}})

    def discard(self, source: str, key: ObjectKey, slot: str) -> None:
        current = self._by_source.get(source, {})
        self.replace(source, {**current, key: current.get(key, frozenset()) - {slot}})

    def slots(self, key: ObjectKey) -> frozenset[str]:
        return self._merged.get(key, frozenset())

    def of_source(self, source: str) -> dict[ObjectKey, frozenset[str]]:
        return dict(self._by_source.get(source, {}))

    def overlay(self, instance: Instance) -> Instance:
        """``instance`` with its reserved free slots shown held (the object itself when none
        is: views that cache by identity stay cheap)."""
        reserved = self._merged.get(instance.key)
        if not reserved:
            return instance
        usage = instance.device_usage
        free = [slot for slot in reserved if slot in usage and not usage[slot]]
        if not free:
            return instance
        return instance.evolve(device_usage={**usage, **dict.fromkeys(free, RESERVED)})

    def _changed(self, keys: set[ObjectKey]) -> None:
        for key in keys:
            merged: frozenset[str] = frozenset()
            for slots in self._by_source.values():
                merged |= slots.get(key, frozenset())
            if merged:
                self._merged[key] = merged
            else:
                self._merged.pop(key, None)
        for listener in list(self._listeners):
            listener(keys)
