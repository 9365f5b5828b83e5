"""The mqtt handler's ``discoveryDetails``::

broker:
  host: mqtt.example.com   # required
  port: 8883               # default 1883, or 8883 with tls
  tls:                     # optional: true, or
    caFile: /etc/akri/ca.pem   # CA bundle (default: the system's)
    insecure: false            # true: no certificate/host-name check (test brokers only)
  clientId: akri-node-a    # default: akri-<random>
  keepaliveSeconds: 30     # default 30
topics:                    # required: topic filters of retained announcements
  - akri/devices/#         #   our JSON format (docs/mqtt.md)
  - homeassistant/#        #   Home Assistant MQTT discovery (…/config topics)
format: auto               # auto (…/config topics are Home Assistant), akri, homeassistant
maxDevices: 1000           # devices per Configuration (default 1000, at most 10000)

Credentials are ``discoveryProperties`` named ``username`` and ``password`` (from a Secret).
"""

from __future__ import annotations

from dataclasses import dataclass

from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.details import brief, load_details, unknown_fields
from discovery_handlers.resolver import host_name_problem

NAME = "mqtt"
FIELDS = ("broker", "topics", "format", "maxDevices")
BROKER_FIELDS = ("host", "port", "tls", "clientId", "keepaliveSeconds")
FORMATS = ("auto", "akri", "homeassistant")
DEFAULT_MAX_DEVICES = 1000
MAX_DEVICES_LIMIT = 10_000
MAX_TOPICS = 64


@dataclass(frozen=True)
class TlsSettings:
    ca_file: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class MqttDetails:
    host: str
    port: int
    topics: tuple[str, ...]
    tls: TlsSettings | None = None
    client_id: str | None = None
    keepalive: int = 30
    format: str = "auto"
    max_devices: int = DEFAULT_MAX_DEVICES


def _fail(message: str) -> InvalidDiscoveryDetailsError:
    return InvalidDiscoveryDetailsError(f"{NAME}: discoveryDetails.{message}")


def check_topic_filter(topic: str) -> str | None:
    """Why ``topic`` is not a valid MQTT topic filter (None if it is)."""
    if not topic or len(topic.encode()) > 65535:
        return "must have 1 to 65535 bytes"
    if "\x00" in topic:
        return "must not contain NUL"
    levels = topic.split("/")
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != len(levels) - 1):
            return "'#' must be a whole level, and the last"
        if "+" in level and level != "+":
            return "'+' must be a whole level"
    return None


def parse_details(text: str) -> MqttDetails:
    """Parse and validate ``discoveryDetails``; the message names the field."""
    parsed = load_details(text, NAME)
    broker = parsed.get("broker")
    if not isinstance(broker, dict):
        raise _fail("broker is required: {host: …, port: …}")
    host = broker.get("host")
    if not isinstance(host, str) or not host.strip() or len(host) > 253:
        raise _fail(f"broker.host must be a host name or address, got {brief(host)}")
    problem = host_name_problem(host.strip())
    if problem is not None:  # getaddrinfo would raise UnicodeError at every connect
        raise _fail(f"broker.host {brief(host)} {problem}")
    tls = _parse_tls(broker.get("tls"))
    port = broker.get("port", 8883 if tls else 1883)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise _fail(f"broker.port must be 1 to 65535, got {brief(port)}")
    client_id = broker.get("clientId")
    if client_id is not None and (not isinstance(client_id, str) or not 0 < len(client_id) <= 128):
        raise _fail(
            f"broker.clientId must be a string of 1 to 128 characters, got {brief(client_id)}"
        )
    keepalive = broker.get("keepaliveSeconds", 30)
    if not isinstance(keepalive, int) or isinstance(keepalive, bool) or not 5 <= keepalive <= 3600:
        raise _fail(f"broker.keepaliveSeconds must be 5 to 3600, got {brief(keepalive)}")
    topics = parsed.get("topics")
    if not isinstance(topics, list) or not topics:
        raise _fail("topics is required: a list of topic filters, e.g. ['akri/devices/#']")
    if len(topics) > MAX_TOPICS:
        raise _fail(f"topics has {len(topics)} filters, more than {MAX_TOPICS}")
    for index, topic in enumerate(topics):
        problem = check_topic_filter(topic) if isinstance(topic, str) else "must be a string"
        if problem:
            raise _fail(f"topics[{index}] {brief(topic)}: {problem}")
    format_ = parsed.get("format", "auto")
    if format_ not in FORMATS:
        raise _fail(f"format must be one of {', '.join(FORMATS)}, got {brief(format_)}")
    max_devices = parsed.get("maxDevices", DEFAULT_MAX_DEVICES)
    if (
        not isinstance(max_devices, int)
        or isinstance(max_devices, bool)
        or not 1 <= max_devices <= MAX_DEVICES_LIMIT
    ):
        raise _fail(f"maxDevices must be 1 to {MAX_DEVICES_LIMIT}, got {brief(max_devices)}")
    return MqttDetails(
        host=host.strip(),
        port=port,
        topics=tuple(topics),
        tls=tls,
        client_id=client_id,
        keepalive=keepalive,
        format=format_,
        max_devices=max_devices,
    )


def _parse_tls(value: object) -> TlsSettings | None:
    if value is None or value is False:
        return None
    if value is True:
        return TlsSettings()
    if not isinstance(value, dict):
        raise _fail(f"broker.tls must be true or {{caFile, insecure}}, got {brief(value)}")
    ca_file = value.get("caFile")
    if ca_file is not None and (not isinstance(ca_file, str) or not ca_file.startswith("/")):
        raise _fail(f"broker.tls.caFile must be an absolute path, got {brief(ca_file)}")
    insecure = value.get("insecure", False)
    if not isinstance(insecure, bool):
        raise _fail(f"broker.tls.insecure must be true or false, got {brief(insecure)}")
    return TlsSettings(ca_file=ca_file, insecure=insecure)


def warnings(text: str) -> list[str]:
    """Unknown fields (ignored, like Akri's handlers do)."""
    parsed = load_details(text, NAME)
    found = unknown_fields(parsed, FIELDS, NAME)
    broker = parsed.get("broker")
    if isinstance(broker, dict):
        found += [
            f"{NAME}: discoveryDetails.broker.{key} is not a known field and is ignored"
            for key in broker
            if key not in BROKER_FIELDS
        ]
    return found
