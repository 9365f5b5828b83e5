"""Issue 12 item 5: proxies (kubeconfig proxy-url, HTTPS_PROXY/NO_PROXY, also in a pod) and
impersonation (as, as-groups, ...) are used, or refused with a clear error — never ignored.
A real CONNECT proxy (asyncio, in this file) sits between the client and the servers."""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from agent.core.kube import KubeClient, TransportError, make_kube_client, resource_path
from agent.core.kube.errors import ConfigError
from agent.core.kube.kubeconfig import load_config
from agent.core.kube.proxy import bypasses_proxy, parse_proxy_url
from tests.core.kube.test_kube_client import read_request
from tests.core.kube.test_kubeconfig import Certs, kubeconfig, make_certs, service_account, write
from tests.doubles.apiserver import ApiServerDouble
from tests.harness.k8s_nodes import CRDS

INSTANCES = resource_path("akri.sh", "v0", "instances", "default")


@dataclass
class ConnectProxy:
    """An HTTP CONNECT proxy: records each tunnel's target and Proxy-Authorization, and
    refuses (407) when ``password`` is set and not given."""

    port: int = 0
    password: str | None = None
    hosts: dict[str, str] = field(default_factory=dict)  # the proxy's own name resolution
    tunnels: list[str] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await read_request(reader)
            lines = head.split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            auth = next(
                (ln.split(":", 1)[1].strip() for ln in lines if ln.lower().startswith("proxy-au")),
                None,
            )
            self.authorizations.append(auth)
            expected = "Basic " + base64.b64encode(f"agent:{self.password}".encode()).decode()
            if method != "CONNECT":
                writer.write(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                return
            if self.password is not None and auth != expected:
                writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
                return
            host, _, port = target.rpartition(":")
            host = host.strip("[]")
            upstream_reader, upstream_writer = await asyncio.open_connection(
                self.hosts.get(host, host), int(port)
            )
            self.tunnels.append(target)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()

            async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
                try:
                    while data := await src.read(65536):
                        dst.write(data)
                        await dst.drain()
                finally:
                    dst.close()

            await asyncio.gather(
                pump(reader, upstream_writer), pump(upstream_reader, writer), return_exceptions=True
            )
        finally:
            writer.close()


@asynccontextmanager
async def connect_proxy(
    password: str | None = None, hosts: dict[str, str] | None = None
) -> AsyncIterator[ConnectProxy]:
    proxy = ConnectProxy(password=password, hosts=hosts or {})
    server = await asyncio.start_server(proxy.serve, "127.0.0.1", 0)
    proxy.port = server.sockets[0].getsockname()[1]
    try:
        yield proxy
    finally:
        server.close()


@pytest.fixture
async def api() -> AsyncIterator[ApiServerDouble]:
    async with ApiServerDouble(crds=CRDS) as server:
        yield server


def api_kubeconfig(api: ApiServerDouble, path: Path, **cluster: object) -> Path:
    doc = yaml.safe_load(api.write_kubeconfig(path).read_text())
    doc["clusters"][0]["cluster"].update(cluster)
    path.write_text(yaml.safe_dump(doc))
    return path


# -- NO_PROXY and proxy URLs ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "port", "no_proxy", "direct"),
    [
        ("api.corp.example", 6443, "", False),
        ("api.corp.example", 6443, "*", True),
        ("api.corp.example", 6443, "corp.example", True),  # a domain and its subdomains
        ("corp.example", 6443, "corp.example", True),
        ("corp.example", 6443, ".corp.example", False),  # a leading dot: subdomains only
        ("api.corp.example", 6443, ".corp.example", True),
        ("api.corp.example", 6443, "*.corp.example", True),
        ("notcorp.example", 6443, "corp.example", False),
        ("api.corp.example", 6443, "api.corp.example:443", False),  # another port
        ("api.corp.example", 6443, " other.example , api.corp.example:6443 ", True),
        ("10.96.0.1", 443, "10.0.0.0/8", True),  # CIDR
        ("10.96.0.1", 443, "192.168.0.0/16,10.96.0.2", False),
        ("10.96.0.1", 443, "10.96.0.1", True),
        ("fd00::1", 443, "fd00::/8", True),
        ("fd00::1", 6443, "[fd00::1]:6443", True),
        ("127.0.0.1", 6443, "", True),  # loopback is never proxied (Go's rule)
        ("localhost", 6443, "", True),
    ],
)
def test_no_proxy_rules(host: str, port: int, no_proxy: str, direct: bool) -> None:
    assert bypasses_proxy(host, port, no_proxy) is direct


