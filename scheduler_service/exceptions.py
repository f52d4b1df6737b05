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
