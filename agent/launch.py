"""The ``akri`` command's entry point: SIGINT (Ctrl-C) and SIGTERM are held from the first line
of our own code, then ``agent.cli`` runs.

Python turns a Ctrl-C into a ``KeyboardInterrupt`` wherever the process is, and a SIGTERM
ends it at once; during an agent's start (imports, settings, the first store reads: a few
hundred milliseconds) that meant a traceback and an exit by the signal (issue 34.13). Held
(blocked), the signal waits until the event loop has taken both signals
(``agent.stop_signals.take_stop_signals``) and then stops the agent the normal way: exit 0,
nothing half-written. Commands that run no loop (``akri status``, ``version``) get Python's
handling back at once. This module imports nothing else before the signals are held
(``agent.stop_signals`` imports only :mod:`signal`); what remains unguarded is the
interpreter's own start, before any of our code runs.
"""

from __future__ import annotations

from agent.stop_signals import hold_stop_signals


def main() -> int:
    """The ``akri`` console script."""
    hold_stop_signals()
    from agent.cli import main as run

    return run(signals_held=True)