def test_proxy_urls() -> None:
    proxy = parse_proxy_url("http://agent:s%40cret@proxy.corp:3128", "HTTPS_PROXY")
    assert (proxy.host, proxy.port) == ("proxy.corp", 3128)
    assert proxy.authorization == "Basic " + base64.b64encode(b"agent:s@cret").decode()
    assert "s@cret" not in repr(proxy) and "agent" not in repr(proxy)
    assert parse_proxy_url("proxy.corp:8080", "HTTPS_PROXY").port == 8080  # bare host:port
    for url, scheme in (("socks5://p:1080", "socks5"), ("https://p:443", "https")):
        with pytest.raises(ConfigError, match=rf"HTTPS_PROXY: {scheme}:// proxies are not"):
            parse_proxy_url(url, "HTTPS_PROXY")


def test_environment_proxy_is_chosen_per_scheme_and_no_proxy(tmp_path: Path) -> None:
    path = write(tmp_path / "kc", kubeconfig({"server": "https://api.corp.example:6443"}))
    env = {"HTTPS_PROXY": "http://proxy.corp:3128", "HTTP_PROXY": "http://other:1"}
    config = load_config(path, environ=env)
    assert config.proxy is not None and config.proxy.address == "proxy.corp:3128"
    assert load_config(path, environ={**env, "no_proxy": ".example"}).proxy is None
    assert load_config(path, environ={"https_proxy": "http://lower:3128"}).proxy is not None
    # a kubeconfig proxy-url wins over the environment
    both = write(
        tmp_path / "kc2",
        kubeconfig({"server": "https://api.corp.example:6443", "proxy-url": "http://kc:8080"}),
    )
    config = load_config(both, environ={**env, "NO_PROXY": "*"})
    assert config.proxy is not None and config.proxy.address == "kc:8080"
    # a socks proxy in the environment is refused, naming the variable and the server
    with pytest.raises(ConfigError, match=r"HTTPS_PROXY: socks5:// proxies .*//api\.corp"):
        load_config(path, environ={"HTTPS_PROXY": "socks5://p:1080"})


def test_in_cluster_honours_the_proxy_environment(tmp_path: Path) -> None:
    sa = service_account(tmp_path / "sa")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    config = load_config(
        environ={**env, "HTTPS_PROXY": "http://proxy:3128"}, service_account_dir=sa
    )
    assert config.proxy is not None and config.proxy.address == "proxy:3128"
    config = load_config(
        environ={**env, "HTTPS_PROXY": "http://proxy:3128", "NO_PROXY": "10.96.0.0/12"},
        service_account_dir=sa,
    )
    assert config.proxy is None


# -- through a real proxy ---------------------------------------------------------------------


