"""The opcua handler's ``discoveryDetails`` (Akri's YAML, unchanged, plus fields of ours)::

    opcuaDiscoveryMethod:              # required: exactly one method
      standard:                        # Akri's: FindServers on each URL
        discoveryUrls: ["opc.tcp://10.0.0.1:4840/"]   # default ["opc.tcp://localhost:4840/"]
      # or, ours (Akri has only a TODO):
      multicast:                       # FindServersOnNetwork on discovery servers with LDS-ME
        discoveryUrls: ["opc.tcp://10.0.0.1:4840/"]   # default ["opc.tcp://localhost:4840/"]
        serverCapabilities: [DA]       # optional: only servers with all of these (Part 12)
    applicationNames: {action: Include, items: ["Server A"]}   # optional (Include/Exclude)
    # ours (Akri ignores them):
    recheckIntervalSeconds: 10         # default 10 (Akri's fixed period): servers that answer
    retryIntervalSeconds: 1            # default 1: servers and URLs that do not answer
    timeoutSeconds: 3                  # default 3 (Akri's TCP pre-check): each whole call
    maxServers: 500                    # default 500: servers offered per Configuration

Like Akri's handlers, unknown fields are ignored with a warning; a field of the wrong type,
an unknown method or a URL that is not ``opc.tcp://host[:port][/path]`` is an error naming
the field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from discovery_handlers.base import InvalidDiscoveryDetailsError
from discovery_handlers.details import brief, load_details, unknown_fields
from discovery_handlers.filters import FilterList, parse_filter
from discovery_handlers.resolver import host_name_problem

NAME = "opcua"
FIELDS = (
    "opcuaDiscoveryMethod",
    "applicationNames",
    "recheckIntervalSeconds",
    "retryIntervalSeconds",
    "timeoutSeconds",
    "maxServers",
)
STANDARD = "standard"
MULTICAST = "multicast"
METHODS = (STANDARD, MULTICAST)
METHOD_FIELDS = {STANDARD: ("discoveryUrls",), MULTICAST: ("discoveryUrls", "serverCapabilities")}
DEFAULT_DISCOVERY_URLS = ("opc.tcp://localhost:4840/",)
DEFAULT_PORT = 4840
SCHEME = "opc.tcp"
MAX_URL_LENGTH = 2048
MAX_URLS = 256
MAX_CAPABILITIES = 32
MAX_FILTER_ITEMS = 10_000
DEFAULT_MAX_SERVERS = 500
MAX_SERVERS_LIMIT = 10_000
DEFAULT_RECHECK = 10.0
DEFAULT_RETRY = 1.0
DEFAULT_TIMEOUT = 3.0
MAX_SECONDS = 3600.0
# Part 12 capability identifiers are short upper-case words (DA, HD, LDS, ...)
_CAPABILITY = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")


@dataclass(frozen=True)
class OpcuaDetails:
    """Parsed ``discoveryDetails``."""

    method: str = STANDARD
    discovery_urls: tuple[str, ...] = DEFAULT_DISCOVERY_URLS
    server_capabilities: tuple[str, ...] = ()
    application_names: FilterList | None = None
    recheck_interval: float = DEFAULT_RECHECK
    retry_interval: float = DEFAULT_RETRY
    timeout: float = DEFAULT_TIMEOUT
    max_servers: int = DEFAULT_MAX_SERVERS


def _fail(message: str) -> InvalidDiscoveryDetailsError:
    return InvalidDiscoveryDetailsError(f"{NAME}: discoveryDetails.{message}")


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an ``opc.tcp://host[:port][/path]`` URL we can use (None if it is).
    The same check applies to URLs from Configurations and to those servers report."""
    if not url or len(url) > MAX_URL_LENGTH:
        return f"must have 1 to {MAX_URL_LENGTH} characters"
    if _UNSAFE.search(url):
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        return f"is not a URL ({error})"
    if parts.scheme.lower() != SCHEME:
        return f"must start with {SCHEME}:// (the only transport this handler speaks)"
    if not parts.hostname:
        return "has no host"
    if port == 0:
        return "has port 0"
    return None


def url_key(url: str) -> str:
    """The form URLs are compared in (never shown, never the device id): ``opc.tcp://`` in
    lower case, the host in lower case, the port always written (4840 if none), no trailing
    slash — ``opc.tcp://PLC:4840/`` (Akri's chart) and ``opc.tcp://plc`` (a server's own)
    are one server, asked once. The path keeps its case (servers tell endpoints apart by
    it). A URL that does not split is its own key."""
    try:
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORT
    except ValueError:
        return url
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    path = parts.path.rstrip("/")
    query = f"?{parts.query}" if parts.query else ""
    return f"{SCHEME}://{host}:{port}{path}{query}"


def host_problem(url: str) -> str | None:
    """Why the host of an accepted URL cannot be looked up (None if it can): a name that is
    not IDNA-encodable (``plc..local``, a label over 63 characters). Such a URL costs itself
    only: a configured one is skipped with a warning, a listed one is not offered."""
    problem = host_name_problem(urlsplit(url).hostname or "")
    return None if problem is None else f"has a host that {problem}"


def split_url(url: str) -> SplitResult:
    """``urlsplit`` of a URL :func:`url_problem` accepted."""
    return urlsplit(url)


