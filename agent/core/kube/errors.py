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

    @property
    def retry_after(self) -> float | None:
        """What the server asks to wait before trying again (``details.retryAfterSeconds``
        of a 429/5xx Status body, the same figure as its ``Retry-After`` header)."""
        try:
            details = json.loads(self.body).get("details") or {}
            seconds = details.get("retryAfterSeconds")
        except (ValueError, AttributeError):
            return None
        return float(seconds) if isinstance(seconds, int | float) and seconds >= 0 else None

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


class ResponseTooLargeError(ApiError):
    """The server answered, but with a body over :data:`agent.core.kube.http.MAX_BODY`: refused
    unread. Not transient — the same request gets the same answer — so it is not a
    :class:`TransportError`: a list asks for smaller pages instead
    (:meth:`~agent.core.kube.client.KubeClient.list_all`). ``status`` is the answer's HTTP
    status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, "ResponseTooLarge", message)
