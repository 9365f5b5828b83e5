"""agent.core.kube.kubeconfig: kubeconfig files, in-cluster settings, credentials, exec plugins,
and clear errors for malformed settings."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.core.kube.client import DEFAULT_TIMEOUT, KubeClient
from agent.core.kube.credentials import Auth, StaticCredentials, TokenFileCredentials
from agent.core.kube.errors import ConfigError, TransportError
from agent.core.kube.exec_credential import EXEC_SHARE, EXEC_TIMEOUT, ExecCredentials, ExecSpec
from agent.core.kube.kubeconfig import (
    MAX_KUBECONFIG_BYTES,
    load_config,
    load_incluster,
    load_kubeconfig,
)
from agent.core.kube.tls import TlsSettings, make_ssl_context

# --- certificates (openssl CLI) ---------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    """PEM files: a CA, a server certificate (127.0.0.1, apiserver.test) and a client
    certificate, both signed by the CA, plus a second, unrelated CA."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def make_certs(directory: Path) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "other-ca"):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-subj", f"/CN={ca}")
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:apiserver.test\n")
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    sign = ("-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            *sign,
            "-out",
            f"{name}.crt",
            "-extfile",
            f"{name}.ext",
        )
    return Certs(
        directory,
        directory / "ca.crt",
        directory / "server.crt",
        directory / "server.key",
        directory / "client.crt",
        directory / "client.key",
        directory / "other-ca.crt",
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


# --- helpers ----------------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(
    cluster: dict[str, Any] | None = None,
    user: dict[str, Any] | None = None,
    *,
    namespace: str | None = "edge",
) -> dict[str, Any]:
    context: dict[str, Any] = {"cluster": "c1", "user": "u1"}
    if namespace:
        context["namespace"] = namespace
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c1", "cluster": cluster or {"server": "https://10.0.0.1:6443"}}],
        "users": [{"name": "u1", "user": user or {}}],
        "contexts": [{"name": "ctx", "context": context}],
        "current-context": "ctx",
    }


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


# --- kubeconfig files -------------------------------------------------------------------------


async def test_token_server_and_namespace(tmp_path: Path) -> None:
    path = write(tmp_path / "kc", kubeconfig(user={"token": "abc"}))
    config = load_kubeconfig([path])
    assert (config.scheme, config.host, config.port, config.path_prefix) == (
        "https",
        "10.0.0.1",
        6443,
        "",
    )
    assert config.namespace == "edge"
    assert config.server == "https://10.0.0.1:6443"
    assert str(path) in config.source and "ctx" in config.source
    assert isinstance(config.credentials, StaticCredentials)
    assert (await config.credentials.get()).authorization == "Bearer abc"


async def test_server_variants(tmp_path: Path) -> None:
    def load(server: str) -> tuple[str, str, int, str]:
        config = load_kubeconfig([write(tmp_path / "kc", kubeconfig({"server": server}))])
        return config.scheme, config.host, config.port, config.path_prefix

    assert load("http://127.0.0.1:8080") == ("http", "127.0.0.1", 8080, "")
    assert load("https://example.com") == ("https", "example.com", 443, "")
    assert load("example.com:6443") == ("https", "example.com", 6443, "")  # kubectl's default
    assert load("https://[fd00::1]:6443/k8s/clusters/c-1/") == (
        "https",
        "fd00::1",
        6443,
        "/k8s/clusters/c-1",
    )
    config = load_kubeconfig([write(tmp_path / "kc", kubeconfig({"server": "https://[fd00::1]"}))])
    assert config.server == "https://[fd00::1]:443"


async def test_basic_auth_and_no_credentials(tmp_path: Path) -> None:
    path = write(tmp_path / "kc", kubeconfig(user={"username": "ann", "password": "s3cret"}))
    auth = await load_kubeconfig([path]).credentials.get()
    assert auth.authorization == "Basic " + b64(b"ann:s3cret")
    path = write(tmp_path / "kc", kubeconfig(user={}, namespace=None))
    config = load_kubeconfig([path])
    assert config.namespace == "default"
    assert (await config.credentials.get()).authorization is None


