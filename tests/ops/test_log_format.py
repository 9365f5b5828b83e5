"""The JSON log fields taken from a message's own wording (``agent/ops/log_format.py``)."""

from __future__ import annotations

import json
import logging

import pytest

from agent.ops.log_format import JsonFormatter


def fields(message: str) -> dict[str, str]:
    record = logging.LogRecord("agent.discovery", logging.INFO, __file__, 1, message, None, None)
    entry: dict[str, str] = json.loads(JsonFormatter("node-a").format(record))
    assert entry["message"] == message and entry["node"] == "node-a"
    return {k: v for k, v in entry.items() if k in ("configuration", "instance", "slot")}


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        # the draining line names the Instance by its key, namespace/name (acceptance F9: the
        # field was "default")
        (
            "instance default/akri-debug-echo-foo-8120fe: draining: 1 slot(s) in use on n1 "
            "(akri-debug-echo-foo-8120fe-0); its Configuration was deleted",
            {"instance": "akri-debug-echo-foo-8120fe"},
        ),
        ("instance cams-1a2b3c added: configuration=cams", {"instance": "cams-1a2b3c"}),
        (
            "slot cams-1a2b3c-0 of instance cams-1a2b3c is reserved: a DRA claim",
            {"instance": "cams-1a2b3c", "slot": "cams-1a2b3c-0"},
        ),
        (
            "configuration default/cams: stopping discovery",
            {"configuration": "default/cams"},
        ),
        # capitalised with a namespace: the same fields
        (
            "Configuration ns-1/cams has no broker; Instance ns-1/cams-1a2b3c kept",
            {"configuration": "ns-1/cams", "instance": "cams-1a2b3c"},
        ),
        # a bare capitalised word is prose, not a name
        ("Instance deleted meanwhile; Configuration gone", {}),
        ("configuration cams without a namespace", {}),
    ],
)
def test_fields_from_the_message(message: str, expected: dict[str, str]) -> None:
    assert fields(message) == expected
