"""Every example Configuration in ``examples/`` passes its handler's own check, the one the
agent runs before starting discovery: the handler the agent would use (``build_handlers``)
accepts its ``discoveryDetails`` without warnings. (``tests/deploy/test_deploy.py`` checks the same
files against the CRD.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent.core.model.configuration import Configuration, parse_configuration
from agent.node.app import build_handlers
from agent.node.settings import AGENT_OPTIONS, AgentSettings, resolve
from discovery_handlers.registry import HandlerRegistry
from tests.paths import REPO

ROOT = REPO
EXAMPLES = sorted(
    path
    for path in (ROOT / "examples").glob("*.yaml")
    if [d.get("kind") for d in yaml.safe_load_all(path.read_text()) if d] == ["Configuration"]
)


def agent_handlers() -> HandlerRegistry:
    class Args:
        pass

    values = resolve(Args(), AGENT_OPTIONS, {"ENABLE_DEBUG_ECHO": "true"})  # type: ignore[arg-type]
    return build_handlers(AgentSettings.from_values(values))


def configuration_of(path: Path) -> Configuration:
    return parse_configuration(yaml.safe_load(path.read_text()))


def test_the_examples_are_found() -> None:
    names = {configuration_of(p).discovery_handler.name for p in EXAMPLES}
    assert {"debugEcho", "udev", "onvif", "mqtt", "mdns", "opcua"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_passes_its_handlers_validate(path: Path) -> None:
    registry = agent_handlers()
    configuration = configuration_of(path)
    name = configuration.discovery_handler.name
    handler = registry.get(name)
    assert handler is not None, f"{path.name}: no embedded handler named {name!r}"
    warnings = handler.validate(configuration.discovery_handler.discovery_details)
    assert not warnings, f"{path.name}: {warnings}"
