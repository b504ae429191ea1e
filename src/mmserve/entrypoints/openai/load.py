"""vLLM's server load tracking (`--enable-server-load-tracking`): the generation requests in flight, counted
from their arrival until their answer's last byte is sent (a stream's included), and `GET /load`.

Role: `ServerLoad`, an ASGI middleware that counts the requests to the generation routes while tracking is
on, and `load_router`, whose `/load` answers `{"server_load": N}` (0 while tracking is off, as vLLM's).
What it does not know: what the requests ask, the engine.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

# the routes whose requests vLLM's load_aware_call counts (those mmserve serves)
COUNTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize",
                 "/detokenize")


class LoadCounter:
    def __init__(self) -> None:
        self.in_flight = 0


class ServerLoad:
    """Counts a request to a counted route until its response is complete (or the exchange ends)."""

    def __init__(self, app: Any, counter: LoadCounter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path
        if scope["type"] != "http" or path not in COUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        self.counter.in_flight += 1
        done = False

        async def counted_send(message: dict) -> None:
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not done:
                done = True
                self.counter.in_flight -= 1

        try:
            await self.app(scope, receive, counted_send)
        finally:
            if not done:
                self.counter.in_flight -= 1


def load_router(counter: LoadCounter) -> APIRouter:
    router = APIRouter()

    @router.get("/load")
    async def load() -> JSONResponse:
        """The generation requests in flight (vLLM's route)."""
        return JSONResponse({"server_load": counter.in_flight})

    return router
