"""Where the API server is and how to authenticate: a kubeconfig file, else the in-cluster
service account, else ``$KUBECONFIG`` / ``~/.kube/config`` (the order the agent always used).

Supported kubeconfig fields: ``current-context``; ``clusters[].cluster``: ``server``,
``certificate-authority(-data)``, ``insecure-skip-tls-verify``, ``tls-server-name``;
``users[].user``: ``token``, ``tokenFile``, ``client-certificate(-data)``,
``client-key(-data)``, ``username``/``password``, ``exec``, and impersonation: ``as``,
``as-uid``, ``as-groups``, ``as-user-extra``. Proxies: ``proxy-url``, else ``HTTPS_PROXY`` /
``NO_PROXY`` from the environment (also in a pod), see :mod:`agent.core.kube.proxy`. File names are
relative to the kubeconfig's directory. Anything malformed or unsupported (``auth-provider``,
a socks5 proxy) raises :class:`ConfigError` naming file and field: nothing is ignored.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from agent.core.kube.credentials import (
    Credentials,
    StaticCredentials,
    TokenFileCredentials,
)
from agent.core.kube.errors import ConfigError
from agent.core.kube.exec_credential import ExecCredentials, parse_exec_spec
from agent.core.kube.proxy import Proxy, parse_proxy_url, proxy_from_environment
from agent.core.kube.tls import TlsSettings, make_ssl_context

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# kubeconfigs with many contexts and embedded certificates stay far below this
MAX_KUBECONFIG_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ClusterConfig:
    """Everything the client needs to reach and authenticate to one API server."""

    scheme: str  # "http" or "https"
    host: str  # without brackets for IPv6
    port: int
    path_prefix: str = ""  # a server URL's path (API servers behind a proxy), no trailing /
    tls: TlsSettings = field(default_factory=TlsSettings)
    credentials: Credentials = field(default_factory=Credentials)
    namespace: str = "default"
    source: str = ""  # where the settings came from (for messages)
    proxy: Proxy | None = None
    # Impersonate-* headers (kubeconfig as/as-groups/...): a name may repeat
    impersonation: tuple[tuple[str, str], ...] = ()

    @property
    def server(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path_prefix}"


def load_config(
    kubeconfig: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    home: Path | None = None,
) -> ClusterConfig:
    """The explicit ``kubeconfig`` file; else in-cluster; else ``$KUBECONFIG``; else
    ``~/.kube/config``."""
    env = os.environ if environ is None else environ
    if kubeconfig:
        return load_kubeconfig([Path(kubeconfig)], environ=env)
    in_cluster = load_incluster(env, service_account_dir)
    if in_cluster is not None:
        # client-go's in-cluster transport honours the proxy environment too
        return dataclasses.replace(
            in_cluster,
            proxy=proxy_from_environment(in_cluster.scheme, in_cluster.host, in_cluster.port, env),
        )
    listed = [Path(p) for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    if listed:
        existing = [p for p in listed if p.is_file()]
        if not existing:
            raise ConfigError(f"$KUBECONFIG: none of {', '.join(map(str, listed))} exists")
        return load_kubeconfig(existing, environ=env)
    default = (home or Path.home()) / ".kube" / "config"
    if default.is_file():
        return load_kubeconfig([default], environ=env)
    raise ConfigError(
        "no Kubernetes configuration: not in a cluster (KUBERNETES_SERVICE_HOST/PORT unset "
        f"or no {service_account_dir / 'token'}), $KUBECONFIG unset, no {default}"
    )


def load_incluster(
    environ: Mapping[str, str], service_account_dir: Path = SERVICE_ACCOUNT_DIR
) -> ClusterConfig | None:
    """The pod's service account, or None when not running in a pod."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "")
    token = service_account_dir / "token"
    if not host or not port or not token.is_file():
        return None
    if not port.isdigit():
        raise ConfigError(f"KUBERNETES_SERVICE_PORT: not a port number: {port!r}")
    ca_file = service_account_dir / "ca.crt"
    ca = _read(ca_file, "in-cluster CA") if ca_file.is_file() else None
    tls = TlsSettings(ca_data=ca)
    _check_tls(tls, f"{ca_file}", "")
    namespace_file = service_account_dir / "namespace"
    namespace = "default"
    if namespace_file.is_file():
        namespace = namespace_file.read_text().strip() or namespace
    return ClusterConfig(
        "https",
        host.strip("[]"),
        int(port),
        tls=tls,
        credentials=TokenFileCredentials(token),
        namespace=namespace,
        source=f"in-cluster service account ({service_account_dir})",
    )


@dataclass
class _Entry:
    """A named kubeconfig entry and the file it came from."""

    body: Mapping[str, Any]
    path: Path
    where: str  # e.g. "clusters[name=prod].cluster"

    @property
    def base(self) -> Path:
        return self.path.parent


