"""The edge every request crosses first: size limit, and values no handler should ever see.

A pure ASGI middleware, so it runs before routing and parsing:
- a body larger than the limit is refused with 413 as soon as its length is known (from
  Content-Length, else while it streams), without reading the rest;
- JSON bodies may hold only finite numbers (no NaN, Infinity or 1e999) and strings without
  NUL characters or lone surrogates; the query string and path no NUL: PostgreSQL cannot store
  either, and JSON cannot carry a non-finite number back in an error. Each is a 422 that
  names the field, in FastAPI's validation-error shape.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 1 << 20
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")


@dataclass(frozen=True)
class _NonFinite:
    """Stands in, while parsing, for a number JSON cannot carry."""

    literal: str


class _Refused(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def _field_error(loc: list[str | int], msg: str, kind: str) -> _Refused:
    return _Refused(422, {"detail": [{"loc": loc, "msg": msg, "type": kind}]})


def _text_problem(text: str) -> str | None:
    match = _BAD_TEXT.search(text)
    if match is None:
        return None
    if match.group() == "\x00":
        return "must not contain NUL (\\u0000) characters"
    return "must not contain lone surrogates (invalid Unicode)"


def _parse_float(literal: str) -> float | _NonFinite:
    value = float(literal)
    return value if math.isfinite(value) else _NonFinite(literal)


def _walk(value: Any, loc: list[str | int]) -> None:
    """Raise a 422 for the first value (or key) in a parsed JSON document that may not pass."""
    if isinstance(value, _NonFinite):
        raise _field_error(
            loc, f"{value.literal} is not a finite number (JSON has none)", "finite_number"
        )
    if isinstance(value, str):
        problem = _text_problem(value)
        if problem is not None:
            raise _field_error(loc, problem, "string_characters")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _walk(item, [*loc, index])
    elif isinstance(value, dict):
        for key, item in value.items():
            problem = _text_problem(key)
            if problem is not None:
                raise _field_error([*loc, _printable(key)], f"key {problem}", "string_characters")
            _walk(item, [*loc, key])


def _printable(text: str) -> str:
    return _BAD_TEXT.sub("\ufffd", text)


def check_json_body(body: bytes) -> None:
    """Raise _Refused for a JSON body with non-finite numbers, NUL or lone surrogates."""
    try:
        document = json.loads(
            body, parse_constant=_NonFinite, parse_float=_parse_float, parse_int=int
        )
    except RecursionError:
        raise _field_error(["body"], "JSON nested too deeply", "json_invalid") from None
    except ValueError:
        return  # not JSON at all: FastAPI answers that itself (422 json_invalid)
    _walk(document, ["body"])


def check_query(query_string: bytes) -> None:
    """Raise _Refused for a query parameter (name or value) holding NUL."""
    text = query_string.decode("latin-1")
    for name, value in parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="replace"):
        for part in (name, value):
            problem = _text_problem(part)
            if problem is not None:
                raise _field_error(["query", _printable(name)], problem, "string_characters")


def check_form_body(body: bytes) -> None:
    """Raise _Refused for a form field holding NUL."""
    text = body.decode("latin-1")
    for name, value in parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="replace"):
        for part in (name, value):
            problem = _text_problem(part)
            if problem is not None:
                raise _field_error(["body", _printable(name)], problem, "string_characters")


class InputGuard:
    """ASGI middleware: refuse oversized bodies and unstorable or unserialisable values."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        large_bodies: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # Path prefix -> its own body limit (workdir bundles are bigger than any JSON body).
        self.large_bodies = dict(large_bodies or {})

    def _limit(self, path: str) -> int:
        for prefix, limit in self.large_bodies.items():
            if path.startswith(prefix):
                return limit
        return self.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            if "\x00" in unquote(scope.get("raw_path", b"").decode("latin-1")):
                raise _field_error(["path"], "must not contain NUL characters", "string_characters")
            check_query(scope.get("query_string", b""))
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length")
            limit = self._limit(scope.get("path", ""))
            if length is not None and length.isdigit() and int(length) > limit:
                raise self._too_large(limit)
            body = await self._read_body(receive, limit)
            content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if body and (content_type == b"application/json" or content_type.endswith(b"+json")):
                check_json_body(body)
            elif body and content_type == b"application/x-www-form-urlencoded":
                check_form_body(body)
        except _Refused as refused:
            await _answer(send, refused.status, refused.body)
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self, limit: int) -> _Refused:
        return _Refused(413, {"detail": f"request body larger than {limit} bytes; send less"})

    async def _read_body(self, receive: Receive, limit: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self._too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later messages (a disconnect) come from the server

    return replay


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close") if status == 413 else (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


# Pages of our own origin only: scripts and styles from here (inline styles for the console's
# meters), nothing framed, no plugins. The API docs page runs one inline script.
_CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "script-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)
_DOCS_CSP = _CSP.replace("script-src 'self'", "script-src 'self' 'unsafe-inline'")
_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)


class SecurityHeaders:
    """ASGI middleware: the same security headers on every response (JSON, HTML, errors)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        csp = (_DOCS_CSP if path in ("/docs", "/redoc") else _CSP).encode()
        api = path.startswith("/v1/")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                present = {name.lower() for name, _ in headers}
                extra = [*_HEADERS, (b"content-security-policy", csp)]
                if api:
                    extra.append((b"cache-control", b"no-store"))
                headers += [(n, v) for n, v in extra if n not in present]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)