async def test_token_file_is_relative_and_reread(tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "token").write_text("first\n")
    path = write(tmp_path / "kc", kubeconfig(user={"tokenFile": "secrets/token"}))
    credentials = load_kubeconfig([path]).credentials
    assert isinstance(credentials, TokenFileCredentials)
    assert credentials.path == tmp_path / "secrets" / "token"
    assert (await credentials.get()).authorization == "Bearer first"
    (tmp_path / "secrets" / "token").write_text("second\n")
    assert (await credentials.get()).authorization == "Bearer first"  # cached for a minute
    assert credentials.invalidate()  # after a 401
    assert (await credentials.get()).authorization == "Bearer second"
    # a failed re-read keeps the last token
    (tmp_path / "secrets" / "token").unlink()
    credentials.invalidate()
    assert (await credentials.get()).authorization == "Bearer second"


async def test_token_file_reread_period(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("one")
    credentials = TokenFileCredentials(token, reread=0.0)
    assert (await credentials.get()).authorization == "Bearer one"
    token.write_text("two")
    assert (await credentials.get()).authorization == "Bearer two"
    with pytest.raises(TransportError, match="cannot read token file"):
        await TokenFileCredentials(tmp_path / "missing").get()


def test_certificate_data_and_relative_ca_file(tmp_path: Path, certs: Certs) -> None:
    shutil.copy(certs.ca, tmp_path / "ca.pem")
    cluster = {
        "server": "https://127.0.0.1:6443",
        "certificate-authority": "ca.pem",
        "tls-server-name": "apiserver.test",
    }
    user = {
        "client-certificate-data": b64(certs.client_cert.read_bytes()),
        "client-key-data": b64(certs.client_key.read_bytes()),
    }
    config = load_kubeconfig([write(tmp_path / "kc", kubeconfig(cluster, user))])
    assert config.tls.ca_data == certs.ca.read_bytes()
    assert config.tls.client_cert == certs.client_cert.read_bytes()
    assert config.tls.client_key == certs.client_key.read_bytes()
    assert config.tls.server_name == "apiserver.test"
    assert not config.tls.insecure
    context = make_ssl_context(config.tls)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    # data wins over a file; files are relative to the kubeconfig's directory
    (tmp_path / "sub").mkdir()
    shutil.copy(certs.client_cert, tmp_path / "sub" / "client.crt")
    shutil.copy(certs.client_key, tmp_path / "sub" / "client.key")
    cluster = {"server": "https://h:1", "certificate-authority-data": b64(certs.ca.read_bytes())}
    user = {"client-certificate": "sub/client.crt", "client-key": "sub/client.key"}
    config = load_kubeconfig([write(tmp_path / "kc", kubeconfig(cluster, user))])
    assert config.tls.ca_data == certs.ca.read_bytes()
    assert config.tls.client_cert == certs.client_cert.read_bytes()


def test_ssl_context_variants(certs: Certs) -> None:
    insecure = make_ssl_context(TlsSettings(insecure=True))
    assert insecure.verify_mode == ssl.CERT_NONE and not insecure.check_hostname
    system = make_ssl_context(TlsSettings())
    assert system.verify_mode == ssl.CERT_REQUIRED
    assert system.minimum_version == ssl.TLSVersion.TLSv1_2
    with pytest.raises(ssl.SSLError):
        make_ssl_context(TlsSettings(insecure=True), (certs.client_cert.read_bytes(), b"junk"))


def test_insecure_skip_tls_verify(tmp_path: Path) -> None:
    cluster = {"server": "https://h:6443", "insecure-skip-tls-verify": True}
    config = load_kubeconfig([write(tmp_path / "kc", kubeconfig(cluster))])
    assert config.tls.insecure


def test_kubeconfig_env_merges_files_first_wins(tmp_path: Path) -> None:
    first = kubeconfig({"server": "https://first:1"}, {"token": "t1"})
    first["clusters"].append({"name": "c2", "cluster": {"server": "https://c2:2"}})
    second = kubeconfig({"server": "https://second:1"}, {"token": "t2"})
    second["current-context"] = "other"
    second["contexts"].append({"name": "other", "context": {"cluster": "c2", "user": "u1"}})
    del first["current-context"]
    a = write(tmp_path / "a" / "config", first)
    b = write(tmp_path / "b" / "config", second)
    env = {"KUBECONFIG": os.pathsep.join([str(tmp_path / "missing"), str(a), str(b)])}
    config = load_config(environ=env, service_account_dir=tmp_path / "no-sa", home=tmp_path)
    # current-context from the second file; c2 and u1 from the first, which defines them
    assert config.server == "https://c2:2"
    assert str(a) in config.source and str(b) in config.source


def test_default_file_in_home(tmp_path: Path) -> None:
    write(tmp_path / ".kube" / "config", kubeconfig({"server": "http://home:80"}))
    config = load_config(environ={}, service_account_dir=tmp_path / "no-sa", home=tmp_path)
    assert config.server == "http://home:80"
    with pytest.raises(ConfigError, match="no Kubernetes configuration"):
        load_config(environ={}, service_account_dir=tmp_path / "no-sa", home=tmp_path / "x")
    with pytest.raises(ConfigError, match=r"\$KUBECONFIG: none of"):
        load_config(environ={"KUBECONFIG": str(tmp_path / "nope")}, home=tmp_path)


# --- in-cluster -------------------------------------------------------------------------------


def service_account(directory: Path, certs: Certs | None = None) -> Path:
    directory.mkdir(parents=True)
    (directory / "token").write_text("sa-token-1")
    (directory / "namespace").write_text("akri\n")
    if certs is not None:
        shutil.copy(certs.ca, directory / "ca.crt")
    return directory


async def test_in_cluster(tmp_path: Path, certs: Certs) -> None:
    sa = service_account(tmp_path / "sa", certs)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    config = load_config(environ=env, service_account_dir=sa, home=tmp_path)
    assert config.server == "https://10.96.0.1:443"
    assert config.namespace == "akri"
    assert config.tls.ca_data == certs.ca.read_bytes()
    assert "in-cluster" in config.source
    credentials = config.credentials
    assert isinstance(credentials, TokenFileCredentials)
    assert (await credentials.get()).authorization == "Bearer sa-token-1"
    (sa / "token").write_text("sa-token-2")  # the kubelet rotated the bound token
    credentials.invalidate()
    assert (await credentials.get()).authorization == "Bearer sa-token-2"
    # IPv6 service host
    env6 = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert load_incluster(env6, sa) is not None
    assert load_incluster(env6, sa).server == "https://[fd00::1]:6443"  # type: ignore[union-attr]


def test_explicit_kubeconfig_wins_and_outside_a_pod_falls_back(tmp_path: Path) -> None:
    sa = service_account(tmp_path / "sa")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    path = write(tmp_path / "kc", kubeconfig({"server": "http://explicit:1"}))
    assert load_config(path, environ=env, service_account_dir=sa).server == "http://explicit:1"
    write(tmp_path / ".kube" / "config", kubeconfig({"server": "http://home:1"}))
    # env set but no token file: not in a pod
    config = load_config(environ=env, service_account_dir=tmp_path / "none", home=tmp_path)
    assert config.server == "http://home:1"
    # token file but no env
    assert load_config(environ={}, service_account_dir=sa, home=tmp_path).server == (
        "http://home:1"
    )
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_PORT"):
        load_incluster({"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "x"}, sa)


# --- exec plugins -----------------------------------------------------------------------------


def plugin(directory: Path, body: str) -> Path:
    """An executable Python script (the plugin); it logs every run to ``runs.log``."""
    script = directory / "plugin.py"
    script.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(
            """\
            import json, os, sys
            with open(os.path.join(os.path.dirname(__file__), "runs.log"), "a") as log:
                run = {"argv": sys.argv[1:], "env": dict(os.environ), "pid": os.getpid()}
                log.write(json.dumps(run) + "\\n")
            """
        )
        + textwrap.dedent(body)
    )
    script.chmod(0o755)
    return script


def runs(directory: Path) -> list[dict[str, Any]]:
    log = directory / "runs.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


TOKEN_PLUGIN = """\
    info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
    print(json.dumps({
        "apiVersion": info["apiVersion"],
        "kind": "ExecCredential",
        "status": {"token": "tok-" + os.environ["TEAM"], "expirationTimestamp": sys.argv[1]},
    }))
    """


async def test_exec_plugin_token_is_cached_until_expiry(tmp_path: Path) -> None:
    plugin(tmp_path, TOKEN_PLUGIN)
    exec_spec = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "./plugin.py",  # relative to the kubeconfig's directory
        "args": ["2999-01-01T00:00:00Z"],
        "env": [{"name": "TEAM", "value": "edge"}],
        "provideClusterInfo": True,
        "interactiveMode": "Never",
    }
    path = write(tmp_path / "kc", kubeconfig(user={"exec": exec_spec}))
    credentials = load_kubeconfig([path]).credentials
    assert isinstance(credentials, ExecCredentials)
    assert credentials.spec.command == str(tmp_path / "plugin.py")
    assert (await credentials.get()).authorization == "Bearer tok-edge"
    assert (await credentials.get()).authorization == "Bearer tok-edge"
    assert credentials.runs == 1  # cached: not expired
    [run] = runs(tmp_path)
    assert run["argv"] == ["2999-01-01T00:00:00Z"]
    info = json.loads(run["env"]["KUBERNETES_EXEC_INFO"])
    assert info["apiVersion"] == "client.authentication.k8s.io/v1"
    assert info["kind"] == "ExecCredential" and info["spec"]["interactive"] is False
    assert info["spec"]["cluster"]["server"] == "https://10.0.0.1:6443"
    assert run["env"]["PATH"] == os.environ["PATH"]  # our environment plus the plugin's env
    # a 401 forces a new run
    assert credentials.invalidate()
    await credentials.get()
    assert credentials.runs == 2


async def test_exec_plugin_expired_credential_is_refreshed(tmp_path: Path) -> None:
    plugin(tmp_path, TOKEN_PLUGIN)
    exec_spec = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(tmp_path / "plugin.py"),
        "args": ["2000-01-01T00:00:00+00:00"],
        "env": [{"name": "TEAM", "value": "x"}],
    }
    path = write(tmp_path / "kc", kubeconfig(user={"exec": exec_spec}))
    credentials = load_kubeconfig([path]).credentials
    assert (await credentials.get()).authorization == "Bearer tok-x"
    await credentials.get()
    assert len(runs(tmp_path)) == 2  # already expired: every use runs the plugin again
    info = json.loads(runs(tmp_path)[0]["env"]["KUBERNETES_EXEC_INFO"])
    assert info["apiVersion"] == "client.authentication.k8s.io/v1beta1"
    assert "cluster" not in info["spec"]  # provideClusterInfo not set


