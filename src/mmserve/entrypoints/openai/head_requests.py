"""HEAD on every GET route: answered as GET would be, headers and all, without the body (RFC 9110 §9.3.2).

Role: an ASGI middleware. A HEAD request goes on to the app as a GET (FastAPI's routes answer only the
methods they name, and listing HEAD beside GET on each would double every operation in the OpenAPI
schema); the body its endpoint writes is dropped, its status and headers (`content-length` as GET
sends it) kept. `scope["head_request"]` tells an error handler the client asked HEAD.
What it does not know: what the routes are or do, authentication.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class HeadAsGet:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return  # nothing of the body goes out; the last (empty) message ends the answer
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET", "head_request": True}, receive, without_body)
