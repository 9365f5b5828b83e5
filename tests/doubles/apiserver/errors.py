"""Kubernetes ``Status`` error objects (``kind: Status``) raised by the store and the routes."""

from __future__ import annotations

from typing import Any

from tests.doubles.apiserver.resources import GroupResource

JSON = dict[str, Any]

REASONS: dict[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}

DEFAULT_MESSAGES: dict[int, str] = {
    400: "the server rejected our request for an unknown reason",
    401: "Unauthorized",
    403: "forbidden",
    404: "the server could not find the requested resource",
    405: "the server does not allow this method on the requested resource",
    409: "the server reported a conflict",
    410: "the resource has expired",
    415: "the server does not support the media type of the request",
    422: "the server rejected our request due to an error in our request",
    429: "Too many requests, please try again later.",
    500: "an error on the server has prevented the request from succeeding",
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted, but may still be "
    "processing the request",
}


class ApiError(Exception):
    """An API failure rendered as a ``metav1.Status`` with the given HTTP ``code``."""

    def __init__(
        self,
        code: int,
        message: str | None = None,
        reason: str | None = None,
        details: JSON | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.code = code
        self.reason = reason or REASONS.get(code, "Unknown")
        self.message = message if message is not None else DEFAULT_MESSAGES.get(code, "")
        self.details = details
        self.headers = headers or {}
        super().__init__(f"{code} {self.reason}: {self.message}")

    def status(self) -> JSON:
        """The ``Status`` object sent to the client."""
        out: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            out["details"] = self.details
        out["code"] = self.code
        return out


def _details(gr: GroupResource, name: str, kind: str | None = None) -> JSON:
    details: JSON = {"name": name}
    if gr.group:
        details["group"] = gr.group
    details["kind"] = kind or gr.resource
    return details


def not_found(gr: GroupResource, name: str) -> ApiError:
    return ApiError(404, f'{gr} "{name}" not found', details=_details(gr, name))


def already_exists(gr: GroupResource, name: str) -> ApiError:
    return ApiError(409, f'{gr} "{name}" already exists', "AlreadyExists", _details(gr, name))


def conflict(gr: GroupResource, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {gr} "{name}": {why}',
        "Conflict",
        _details(gr, name),
    )


def apply_conflict(conflicts: list[tuple[str, str]]) -> ApiError:
    """A server-side apply (without ``force``) that would change fields other managers own:
    409 Conflict with a ``FieldManagerConflict`` cause per (printed manager, field), worded as
    the apply handler's ``NewConflictError``/``getConflictMessage``."""
    causes = [
        {"reason": "FieldManagerConflict", "message": f"conflict with {manager}", "field": field}
        for manager, field in conflicts
    ]
    if len(conflicts) == 1:
        manager, field = conflicts[0]
        text = f"Apply failed with 1 conflict: conflict with {manager}: {field}"
    else:
        by_manager: dict[str, list[str]] = {}
        for manager, field in conflicts:
            by_manager.setdefault(manager, []).append(field)
        lines = []
        for manager in sorted(by_manager):
            lines.append(f"conflicts with {manager}:")
            lines += [f"- {field}" for field in by_manager[manager]]
        text = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return ApiError(409, text, "Conflict", {"causes": causes})


MODIFIED = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def stale(gr: GroupResource, name: str) -> ApiError:
    """The optimistic-concurrency conflict of an update whose resourceVersion is not current."""
    return conflict(gr, name, MODIFIED)


def precondition_failed(gr: GroupResource, key: str, name: str, what: str) -> ApiError:
    """A failed ``preconditions`` check (delete options, uid in an update body)."""
    why = (
        f"StorageError: invalid object, Code: 4, Key: {key}, ResourceVersion: 0, "
        f"AdditionalErrorMsg: Precondition failed: {what}"
    )
    return conflict(gr, name, why)


def invalid(
    gr: GroupResource, kind: str, name: str, causes: list[tuple[str, str, str]]
) -> ApiError:
    """422 Invalid. ``causes`` are ``(reason, field, message)`` triples, e.g.
    ``("FieldValueRequired", "metadata.name", "Required value: name is required")``."""
    qualified = f"{kind}.{gr.group}" if gr.group else kind
    # the message names each distinct cause once (ErrorList.ToAggregate drops repeats); the
    # details list them all
    texts = list(dict.fromkeys(f"{field}: {msg}" if field else msg for _, field, msg in causes))
    text = ", ".join(texts)
    if len(texts) > 1:
        text = f"[{text}]"
    details = _details(gr, name, kind)
    details["causes"] = [
        {"reason": reason, "message": msg, "field": field} for reason, field, msg in causes
    ]
    return ApiError(422, f'{qualified} "{name}" is invalid: {text}', "Invalid", details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def namespace_mismatch() -> ApiError:
    return bad_request(
        "the namespace of the provided object does not match the namespace sent on the request"
    )


def name_mismatch(in_body: str, in_url: str) -> ApiError:
    return bad_request(
        f"the name of the object ({in_body}) does not match the name on the URL ({in_url})"
    )


def internal(message: str) -> ApiError:
    return ApiError(500, f"Internal error occurred: {message}")


def gone(message: str) -> ApiError:
    return ApiError(410, message, "Expired")


def endpoint_not_found() -> ApiError:
    return ApiError(404, details={})


def method_not_allowed() -> ApiError:
    return ApiError(405)


def unsupported_media_type(content_type: str, accepted: list[str]) -> ApiError:
    return ApiError(
        415,
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{', '.join(accepted)}",
        details={"causes": [{"reason": "UnexpectedServerResponse", "message": content_type}]}
        if content_type
        else None,
    )


def from_code(code: int, message: str | None = None, retry_after: int | None = None) -> ApiError:
    """A generic error for fault injection: right ``reason`` and default message for ``code``."""
    headers: dict[str, str] = {}
    details: JSON | None = None
    if code in (429, 503, 504) and retry_after is not None:
        headers["Retry-After"] = str(retry_after)
        details = {"retryAfterSeconds": retry_after}
    return ApiError(code, message, details=details, headers=headers)
