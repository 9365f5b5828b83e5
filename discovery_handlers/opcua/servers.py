"""What the opcua handler makes of FindServers and FindServersOnNetwork answers (pure: no
network, no ``asyncua``).

Akri's rules (``discovery-handlers/opcua/src/discovery_impl.rs``), and where we differ:

- an application is offered if its ``ApplicationType`` is Server — and, unlike Akri, also
  ClientAndServer (asyncua's servers and many SDKs' are ClientAndServer, and Akri skips them);
  clients and discovery servers are never offered;
- the ``applicationNames`` filter is applied to ``ApplicationName.Text`` (exact match);
- its DiscoveryURL is the first one starting with ``opc.tcp`` (an application without one is
  skipped, as in Akri, where a non-``opc.tcp`` URL fails its parse);
- if that URL's host does not resolve on this node, the host of the URL that was asked is
  used instead (Akri PR #584): the queried URL with the server URL's path, as Akri writes it,
  so the device id — and the Instance name — is Akri's. One difference: a server URL with an
  explicit port other than the queried URL's keeps its own port (a server registered with a
  discovery server on the same host; Akri would take the discovery server's port);
- URLs are kept verbatim (never normalised): the device id is the DiscoveryURL string, hashed
  into the Instance name like Akri does; two URLs of one server (``opc.tcp://plc:4840/`` and
  ``opc.tcp://PLC``) are told apart by :func:`~discovery_handlers.opcua.details.url_key` only,
  and the first one is the id.

Property values come from the network, so they are made safe for container environments:
control characters become spaces and each value is at most :data:`MAX_VALUE` characters.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from discovery_handlers.base import Device
from discovery_handlers.filters import FilterList, equal, passes
from discovery_handlers.opcua.details import (
    DEFAULT_PORT,
    SCHEME,
    host_problem,
    split_url,
    url_key,
    url_problem,
)

DISCOVERY_URL = "OPCUA_DISCOVERY_URL"
APPLICATION_URI = "OPCUA_APPLICATION_URI"
APPLICATION_NAME = "OPCUA_APPLICATION_NAME"
PRODUCT_URI = "OPCUA_PRODUCT_URI"
SERVER_CAPABILITIES = "OPCUA_SERVER_CAPABILITIES"
MAX_VALUE = 1024
MAX_CAPABILITIES = 32  # kept per FindServersOnNetwork record
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ApplicationType(enum.IntEnum):
    """OPC UA ``ApplicationType`` (Part 4, 7.2)."""

    SERVER = 0
    CLIENT = 1
    CLIENT_AND_SERVER = 2
    DISCOVERY_SERVER = 3


@dataclass(frozen=True)
class Application:
    """The fields of an ``ApplicationDescription`` this handler uses."""

    uri: str
    product_uri: str
    name: str
    type: int
    discovery_urls: tuple[str, ...]


@dataclass(frozen=True)
class Record:
    """A ``ServerOnNetwork`` record of FindServersOnNetwork (an LDS-ME's mDNS cache)."""

    record_id: int
    server_name: str
    discovery_url: str
    capabilities: tuple[str, ...]


@dataclass(frozen=True)
class Listed:
    """A server a discovery URL told us about: the URL it is offered under (the device id)
    and what is known of it."""

    url: str
    application: Application | None = None  # standard: from the FindServers answer
    record: Record | None = None  # multicast: from the FindServersOnNetwork answer


def env_value(text: str) -> str:
    """``text`` safe for a container's environment: control characters (NUL among them)
    become spaces, at most :data:`MAX_VALUE` characters."""
    return _CONTROL.sub(" ", text[:MAX_VALUE])


def trimmed(application: Application) -> Application:
    """What is kept of an application (bounded, whatever a server sent): its texts cut to
    :data:`MAX_VALUE` characters (what a property can show) and its first ``opc.tcp``
    DiscoveryURL only (the one :func:`chosen_url` takes; its own length is bounded by
    :func:`url_problem`) — at most ~5 KB of text per server."""
    url = chosen_url(application)
    return Application(
        uri=application.uri[:MAX_VALUE],
        product_uri=application.product_uri[:MAX_VALUE],
        name=application.name[:MAX_VALUE],
        type=application.type,
        discovery_urls=(url,) if url is not None else (),
    )


def offered_type(application: Application) -> bool:
    """Server or ClientAndServer (Akri: Server only)."""
    return application.type in (ApplicationType.SERVER, ApplicationType.CLIENT_AND_SERVER)


def wanted(application: Application, names: FilterList | None) -> bool:
    """Offered by type and passing the ``applicationNames`` filter."""
    return offered_type(application) and passes(names, [application.name], equal)


def chosen_url(application: Application) -> str | None:
    """Akri's choice: the first DiscoveryURL starting with ``opc.tcp`` (None without one, or
    when that one is not a usable URL)."""
    for url in application.discovery_urls:
        if url.startswith(SCHEME):
            return url if url_problem(url) is None else None
    return None


def url_host(url: str) -> str:
    """The host of an accepted URL, without IPv6 brackets."""
    return split_url(url).hostname or ""


def needs_resolving(host: str) -> bool:
    """False for IP literals (they always "resolve")."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def _netloc_host(netloc: str) -> str:
    """The host part of ``netloc`` as written (IPv6 brackets kept, no user, no port)."""
    host = netloc.rsplit("@", 1)[-1]
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.split(":", 1)[0]


def substitute_host(queried: str, server_url: str) -> str:
    """The URL of a server whose host does not resolve, seen through ``queried`` (Akri PR
    #584, ``get_discovery_url_ip``): the queried URL followed by the server URL's path (the
    queried URL itself if it has a path of its own). A server URL with an explicit port other
    than the queried one keeps that port on the queried host."""
    asked = split_url(queried)
    server = split_url(server_url)
    if server.port is not None and server.port != (asked.port or DEFAULT_PORT):
        return f"{asked.scheme}://{_netloc_host(asked.netloc)}:{server.port}{server.path}"
    path = server.path
    if asked.path not in ("", "/"):
        return queried
    if queried.endswith("/") and path.startswith("/"):
        path = path[1:]
    return queried + path


def listed_by_find_servers(
    queried: str,
    applications: Sequence[Application],
    names: FilterList | None,
    resolvable: Mapping[str, bool | None],
) -> tuple[list[Listed], list[str]]:
    """The servers a FindServers answer from ``queried`` offers (in answer order, first of a
    URL kept), and why others were skipped (for the debug log). ``resolvable`` says for each
    host name of :func:`hosts_of` whether it resolves on this node (None: not known yet, the
    server is left out until it is). A URL whose host is not a host name at all
    (:func:`~discovery_handlers.opcua.details.host_problem`) is skipped: it costs itself."""
    listed: dict[str, Listed] = {}  # by url_key: the first of a server's URLs
    skipped: list[str] = []
    for application in applications:
        if not wanted(application, names):
            continue
        url = chosen_url(application)
        if url is None:
            skipped.append(f"{application.name[:80]!r} has no usable opc.tcp DiscoveryURL")
            continue
        if host_problem(url) is not None:
            skipped.append(f"{application.name[:80]!r}: {url[:200]!r} {host_problem(url)}")
            continue
        host = url_host(url)
        if needs_resolving(host):
            verdict = resolvable.get(host, True)
            if verdict is None:
                continue  # not resolved yet: listed once it is (the others do not wait)
            if not verdict:
                url = substitute_host(queried, url)
                if url_problem(url) is not None:
                    skipped.append(f"{application.name[:80]!r}: {url[:200]!r} is not usable")
                    continue
        listed.setdefault(url_key(url), Listed(url, application=application))
    return list(listed.values()), skipped


def hosts_of(
    applications: Iterable[Application], names: FilterList | None, limit: int
) -> list[str]:
    """The host names (not IP literals) of the DiscoveryURLs that would be offered, in answer
    order, at most ``limit`` (``maxServers``: no more servers are tracked, so a discovery
    server listing thousands of names cannot have them all looked up): the ones to resolve
    before :func:`listed_by_find_servers` (the others count as resolving)."""
    hosts: dict[str, None] = {}
    for application in applications:
        if len(hosts) >= limit:
            break
        if wanted(application, names):
            url = chosen_url(application)
            if url is not None and needs_resolving(url_host(url)) and host_problem(url) is None:
                hosts[url_host(url)] = None
    return list(hosts)


def offered(
    applications: Iterable[Application], names: FilterList | None, limit: int
) -> tuple[Application, ...]:
    """What is kept of a discovery URL's FindServers answer: the applications that may be
    offered (wanted, with a usable ``opc.tcp`` URL whose host is a host name), trimmed
    (:func:`trimmed`), the first ``limit + 1`` distinct URLs (one more than are tracked
    tells that there were more)."""
    kept: dict[str, Application] = {}
    for application in applications:
        if len(kept) > limit:
            break
        if not wanted(application, names):
            continue
        url = chosen_url(application)
        if url is not None and host_problem(url) is None:
            kept.setdefault(url_key(url), trimmed(application))
    return tuple(kept.values())


def bad_hosts(applications: Iterable[Application], names: FilterList | None) -> list[str]:
    """The DiscoveryURLs that would be offered but whose host is not a host name (each one
    is skipped, with a warning naming it)."""
    found: list[str] = []
    for application in applications:
        if wanted(application, names):
            url = chosen_url(application)
            if url is not None and host_problem(url) is not None:
                found.append(url)
    return found


def listed_by_find_servers_on_network(
    records: Sequence[Record], capabilities: Sequence[str]
) -> tuple[list[Listed], list[str]]:
    """The servers of FindServersOnNetwork records: each record with a usable ``opc.tcp``
    DiscoveryUrl and every capability asked for (compared without case, as Part 4 says; the
    discovery server filters too, this is in case it does not)."""
    wanted_capabilities = {c.upper() for c in capabilities}
    listed: dict[str, Listed] = {}
    skipped: list[str] = []
    for record in records:
        if not wanted_capabilities <= {c.upper() for c in record.capabilities}:
            continue
        url = record.discovery_url
        if not url.startswith(SCHEME) or url_problem(url) is not None:
            skipped.append(f"{record.server_name[:80]!r}: {url[:200]!r} is not an opc.tcp URL")
            continue
        if host_problem(url) is not None:
            skipped.append(f"{record.server_name[:80]!r}: {url[:200]!r} {host_problem(url)}")
            continue
        listed.setdefault(url_key(url), Listed(url, record=_trimmed_record(record)))
    return list(listed.values()), skipped


def _trimmed_record(record: Record) -> Record:
    return Record(
        record_id=record.record_id,
        server_name=record.server_name[:MAX_VALUE],
        discovery_url=record.discovery_url,
        capabilities=tuple(c[:MAX_VALUE] for c in record.capabilities[:MAX_CAPABILITIES]),
    )


def _endpoint(url: str) -> tuple[str, int] | None:
    if not url.startswith(SCHEME) or url_problem(url) is not None:
        return None
    parts = split_url(url)
    return (parts.hostname or "").lower(), parts.port or DEFAULT_PORT


def own_application(url: str, applications: Sequence[Application]) -> Application | None:
    """The application a server at ``url`` describes as itself in its FindServers answer: the
    one listing ``url`` among its DiscoveryURLs, else the one listing the same host and port
    (a discovery server lists its own URL without the path its mDNS record has, and the
    servers registered with it too), else the only one; None if that cannot tell."""
    key = url_key(url)
    for application in applications:
        if any(url_key(item) == key for item in application.discovery_urls):
            return application
    endpoint = _endpoint(url)
    for application in applications:
        if endpoint is not None and endpoint in map(_endpoint, application.discovery_urls):
            return application
    return applications[0] if len(applications) == 1 else None


def device_of(listed: Listed, application: Application) -> Device:
    """The device for a server: id = its DiscoveryURL (Akri's), and the properties a broker
    needs (Akri has only ``OPCUA_DISCOVERY_URL``)."""
    properties = {
        DISCOVERY_URL: listed.url,
        APPLICATION_URI: env_value(application.uri),
        APPLICATION_NAME: env_value(application.name),
        PRODUCT_URI: env_value(application.product_uri),
    }
    if listed.record is not None:
        properties[SERVER_CAPABILITIES] = env_value(",".join(listed.record.capabilities))
    return Device(id=listed.url, properties=properties)
