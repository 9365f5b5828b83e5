"""ONVIF device-service SOAP 1.2 messages, pure: request envelopes (with an optional
WS-Security UsernameToken, PasswordDigest as in ONVIF Core §5.9.4) and parsers for the
answers to GetDeviceInformation, GetNetworkInterfaces and GetScopes, and for SOAP Faults.

Answers are parsed with defusedxml under a size cap; a malformed answer raises
:class:`SoapError`.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from discovery_handlers.onvif.wsdiscovery import SOAP_ENV

DEVICE_WSDL = "http://www.onvif.org/ver10/device/wsdl"
SCHEMA = "http://www.onvif.org/ver10/schema"
WSSE = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-secext-1.0.xsd"
WSU = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-utility-1.0.xsd"
PASSWORD_DIGEST = (
    "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-username-token-profile-1.0"
    "#PasswordDigest"
)
BASE64_BINARY = (
    "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-soap-message-security-1.0#Base64Binary"
)
MAX_RESPONSE_BYTES = 1024 * 1024
CONTENT_TYPE = "application/soap+xml; charset=utf-8"


class SoapError(Exception):
    """An answer that is not a usable SOAP message."""


@dataclass(frozen=True)
class UsernameToken:
    """A WS-Security UsernameToken with a PasswordDigest."""

    username: str
    nonce: str  # base64
    created: str
    digest: str  # base64(sha1(nonce bytes + created + password))

    def __repr__(self) -> str:
        return "UsernameToken(***)"


def password_digest(nonce: bytes, created: str, password: str) -> str:
    """Base64(SHA-1(nonce + created + password)) — the UsernameToken PasswordDigest."""
    sha1 = hashlib.sha1(nonce + created.encode() + password.encode(), usedforsecurity=False)
    return base64.b64encode(sha1.digest()).decode()


def make_token(
    username: str,
    password: str | None,
    *,
    nonce: bytes | None = None,
    now: datetime.datetime | None = None,
) -> UsernameToken:
    """A fresh UsernameToken (random 16-byte nonce, ``Created`` = now in UTC)."""
    nonce = os.urandom(16) if nonce is None else nonce
    now = now or datetime.datetime.now(datetime.UTC)
    created = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.") + (
        f"{now.microsecond // 1000:03d}Z"
    )
    return UsernameToken(
        username=username,
        nonce=base64.b64encode(nonce).decode(),
        created=created,
        digest=password_digest(nonce, created, password or ""),
    )


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def security_header(token: UsernameToken) -> str:
    """The ``wsse:Security`` header element for ``token``."""
    return (
        f'<wsse:Security s:mustUnderstand="1" xmlns:wsse="{WSSE}" xmlns:wsu="{WSU}">'
        "<wsse:UsernameToken>"
        f"<wsse:Username>{_escape(token.username)}</wsse:Username>"
        f'<wsse:Password Type="{PASSWORD_DIGEST}">{token.digest}</wsse:Password>'
        f'<wsse:Nonce EncodingType="{BASE64_BINARY}">{token.nonce}</wsse:Nonce>'
        f"<wsu:Created>{token.created}</wsu:Created>"
        "</wsse:UsernameToken>"
        "</wsse:Security>"
    )


def request(operation: str, token: UsernameToken | None = None) -> bytes:
    """A device-service request without parameters, e.g. ``GetDeviceInformation``."""
    header = security_header(token) if token is not None else ""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f'<s:Envelope xmlns:s="{SOAP_ENV}" xmlns:tds="{DEVICE_WSDL}">'
        f"<s:Header>{header}</s:Header>"
        f"<s:Body><tds:{operation}/></s:Body>"
        "</s:Envelope>"
    ).encode()


def action_header(operation: str) -> str:
    """The Content-Type with the SOAP 1.2 ``action`` parameter."""
    return f'{CONTENT_TYPE}; action="{DEVICE_WSDL}/{operation}"'


@dataclass(frozen=True)
class Fault:
    """A SOAP 1.2 Fault: code, subcodes (local names) and reason text."""

    code: str
    subcodes: tuple[str, ...]
    reason: str

    @property
    def not_authorized(self) -> bool:
        """The camera refused the credentials (ONVIF ``ter:NotAuthorized``, or a
        ``wsse:FailedAuthentication``-style subcode)."""
        names = {name.lower() for name in self.subcodes}
        return bool(
            names
            & {"notauthorized", "failedauthentication", "invalidsecuritytoken", "invalidsecurity"}
        )


def _local(tag: Any) -> str:
    return str(tag).rpartition("}")[2] if isinstance(tag, str) else ""


def _ns(tag: Any) -> str:
    return str(tag)[1:].partition("}")[0] if isinstance(tag, str) and tag.startswith("{") else ""


def parse_envelope(data: bytes) -> Any:
    """The Body element of a SOAP 1.2 envelope (raises :class:`SoapError`)."""
    from defusedxml import ElementTree as SafeElementTree

    if len(data) > MAX_RESPONSE_BYTES:
        raise SoapError(f"answer larger than {MAX_RESPONSE_BYTES} bytes")
    try:
        root = SafeElementTree.fromstring(data, forbid_dtd=True)
    except Exception as error:
        raise SoapError(f"answer is not acceptable XML: {type(error).__name__}") from None
    if _local(root.tag) != "Envelope" or _ns(root.tag) != SOAP_ENV:
        raise SoapError("answer is not a SOAP 1.2 envelope")
    for child in root:
        if _local(child.tag) == "Body" and _ns(child.tag) == SOAP_ENV:
            return child
    raise SoapError("answer has no SOAP Body")


def _value_local_name(text: str | None) -> str:
    return (text or "").strip().rpartition(":")[2]


def find_fault(body: Any) -> Fault | None:
    """The Fault in a SOAP Body, if any."""
    for child in body:
        if _local(child.tag) != "Fault":
            continue
        values = [_value_local_name(p.text) for p in child.iter() if _local(p.tag) == "Value"]
        texts = [(p.text or "").strip() for p in child.iter() if _local(p.tag) == "Text"]
        code, subcodes = (values[0], values[1:]) if values else ("", [])
        reason = texts[0][:200] if texts else ""
        return Fault(code, tuple(subcodes), reason)
    return None


def _response(body: Any, name: str) -> Any:
    for child in body:
        if _local(child.tag) == name:
            return child
    raise SoapError(f"answer has no {name}")


def _descendants(element: Any, *path: str) -> list[Any]:
    """Elements reached from ``element`` by local names (``*`` = any)."""
    current = [element]
    for step in path:
        current = [c for e in current for c in e if step == "*" or _local(c.tag) == step]
    return current


@dataclass(frozen=True)
class DeviceInformation:
    """GetDeviceInformationResponse."""

    manufacturer: str = ""
    model: str = ""
    firmware_version: str = ""
    serial_number: str = ""
    hardware_id: str = ""


def parse_device_information(body: Any) -> DeviceInformation:
    """Parse a GetDeviceInformationResponse Body."""
    response = _response(body, "GetDeviceInformationResponse")
    values = {_local(c.tag): (c.text or "").strip()[:256] for c in response}
    return DeviceInformation(
        manufacturer=values.get("Manufacturer", ""),
        model=values.get("Model", ""),
        firmware_version=values.get("FirmwareVersion", ""),
        serial_number=values.get("SerialNumber", ""),
        hardware_id=values.get("HardwareId", ""),
    )


def parse_network_interfaces(body: Any) -> tuple[str | None, str | None]:
    """(IPv4 address, MAC address) of a GetNetworkInterfacesResponse, as Akri reads them:
    the first ``NetworkInterfaces/IPv4/Config/*/Address`` and the first
    ``NetworkInterfaces/Info/HwAddress``; None where absent."""
    response = _response(body, "GetNetworkInterfacesResponse")
    addresses = [
        (a.text or "").strip()
        for a in _descendants(response, "NetworkInterfaces", "IPv4", "Config", "*", "Address")
    ]
    macs = [
        (m.text or "").strip()
        for m in _descendants(response, "NetworkInterfaces", "Info", "HwAddress")
    ]
    ip = next((a for a in addresses if a), None)
    mac = next((m for m in macs if m), None)
    return (ip[:64] if ip else None, mac[:64] if mac else None)


def parse_scopes(body: Any) -> tuple[str, ...]:
    """The ``ScopeItem`` values of a GetScopesResponse."""
    response = _response(body, "GetScopesResponse")
    items = _descendants(response, "Scopes", "ScopeItem")
    return tuple((item.text or "").strip()[:4096] for item in items[:128] if item.text)
