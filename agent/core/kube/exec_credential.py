"""Credentials from an exec plugin (``users[].user.exec``): run the command, read the
``ExecCredential`` it prints, cache it until ``status.expirationTimestamp``.

Supports ``client.authentication.k8s.io/v1`` and ``v1beta1``: ``status.token`` or
``status.clientCertificateData`` + ``status.clientKeyData``. The plugin runs without a
terminal (``spec.interactive`` is false), with the kubeconfig's ``env`` added to ours and
``KUBERNETES_EXEC_INFO`` set.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.core.kube.credentials import Auth, Credentials
from agent.core.kube.errors import ConfigError, TransportError

API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
# Credentials are fetched inside a request, so a plugin can never take longer than the
# request's own timeout; a longer limit here was a promise the request never kept (it was
# 60 s against 30 s). The plugin gets this share of the time the request has left: its own
# "no answer" error, naming the plugin, comes first, with time left to send the request.
EXEC_SHARE = 0.8
# when the caller names no deadline: the share of the client's default 30 s
EXEC_TIMEOUT = 24.0
EXPIRY_MARGIN = 10.0  # refresh this many seconds before the credential expires


@dataclass(frozen=True)
class ExecSpec:
    """A parsed ``user.exec`` block."""

    command: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    api_version: str
    install_hint: str = ""
    cluster: Mapping[str, Any] | None = None  # sent in KUBERNETES_EXEC_INFO (provideClusterInfo)


def parse_exec_spec(
    raw: Any, base_dir: Path, where: str, cluster: Mapping[str, Any] | None = None
) -> ExecSpec:
    """``where`` names the file and field for errors. A relative command containing a ``/``
    is relative to ``base_dir`` (the kubeconfig's directory)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping")
    command = raw.get("command")
    if not isinstance(command, str) or not command:
        raise ConfigError(f"{where}.command: required (a program name or path)")
    if "/" in command and not os.path.isabs(command):
        command = str(base_dir / command)
    api_version = raw.get("apiVersion")
    if api_version not in API_VERSIONS:
        raise ConfigError(
            f"{where}.apiVersion: {api_version!r} is not supported (use one of "
            f"{', '.join(API_VERSIONS)})"
        )
    args = raw.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}.args: must be a list of strings")
    env: list[tuple[str, str]] = []
    for index, item in enumerate(raw.get("env") or []):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ConfigError(f"{where}.env[{index}]: needs a name and a value")
        env.append((item["name"], str(item.get("value") or "")))
    if raw.get("interactiveMode") == "Always":
        raise ConfigError(f"{where}.interactiveMode: Always needs a terminal; the agent has none")
    return ExecSpec(
        command,
        tuple(args),
        tuple(env),
        api_version,
        str(raw.get("installHint") or ""),
        cluster if raw.get("provideClusterInfo") else None,
    )


class ExecCredentials(Credentials):
    """Runs the plugin when there is no cached credential or it is about to expire."""

    def __init__(self, spec: ExecSpec, *, timeout: float | None = None) -> None:
        """``timeout``: an upper bound of its own for each run (else only the request's)."""
        self.spec = spec
        self._timeout = timeout
        self._lock = asyncio.Lock()
        self._auth: Auth | None = None
        self._expires: float | None = None  # time.time() value
        self.runs = 0

    async def get(self, deadline: float | None = None) -> Auth:
        async with self._lock:
            if self._auth is None or (
                self._expires is not None and time.time() >= self._expires - EXPIRY_MARGIN
            ):
                # measured now, not before the lock: waiting for another caller's run (up to
                # its whole limit) used this request's time too
                within = None if deadline is None else deadline - asyncio.get_running_loop().time()
                self._auth, self._expires = await self._run(self.run_limit(within))
            return self._auth

    def run_limit(self, within: float | None) -> float:
        """Seconds a run may take when the request has ``within`` seconds left."""
        derived = EXEC_TIMEOUT if within is None else max(within, 0.0) * EXEC_SHARE
        return derived if self._timeout is None else min(self._timeout, derived)

    def invalidate(self) -> bool:
        self._auth = None
        return True

    async def _run(self, limit: float) -> tuple[Auth, float | None]:
        spec = self.spec
        info: dict[str, Any] = {
            "apiVersion": spec.api_version,
            "kind": "ExecCredential",
            "spec": {"interactive": False},
        }
        if spec.cluster is not None:
            info["spec"]["cluster"] = dict(spec.cluster)
        env = {**os.environ, **dict(spec.env), "KUBERNETES_EXEC_INFO": json.dumps(info)}
        self.runs += 1
        # one deadline for starting and running the plugin: on a loaded node the start alone
        # may take a while, and the request's own deadline comes soon after
        deadline = asyncio.get_running_loop().time() + limit
        too_slow = f"exec credential plugin {spec.command}: no answer within {limit:.1f}s"
        try:
            async with asyncio.timeout_at(deadline):
                process = await asyncio.create_subprocess_exec(
                    spec.command,
                    *spec.args,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    env=env,
                )
        except OSError as error:
            hint = f" ({spec.install_hint.strip()})" if spec.install_hint else ""
            raise TransportError(
                f"exec credential plugin {spec.command}: {error.strerror or error}{hint}"
            ) from error
        except TimeoutError as error:
            raise TransportError(too_slow) from error
        try:
            async with asyncio.timeout_at(deadline):
                stdout, stderr = await process.communicate()
        except BaseException as error:  # timed out, or the request was cancelled
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            if isinstance(error, TimeoutError):
                raise TransportError(too_slow) from error
            raise
        if process.returncode != 0:
            tail = stderr.decode("utf-8", "replace").strip()[-500:]
            raise TransportError(
                f"exec credential plugin {spec.command} exited with {process.returncode}: {tail}"
            )
        return parse_exec_credential(stdout, spec.api_version, spec.command)


def parse_exec_credential(
    output: bytes, api_version: str, command: str
) -> tuple[Auth, float | None]:
    """The credential and its expiry (epoch seconds, None: no expiry) from the plugin's
    stdout."""
    what = f"exec credential plugin {command}"
    try:
        doc = json.loads(output)
    except ValueError as error:
        raise TransportError(f"{what}: output is not JSON: {error}") from error
    if not isinstance(doc, dict) or doc.get("kind") != "ExecCredential":
        raise TransportError(f"{what}: output is not an ExecCredential")
    if doc.get("apiVersion") != api_version:
        raise TransportError(
            f"{what}: apiVersion {doc.get('apiVersion')!r} differs from the requested "
            f"{api_version!r}"
        )
    status = doc.get("status")
    if not isinstance(status, dict):
        raise TransportError(f"{what}: ExecCredential has no status")
    token = status.get("token")
    cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
    if bool(cert) != bool(key):
        raise TransportError(
            f"{what}: status.clientCertificateData and status.clientKeyData go together"
        )
    if not token and not cert:
        raise TransportError(f"{what}: status has neither a token nor a client certificate")
    auth = Auth(
        f"Bearer {token}" if token else None,
        (str(cert).encode(), str(key).encode()) if cert else None,
    )
    expires: float | None = None
    stamp = status.get("expirationTimestamp")
    if stamp:
        try:
            moment = datetime.datetime.fromisoformat(str(stamp))
        except ValueError as error:
            raise TransportError(f"{what}: bad status.expirationTimestamp {stamp!r}") from error
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.UTC)
        expires = moment.timestamp()
    return auth, expires
