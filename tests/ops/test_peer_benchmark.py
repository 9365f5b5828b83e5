"""The side-by-side benchmark section (benchmarks/peer.py): skipped without a peer binary,
refused with a clear error for a path that cannot run, ratios of ours to the peer."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peer import FIGURES, PeerPlan, _order, _ratio, run_peer, table


async def test_without_a_peer_binary_the_section_says_it_was_skipped() -> None:
    result = await run_peer(None, PeerPlan())
    assert "skipped" in result and "--peer-bin" in result["skipped"]
    assert table(result).startswith('{"skipped"')


async def test_a_peer_binary_that_cannot_run_is_an_error(tmp_path: Path) -> None:
    text = tmp_path / "not-a-binary"
    text.write_text("")
    with pytest.raises(RuntimeError, match="not an executable"):
        await run_peer(text, PeerPlan())


def test_ratio_is_ours_over_the_peer() -> None:
    assert _ratio({"p50": 3.0, "p99": 9.0}, {"p50": 1.5, "p99": 3.0}) == {"p50": 2.0, "p99": 3.0}
    assert _ratio({"error": "no samples", "n": 0}, {"p50": 1.0}) == {"p50": None, "p99": None}


def test_rounds_alternate_who_goes_first() -> None:
    assert [_order(r) for r in range(3)] == [
        ("ours", "peer"),
        ("peer", "ours"),
        ("ours", "peer"),
    ]
    three = ("ours", "peer", "baseline")
    assert [_order(r, three)[0] for r in range(4)] == ["ours", "peer", "baseline", "ours"]
    assert "version_ms" in FIGURES and "allocate_regrant_ms" in FIGURES
