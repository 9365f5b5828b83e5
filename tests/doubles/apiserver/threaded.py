"""Run an :class:`ApiServerDouble` on its own event loop in a background thread, for
synchronous tests (kubectl subprocesses, the sync ``kubernetes`` client)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, TypeVar

from tests.doubles.apiserver.server import ApiServerDouble

T = TypeVar("T")


class ThreadedApiServer:
    """``with ThreadedApiServer() as api: subprocess.run(["kubectl", f"--server={api.url}", ...])``.

    ``api`` is the :class:`ApiServerDouble`; its synchronous helpers (``create``, ``get``,
    ``fail``, ``requests_for``...) are safe to call from the test thread. Coroutines such as
    ``restart()`` must go through :meth:`call`.
    """

    def __init__(self, api: ApiServerDouble | None = None, **kwargs: Any) -> None:
        self.api = api or ApiServerDouble(**kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.api.url

    def start(self) -> ApiServerDouble:
        if self._thread is not None:
            return self.api
        ready = threading.Event()
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="apiserver-double", daemon=True)
        self._thread.start()
        ready.wait()
        self.call(self.api.start())
        return self.api

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        """Run a coroutine on the server's loop and return its result."""
        if self._loop is None:
            raise RuntimeError("not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        try:
            self.call(self.api.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            self._loop = None
            self._thread = None

    def __enter__(self) -> ApiServerDouble:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