async def test_exec_plugin_client_certificate(tmp_path: Path, certs: Certs) -> None:
    cert, key = certs.client_cert.read_text(), certs.client_key.read_text()
    plugin(
        tmp_path,
        f"""\
        print(json.dumps({{
            "apiVersion": "client.authentication.k8s.io/v1",
            "kind": "ExecCredential",
            "status": {{"clientCertificateData": {cert!r}, "clientKeyData": {key!r}}},
        }}))
        """,
    )
    exec_spec = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": str(tmp_path / "plugin.py"),
    }
    credentials = load_kubeconfig(
        [write(tmp_path / "kc", kubeconfig(user={"exec": exec_spec}))]
    ).credentials
    auth = await credentials.get()
    assert auth.authorization is None
    assert auth.client_pair == (cert.encode(), key.encode())
    make_ssl_context(TlsSettings(insecure=True), auth.client_pair)  # usable


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("sys.stderr.write('login failed'); sys.exit(3)", "exited with 3: login failed"),
        ("print('not json')", "not JSON"),
        (
            "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1beta1',"
            " 'kind': 'ExecCredential', 'status': {'token': 't'}}))",
            "differs from the requested",
        ),
        (
            "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1',"
            " 'kind': 'ExecCredential', 'status': {}}))",
            "neither a token nor a client certificate",
        ),
        (
            "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1',"
            " 'kind': 'ExecCredential', 'status': {'token': 't',"
            " 'expirationTimestamp': 'soon'}}))",
            "expirationTimestamp",
        ),
    ],
)
async def test_exec_plugin_failures(tmp_path: Path, body: str, message: str) -> None:
    plugin(tmp_path, body)
    exec_spec = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": str(tmp_path / "plugin.py"),
    }
    credentials = load_kubeconfig(
        [write(tmp_path / "kc", kubeconfig(user={"exec": exec_spec}))]
    ).credentials
    with pytest.raises(TransportError, match=message) as caught:
        await credentials.get()
    assert caught.value.status == 0


