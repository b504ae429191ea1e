"""The server's span of each generation request (with `--otlp-traces-endpoint`).

Role: an ASGI middleware around `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses` and
`/v1/messages`. It opens the
request's server span — continuing the client's W3C `traceparent` header when there is one — before
the app reads the body, and ends it when the last byte of the answer (a whole stream included) is
sent, with the status code and the request id the serving layer chose. The span's own traceparent is
left in the request's state (`request.state.trace_parent`) for the serving layer to hand the engine.
What it does not know: the engine, how a request is served, OpenTelemetry beyond `Tracing`.
"""

from __future__ import annotations

from typing import Any

from mmserve.entrypoints.openai.body_limit import ASGIApp, Message, Receive, Scope, Send
from mmserve.tracing import Tracing

TRACED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


class TraceMiddleware:
    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        path = scope["path"]
        span = self.tracing.start_server_span(f"POST {path}", headers,
                                              {"http.request.method": "POST", "http.route": path})
        state: dict[str, Any] = scope.setdefault("state", {})
        state["trace_parent"] = self.tracing.traceparent(span)

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        finally:
            request_id = state.get("request_id")
            if request_id is not None:
                span.set_attribute("gen_ai.request.id", request_id)
            span.end()
