"""HTTP proxies between the agent and the API server, as kubectl and client-go use them.

* kubeconfig ``clusters[].cluster.proxy-url`` wins; else the environment: ``HTTPS_PROXY``
  (``HTTP_PROXY`` for an ``http://`` server), in upper or lower case, unless ``NO_PROXY``
  names the server (Go's rules: ``*``; an IP address or CIDR; a domain, which also matches
  its subdomains, with a leading dot only its subdomains; optionally ``:port``). Loopback servers
  are never proxied, as in Go.
* The agent always tunnels with ``CONNECT host:port`` (TLS to the API server runs inside the
  tunnel, so the proxy sees no request), with ``Proxy-Authorization: Basic`` when the proxy
  URL carries ``user:password@``.
* Only ``http://`` proxies: an ``https://`` or ``socks5://`` proxy is refused with a clear
  error rather than silently bypassed.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from agent.core.kube.errors import ConfigError

CONNECT_HEAD_LIMIT = 16 * 1024


class ProxyRefusedError(OSError):
    """The proxy answered the CONNECT with something other than 2xx."""


@dataclass(frozen=True)
class Proxy:
    """Where the tunnel starts, and how to authenticate to it (never shown in messages)."""

    host: str
    port: int
    authorization: str | None = None
    source: str = ""  # "proxy-url of <file>" or "HTTPS_PROXY" (for messages)

    def __repr__(self) -> str:  # the authorization stays out of logs
        return f"Proxy({self.host}:{self.port}, from {self.source})"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_proxy_url(url: str, where: str) -> Proxy:
    """``http://[user:password@]host[:port]``; anything else is a :class:`ConfigError`."""
    if "://" not in url:
        url = f"http://{url}"  # Go accepts a bare host:port in the environment
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ConfigError(
            f"{where}: {parts.scheme}:// proxies are not supported; use an http:// proxy "
            "(the agent tunnels with CONNECT, so TLS to the API server stays end to end)"
        )
    if not parts.hostname:
        raise ConfigError(f"{where}: no host in the proxy URL")
    try:
        port = parts.port or 80
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from error
    authorization = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return Proxy(parts.hostname, port, authorization, where)


def _env(environ: Mapping[str, str], name: str) -> str:
    return environ.get(name.upper()) or environ.get(name.lower()) or ""


def proxy_from_environment(
    scheme: str, host: str, port: int, environ: Mapping[str, str]
) -> Proxy | None:
    """The proxy the environment asks for to reach ``scheme://host:port``, or None."""
    variable = "HTTPS_PROXY" if scheme == "https" else "HTTP_PROXY"
    url = _env(environ, variable)
    if not url or bypasses_proxy(host, port, _env(environ, "NO_PROXY")):
        return None
    return parse_proxy_url(url, variable)


def bypasses_proxy(host: str, port: int, no_proxy: str) -> bool:
    """Whether ``host:port`` is reached directly (Go's ``httpproxy`` rules)."""
    host = host.lower().strip("[]")
    if host == "localhost":
        return True
    address = _ip(host)
    if address is not None and address.is_loopback:
        return True
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        if "/" in entry:  # a CIDR block
            try:
                network = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                continue
            if address is not None and address in network:
                return True
            continue
        entry_host, entry_port = _split_port(entry)
        if entry_port is not None and entry_port != port:
            continue
        entry_address = _ip(entry_host)
        if entry_address is not None:
            if address == entry_address:
                return True
            continue
        if entry_host.startswith("*."):
            entry_host = entry_host[1:]
        if entry_host.startswith("."):  # subdomains only
            if host.endswith(entry_host):
                return True
        elif host == entry_host or host.endswith("." + entry_host):
            return True
    return False


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6]:port
        host, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
        return host, int(port) if port.isdigit() else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, int(port) if port.isdigit() else None
    return entry, None


async def open_tunnel(
    proxy: Proxy, host: str, port: int, *, limit: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP stream to ``host:port`` through the proxy (``CONNECT``), ready for TLS or HTTP."""
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port, limit=limit)
    try:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
        if proxy.authorization:
            lines.append(f"Proxy-Authorization: {proxy.authorization}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        await writer.drain()
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as error:
            raise ProxyRefusedError(f"proxy {proxy.address}: answer too long") from error
        status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ProxyRefusedError(f"proxy {proxy.address}: bad answer {status_line[:80]!r}")
        if not 200 <= int(parts[1]) < 300:
            hint = " (check the proxy's user:password)" if parts[1] == "407" else ""
            raise ProxyRefusedError(
                f"proxy {proxy.address} ({proxy.source}) refused CONNECT {authority}: "
                f"{status_line[9:].strip()[:120]}{hint}"
            )
    except BaseException:
        writer.close()
        raise
    return reader, writer
