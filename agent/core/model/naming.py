"""Akri-compatible names: instance digests, instance names, slot ids, CDI names.

Akri (v0.13, ``discovery_handler_registry.rs``) names an Instance ``<configuration>-<digest>``
where digest is a 3-byte blake2b over the device id (shared devices) or the device id followed
by the node name (local devices), hex encoded. We reproduce that exactly for every name that
Akri itself could use, and only deviate where Akri would produce an invalid Kubernetes name:

* names are sanitised into DNS-1123 subdomains (lower case, ``[a-z0-9.-]``);
* an instance name is at most ``MAX_INSTANCE_NAME_LENGTH`` characters so that slot ids
  ``<instance>-<n>`` (n < ``MAX_CAPACITY``) fit kubelet's 63-character device ID limit and
  ``akri.sh/<instance>`` is a valid extended resource name. Longer configuration names are
  shortened deterministically: a prefix plus 8 hex chars of sha256 over the full name.

Collisions: the 24-bit digest collides (about 3 % at 1,000 devices). :func:`candidate_names`
yields the Akri name first, then salted alternatives (digest over ``key + "#<i>"``); the
discovery layer picks the first candidate not owned by a different device (see
``agent/node/discovery/plan.py`` and docs/slot-model.md).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterator

MAX_CAPACITY = 1000
"""Largest capacity accepted; slot indexes are 0..999 (3 digits)."""

KUBELET_DEVICE_ID_MAX = 63
MAX_INSTANCE_NAME_LENGTH = KUBELET_DEVICE_ID_MAX - 1 - len(str(MAX_CAPACITY - 1))  # 59
DNS_SUBDOMAIN_MAX = 253
DIGEST_HEX_LENGTH = 6
DEVICE_DIGEST_ANNOTATION = "akri.sh/device-digest"
DRAINING_ANNOTATION = "akri.sh/draining"
OFFLINE_ANNOTATION = "akri.sh/offline"  # earlier agents: one comma-separated list of nodes
# a shared Instance's node that does not see the device right now (its offline grace) says so
# with an annotation of its own, akri.sh/offline.<node> (:func:`offline_annotation`), written
# by a server-side apply with the node's own field manager: one key per node, so nodes going
# offline together never conflict (docs/slot-model.md)
OFFLINE_NODE_PREFIX = "akri.sh/offline."
# on every Instance while it exists; removed once no slot is held, so a deleted Instance
# (or the garbage collector, after its Configuration was deleted) waits for its pods
SLOTS_FINALIZER = "akri.sh/slots"
CONFIGURATION_LABEL = "akri.sh/configuration"
# pure functions asked again for every device on every list: remember a few thousand devices
NAMING_CACHE_SIZE = 16384

_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_INVALID_CHARS_RE = re.compile(r"[^a-z0-9.-]+")


def is_dns_subdomain(name: str) -> bool:
    """True if ``name`` is a valid Kubernetes object name (RFC 1123 subdomain)."""
    return 0 < len(name) <= DNS_SUBDOMAIN_MAX and bool(_DNS_SUBDOMAIN_RE.match(name))


def is_dns_label(name: str) -> bool:
    """True if ``name`` is a valid RFC 1123 label (≤ 63 chars)."""
    return 0 < len(name) <= 63 and bool(_DNS_LABEL_RE.match(name))


def device_key(device_id: str, node_name: str, shared: bool) -> str:
    """The string Akri hashes: the id for shared devices, id + node (no separator) otherwise."""
    return device_id if shared else device_id + node_name


@functools.lru_cache(maxsize=NAMING_CACHE_SIZE)
def akri_digest(key: str) -> str:
    """Akri's 3-byte blake2b digest of ``key`` as 6 lowercase hex characters."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=3).hexdigest()


