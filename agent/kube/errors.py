"""Errors of the Kubernetes client."""

from __future__ import annotations

import json


class ConfigError(Exception):
    """Connection settings are missing or malformed (names the file and the field)."""


class ApiError(Exception):
    """The API server answered with an HTTP error status.

    ``status`` is the HTTP status (0 for :class:`TransportError`), ``reason`` the Status
    object's ``reason`` (``AlreadyExists``, ``Conflict``, ...) or the HTTP reason phrase, and
    ``body`` the response body as text (usually a JSON ``Status``).
    """

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        super().__init__(self._describe())

    @classmethod
    def from_response(cls, status: int, phrase: str, body: bytes) -> ApiError:
        text = body.decode("utf-8", "replace")
        reason = phrase
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("reason"):
            reason = str(parsed["reason"])
        return cls(status, reason, text)

    def _describe(self) -> str:
        message = self.body
        try:
            parsed = json.loads(self.body)
            if isinstance(parsed, dict) and parsed.get("message"):
                message = str(parsed["message"])
        except ValueError:
            pass
        head = f"HTTP {self.status} {self.reason}" if self.status else self.reason
        return f"{head}: {message[:300]}" if message else head


class TransportError(ApiError):
    """No HTTP answer: connection refused or dropped, TLS failure, timeout, bad response,
    or no credentials (a failing exec plugin). ``status`` is 0."""

    def __init__(self, reason: str) -> None:
        super().__init__(0, reason, "")