async def test_exec_plugin_that_hangs_is_killed(tmp_path: Path) -> None:
    plugin(tmp_path, "import time; print(os.getpid(), flush=True); time.sleep(30)")
    spec = ExecSpec(str(tmp_path / "plugin.py"), (), (), "client.authentication.k8s.io/v1")
    credentials = ExecCredentials(spec, timeout=1.0)
    with pytest.raises(TransportError, match=r"no answer within 1\.0s"):
        await credentials.get()
    # a cancelled request does not leave the plugin running either
    task = asyncio.ensure_future(ExecCredentials(spec, timeout=30).get())
    # cancel once the second run has started (it logs itself first): not after a fixed time,
    # which a loaded machine outlasts before the plugin even starts
    deadline = asyncio.get_running_loop().time() + 20
    log = tmp_path / "runs.log"
    while (log.read_text() if log.exists() else "").count("\n") < 2:  # whole lines only
        assert asyncio.get_running_loop().time() < deadline, "the plugin never started"
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(runs(tmp_path)) == 2
    for run in runs(tmp_path):
        assert not Path(f"/proc/{run['pid']}").exists()


async def test_exec_plugin_gets_less_time_than_the_request(tmp_path: Path) -> None:
    """Before: the plugin had 60 s inside a request of 30 s, so a slow plugin ended as the
    request's anonymous "no answer within 30s". Its limit now derives from the time the
    request has left: the error names the plugin, and it is killed."""
    plugin(tmp_path, "import time; time.sleep(30)")
    exec_spec = {"apiVersion": "client.authentication.k8s.io/v1", "command": "./plugin.py"}
    config = load_kubeconfig([write(tmp_path / "kc", kubeconfig(user={"exec": exec_spec}))])
    client = KubeClient(config, timeout=2.0)
    try:
        with pytest.raises(TransportError) as caught:
            await client.get("/api/v1/namespaces")
    finally:
        await client.close()
    assert "exec credential plugin" in str(caught.value)
    assert f"no answer within {2.0 * EXEC_SHARE:.1f}s" in str(caught.value)
    (run,) = runs(tmp_path)
    assert not Path(f"/proc/{run['pid']}").exists()


