"""``debugEcho``: Akri's fake-device handler, for trying the agent and for tests.

discoveryDetails (Akri-compatible)::

    descriptions: ["foo0", "foo1"]   # required; one device per string

Each description is a device with id = the description and property
``DEBUG_ECHO_DESCRIPTION``. If the availability file (Akri: ``/tmp/debug-echo-availability.txt``)
contains ``OFFLINE`` the device list is empty ("unplugged"); any other content, or no file,
means online. The file is re-read when inotify reports a change of it (or every
``poll_interval`` seconds where inotify cannot be used), and a new list is sent only when
availability changes. ``shared`` comes from the agent (Akri: env
``DEBUG_ECHO_INSTANCES_SHARED``), not from discoveryDetails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from discovery_handlers.base import (
    Device,
    DiscoveryHandler,
    DiscoveryProperties,
    InvalidDiscoveryDetailsError,
)
from discovery_handlers.details import brief, load_details, unknown_fields

NAME = "debugEcho"
FIELDS = ("descriptions",)
DEFAULT_AVAILABILITY_FILE = Path("/tmp/debug-echo-availability.txt")
PROPERTY = "DEBUG_ECHO_DESCRIPTION"
OFFLINE = "OFFLINE"


def parse_descriptions(details: str) -> list[str]:
    """The ``descriptions`` list; raises with a message naming the field."""
    parsed = load_details(details, NAME)
    descriptions = parsed.get("descriptions")
    if descriptions is None:
        raise InvalidDiscoveryDetailsError(f"{NAME}: discoveryDetails.descriptions is required")
    if not isinstance(descriptions, list):
        raise InvalidDiscoveryDetailsError(
            f"{NAME}: discoveryDetails.descriptions must be a list of strings, "
            f"got {type(descriptions).__name__}"
        )
    for index, item in enumerate(descriptions):
        if not isinstance(item, str) or not item:
            raise InvalidDiscoveryDetailsError(
                f"{NAME}: discoveryDetails.descriptions[{index}] must be a non-empty string, "
                f"got {brief(item)}"
            )
    return list(dict.fromkeys(descriptions))


def is_offline(availability_file: Path) -> bool:
    """True if the availability file says ``OFFLINE``."""
    try:
        return availability_file.read_text().strip() == OFFLINE
    except (OSError, UnicodeDecodeError):
        return False


class DebugEchoHandler(DiscoveryHandler):
    """Reports one fake device per description."""

    name = NAME

    def __init__(
        self,
        *,
        shared: bool = True,
        availability_file: Path = DEFAULT_AVAILABILITY_FILE,
        poll_interval: float = 0.5,
    ) -> None:
        self._shared = shared
        self.availability_file = availability_file
        self.poll_interval = poll_interval

    @property
    def shared(self) -> bool:
        return self._shared

    def validate(self, discovery_details: str) -> Sequence[str]:
        parse_descriptions(discovery_details)
        return unknown_fields(load_details(discovery_details, NAME), FIELDS, NAME)

    async def discover(
        self, discovery_details: str, discovery_properties: DiscoveryProperties
    ) -> AsyncIterator[list[Device]]:
        devices = [
            Device(id=text, properties={PROPERTY: text})
            for text in parse_descriptions(discovery_details)
        ]
        from agent.core.aio.fswatch import DirectoryWatch  # the agent's, when run inside it

        name = self.availability_file.name
        watch = DirectoryWatch(
            [self.availability_file.parent],
            self.poll_interval,
            interesting=lambda entry, _removed: entry == name,
        )
        last: bool | None = None
        watch.arm()
        try:
            while True:
                offline = is_offline(self.availability_file)
                if offline != last:
                    last = offline
                    yield [] if offline else list(devices)
                await watch.changed()
        finally:
            watch.close()
