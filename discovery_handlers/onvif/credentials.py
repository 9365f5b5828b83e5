"""Camera credentials from ``discoveryProperties``, in Akri's forms (``credential_store.rs``),
processed in this order (later forms override earlier ones for the same uuid):

1. ``device_credential_list``: a JSON list of property names; each named property is a JSON map
   ``uuid → {username, password?, base64encoded?}``;
2. ``device_credential_ref_list``: a JSON list of property names; each a JSON map
   ``uuid → {username_ref, password_ref?}`` naming other properties that hold the values;
3. ``username_<uuid>`` / ``password_<uuid>`` with the uuid's ``-`` written as ``_``;
4. ``username_default`` / ``password_default`` for every camera without its own.

Malformed entries are skipped, as Akri does. Lookups ignore case. Credentials never appear
in ``repr`` or log lines.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from discovery_handlers.base import DiscoveryProperties

DEVICE_CREDENTIAL_LIST = "device_credential_list"
DEVICE_CREDENTIAL_REF_LIST = "device_credential_ref_list"
USERNAME_PREFIX = "username_"
PASSWORD_PREFIX = "password_"
DEFAULT_ID = "default"


@dataclass(frozen=True)
class Credential:
    """A username and optional password (shown as ``***`` in ``repr``)."""

    username: str = field(repr=False)
    password: str | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return "Credential(***)"


def _text(value: bytes | None) -> str | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _json(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _list_contents(properties: DiscoveryProperties, key: str) -> list[Any]:
    names = _json(_text(properties.get(key)))
    if not isinstance(names, list):
        return []
    contents = []
    for name in names:
        if isinstance(name, str):
            parsed = _json(_text(properties.get(name)))
            if isinstance(parsed, dict):
                contents.append(parsed)
    return contents


def _decode_base64(text: str) -> str | None:
    try:
        return base64.b64decode(text, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


class CredentialStore:
    """uuid → :class:`Credential`, with the default as fallback."""

    def __init__(self, credentials: Mapping[str, Credential] | None = None) -> None:
        self._credentials = {k.lower(): v for k, v in (credentials or {}).items()}

    def __repr__(self) -> str:
        return f"CredentialStore({len(self._credentials)} entries)"

    def __len__(self) -> int:
        return len(self._credentials)

    def get(self, uuid: str) -> Credential | None:
        """The credential for the camera ``uuid`` (else the default, else None)."""
        return self._credentials.get(uuid.lower()) or self._credentials.get(DEFAULT_ID)

    @classmethod
    def from_properties(cls, properties: DiscoveryProperties) -> CredentialStore:
        """Build the store from resolved ``discoveryProperties``."""
        found: dict[str, Credential] = {}
        for content in _list_contents(properties, DEVICE_CREDENTIAL_LIST):
            for uuid, data in content.items():
                if not isinstance(data, dict) or not isinstance(data.get("username"), str):
                    continue
                password = data.get("password")
                if not isinstance(password, str):
                    password = None
                elif data.get("base64encoded") is True:
                    password = _decode_base64(password)
                found[uuid.lower()] = Credential(data["username"], password)
        for content in _list_contents(properties, DEVICE_CREDENTIAL_REF_LIST):
            for uuid, data in content.items():
                if not isinstance(data, dict) or not isinstance(data.get("username_ref"), str):
                    continue
                username = _text(properties.get(data["username_ref"]))
                if not username:
                    continue
                password_ref = data.get("password_ref")
                password = (
                    _text(properties.get(password_ref)) if isinstance(password_ref, str) else None
                )
                found[uuid.lower()] = Credential(username, password)
        for key, value in properties.items():
            uuid = key.removeprefix(USERNAME_PREFIX)
            if uuid == key or not uuid:
                continue
            username = _text(value)
            if username is None:
                continue
            password = _text(properties.get(PASSWORD_PREFIX + uuid))
            found[uuid.replace("_", "-").lower()] = Credential(username, password)
        default_username = _text(properties.get(USERNAME_PREFIX + DEFAULT_ID))
        if default_username is not None:
            found[DEFAULT_ID] = Credential(
                default_username, _text(properties.get(PASSWORD_PREFIX + DEFAULT_ID))
            )
        return cls(found)
