"""Who the client is: an ``Authorization`` header and/or a client certificate per request.

Implementations: none, a fixed header (token or basic auth), a token file that is re-read
(bound service-account tokens rotate), and an exec plugin (:mod:`agent.core.kube.exec_credential`).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from pathlib import Path

from agent.core.kube.errors import TransportError

TOKEN_FILE_REREAD = 60.0  # seconds, as client-go


@dataclass(frozen=True)
class Auth:
    """What to send: an ``Authorization`` value and/or a (PEM certificate, PEM key) pair."""

    authorization: str | None = None
    client_pair: tuple[bytes, bytes] | None = None


class Credentials:
    """No credentials (the base class of the others)."""

    async def get(self, deadline: float | None = None) -> Auth:
        """The credential to send. ``deadline``: when the request ends, on the event loop's
        clock (an exec plugin must answer well before it, so its own error names the
        plugin). Absolute, so that time spent waiting for another caller's run counts."""
        return Auth()

    def invalidate(self) -> bool:
        """The server answered 401: forget cached credentials. True if a retry may help."""
        return False


class StaticCredentials(Credentials):
    """A fixed ``Authorization`` header."""

    def __init__(self, authorization: str) -> None:
        self._auth = Auth(authorization)

    @classmethod
    def bearer(cls, token: str) -> StaticCredentials:
        return cls(f"Bearer {token}")

    @classmethod
    def basic(cls, username: str, password: str) -> StaticCredentials:
        pair = base64.b64encode(f"{username}:{password}".encode()).decode("ascii")
        return cls(f"Basic {pair}")

    async def get(self, deadline: float | None = None) -> Auth:
        return self._auth


class TokenFileCredentials(Credentials):
    """A bearer token read from a file, re-read every ``reread`` seconds and after a 401.
    If a re-read fails, the last token read is used (the error is raised only if there is
    none)."""

    def __init__(self, path: Path, *, reread: float = TOKEN_FILE_REREAD) -> None:
        self.path = path
        self._reread = reread
        self._token: str | None = None
        self._read_at = 0.0

    async def get(self, deadline: float | None = None) -> Auth:
        now = time.monotonic()
        if self._token is None or now - self._read_at >= self._reread:
            try:
                token = self.path.read_text().strip()
            except OSError as error:
                if self._token is None:
                    raise TransportError(f"cannot read token file {self.path}: {error}") from error
                token = self._token
            if not token and self._token is None:
                raise TransportError(f"token file {self.path} is empty")
            self._token = token or self._token
            self._read_at = now
        return Auth(f"Bearer {self._token}")

    def invalidate(self) -> bool:
        self._read_at = 0.0
        return True
