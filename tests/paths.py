"""Paths every test folder shares: the repository root, ``tests/`` and its data fixtures.

Test modules live at different depths (``tests/<area>/`` or ``tests/<area>/<part>/``), so
none of them should count ``parent`` hops from its own ``__file__``.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
DOUBLES = TESTS / "doubles"