async def test_kubeconfig_proxy_url_carries_requests_and_watches(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    async with connect_proxy(password="pw") as proxy:
        path = api_kubeconfig(
            api, tmp_path / "kc", **{"proxy-url": f"http://agent:pw@127.0.0.1:{proxy.port}"}
        )
        client = make_kube_client(str(path), timeout=5)
        try:
            listed = await client.get(INSTANCES)
            assert listed["items"] == []
            stream = client.watch(
                INSTANCES, listed["metadata"]["resourceVersion"], timeout_seconds=1
            )
            async for _ in stream:
                pass
        finally:
            await client.close()
        assert proxy.tunnels and all(t == f"127.0.0.1:{api.port}" for t in proxy.tunnels)
        assert len(proxy.tunnels) == 1  # the watch went through the pooled tunnel


async def test_a_proxy_refusing_credentials_is_a_clear_error(
    api: ApiServerDouble, tmp_path: Path
) -> None:
    async with connect_proxy(password="right") as proxy:
        path = api_kubeconfig(
            api, tmp_path / "kc", **{"proxy-url": f"http://agent:wrong@127.0.0.1:{proxy.port}"}
        )
        client = make_kube_client(str(path), timeout=5)
        try:
            with pytest.raises(TransportError, match=r"refused CONNECT .*407.*user:password"):
                await client.get(INSTANCES)
        finally:
            await client.close()


async def test_https_through_the_environment_proxy_verifies_the_api_server(
    tmp_path: Path,
) -> None:
    """TLS runs inside the tunnel: the API server's certificate is checked against the
    kubeconfig's CA as without a proxy."""
    certs: Certs = make_certs(tmp_path / "certs")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.server_cert, certs.server_key)
    seen: list[str] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen.append(await read_request(reader))
            body = b'{"kind":"InstanceList","items":[],"metadata":{"resourceVersion":"5"}}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    try:
        async with connect_proxy(hosts={"apiserver.test": "127.0.0.1"}) as proxy:
            path = write(
                tmp_path / "kc",
                kubeconfig(
                    {
                        # not a loopback name, so the environment's proxy applies
                        "server": f"https://apiserver.test:{port}",
                        "certificate-authority": str(certs.ca),
                    },
                    {"token": "t0k"},
                ),
            )
            # apiserver.test resolves only at the proxy: the client never looks it up
            env = {"HTTPS_PROXY": f"http://127.0.0.1:{proxy.port}", "NO_PROXY": "corp.example"}
            client = KubeClient(load_config(path, environ=env), timeout=5)
            try:
                assert (await client.get(INSTANCES))["metadata"]["resourceVersion"] == "5"
            finally:
                await client.close()
            assert proxy.tunnels == [f"apiserver.test:{port}"]
            assert "Authorization: Bearer t0k" in seen[0]
    finally:
        server.close()


# -- impersonation ----------------------------------------------------------------------------


async def test_impersonation_headers_are_sent(tmp_path: Path) -> None:
    heads: list[str] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    user = {
        "token": "t",
        "as": "system:serviceaccount:akri:agent",
        "as-uid": "1234",
        "as-groups": ["system:serviceaccounts", "edge ops"],
        "as-user-extra": {"scopes/x": ["a", "b"]},
    }
    path = write(tmp_path / "kc", kubeconfig({"server": f"http://127.0.0.1:{port}"}, user))
    client = make_kube_client(str(path), timeout=5)
    try:
        await client.get(INSTANCES)
    finally:
        await client.close()
        server.close()
    lines = heads[0].split("\r\n")
    assert "Impersonate-User: system:serviceaccount:akri:agent" in lines
    assert "Impersonate-Uid: 1234" in lines
    assert [ln for ln in lines if ln.startswith("Impersonate-Group:")] == [
        "Impersonate-Group: system:serviceaccounts",
        "Impersonate-Group: edge ops",
    ]
    assert [ln for ln in lines if ln.startswith("Impersonate-Extra-")] == [
        "Impersonate-Extra-scopes%2Fx: a",
        "Impersonate-Extra-scopes%2Fx: b",
    ]


def test_impersonation_values_cannot_inject_headers(tmp_path: Path) -> None:
    path = write(tmp_path / "kc", kubeconfig(user={"as": "me\r\nX-Evil: 1"}))
    with pytest.raises(ConfigError, match="control characters"):
        load_config(path, environ={})
