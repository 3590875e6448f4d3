"""The request-body limit: bodies over ``TORCHRELAY_API_MAX_BODY_BYTES`` are refused with 413.

:class:`BodyLimit` is a pure ASGI middleware in front of everything else (authentication,
routing, the kept answers): a ``Content-Length`` over the limit is answered 413 at once,
without reading a byte of the body; a body without one (``Transfer-Encoding: chunked``) is
counted as it is received and refused with 413 once it passes the limit, and the app behind
sees the client go away (``http.disconnect``) instead of the rest. Nothing larger than the
limit is ever held in memory by the API, whoever sends it, with or without a token.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from services.api.gateway import ApiProblem

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

SETTING = "TORCHRELAY_API_MAX_BODY_BYTES"


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The largest ``Content-Length`` of the request, or None when it declares none (or none
    that is a number: such a body is counted as it arrives instead)."""
    found: int | None = None
    for name, value in headers:
        if name.lower() == b"content-length":
            text = value.strip()
            if text.isdigit():
                found = max(found or 0, int(text))
    return found


def too_large(limit: int, length: int | None, path: str) -> tuple[dict[str, Any], bytes]:
    """The 413 problem document's ``http.response.start`` message and its body."""
    size = f"{length} bytes (Content-Length)" if length is not None else "over the limit"
    problem = ApiProblem(
        413,
        "Content Too Large",
        f"body: the request body is {size}; this API takes at most {limit} bytes "
        f"({SETTING}); send a smaller body",
        kind="too-large",
        field="body",
    )
    body = json.dumps(problem.document(path)).encode()
    start = {
        "type": "http.response.start",
        "status": 413,
        "headers": [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    return start, body


class BodyLimit:
    """Refuse HTTP request bodies over ``max_bytes()`` with 413 (see the module).

    ``max_bytes`` is asked per request, so the limit follows settings loaded at start.
    """

    def __init__(self, app: Asgi, max_bytes: Callable[[], int]) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes()
        path = str(scope.get("path", ""))
        length = declared_length(scope.get("headers", []))
        if length is not None and length > limit:
            start, body = too_large(limit, length, path)
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        if length is not None:
            # The server delivers no more than Content-Length bytes: nothing to count.
            await self.app(scope, receive, send)
            return

        received = 0
        started = False
        refused = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not started:
                        start, body = too_large(limit, None, path)
                        await send(start)
                        await send({"type": "http.response.body", "body": body})
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went instead: what the app answers to the disconnect is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, tracked_send)


__all__ = ["SETTING", "BodyLimit", "declared_length", "too_large"]
