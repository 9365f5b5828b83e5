"""The ``ssl.SSLContext`` for an ``https://`` API server."""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsSettings:
    """Trust and identity for TLS. PEM data, never file names (files are read at load time)."""

    ca_data: bytes | None = None  # None: the system's trust store
    insecure: bool = False  # insecure-skip-tls-verify
    server_name: str | None = None  # tls-server-name (SNI and certificate check)
    client_cert: bytes | None = None
    client_key: bytes | None = None


def make_ssl_context(
    settings: TlsSettings, client_pair: tuple[bytes, bytes] | None = None
) -> ssl.SSLContext:
    """A client context. ``client_pair`` (PEM certificate, PEM key) overrides the settings'
    client certificate (credentials from an exec plugin). Raises ``ssl.SSLError`` or
    ``ValueError`` on bad PEM data."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif settings.ca_data is not None:
        context.load_verify_locations(cadata=settings.ca_data.decode("ascii", "replace"))
    else:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    cert, key = client_pair or (settings.client_cert, settings.client_key)
    if cert is not None and key is not None:
        _load_cert_chain(context, cert, key)
    return context


def _load_cert_chain(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """``load_cert_chain`` only reads files: write a private temporary file, load it, remove
    it at once."""
    fd, path = tempfile.mkstemp(prefix="kube-client-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as handle:  # mkstemp: mode 0600
            handle.write(cert.rstrip(b"\n") + b"\n" + key)
        context.load_cert_chain(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