def test_exec_run_limit_follows_the_request() -> None:
    spec = ExecSpec("x", (), (), "client.authentication.k8s.io/v1")
    assert ExecCredentials(spec).run_limit(30.0) == 30.0 * EXEC_SHARE < 30.0
    assert ExecCredentials(spec).run_limit(None) == EXEC_TIMEOUT < DEFAULT_TIMEOUT
    assert ExecCredentials(spec, timeout=1.0).run_limit(30.0) == 1.0
    assert ExecCredentials(spec).run_limit(-1.0) == 0.0


async def test_exec_plugin_limit_counts_the_wait_for_another_run() -> None:
    """Two requests need a credential at once: the second waits for the first's run. Before:
    its plugin limit was measured before that wait, so its run could outlast its request.
    Now the limit is what is left of its deadline once it holds the lock."""
    spec = ExecSpec("x", (), (), "client.authentication.k8s.io/v1")
    credentials = ExecCredentials(spec)
    loop = asyncio.get_running_loop()
    limits: list[float] = []
    first_running = asyncio.Event()
    first_ended_at: list[float] = []

    async def run(limit: float) -> tuple[Auth, float | None]:
        limits.append(limit)
        if len(limits) == 1:
            first_running.set()
            await asyncio.sleep(0.3)  # the first run takes a while (time passes; no assertion)
            first_ended_at.append(loop.time())
            raise TransportError("the first run failed")
        return Auth("Bearer t", None), None

    credentials._run = run  # type: ignore[method-assign]
    deadline = loop.time() + 30.0
    first = asyncio.create_task(credentials.get(deadline))
    await first_running.wait()
    second = asyncio.create_task(credentials.get(deadline))
    with pytest.raises(TransportError):
        await first
    assert (await second).authorization == "Bearer t"
    assert limits[0] <= 30.0 * EXEC_SHARE
    # the second's limit: what was left of its deadline after the first run ended
    assert limits[1] <= (deadline - first_ended_at[0]) * EXEC_SHARE < 30.0 * EXEC_SHARE


