"""SIGINT (Ctrl-C) and SIGTERM, held from the start of the ``akri`` command until its event loop
takes them (issue 34.13): ``agent/launch.py`` holds them before anything else is imported,
``agent/cli.py`` gives them back to Python (a command that runs no loop) or to its loop. Its
own module, imported by both, so that neither of those two imports the other back. It imports
nothing but :mod:`signal`: the launcher must not import more before the signals are held.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def hold_stop_signals() -> None:
    """Block SIGINT and SIGTERM in this thread (and the threads it starts)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release_stop_signals() -> None:
    """Python's own handling of SIGINT and SIGTERM again (a command that does not run a loop);
    one held meanwhile arrives now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def take_stop_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
    """The loop answers SIGINT and SIGTERM with ``stop`` from now on; one held since the start
    arrives now."""
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
