"""Errors shared across domain modules (each maps to a 4xx answer in errors.py)."""

from __future__ import annotations


class FieldError(Exception):
    """A request value that passed the schema but not a rule that needs the server (e.g. the clock)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotAllowed(Exception):
    """The caller's role does not permit this action."""


# OpenAPI documentation of the error answers (the body is always {"detail": ...}).
def error_responses(*codes: int) -> dict[int | str, dict[str, str]]:
    """`responses=` entries for the given 4xx codes, for routers and routes."""
    text = {
        400: "The body is not valid JSON.",
        401: "Missing, unknown or revoked bearer token.",
        403: "The token's role may not do this.",
        404: "No such resource, or not one the caller may see.",
        409: "Conflicts with the resource's current state.",
    }
    return {code: {"description": text[code]} for code in codes}
