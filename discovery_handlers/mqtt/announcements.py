"""Retained MQTT announcements → devices (pure: no network).

Two formats:

- **ours** (``format: akri``; JSON Schema in docs/mqtt-announcement.schema.json)::

      {"id": "sensor-7", "properties": {"room": "lab"}, "availabilityTopic": "sensors/7/status"}

  Properties become ``MQTT_<NAME>`` (upper case, other characters ``_``), plus ``MQTT_TOPIC``.
- **Home Assistant MQTT discovery**: ``<prefix>/<component>/[<node_id>/]<object_id>/config``
  with a JSON config whose abbreviated keys (``stat_t``, ``dev`` → ``ids``/``mf``/``mdl``…)
  are expanded and ``~`` is replaced by the base topic; id = ``unique_id``, else
  ``<component>/<node_id>/<object_id>``.

An empty retained payload removes the device announced on that topic. An availability topic
whose last payload is the "not available" value (``offline`` by default) takes the device
out of the list (the agent then applies its offline grace). Bad messages — not UTF-8, not
JSON, over :data:`MAX_PAYLOAD` bytes, a bad id — are refused with a reason and change
nothing; devices beyond ``maxDevices`` are refused too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from discovery_handlers.base import Device

MAX_PAYLOAD = 64 * 1024
MAX_ID = 256
MAX_PROPERTIES = 64
MAX_VALUE = 4096
PREFIX = "MQTT_"

# Home Assistant's abbreviations (homeassistant/components/mqtt/abbreviations.py), the ones
# that carry identity, topics and availability
ABBREVIATIONS = {
    "avty": "availability",
    "avty_mode": "availability_mode",
    "avty_t": "availability_topic",
    "avty_tpl": "availability_template",
    "cmd_t": "command_topic",
    "cmd_tpl": "command_template",
    "dev": "device",
    "dev_cla": "device_class",
    "ent_cat": "entity_category",
    "json_attr_t": "json_attributes_topic",
    "name": "name",
    "obj_id": "object_id",
    "pl_avail": "payload_available",
    "pl_not_avail": "payload_not_available",
    "stat_t": "state_topic",
    "t": "topic",
    "uniq_id": "unique_id",
    "unit_of_meas": "unit_of_measurement",
    "val_tpl": "value_template",
}
DEVICE_ABBREVIATIONS = {
    "cns": "connections",
    "ids": "identifiers",
    "mf": "manufacturer",
    "mdl": "model",
    "mdl_id": "model_id",
    "name": "name",
    "sa": "suggested_area",
    "sw": "sw_version",
    "hw": "hw_version",
    "via_device": "via_device",
}
_HA_TOPIC = re.compile(
    r"^(?P<prefix>[^/]+(?:/[^/]+)*?)/(?P<component>[^/]+)/(?:(?P<node>[^/]+)/)?(?P<object>[^/]+)/config$"
)
_ID = re.compile(r"^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?$")  # printable ASCII, no edge spaces


class RefusedMessage(ValueError):
    """A message that changes nothing, and why."""


class DeviceCapReached(RefusedMessage):
    """A new device when ``maxDevices`` devices are already known."""


def env_name(text: str) -> str:
    """``MQTT_<TEXT>`` as an environment variable name."""
    cleaned = re.sub(r"[^A-Z0-9_]", "_", text.upper())
    return PREFIX + cleaned if cleaned else PREFIX + "_"


@dataclass(frozen=True)
class Announcement:
    """A device as announced on ``topic``."""

    id: str
    properties: Mapping[str, str]
    availability_topic: str | None = None
    available: str = "online"
    not_available: str = "offline"


def decode(payload: bytes) -> Any:
    """JSON of a payload, or :class:`RefusedMessage`."""
    if len(payload) > MAX_PAYLOAD:
        raise RefusedMessage(f"payload of {len(payload)} bytes, more than {MAX_PAYLOAD}")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise RefusedMessage("payload is not UTF-8") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise RefusedMessage("payload is not JSON") from None


def _check_id(value: Any) -> str:
    if not isinstance(value, str) or not _ID.match(value) or len(value) > MAX_ID:
        raise RefusedMessage(f"id must be 1 to {MAX_ID} printable ASCII characters")
    return value


def _properties(pairs: Mapping[str, Any]) -> dict[str, str]:
    result: dict[str, str] = {}
    for key, value in pairs.items():
        if value is None or isinstance(value, (dict, list)):
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        result[env_name(str(key))[:256]] = text[:MAX_VALUE]
        if len(result) >= MAX_PROPERTIES:
            break
    return result


def parse_akri(topic: str, payload: bytes) -> Announcement:
    """Our JSON announcement (``payload`` not empty)."""
    data = decode(payload)
    if not isinstance(data, dict):
        raise RefusedMessage("payload must be a JSON object")
    device_id = _check_id(data.get("id"))
    raw = data.get("properties", {})
    if not isinstance(raw, dict):
        raise RefusedMessage("properties must be an object of strings")
    properties = _properties(raw)
    properties[PREFIX + "TOPIC"] = topic
    availability = data.get("availabilityTopic")
    if availability is not None and (not isinstance(availability, str) or not availability):
        raise RefusedMessage("availabilityTopic must be a topic")
    return Announcement(device_id, properties, availability)


def expand(config: Mapping[str, Any]) -> dict[str, Any]:
    """Home Assistant abbreviations expanded, ``~`` replaced by the base topic."""
    full = {ABBREVIATIONS.get(k, k): v for k, v in config.items()}
    device = full.get("device")
    if isinstance(device, dict):
        full["device"] = {DEVICE_ABBREVIATIONS.get(k, k): v for k, v in device.items()}
    availability = full.get("availability")
    if isinstance(availability, list):
        full["availability"] = [
            {ABBREVIATIONS.get(k, k): v for k, v in item.items()}
            for item in availability
            if isinstance(item, dict)
        ]
    base = full.get("~")
    if isinstance(base, str):
        for key, value in list(full.items()):
            if key.endswith("_topic") and isinstance(value, str):
                if value.startswith("~"):
                    full[key] = base + value[1:]
                elif value.endswith("~"):
                    full[key] = value[:-1] + base
    return full


def parse_homeassistant(topic: str, payload: bytes) -> Announcement:
    """A Home Assistant discovery config (``payload`` not empty)."""
    match = _HA_TOPIC.match(topic)
    if match is None:
        raise RefusedMessage("not a <prefix>/<component>/[<node_id>/]<object_id>/config topic")
    data = decode(payload)
    if not isinstance(data, dict):
        raise RefusedMessage("payload must be a JSON object")
    config = expand(data)
    component, node, object_id = match["component"], match["node"], match["object"]
    unique = config.get("unique_id")
    device_id = _check_id(
        unique if unique is not None else "/".join(p for p in (component, node, object_id) if p)
    )
    properties = {
        PREFIX + "TOPIC": topic,
        PREFIX + "HA_COMPONENT": component,
        PREFIX + "HA_OBJECT_ID": object_id,
    }
    if node:
        properties[PREFIX + "HA_NODE_ID"] = node
    for key, name in (
        ("name", "NAME"),
        ("unique_id", "UNIQUE_ID"),
        ("state_topic", "STATE_TOPIC"),
        ("command_topic", "COMMAND_TOPIC"),
        ("device_class", "DEVICE_CLASS"),
        ("unit_of_measurement", "UNIT_OF_MEASUREMENT"),
    ):
        value = config.get(key)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            properties[PREFIX + name] = str(value)[:MAX_VALUE]
    device = config.get("device")
    if isinstance(device, dict):
        identifiers = device.get("identifiers")
        if isinstance(identifiers, str):
            identifiers = [identifiers]
        if isinstance(identifiers, list):
            joined = ",".join(str(i) for i in identifiers if isinstance(i, (str, int)))
            properties[PREFIX + "DEVICE_IDENTIFIERS"] = joined[:MAX_VALUE]
        for key, name in (
            ("name", "DEVICE_NAME"),
            ("manufacturer", "DEVICE_MANUFACTURER"),
            ("model", "DEVICE_MODEL"),
            ("sw_version", "DEVICE_SW_VERSION"),
            ("hw_version", "DEVICE_HW_VERSION"),
        ):
            value = device.get(key)
            if isinstance(value, str):
                properties[PREFIX + name] = value[:MAX_VALUE]
    availability_topic, available, not_available = _availability(config)
    if availability_topic:
        properties[PREFIX + "AVAILABILITY_TOPIC"] = availability_topic
    return Announcement(device_id, properties, availability_topic, available, not_available)


def _availability(config: Mapping[str, Any]) -> tuple[str | None, str, str]:
    available = config.get("payload_available", "online")
    not_available = config.get("payload_not_available", "offline")
    topic = config.get("availability_topic")
    entries = config.get("availability")
    if not isinstance(topic, str) and isinstance(entries, list) and entries:
        first = entries[0]
        topic = first.get("topic")
        available = first.get("payload_available", available)
        not_available = first.get("payload_not_available", not_available)
    if not isinstance(topic, str) or not topic:
        return None, "online", "offline"
    return topic, str(available), str(not_available)


def is_homeassistant(topic: str, format_: str) -> bool:
    """Which parser a topic's messages go to."""
    if format_ == "homeassistant":
        return True
    if format_ == "akri":
        return False
    return topic.endswith("/config")