def load_kubeconfig(
    paths: Sequence[Path],
    context: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ClusterConfig:
    """Merge kubeconfig files like kubectl (the first file defining a name wins) and resolve
    ``context`` (default: ``current-context``). ``environ`` (default ``os.environ``) supplies
    the proxy variables."""
    clusters: dict[str, _Entry] = {}
    users: dict[str, _Entry] = {}
    contexts: dict[str, _Entry] = {}
    current = ""
    for path in paths:
        doc = _load_yaml(path)
        current = current or str(doc.get("current-context") or "")
        for section, key, target in (
            ("clusters", "cluster", clusters),
            ("users", "user", users),
            ("contexts", "context", contexts),
        ):
            items = doc.get(section) or []
            if not isinstance(items, list):
                raise ConfigError(f"{path}: {section}: must be a list")
            for index, item in enumerate(items):
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    raise ConfigError(f"{path}: {section}[{index}]: needs a name")
                body = item.get(key) or {}
                where = f"{section}[name={item['name']}].{key}"
                if not isinstance(body, dict):
                    raise ConfigError(f"{path}: {where}: must be a mapping")
                target.setdefault(item["name"], _Entry(body, path, where))
    files = ", ".join(map(str, paths))
    name = context or current
    if not name:
        raise ConfigError(f"{files}: current-context is not set")
    if name not in contexts:
        raise ConfigError(f"{files}: current-context: no context named {name!r}")
    ctx = contexts[name]
    cluster_name = ctx.body.get("cluster")
    if not isinstance(cluster_name, str) or cluster_name not in clusters:
        raise ConfigError(f"{ctx.path}: {ctx.where}.cluster: no cluster named {cluster_name!r}")
    cluster = clusters[cluster_name]
    user_name = ctx.body.get("user")
    user = users.get(user_name) if isinstance(user_name, str) else None
    if user_name and user is None:
        raise ConfigError(f"{ctx.path}: {ctx.where}.user: no user named {user_name!r}")
    return dataclasses.replace(
        _cluster_config(cluster, user, os.environ if environ is None else environ),
        namespace=str(ctx.body.get("namespace") or "default"),
        source=f"kubeconfig {files}, context {name}",
    )


def _cluster_config(
    cluster: _Entry, user: _Entry | None, environ: Mapping[str, str]
) -> ClusterConfig:
    at = f"{cluster.path}: {cluster.where}"
    c = cluster.body
    server = c.get("server")
    if not isinstance(server, str) or not server:
        raise ConfigError(f"{at}.server: required (the API server's URL)")
    if "://" not in server:
        server = f"https://{server}"
    url = urlsplit(server)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"{at}.server: not an http(s) URL: {server!r}")
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError as error:
        raise ConfigError(f"{at}.server: {error}: {server!r}") from error
    proxy_url = c.get("proxy-url")
    proxy: Proxy | None
    if proxy_url:
        proxy = parse_proxy_url(str(proxy_url), f"{at}.proxy-url")
    else:
        try:
            proxy = proxy_from_environment(url.scheme, url.hostname, port, environ)
        except ConfigError as error:
            raise ConfigError(f"{error} (for {server})") from error
    ca = _data_or_file(c, "certificate-authority", cluster)
    insecure = bool(c.get("insecure-skip-tls-verify"))
    if insecure and ca is not None:
        raise ConfigError(
            f"{at}: certificate-authority and insecure-skip-tls-verify exclude each other"
        )
    cert: bytes | None = None
    key: bytes | None = None
    credentials: Credentials = Credentials()
    if user is not None:
        credentials, cert, key = _user_credentials(user, url.scheme, server, ca)
    tls = TlsSettings(ca, insecure, c.get("tls-server-name") or None, cert, key)
    if url.scheme == "https":
        _check_tls(tls, f"{at}.certificate-authority", f"{user.path}: {user.where}" if user else "")
    return ClusterConfig(
        url.scheme,
        url.hostname,
        port,
        url.path.rstrip("/"),
        tls,
        credentials,
        proxy=proxy,
        impersonation=_impersonation(user) if user is not None else (),
    )


