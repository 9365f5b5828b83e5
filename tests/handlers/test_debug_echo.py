"""debugEcho handler: details validation, devices, OFFLINE toggling."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.debug_echo import DebugEchoHandler, parse_descriptions


def test_parse_descriptions() -> None:
    assert parse_descriptions('descriptions: ["foo0", "foo1"]') == ["foo0", "foo1"]
    assert parse_descriptions("descriptions:\n- a\n- a\n") == ["a"]


@pytest.mark.parametrize(
    ("details", "needle"),
    [
        ("descriptions: foo", "must be a list"),
        ("descriptions: [1]", "descriptions[0]"),
        ("descriptions: ['']", "descriptions[0]"),
        ("{}", "descriptions is required"),
        ("", "descriptions is required"),
        ("- a", "must be a YAML mapping"),
        ("descriptions: [", "not valid YAML"),
    ],
)
def test_bad_details_are_rejected_clearly(details: str, needle: str) -> None:
    with pytest.raises(InvalidDiscoveryDetailsError, match="debugEcho") as info:
        DebugEchoHandler().validate(details)
    assert needle in str(info.value)


def test_unknown_fields_are_warnings_not_errors() -> None:
    """Akri's handlers ignore unknown discoveryDetails fields; a typo must not stop an Akri
    user's Configuration (the agent logs and records the warning)."""
    warnings = DebugEchoHandler().validate("descriptions: [a]\nextra: 1")
    assert warnings == [
        "debugEcho: ignoring unknown field(s) extra in discoveryDetails (known: descriptions)"
    ]


async def test_devices_and_offline_toggle(tmp_path: Path) -> None:
    availability = tmp_path / "avail"
    handler = DebugEchoHandler(shared=False, availability_file=availability, poll_interval=0.01)
    assert handler.shared is False
    stream = handler.discover('descriptions: ["foo0", "foo1"]', {})
    first = await asyncio.wait_for(anext(stream), 1)
    assert [d.id for d in first] == ["foo0", "foo1"]
    assert first[0].properties == {"DEBUG_ECHO_DESCRIPTION": "foo0"}
    availability.write_text("OFFLINE\n")
    assert await asyncio.wait_for(anext(stream), 1) == []
    availability.write_text("ONLINE")
    assert len(await asyncio.wait_for(anext(stream), 1)) == 2
    availability.unlink()
    availability.write_text("OFFLINE")
    assert await asyncio.wait_for(anext(stream), 1) == []
    await stream.aclose()  # type: ignore[attr-defined]