@functools.lru_cache(maxsize=NAMING_CACHE_SIZE)
def device_fingerprint(key: str) -> str:
    """A collision-resistant fingerprint of a device key, stored as an annotation on Instances
    so that two devices whose 24-bit digests collide are never merged."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _short_hash(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:length]


ANNOTATION_NAME_MAX = 63  # the part after "<prefix>/" of an annotation key
_ANNOTATION_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


@functools.lru_cache(maxsize=NAMING_CACHE_SIZE)
def offline_annotation(node: str) -> str:
    """The annotation key by which ``node`` says it does not see a shared Instance's device
    right now: ``akri.sh/offline.<node>``. An annotation key's name part is at most 63
    characters of ``[A-Za-z0-9_.-]``; a node name that does not fit (Kubernetes allows 253)
    is cut and suffixed with 10 hex characters of its sha256, so every node keeps a key of
    its own. Readers compute the key of each node they look for (the value is the time the
    node stopped seeing the device)."""
    name = OFFLINE_NODE_PREFIX.split("/", 1)[1] + node
    if len(name) <= ANNOTATION_NAME_MAX and _ANNOTATION_NAME_RE.match(name):
        return f"akri.sh/{name}"
    digest = _short_hash(node, 10)
    keep = ANNOTATION_NAME_MAX - len(OFFLINE_NODE_PREFIX.split("/", 1)[1]) - len(digest) - 1
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "-", node)[:keep].strip("-_.")
    return f"{OFFLINE_NODE_PREFIX}{cleaned}-{digest}" if cleaned else OFFLINE_NODE_PREFIX + digest


@functools.lru_cache(maxsize=NAMING_CACHE_SIZE)
def sanitize_name(name: str) -> str:
    """Turn any string into a DNS-1123 subdomain deterministically.

    Valid names are returned unchanged. Otherwise characters outside ``[a-z0-9.-]`` become
    ``-``, labels are trimmed of leading/trailing ``-`` and, because two different inputs can
    sanitise to the same text, a hash of the original is appended.
    """
    if is_dns_subdomain(name):
        return name
    lowered = _INVALID_CHARS_RE.sub("-", name.lower())
    labels = [label.strip("-") for label in lowered.split(".")]
    cleaned = ".".join(label for label in labels if label)
    suffix = _short_hash(name)
    base = f"{cleaned}-{suffix}" if cleaned else f"x-{suffix}"
    if len(base) > DNS_SUBDOMAIN_MAX:
        base = f"{cleaned[: DNS_SUBDOMAIN_MAX - 9].rstrip('.-')}-{suffix}"
    return base


def _fit(prefix: str, limit: int) -> str:
    """Shorten ``prefix`` to ``limit`` chars, keeping it distinct with a hash of the original."""
    if len(prefix) <= limit:
        return prefix
    head = prefix[: limit - 9].rstrip(".-")
    return f"{head}-{_short_hash(prefix)}"


@functools.lru_cache(maxsize=NAMING_CACHE_SIZE)
def instance_name(configuration_name: str, digest: str) -> str:
    """``<configuration>-<digest>``, shortened deterministically when too long."""
    prefix = _fit(sanitize_name(configuration_name), MAX_INSTANCE_NAME_LENGTH - 1 - len(digest))
    return f"{prefix}-{digest}"


def instance_prefix(configuration_name: str) -> str:
    """What every Instance name of ``configuration_name`` starts with, before ``-<digest>``."""
    return instance_name(configuration_name, "0" * DIGEST_HEX_LENGTH)[: -DIGEST_HEX_LENGTH - 1]


_DIGEST_TAIL_RE = re.compile(r"^(.+)-[0-9a-f]{6}$")


def instance_shaped_prefix(name: str) -> str | None:
    """If ``name`` looks like an Instance name ``<prefix>-<6 hex>``, the prefix, else None:
    the Configuration whose Instances would be named like it is the one whose
    :func:`instance_prefix` that is."""
    match = _DIGEST_TAIL_RE.match(name)
    return match.group(1) if match else None


def candidate_names(configuration_name: str, key: str) -> Iterator[tuple[str, str]]:
    """Yield ``(instance_name, digest)``: Akri's name first, then salted alternatives."""
    yield instance_name(configuration_name, akri_digest(key)), akri_digest(key)
    salt = 1
    while True:
        digest = akri_digest(f"{key}#{salt}")
        yield instance_name(configuration_name, digest), digest
        salt += 1


def digest_of_instance(instance: str) -> str:
    """The digest part of an instance name (text after the last ``-``)."""
    return instance.rsplit("-", 1)[-1]


@functools.lru_cache(maxsize=NAMING_CACHE_SIZE)
def cdi_name(configuration_name: str, digest: str) -> str:
    """Akri's CDI fully-qualified name ``akri.sh/<configuration>=<digest>``."""
    return f"akri.sh/{sanitize_name(configuration_name)}={digest}"


def slot_id(instance: str, index: int) -> str:
    """Slot (IL device) id ``<instance>-<n>``."""
    return f"{instance}-{index}"


def parse_slot_id(instance: str, slot: str) -> int | None:
    """Slot index of ``slot`` if it is a slot of ``instance``, else None."""
    prefix = instance + "-"
    if not slot.startswith(prefix):
        return None
    tail = slot[len(prefix) :]
    if not tail.isdigit() or (len(tail) > 1 and tail[0] == "0"):
        return None
    return int(tail)


def configuration_resource_name(configuration_name: str) -> str:
    """Name part of the configuration-level resource and vdev prefix, fitted like instances."""
    return _fit(sanitize_name(configuration_name), MAX_INSTANCE_NAME_LENGTH)
