"""Errors of the Kubernetes client."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CAUSE_MESSAGE_LIMIT = 500  # characters of one cause's message in str(error)
MESSAGE_LIMIT = 300  # characters of a message without causes in str(error)


class ConfigError(Exception):
    """Connection settings are missing or malformed (names the file and the field)."""


@dataclass(frozen=True)
class Cause:
    """One entry of a Status's ``details.causes``: which field the server refused and why
    (``field`` ``status.devices``, ``reason`` ``FieldValueForbidden``, ``message``
    ``Forbidden: ...``)."""

    field: str
    message: str
    reason: str = ""

    def __str__(self) -> str:
        message = _shortened(self.message, CAUSE_MESSAGE_LIMIT)
        return f"{self.field}: {message}" if self.field else message


class ApiError(Exception):
    """The API server answered with an HTTP error status.

    ``status`` is the HTTP status (0 for :class:`TransportError`), ``reason`` the Status
    object's ``reason`` (``AlreadyExists``, ``Conflict``, ...) or the HTTP reason phrase,
    ``body`` the response body as text (usually a JSON ``Status``), and ``causes`` the
    Status's ``details.causes`` (a 422 names each refused field there). ``str(error)``
    names every cause, each shortened on its own: the Status ``message`` repeats them, but
    a long ``Invalid value`` can push the field that matters out of a shortened message.
    """

    def __init__(self, status: int, reason: str, body: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        self.causes = _causes(body)
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
        if self.causes:
            # "<Kind>.<group> "<name>" is invalid: <the causes, joined>": keep the part
            # before the causes, then each cause shortened on its own
            subject, sep, _rest = message.partition(" is invalid: ")
            subject = _shortened(subject + " is invalid" if sep else message, MESSAGE_LIMIT)
            return f"{head}: {subject}: " + "; ".join(str(c) for c in self.causes)
        return f"{head}: {message[:MESSAGE_LIMIT]}" if message else head


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


def _causes(body: str) -> tuple[Cause, ...]:
    """``details.causes`` of a Status body (none when the body is not one)."""
    try:
        parsed: Any = json.loads(body) if body else None
    except ValueError:
        return ()
    details = parsed.get("details") if isinstance(parsed, dict) else None
    causes = details.get("causes") if isinstance(details, dict) else None
    if not isinstance(causes, list):
        return ()
    return tuple(
        Cause(str(c.get("field") or ""), str(c.get("message") or ""), str(c.get("reason") or ""))
        for c in causes
        if isinstance(c, dict) and (c.get("field") or c.get("message"))
    )


def _shortened(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