@dataclass
class DeviceTable:
    """The devices known from retained announcements and availability messages."""

    max_devices: int
    format: str = "auto"
    by_topic: dict[str, Announcement] = field(default_factory=dict)
    availability: dict[str, str] = field(default_factory=dict)  # topic -> last payload

    def apply(self, topic: str, payload: bytes) -> bool:
        """One message; True if the device list changed. Raises :class:`RefusedMessage`."""
        if topic in self.watched_availability_topics():
            before = self.devices()
            self.availability[topic] = payload.decode("utf-8", "replace")[:256]
            return self.devices() != before
        if not payload:
            return self.by_topic.pop(topic, None) is not None
        parse = parse_homeassistant if is_homeassistant(topic, self.format) else parse_akri
        try:
            announcement = parse(topic, payload)
        except RefusedMessage:
            # maybe an availability message that came before its device's announcement
            # (retained messages arrive in any order): remember short ones, boundedly
            if len(payload) <= 256 and len(self.availability) < 4 * self.max_devices:
                self.availability[topic] = payload.decode("utf-8", "replace")
            raise
        clash = next(
            (t for t, a in self.by_topic.items() if a.id == announcement.id and t != topic), None
        )
        if clash is not None:
            raise RefusedMessage(f"id {announcement.id!r} is already announced on {clash}")
        if topic not in self.by_topic and len(self.by_topic) >= self.max_devices:
            raise DeviceCapReached(f"more than maxDevices ({self.max_devices}) devices")
        if self.by_topic.get(topic) == announcement:
            return False
        self.by_topic[topic] = announcement
        return True

    def watched_availability_topics(self) -> set[str]:
        return {a.availability_topic for a in self.by_topic.values() if a.availability_topic}

    def devices(self) -> list[Device]:
        """The full list: every announced device whose availability is not "offline"."""
        result = []
        for announcement in self.by_topic.values():
            topic = announcement.availability_topic
            if topic is not None and self.availability.get(topic) == announcement.not_available:
                continue
            result.append(Device(id=announcement.id, properties=dict(announcement.properties)))
        return sorted(result, key=lambda d: d.id)
