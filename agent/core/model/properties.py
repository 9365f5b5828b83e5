"""Resolve ``discoveryProperties`` into the bytes a handler receives (Akri semantics).

``value`` → its UTF-8 bytes; ``valueFrom.secretKeyRef`` → the Secret's ``data[key]``
(base64-decoded); ``configMapKeyRef`` → ``data[key]``, else ``binaryData[key]``; a missing
object or key is an error unless ``optional: true`` (then the property is omitted); neither
value nor valueFrom → ``None`` (Akri's ``ByteData{vec: None}``).

Values are secrets: they are never logged, and errors name only the reference.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.model.configuration import DiscoveryProperty, KeyRef


class PropertyResolutionError(Exception):
    """A required Secret/ConfigMap key could not be read."""


ObjectReader = Callable[[str, str, str], Awaitable[Mapping[str, Any] | None]]
"""``(kind, namespace, name) -> object or None if it does not exist``."""


@dataclass(frozen=True)
class ObjectRef:
    """A Secret or ConfigMap a Configuration depends on."""

    kind: str  # "secret" | "configMap"
    namespace: str
    name: str


def references(properties: Sequence[DiscoveryProperty]) -> set[ObjectRef]:
    """Objects whose changes must trigger re-resolution."""
    return {
        ObjectRef(p.value_from.kind, p.value_from.namespace, p.value_from.name)
        for p in properties
        if p.value_from is not None
    }


def value_from_object(ref: KeyRef, obj: Mapping[str, Any] | None) -> bytes | None:
    """The referenced key's bytes from an already-read object (None if absent)."""
    if obj is None:
        return None
    data = obj.get("data") or {}
    if ref.kind == "secret":
        encoded = data.get(ref.key)
        if encoded is None:
            string_data = (obj.get("stringData") or {}).get(ref.key)
            return string_data.encode() if isinstance(string_data, str) else None
        try:
            return base64.b64decode(encoded, validate=True)
        except (ValueError, TypeError) as error:
            raise PropertyResolutionError(
                f"secret {ref.namespace}/{ref.name} key {ref.key!r} is not valid base64"
            ) from error
    if ref.key in data and isinstance(data[ref.key], str):
        return str(data[ref.key]).encode()
    binary = (obj.get("binaryData") or {}).get(ref.key)
    if isinstance(binary, str):
        return base64.b64decode(binary)
    return None


async def resolve_properties(
    properties: Sequence[DiscoveryProperty], read: ObjectReader
) -> dict[str, bytes | None]:
    """Resolve every property; raises :class:`PropertyResolutionError` naming the reference."""
    result: dict[str, bytes | None] = {}
    for prop in properties:
        if prop.value is not None:
            result[prop.name] = prop.value.encode()
            continue
        ref = prop.value_from
        if ref is None:
            result[prop.name] = None
            continue
        obj = await read(ref.kind, ref.namespace, ref.name)
        value = value_from_object(ref, obj)
        if value is None:
            if ref.optional:
                continue
            what = "Secret" if ref.kind == "secret" else "ConfigMap"
            missing = "does not exist" if obj is None else f"has no key {ref.key!r}"
            raise PropertyResolutionError(
                f"discoveryProperties {prop.name}: {what} {ref.namespace}/{ref.name} {missing}"
            )
        result[prop.name] = value
    return result
