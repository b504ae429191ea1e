"""A request-body size limit for the HTTP server, enforced before a body is held whole.

Role: an ASGI middleware. A request whose `Content-Length` is over `max_bytes` is answered 413
with OpenAI's error JSON (Anthropic's on its Messages routes: http_errors.py's `error_body`) without
any of its body being held. A body without a length (chunked) is read here as it arrives and refused
with the same 413 as soon as it passes the limit (so no more than the limit is ever held), else handed
on to the app whole. Other requests are not affected.

Before a 413 goes out, the rest of the refused body (up to `DRAIN_MAX_BYTES`) is read and dropped:
a server that closes a connection with unread bytes in its socket makes the kernel send a reset,
which can destroy the 413 in the client's buffer before the client reads it.

What it does not know: routes, the engine, what the body holds.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from mmserve.entrypoints.openai.http_errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
# a refused body longer than this is not read to its end: the connection is closed under it
DRAIN_MAX_BYTES = 256 * 1024 * 1024


def _message(max_bytes: int, size: int | None, path: str) -> bytes:
    got = f"{size} bytes" if size is not None else "more than that"
    return json.dumps(error_body(path, 413, f"the request body is {got}; the limit is {max_bytes} bytes "
                                 "(--max-request-bytes)", code="request_too_large")).encode()


async def _drain(receive: Receive, more_body: bool = True) -> None:
    """Read and drop the rest of a refused body, up to DRAIN_MAX_BYTES, so the close is a clean one."""
    dropped = 0
    while more_body and dropped <= DRAIN_MAX_BYTES:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return
        dropped += len(message.get("body", b""))
        more_body = message.get("more_body", False)


async def _send_413(send: Send, max_bytes: int, size: int | None, path: str) -> None:
    body = _message(max_bytes, size, path)
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if int(length) <= DRAIN_MAX_BYTES:
                await _drain(receive)
            await _send_413(send, self.max_bytes, int(length), scope.get("path", ""))
            return
        if length is not None:  # the server reads exactly that many bytes: within the limit
            await self.app(scope, receive, send)
            return
        # no length (chunked): read it here, up to the limit, then hand it on as it came
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            received += len(chunks[-1])
            if received > self.max_bytes:
                await _drain(receive, message.get("more_body", False))
                await _send_413(send, self.max_bytes, None, scope.get("path", ""))
                return
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)