def _impersonation(user: _Entry) -> tuple[tuple[str, str], ...]:
    """The ``Impersonate-*`` headers for ``as``, ``as-uid``, ``as-groups``, ``as-user-extra``
    (as kubectl sends them)."""
    at = f"{user.path}: {user.where}"
    u = user.body
    name = u.get("as") or ""
    uid = u.get("as-uid") or ""
    groups = u.get("as-groups") or []
    extra = u.get("as-user-extra") or {}
    if not isinstance(name, str) or not isinstance(uid, str):
        raise ConfigError(f"{at}.as/as-uid: must be strings")
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise ConfigError(f"{at}.as-groups: must be a list of strings")
    if not isinstance(extra, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(i, str) for i in v)
        for k, v in extra.items()
    ):
        raise ConfigError(f"{at}.as-user-extra: must map strings to lists of strings")
    if (groups or extra or uid) and not name:
        raise ConfigError(
            f"{at}: as-groups, as-uid and as-user-extra need a user to impersonate (as)"
        )
    headers: list[tuple[str, str]] = []
    if name:
        headers.append(("Impersonate-User", name))
    if uid:
        headers.append(("Impersonate-Uid", uid))
    headers.extend(("Impersonate-Group", group) for group in groups)
    for key, values in extra.items():
        header = "Impersonate-Extra-" + quote(key, safe="")
        headers.extend((header, value) for value in values)
    for header, value in headers:
        if any(ord(char) < 32 or ord(char) == 127 for char in value):
            raise ConfigError(f"{at}: {header}: control characters are not allowed")
    return tuple(headers)


def _user_credentials(
    user: _Entry, scheme: str, server: str, ca: bytes | None
) -> tuple[Credentials, bytes | None, bytes | None]:
    at = f"{user.path}: {user.where}"
    u = user.body
    if u.get("auth-provider"):
        raise ConfigError(f"{at}.auth-provider: not supported; use an exec credential plugin")
    cert = _data_or_file(u, "client-certificate", user)
    key = _data_or_file(u, "client-key", user)
    if (cert is None) != (key is None):
        raise ConfigError(f"{at}: client-certificate and client-key go together")
    token = u.get("token")
    token_file = u.get("tokenFile")
    username = u.get("username")
    if (token or token_file) and username:
        raise ConfigError(f"{at}: username/password and a token exclude each other")
    if u.get("exec") is not None:
        info = {"server": server, "insecure-skip-tls-verify": False}
        if ca is not None:
            info["certificate-authority-data"] = base64.b64encode(ca).decode("ascii")
        spec = parse_exec_spec(u["exec"], user.base, f"{at}.exec", info)
        return ExecCredentials(spec), cert, key
    if token:
        return StaticCredentials.bearer(str(token).strip()), cert, key
    if token_file:
        path = _resolve(str(token_file), user.base)
        if not path.is_file():
            raise ConfigError(f"{at}.tokenFile: {path} does not exist")
        return TokenFileCredentials(path), cert, key
    if username:
        return StaticCredentials.basic(str(username), str(u.get("password") or "")), cert, key
    return Credentials(), cert, key


def _check_tls(tls: TlsSettings, where_ca: str, where_user: str) -> None:
    """Fail at load time, naming the field, rather than at the first request."""
    try:
        make_ssl_context(TlsSettings(tls.ca_data, tls.insecure))
    except (ssl.SSLError, ValueError) as error:
        raise ConfigError(f"{where_ca}: not a usable PEM CA certificate: {error}") from error
    if tls.client_cert is not None:
        try:
            make_ssl_context(TlsSettings(insecure=True), (tls.client_cert, tls.client_key or b""))
        except (ssl.SSLError, ValueError) as error:
            raise ConfigError(
                f"{where_user}: client-certificate/client-key are not a matching PEM "
                f"certificate and key: {error}"
            ) from error


def _data_or_file(body: Mapping[str, Any], name: str, entry: _Entry) -> bytes | None:
    """``<name>-data`` (base64) wins over ``<name>`` (a file, relative to the kubeconfig)."""
    at = f"{entry.path}: {entry.where}"
    data = body.get(f"{name}-data")
    if data:
        try:
            return base64.b64decode(str(data), validate=True)
        except (binascii.Error, ValueError) as error:
            raise ConfigError(f"{at}.{name}-data: not valid base64: {error}") from error
    file = body.get(name)
    if file:
        return _read(_resolve(str(file), entry.base), f"{at}.{name}")
    return None


def _resolve(path: str, base: Path) -> Path:
    expanded = Path(os.path.expanduser(path))
    return expanded if expanded.is_absolute() else base / expanded


def _read(path: Path, where: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{where}: cannot read {path}: {error.strerror or error}") from error


def _load_yaml(path: Path) -> Mapping[str, Any]:
    import yaml  # only needed outside a pod

    from agent.core.bounded_yaml import YamlLimitError, safe_load_all_limited, yaml_problem

    text = _read(path, "kubeconfig").decode("utf-8", "replace")
    try:
        # limited: a few hundred bytes of nested aliases expand to gigabytes
        docs = list(safe_load_all_limited(text, max_bytes=MAX_KUBECONFIG_BYTES))
    except YamlLimitError as error:
        raise ConfigError(f"{path}: too large: {error}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(error)}") from error
    if len(docs) > 1:
        raise ConfigError(f"{path}: a kubeconfig is one YAML document, found {len(docs)}")
    doc = docs[0] if docs else None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a kubeconfig must be a mapping")
    return doc