async def test_exec_plugin_not_installed_shows_the_hint(tmp_path: Path) -> None:
    exec_spec = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "no-such-credential-helper",
        "installHint": "install it from example.com",
    }
    credentials = load_kubeconfig(
        [write(tmp_path / "kc", kubeconfig(user={"exec": exec_spec}))]
    ).credentials
    with pytest.raises(TransportError, match=r"install it from example\.com"):
        await credentials.get()


def test_an_alias_bomb_kubeconfig_is_refused_with_a_short_message(tmp_path: Path) -> None:
    """Before: ``yaml.safe_load`` without a limit: 200 bytes of nested aliases expand to
    10^9 values (memory exhausted before any error)."""
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for index in range(1, 9):
        previous, name = chr(96 + index), chr(97 + index)
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 10) + "]")
    path = tmp_path / "kc"
    path.write_text("\n".join(levels) + "\n")
    with pytest.raises(ConfigError, match=r"too large: .*aliases") as caught:
        load_kubeconfig([path])
    assert len(str(caught.value)) < 300
    path.write_text("clusters: []\n---\nclusters: []\n")
    with pytest.raises(ConfigError, match="one YAML document, found 2"):
        load_kubeconfig([path])
    path.write_bytes(b"#" * (MAX_KUBECONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="too large"):
        load_kubeconfig([path])


# --- malformed settings: ConfigError naming file and field ---------------------------------


MALFORMED: list[tuple[str, Any, str]] = [
    ("not-yaml", "clusters: [\n", "not valid YAML"),
    ("not-a-mapping", "- 1\n- 2\n", "must be a mapping"),
    ("no-current-context", {**kubeconfig(), "current-context": ""}, "current-context is not"),
    ("unknown-context", {**kubeconfig(), "current-context": "nope"}, "no context named 'nope'"),
    (
        "unknown-cluster",
        {**kubeconfig(), "contexts": [{"name": "ctx", "context": {"cluster": "zz"}}]},
        r"contexts\[name=ctx\]\.context\.cluster: no cluster named 'zz'",
    ),
    (
        "unknown-user",
        {**kubeconfig(), "contexts": [{"name": "ctx", "context": {"cluster": "c1", "user": "x"}}]},
        r"contexts\[name=ctx\]\.context\.user: no user named 'x'",
    ),
    ("clusters-not-a-list", {**kubeconfig(), "clusters": {"a": 1}}, "clusters: must be a list"),
    ("nameless", {**kubeconfig(), "users": [{"user": {}}]}, r"users\[0\]: needs a name"),
    ("no-server", kubeconfig({"server": ""}), r"clusters\[name=c1\]\.cluster\.server: required"),
    ("bad-scheme", kubeconfig({"server": "ftp://h"}), r"cluster\.server: not an http\(s\) URL"),
    ("bad-port", kubeconfig({"server": "https://h:99999"}), r"cluster\.server: Port out of"),
    (
        "bad-base64",
        kubeconfig({"server": "https://h", "certificate-authority-data": "%%%"}),
        r"cluster\.certificate-authority-data: not valid base64",
    ),
    (
        "bad-ca-pem",
        kubeconfig({"server": "https://h", "certificate-authority-data": b64(b"hello")}),
        r"cluster\.certificate-authority: not a usable PEM CA certificate",
    ),
    (
        "missing-ca-file",
        kubeconfig({"server": "https://h", "certificate-authority": "nope/ca.crt"}),
        r"cluster\.certificate-authority: cannot read .*nope/ca.crt",
    ),
    (
        "ca-and-insecure",
        kubeconfig(
            {
                "server": "https://h",
                "certificate-authority-data": b64(b"x"),
                "insecure-skip-tls-verify": True,
            }
        ),
        "exclude each other",
    ),
    (
        "cert-without-key",
        kubeconfig(user={"client-certificate-data": b64(b"x")}),
        r"users\[name=u1\]\.user: client-certificate and client-key go together",
    ),
    (
        "bad-client-pem",
        kubeconfig(user={"client-certificate-data": b64(b"x"), "client-key-data": b64(b"y")}),
        r"users\[name=u1\]\.user: client-certificate/client-key are not a matching PEM",
    ),
    (
        "token-and-basic",
        kubeconfig(user={"token": "t", "username": "u", "password": "p"}),
        "exclude each other",
    ),
    (
        "missing-token-file",
        kubeconfig(user={"tokenFile": "gone"}),
        r"users\[name=u1\]\.user\.tokenFile: .*gone does not exist",
    ),
    (
        "auth-provider",
        kubeconfig(user={"auth-provider": {"name": "oidc"}}),
        r"user\.auth-provider: not supported",
    ),
    (
        "exec-api-version",
        kubeconfig(user={"exec": {"command": "x", "apiVersion": "v9"}}),
        r"user\.exec\.apiVersion: 'v9' is not supported",
    ),
    (
        "exec-no-command",
        kubeconfig(user={"exec": {"apiVersion": "client.authentication.k8s.io/v1"}}),
        r"user\.exec\.command: required",
    ),
    (
        "exec-bad-env",
        kubeconfig(
            user={
                "exec": {
                    "command": "x",
                    "apiVersion": "client.authentication.k8s.io/v1",
                    "env": [{"value": "v"}],
                }
            }
        ),
        r"user\.exec\.env\[0\]: needs a name",
    ),
    (
        "exec-interactive",
        kubeconfig(
            user={
                "exec": {
                    "command": "x",
                    "apiVersion": "client.authentication.k8s.io/v1",
                    "interactiveMode": "Always",
                }
            }
        ),
        r"user\.exec\.interactiveMode: Always needs a terminal",
    ),
    (
        "socks-proxy",
        kubeconfig({"server": "https://h", "proxy-url": "socks5://proxy:1080"}),
        r"cluster\.proxy-url: socks5:// proxies are not supported",
    ),
    (
        "groups-without-user",
        kubeconfig(user={"token": "t", "as-groups": ["admins"]}),
        r"user: as-groups, as-uid and as-user-extra need a user to impersonate",
    ),
]


@pytest.mark.parametrize(("name", "doc", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_kubeconfig_names_file_and_field(
    tmp_path: Path, name: str, doc: Any, message: str
) -> None:
    path = tmp_path / name / "config"
    path.parent.mkdir()
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path)
    assert str(path) in str(caught.value)


def test_unreadable_kubeconfig(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read .*missing"):
        load_config(tmp_path / "missing")
