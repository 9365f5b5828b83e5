"""The mqtt handler's pure parts: discoveryDetails, announcement formats, the device table."""

from __future__ import annotations

import json

import pytest

from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.mqtt.announcements import (
    DeviceTable,
    RefusedMessage,
    env_name,
    expand,
    parse_akri,
    parse_homeassistant,
)
from discovery_handlers.mqtt.details import check_topic_filter, parse_details, warnings
from tests.paths import REPO


def test_details_defaults_and_tls_port() -> None:
    plain = parse_details("broker: {host: mqtt.local}\ntopics: ['a/#']")
    assert (plain.port, plain.tls, plain.max_devices, plain.format) == (1883, None, 1000, "auto")
    secure = parse_details("broker: {host: mqtt.local, tls: true}\ntopics: ['a/#']")
    assert secure.port == 8883 and secure.tls is not None


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("topics: ['a']", "broker is required"),
        ("broker: {host: ''}\ntopics: ['a']", "broker.host"),
        ("broker: {host: h, port: 0}\ntopics: ['a']", "broker.port"),
        ("broker: {host: h, port: true}\ntopics: ['a']", "broker.port"),
        ("broker: {host: h}", "topics is required"),
        ("broker: {host: h}\ntopics: []", "topics is required"),
        ("broker: {host: h}\ntopics: ['a/#/b']", "topics[0]"),
        ("broker: {host: h}\ntopics: ['a/b+']", "topics[0]"),
        ("broker: {host: h}\ntopics: [5]", "topics[0]"),
        ("broker: {host: h}\ntopics: ['a']\nformat: xml", "format"),
        ("broker: {host: h}\ntopics: ['a']\nmaxDevices: 0", "maxDevices"),
        ("broker: {host: h, tls: {caFile: rel.pem}}\ntopics: ['a']", "broker.tls.caFile"),
        # issue 42.1: not IDNA-encodable (getaddrinfo raised UnicodeError at every connect)
        ("broker: {host: mqtt..local}\ntopics: ['a']", "broker.host 'mqtt..local' is not a"),
        (f"broker: {{host: {'b' * 64}.local}}\ntopics: ['a']", "is not a valid host name"),
    ],
)
def test_bad_details_name_the_field(text: str, field: str) -> None:
    with pytest.raises(InvalidDiscoveryDetailsError, match="mqtt: discoveryDetails") as info:
        parse_details(text)
    assert field in str(info.value)


def test_unknown_fields_are_warnings() -> None:
    found = warnings("broker: {host: h, qos: 2}\ntopics: ['a']\nretain: true")
    assert any("retain" in w for w in found) and any("broker.qos" in w for w in found)


def test_topic_filters() -> None:
    assert check_topic_filter("a/+/c/#") is None
    assert check_topic_filter("#") is None
    assert check_topic_filter("a/#/c") and check_topic_filter("a#") and check_topic_filter("")


def test_our_format_properties_are_env_var_safe() -> None:
    found = parse_akri(
        "akri/devices/x",
        json.dumps(
            {"id": "x-1", "properties": {"room name": "lab", "n": 3, "nested": {}}}
        ).encode(),
    )
    assert found.id == "x-1"
    assert found.properties == {
        "MQTT_ROOM_NAME": "lab",
        "MQTT_N": "3",
        "MQTT_TOPIC": "akri/devices/x",
    }
    assert env_name("temp-°C") == "MQTT_TEMP__C"


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\xff", "not UTF-8"),
        (b"{", "not JSON"),
        (b"[1]", "JSON object"),
        (json.dumps({"id": ""}).encode(), "id must be"),
        (json.dumps({"id": "a\tb"}).encode(), "id must be"),
        (json.dumps({"id": "x" * 300}).encode(), "id must be"),
        (json.dumps({"id": "x", "properties": []}).encode(), "properties"),
        (b"[" * 100_000, "more than"),
    ],
)
def test_bad_announcements_are_refused(payload: bytes, why: str) -> None:
    with pytest.raises(RefusedMessage, match=why):
        parse_akri("t", payload)


def test_home_assistant_abbreviations_and_base_topic() -> None:
    config = expand({"~": "home/x", "stat_t": "~/state", "cmd_t": "~/set", "dev": {"mf": "A"}})
    assert config["state_topic"] == "home/x/state" and config["command_topic"] == "home/x/set"
    assert config["device"] == {"manufacturer": "A"}


def test_home_assistant_id_without_unique_id_and_availability_list() -> None:
    payload = {"name": "T", "availability": [{"t": "dev/t/avail", "pl_not_avail": "dead"}]}
    found = parse_homeassistant("homeassistant/sensor/t1/config", json.dumps(payload).encode())
    assert found.id == "sensor/t1"
    assert (found.availability_topic, found.not_available) == ("dev/t/avail", "dead")
    with pytest.raises(RefusedMessage, match="config topic"):
        parse_homeassistant("homeassistant/config", b"{}")


def test_the_table_handles_removal_clashes_caps_and_early_availability() -> None:
    table = DeviceTable(max_devices=2)
    # availability before the announcement (retained messages come in any order)
    with pytest.raises(RefusedMessage):
        table.apply("akri/a/status", b"offline")
    body = {"id": "a", "availabilityTopic": "akri/a/status"}
    assert table.apply("akri/a", json.dumps(body).encode())
    assert table.devices() == []  # known offline already
    assert table.apply("akri/a/status", b"online")
    assert [d.id for d in table.devices()] == ["a"]
    with pytest.raises(RefusedMessage, match="already announced"):
        table.apply("akri/other", json.dumps({"id": "a"}).encode())
    assert table.apply("akri/b", json.dumps({"id": "b"}).encode())
    with pytest.raises(RefusedMessage, match="maxDevices"):
        table.apply("akri/c", json.dumps({"id": "c"}).encode())
    assert not table.apply("akri/b", json.dumps({"id": "b"}).encode())  # the same again
    assert table.apply("akri/b", b"")
    assert [d.id for d in table.devices()] == ["a"]


def test_the_documented_schema_and_the_parser_agree() -> None:

    import jsonschema

    schema = json.loads((REPO / "docs/mqtt-announcement.schema.json").read_text())
    good = {"id": "sensor-7", "properties": {"room": "lab", "n": 1}, "availabilityTopic": "s/7"}
    jsonschema.validate(good, schema)
    parse_akri("t", json.dumps(good).encode())
    for bad in ({"id": ""}, {"id": "a\tb"}, {"properties": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        with pytest.raises(RefusedMessage):
            parse_akri("t", json.dumps(bad).encode())