def host_and_port(url: str) -> tuple[str, int]:
    """The host (without IPv6 brackets) and port (default 4840) of an accepted URL."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or DEFAULT_PORT


def _urls(raw: Any, field: str) -> tuple[str, ...]:
    if raw is None:
        return DEFAULT_DISCOVERY_URLS
    if not isinstance(raw, list):
        raise _fail(f"{field} must be a list of opc.tcp:// URLs, got {brief(raw)}")
    if len(raw) > MAX_URLS:
        raise _fail(f"{field} has {len(raw)} URLs, more than {MAX_URLS}")
    urls: list[str] = []
    for index, item in enumerate(raw):
        if not isinstance(item, str):
            raise _fail(f"{field}[{index}] must be an opc.tcp:// URL, got {brief(item)}")
        problem = url_problem(item)
        if problem is not None:
            raise _fail(f"{field}[{index}] {brief(item)} {problem}")
        urls.append(item)
    # one per server: the first of the URLs that are the same server (:func:`url_key`)
    first: dict[str, str] = {}
    for url in urls:
        first.setdefault(url_key(url), url)
    return tuple(first.values())


def _capabilities(raw: Any, field: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _fail(f"{field} must be a list of capability identifiers (DA, HD, ...)")
    if len(raw) > MAX_CAPABILITIES:
        raise _fail(f"{field} has {len(raw)} entries, more than {MAX_CAPABILITIES}")
    for index, item in enumerate(raw):
        if not isinstance(item, str) or not _CAPABILITY.match(item):
            raise _fail(
                f"{field}[{index}] must be a capability identifier (letters, digits, 1 to 32), "
                f"got {brief(item)}"
            )
    return tuple(dict.fromkeys(item.upper() for item in raw))


def _method(parsed: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    raw = parsed.get("opcuaDiscoveryMethod")
    if raw is None:
        raise _fail(
            "opcuaDiscoveryMethod is required: {standard: {discoveryUrls: [...]}} "
            "or {multicast: {discoveryUrls: [...]}}"
        )
    if not isinstance(raw, dict) or len(raw) != 1:
        raise _fail(
            "opcuaDiscoveryMethod must be a mapping with exactly one method (standard or "
            f"multicast), got {brief(raw)}"
        )
    ((method, body),) = raw.items()
    if method not in METHODS:
        raise _fail(
            f"opcuaDiscoveryMethod has the unknown method {brief(method)} "
            f"(known: {', '.join(METHODS)})"
        )
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise _fail(f"opcuaDiscoveryMethod.{method} must be a mapping, got {brief(body)}")
    return method, body


def _seconds(parsed: dict[str, Any], field: str, default: float, minimum: float) -> float:
    raw = parsed.get(field)
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise _fail(f"{field} must be a number of seconds, got {brief(raw)}")
    if not minimum <= raw <= MAX_SECONDS:
        raise _fail(f"{field} must be between {minimum:g} and {MAX_SECONDS:g}, got {raw}")
    return float(raw)


def parse_details(text: str) -> OpcuaDetails:
    """Parse and validate ``discoveryDetails``; the message names the field."""
    parsed = load_details(text, NAME)
    method, body = _method(parsed)
    prefix = f"opcuaDiscoveryMethod.{method}"
    urls = _urls(body.get("discoveryUrls"), f"{prefix}.discoveryUrls")
    capabilities = (
        _capabilities(body.get("serverCapabilities"), f"{prefix}.serverCapabilities")
        if method == MULTICAST
        else ()
    )
    max_servers = parsed.get("maxServers", DEFAULT_MAX_SERVERS)
    if (
        isinstance(max_servers, bool)
        or not isinstance(max_servers, int)
        or not 1 <= max_servers <= MAX_SERVERS_LIMIT
    ):
        raise _fail(f"maxServers must be 1 to {MAX_SERVERS_LIMIT}, got {brief(max_servers)}")
    return OpcuaDetails(
        method=method,
        discovery_urls=urls,
        server_capabilities=capabilities,
        application_names=parse_filter(
            parsed.get("applicationNames"), "applicationNames", _fail, MAX_FILTER_ITEMS
        ),
        recheck_interval=_seconds(parsed, "recheckIntervalSeconds", DEFAULT_RECHECK, 0.5),
        retry_interval=_seconds(parsed, "retryIntervalSeconds", DEFAULT_RETRY, 0.1),
        timeout=_seconds(parsed, "timeoutSeconds", DEFAULT_TIMEOUT, 0.1),
        max_servers=max_servers,
    )


def warnings(text: str) -> list[str]:
    """Warnings about usable ``discoveryDetails``: unknown fields (ignored, like Akri) and a
    list of discovery URLs that is empty (nothing can be found)."""
    parsed = load_details(text, NAME)
    found = unknown_fields(parsed, FIELDS, NAME)
    method, body = _method(parsed)
    known = METHOD_FIELDS[method]
    unknown = sorted(str(key) for key in body if key not in known)
    if unknown:
        found.append(
            f"{NAME}: ignoring unknown field(s) {', '.join(unknown)} in "
            f"discoveryDetails.opcuaDiscoveryMethod.{method} (known: {', '.join(known)})"
        )
    urls = body.get("discoveryUrls")
    for index, url in enumerate(urls if isinstance(urls, list) else []):
        problem = host_problem(url) if isinstance(url, str) else None
        if problem is not None:
            found.append(
                f"{NAME}: discoveryDetails.opcuaDiscoveryMethod.{method}.discoveryUrls[{index}] "
                f"{brief(url)} {problem}: it is skipped (the other URLs are asked)"
            )
    if body.get("discoveryUrls") == []:
        found.append(
            f"{NAME}: discoveryDetails.opcuaDiscoveryMethod.{method}.discoveryUrls is empty: "
            "no server will be found (leave it out for the default opc.tcp://localhost:4840/)"
        )
    return found
