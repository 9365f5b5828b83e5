"""In-process fan-out of change events to any number of asyncio subscribers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")
_CLOSED = object()


class Subscription(Generic[T]):
    """An async iterator of events; ``close()`` (or leaving ``async with``) unsubscribes."""

    def __init__(self, owner: Broadcaster[T], initial: Iterable[T]) -> None:
        self._owner = owner
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        for item in initial:
            self._queue.put_nowait(item)

    def _put(self, item: object) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> Subscription[T]:
        return self

    async def __anext__(self) -> T:
        item = await self._queue.get()
        if item is _CLOSED:
            self._queue.put_nowait(_CLOSED)
            raise StopAsyncIteration
        return item  # type: ignore[return-value]

    def pending(self) -> int:
        """Events queued and not yet consumed."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop receiving events; a pending ``__anext__`` ends the iteration."""
        self._owner._unsubscribe(self)
        self._queue.put_nowait(_CLOSED)

    async def __aenter__(self) -> Subscription[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Broadcaster(Generic[T]):
    """Publishes each event to every current subscriber, in order, without blocking."""

    def __init__(self) -> None:
        self._subscribers: list[Subscription[T]] = []

    def subscribe(self, initial: Iterable[T] = ()) -> Subscription[T]:
        """A new subscription that first yields ``initial``, then every published event."""
        subscription = Subscription(self, initial)
        self._subscribers.append(subscription)
        return subscription

    def _unsubscribe(self, subscription: Subscription[T]) -> None:
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)

    def publish(self, event: T) -> None:
        """Deliver ``event`` to all subscribers."""
        for subscription in list(self._subscribers):
            subscription._put(event)

    def close(self) -> None:
        """End every subscription."""
        for subscription in list(self._subscribers):
            subscription.close()
