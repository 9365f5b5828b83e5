"""A scripted stand-in for :class:`agent.node.kubelet.state.KubeletState` (unit tests
of the reclaimer; the end-to-end tests use the kubelet double instead)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping

from agent.node.kubelet.state import KubeletView

Listing = Mapping[str, frozenset[str]]


class ScriptedKubelet:
    """``listed()`` / ``checkpointed()`` give what kubelet says now (sync or async)."""

    def __init__(
        self,
        listed: Callable[[], Listing | Awaitable[Listing]] = lambda: {},
        checkpointed: Callable[[], Listing] = lambda: {},
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.listed = listed
        self.checkpointed = checkpointed
        self.clock = clock
        self.present = True
        self.identity: tuple[int, int] | None = (1, 1)
        self.calls = 0

    def available(self) -> bool:
        return self.present

    def socket_identity(self) -> tuple[int, int] | None:
        return self.identity

    async def view(self) -> KubeletView:
        self.calls += 1
        taken = self.clock()
        answer = self.listed()
        listed = await answer if isinstance(answer, Awaitable) else answer
        return KubeletView(listed, self.checkpointed(), taken)
