"""Decoding of Kubernetes protobuf request bodies for a few core kinds.

``kubectl create namespace|configmap|secret`` (typed clients) send
``application/vnd.kubernetes.protobuf``, and so do Helm's release storage (a typed Secret
client: its DELETE carries protobuf DeleteOptions); everything else kubectl, Helm and the
Python clients send is JSON. Responses are always JSON (clients accept it). Only the fields
such commands set are mapped; unknown fields are skipped.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

JSON = dict[str, Any]
MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
_MAGIC = b"k8s\x00"

# A message schema maps field numbers to (json name, kind); kind is a scalar kind name or a
# nested schema. Scalar kinds: string, bytes (base64 in JSON), int, bool, strings (repeated
# string), map (map<string,string>), bytesmap (map<string,bytes>).
Schema = dict[int, tuple[str, Any]]

OWNER_REFERENCE: Schema = {
    1: ("kind", "string"),
    3: ("name", "string"),
    4: ("uid", "string"),
    5: ("apiVersion", "string"),
    6: ("controller", "bool"),
    7: ("blockOwnerDeletion", "bool"),
}
OBJECT_META: Schema = {
    1: ("name", "string"),
    2: ("generateName", "string"),
    3: ("namespace", "string"),
    5: ("uid", "string"),
    6: ("resourceVersion", "string"),
    7: ("generation", "int"),
    11: ("labels", "map"),
    12: ("annotations", "map"),
    13: ("ownerReferences", ("repeated", OWNER_REFERENCE)),
    14: ("finalizers", "strings"),
}
NAMESPACE: Schema = {
    1: ("metadata", OBJECT_META),
    2: ("spec", {1: ("finalizers", "strings")}),
}
CONFIG_MAP: Schema = {
    1: ("metadata", OBJECT_META),
    2: ("data", "map"),
    3: ("binaryData", "bytesmap"),
    4: ("immutable", "bool"),
}
SECRET: Schema = {
    1: ("metadata", OBJECT_META),
    2: ("data", "bytesmap"),
    3: ("type", "string"),
    4: ("stringData", "map"),
    5: ("immutable", "bool"),
}
DELETE_OPTIONS: Schema = {
    1: ("gracePeriodSeconds", "int0"),
    2: ("preconditions", {1: ("uid", "string"), 2: ("resourceVersion", "string")}),
    3: ("orphanDependents", "bool"),
    4: ("propagationPolicy", "string"),
    5: ("dryRun", "strings"),
}
KINDS: dict[tuple[str, str], Schema] = {
    ("v1", "Namespace"): NAMESPACE,
    ("v1", "ConfigMap"): CONFIG_MAP,
    ("v1", "Secret"): SECRET,
}
_UNKNOWN: Schema = {
    1: ("typeMeta", {1: ("apiVersion", "string"), 2: ("kind", "string")}),
    2: ("raw", "bytes"),
}


class ProtobufError(ValueError):
    """A body that is not a decodable Kubernetes protobuf envelope."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise ProtobufError("truncated varint")
        byte = buf[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
            yield number, value
        elif wire == 2:
            length, i = _varint(buf, i)
            yield number, buf[i : i + length]
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")


def _map_entry(raw: bytes) -> tuple[str, bytes]:
    key, value = "", b""
    for number, item in _fields(raw):
        if number == 1 and isinstance(item, bytes):
            key = item.decode()
        elif number == 2 and isinstance(item, bytes):
            value = item
    return key, value


def decode_message(buf: bytes, schema: Schema) -> JSON:
    out: JSON = {}
    for number, value in _fields(buf):
        if number not in schema:
            continue
        name, kind = schema[number]
        if isinstance(kind, dict) and isinstance(value, bytes):
            out[name] = decode_message(value, kind)
        elif isinstance(kind, tuple) and isinstance(value, bytes):
            out.setdefault(name, []).append(decode_message(value, kind[1]))
        elif kind == "string" and isinstance(value, bytes):
            if value:  # proto2 writes empty optional strings; JSON omits them
                out[name] = value.decode()
        elif kind == "bytes" and isinstance(value, bytes):
            out[name] = value
        elif kind == "strings" and isinstance(value, bytes):
            out.setdefault(name, []).append(value.decode())
        elif kind == "int" and isinstance(value, int):
            if value:
                out[name] = value
        elif kind == "int0" and isinstance(value, int):  # an optional int where 0 is a value
            out[name] = value
        elif kind == "bool" and isinstance(value, int):
            out[name] = bool(value)
        elif kind in ("map", "bytesmap") and isinstance(value, bytes):
            key, item = _map_entry(value)
            text = item.decode() if kind == "map" else base64.b64encode(item).decode()
            out.setdefault(name, {})[key] = text
    return out


def decode_object(body: bytes) -> JSON:
    """The JSON form of a protobuf-encoded object of one of :data:`KINDS`."""
    if not body.startswith(_MAGIC):
        raise ProtobufError("missing the k8s protobuf magic prefix")
    envelope = decode_message(body[len(_MAGIC) :], _UNKNOWN)
    type_meta = envelope.get("typeMeta") or {}
    key = (type_meta.get("apiVersion", ""), type_meta.get("kind", ""))
    schema = KINDS.get(key)
    if schema is None:
        raise ProtobufError(f"protobuf decoding of {key[0]} {key[1]} is not implemented")
    obj = decode_message(envelope.get("raw", b""), schema)
    return {"apiVersion": key[0], "kind": key[1], **obj}


def decode_delete_options(body: bytes) -> JSON:
    """The JSON form of protobuf-encoded DeleteOptions (any apiVersion: client-go sends them as
    meta.k8s.io/v1 or as the resource's group version)."""
    if not body.startswith(_MAGIC):
        raise ProtobufError("missing the k8s protobuf magic prefix")
    envelope = decode_message(body[len(_MAGIC) :], _UNKNOWN)
    kind = (envelope.get("typeMeta") or {}).get("kind", "")
    if kind != "DeleteOptions":
        raise ProtobufError(f"expected DeleteOptions, got {kind or 'no kind'}")
    return decode_message(envelope.get("raw", b""), DELETE_OPTIONS)
