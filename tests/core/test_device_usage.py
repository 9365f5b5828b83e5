"""deviceUsage value parsing and formatting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.model.device_usage import (
    FREE,
    ClaimUsage,
    ConfigurationUsage,
    NodeUsage,
    UnknownUsage,
    format_usage,
    holder_node,
    is_free,
    parse_usage,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", FREE),
        ("node-a", NodeUsage("node-a")),
        ("C:cams-0:node-b", ConfigurationUsage("cams-0", "node-b")),
        ("C:0:node-b", ConfigurationUsage("0", "node-b")),  # Akri v0.12 vdev ids
        ("D:6f1c-11:node-c", ClaimUsage("6f1c-11", "node-c")),
    ],
)
def test_parse_known_forms(value: str, expected: object) -> None:
    assert parse_usage(value) == expected
    assert format_usage(parse_usage(value)) == value


@pytest.mark.parametrize("value", ["C:x", "C::node", "C:v:", "D:uid", "C:a:b:c", "a:b"])
def test_malformed_values_are_unknown_and_never_free(value: str) -> None:
    usage = parse_usage(value)
    assert isinstance(usage, UnknownUsage)
    assert usage.problem
    assert not is_free(usage)
    assert holder_node(usage) is None
    assert format_usage(usage) == value


def test_holder_node() -> None:
    assert holder_node(parse_usage("n1")) == "n1"
    assert holder_node(parse_usage("C:v-1:n2")) == "n2"
    assert holder_node(parse_usage("D:u:n3")) == "n3"
    assert holder_node(FREE) is None


@given(st.text(max_size=80))
def test_any_text_parses_and_formats_back(value: str) -> None:
    assert format_usage(parse_usage(value)) == value
