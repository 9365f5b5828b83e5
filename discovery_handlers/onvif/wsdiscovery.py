"""WS-Discovery (2005/04, the version ONVIF uses) messages, pure: build a Probe for
``tdn:NetworkVideoTransmitter``; parse ProbeMatches, Hello and Bye into :class:`Endpoint`
records.

Datagrams come from anyone on the network, so parsing is defensive: a size cap, defusedxml
(no DTDs, no entity expansion, no external references), caps on the number of matches,
addresses and scopes, and anything malformed is ignored (None), never raised.
"""

from __future__ import annotations

import enum
import uuid as uuid_module
from dataclasses import dataclass
from typing import Any

MULTICAST_IPV4 = "239.255.255.250"
MULTICAST_IPV6 = "ff02::c"
PORT = 3702
MAX_MESSAGE_BYTES = 64 * 1024
MAX_MATCHES = 64  # ProbeMatch elements per message
MAX_XADDRS = 16  # per endpoint
MAX_SCOPES = 128  # per endpoint
MAX_TEXT = 4096  # characters of one address / scope

SOAP_ENV = "http://www.w3.org/2003/05/soap-envelope"
WSA = "http://schemas.xmlsoap.org/ws/2004/08/addressing"
WSD = "http://schemas.xmlsoap.org/ws/2005/04/discovery"
NETWORK_WSDL = "http://www.onvif.org/ver10/network/wsdl"
DISCOVERY_URN = "urn:schemas-xmlsoap-org:ws:2005:04:discovery"
ACTION_PROBE = WSD + "/Probe"
ACTION_PROBE_MATCHES = WSD + "/ProbeMatches"
ACTION_HELLO = WSD + "/Hello"
ACTION_BYE = WSD + "/Bye"
NVT_LOCAL_NAME = "NetworkVideoTransmitter"


class Kind(enum.Enum):
    """What a parsed message says about the endpoints in it."""

    PROBE_MATCHES = "ProbeMatches"
    HELLO = "Hello"
    BYE = "Bye"
    PROBE = "Probe"


@dataclass(frozen=True)
class Endpoint:
    """One device as a discovery message describes it."""

    uuid: str  # from EndpointReference/Address: urn:/uuid: stripped, lower case (Akri)
    address: str  # EndpointReference/Address as sent
    xaddrs: tuple[str, ...] = ()
    scopes: tuple[str, ...] | None = None  # None: no Scopes element
    types: tuple[str, ...] = ()
    metadata_version: str = ""

    @property
    def is_video_transmitter(self) -> bool:
        """True if Types lists NetworkVideoTransmitter (any prefix)."""
        return any(t.rpartition(":")[2] == NVT_LOCAL_NAME for t in self.types)


@dataclass(frozen=True)
class Message:
    """A parsed discovery message."""

    kind: Kind
    message_id: str
    relates_to: str
    endpoints: tuple[Endpoint, ...]
    types: tuple[str, ...] = ()  # of a Probe


def device_uuid(address: str) -> str:
    """Akri's device uuid: the EndpointReference address without ``urn:`` then ``uuid:``,
    lower case."""
    text = address.strip()
    text = text.removeprefix("urn:")
    text = text.removeprefix("uuid:")
    return text.lower()


def new_message_id() -> str:
    """A fresh ``uuid:`` message id."""
    return f"uuid:{uuid_module.uuid4()}"


def _escape(text: str) -> str:
    return (
        text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    )


def build_probe(message_id: str) -> bytes:
    """A Probe for ONVIF network video transmitters (SOAP 1.2, multicast)."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f'<s:Envelope xmlns:s="{SOAP_ENV}" xmlns:a="{WSA}" xmlns:d="{WSD}" '
        f'xmlns:tdn="{NETWORK_WSDL}">'
        "<s:Header>"
        f"<a:MessageID>{_escape(message_id)}</a:MessageID>"
        f"<a:To>{DISCOVERY_URN}</a:To>"
        f"<a:Action>{ACTION_PROBE}</a:Action>"
        "</s:Header>"
        "<s:Body><d:Probe><d:Types>tdn:NetworkVideoTransmitter</d:Types></d:Probe></s:Body>"
        "</s:Envelope>"
    ).encode()


def _parse_xml(data: bytes) -> Any | None:
    from defusedxml import ElementTree as SafeElementTree  # lazily: only when discovering

    if len(data) > MAX_MESSAGE_BYTES:
        return None
    try:
        return SafeElementTree.fromstring(data, forbid_dtd=True)
    except Exception:  # ParseError, defusedxml's DTD/entity refusals, bad encodings
        return None


def _local(tag: Any) -> str:
    return str(tag).rpartition("}")[2] if isinstance(tag, str) else ""


def _ns(tag: Any) -> str:
    return str(tag)[1:].partition("}")[0] if isinstance(tag, str) and tag.startswith("{") else ""


def _child(element: Any, namespace: str, name: str) -> Any | None:
    for child in element:
        if _local(child.tag) == name and _ns(child.tag) == namespace:
            return child
    return None


def _text(element: Any | None) -> str:
    if element is None or element.text is None:
        return ""
    return str(element.text).strip()[:MAX_TEXT]


def _words(element: Any | None, limit: int) -> tuple[str, ...]:
    if element is None or element.text is None:
        return ()
    words = str(element.text).split()
    return tuple(word for word in words[:limit] if len(word) <= MAX_TEXT)


def _endpoint(element: Any) -> Endpoint | None:
    reference = _child(element, WSA, "EndpointReference")
    address = _text(_child(reference, WSA, "Address")) if reference is not None else ""
    if not address:
        return None
    uuid = device_uuid(address)
    if not uuid:
        return None
    scopes_element = _child(element, WSD, "Scopes")
    return Endpoint(
        uuid=uuid,
        address=address,
        xaddrs=tuple(dict.fromkeys(_words(_child(element, WSD, "XAddrs"), MAX_XADDRS))),
        scopes=None if scopes_element is None else _words(scopes_element, MAX_SCOPES),
        types=_words(_child(element, WSD, "Types"), MAX_SCOPES),
        metadata_version=_text(_child(element, WSD, "MetadataVersion"))[:64],
    )


def parse_message(data: bytes) -> Message | None:
    """Parse a WS-Discovery datagram; None if it is not a well-formed Probe, ProbeMatches,
    Hello or Bye (or is hostile: too large, has a DTD or entities)."""
    root = _parse_xml(data)
    if root is None or _local(root.tag) != "Envelope" or _ns(root.tag) != SOAP_ENV:
        return None
    header = _child(root, SOAP_ENV, "Header")
    body = _child(root, SOAP_ENV, "Body")
    if body is None:
        return None
    message_id = _text(_child(header, WSA, "MessageID")) if header is not None else ""
    relates_to = _text(_child(header, WSA, "RelatesTo")) if header is not None else ""
    for kind in Kind:
        element = _child(body, WSD, kind.value)
        if element is None:
            continue
        if kind is Kind.PROBE:
            types = _words(_child(element, WSD, "Types"), MAX_SCOPES)
            return Message(kind, message_id, relates_to, (), types)
        if kind is Kind.PROBE_MATCHES:
            matches = [c for c in element if _local(c.tag) == "ProbeMatch" and _ns(c.tag) == WSD]
            found = (_endpoint(match) for match in matches[:MAX_MATCHES])
            endpoints = tuple(e for e in found if e is not None)
        else:
            endpoint = _endpoint(element)
            endpoints = () if endpoint is None else (endpoint,)
        return Message(kind, message_id, relates_to, endpoints)
    return None
