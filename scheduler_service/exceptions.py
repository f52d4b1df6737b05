"""The scheduler's error contract: every domain error is a `GreenflowError` with its HTTP status.

Services raise these; `errors.py` renders every one of them with a single handler, so no
router translates errors itself and the handler needs no domain imports.
"""

from __future__ import annotations

from typing import Any


class GreenflowError(Exception):
    """A failure the caller can act on: a message and the HTTP status that answers it."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code

    def body(self) -> dict[str, Any]:
        """The JSON body of the answer."""
        return {"detail": self.message}

    def headers(self) -> dict[str, str] | None:
        """Extra response headers (e.g. Retry-After), if any."""
        return None


class FieldError(GreenflowError):
    """A request value that passed the schema but not a rule that needs the server (e.g. the clock)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", 422)
        self.field = field
        self.message = message

    def body(self) -> dict[str, Any]:
        """The same shape as FastAPI's validation errors, naming the body field."""
        return {
            "detail": [{"loc": ["body", self.field], "msg": self.message, "type": "value_error"}]
        }


class NotAllowed(GreenflowError):
    """The caller's role does not permit this action."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 403)


class JobNotFound(GreenflowError):
    """No such job, or not one the caller may see (the two are indistinguishable on purpose)."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} not found", 404)
        self.job_id = job_id


class SubmissionConflict(GreenflowError):
    """A submission_id was reused with a different spec."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 409)


class InvalidTransition(GreenflowError):
    """A state change the lifecycle does not allow (e.g. leaving a terminal state)."""

    def __init__(self, job_id: int, from_state: str, to_state: str) -> None:
        super().__init__(f"job {job_id} cannot go from {from_state} to {to_state}", 409)
        self.from_state = from_state
        self.to_state = to_state


class UnknownNode(GreenflowError):
    """A heartbeat from a node the scheduler does not know (it must register again)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"node {name} is not registered (or was marked lost): register again", 404)
        self.name = name


# OpenAPI documentation of the error answers (the body is always {"detail": ...}).
def error_responses(*codes: int) -> dict[int | str, dict[str, str]]:
    """`responses=` entries for the given 4xx codes, for routers and routes."""
    text = {
        400: "The body is not valid JSON.",
        401: "Missing, unknown or revoked bearer token.",
        403: "The token's role may not do this.",
        404: "No such resource, or not one the caller may see.",
        409: "Conflicts with the resource's current state.",
        429: "Too many failed authentication attempts from this address (see Retry-After).",
    }
    return {code: {"description": text[code]} for code in codes}
