"""The OpenAI-compatible HTTP server: a FastAPI app factory and `serve()`.

Role: routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/v1/stats`, `/health`,
`/metrics`, and the web chat's from web_ui.py unless it is turned off), Bearer-token
authentication on `/v1`, and one error shape for every failure —
OpenAI's `{"error": {"message", "type", "param", "code"}}` with 400 for bad input (malformed
JSON and schema errors included), 401, 404, 413 for a body over `--max-request-bytes`
(`body_limit.py`), 503 when the engine is down. The engine thread starts
and stops with the app's lifespan. All state lives on the app (no module globals).

What it does not know: how requests are turned into prompts and responses (serving.py), media
(media.py), or the engine's internals.
"""

from __future__ import annotations

import hmac
import logging
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmserve.cluster.replicas import ReplicaSet
from mmserve.engine.async_engine import AsyncEngine, EngineDeadError, ShuttingDownError
from mmserve.engine.llm_engine import Engine
from mmserve.entrypoints.openai.body_limit import BodyLimit
from mmserve.entrypoints.openai.metrics import ServerMetrics
from mmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
)
from mmserve.entrypoints.openai.serving import OpenAIServing, ServerConfig, engine_error
from mmserve.entrypoints.openai.trace_middleware import TraceMiddleware
from mmserve.entrypoints.openai.web_ui import web_ui_router
from mmserve.errors import InvalidInputError

logger = logging.getLogger("mmserve.server")


def _error(status_code: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, request: Request | None = None) -> JSONResponse:
    if request is not None and 400 <= status_code < 500:  # the request's own fault: why, for whoever reads the log
        logger.info("%s %s -> %d%s: %s", request.method, request.url.path, status_code,
                    f" ({param})" if param else "", message)
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code)


def field_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as the request field it names: ('messages', 0, 'content') ->
    'messages[0].content', the style every error's `param` uses."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def server_flag(setting: str) -> str:
    """An engine setting as `mmserve serve` spells its flag."""
    return "--" + setting.replace("_", "-")


def _client_message(exc: InvalidInputError) -> str:
    """The error's text as a client of this server reads it: engine settings named as server flags."""
    message = str(exc)
    return message.replace(exc.setting, server_flag(exc.setting)) if exc.setting else message


def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []

    def where(error: dict[str, Any]) -> str:
        return field_path([p for p in error.get("loc", ()) if p != "body"])

    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return _error(400, f"the request body is not valid JSON: {first.get('msg', '')}", code="invalid_json",
                      request=request)
    message = "; ".join(f"{where(e)}: {e.get('msg')}" for e in errors[:5]) or "invalid request"
    return _error(400, message, param=where(first) or None, request=request)


def _install_error_handlers(app: FastAPI) -> None:
    async def request_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestError)
        return _error(exc.status_code, exc.message, exc.type, exc.param, exc.code, request)

    async def invalid_input(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidInputError)
        return _error(400, _client_message(exc), param=exc.param, request=request)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, request=request)

    async def engine_dead(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EngineDeadError)
        return JSONResponse(ErrorResponse(error=engine_error(exc)).model_dump(), status_code=503)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        return _validation_error(request, exc)

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(InvalidInputError, invalid_input)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(EngineDeadError, engine_dead)


def _auth_dependency(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise RequestError("Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                               status_code=401, code="invalid_api_key")
    return check


def _v1_router(serving: OpenAIServing, engine: AsyncEngine | ReplicaSet, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_auth_dependency(api_key))])

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await serving.chat(body, raw)

    @router.post("/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await serving.completions(body, raw)

    @router.get("/models")
    async def models() -> ModelList:
        root = engine.frontend.config.model
        return ModelList(data=[ModelCard(id=serving.config.served_model_name, root=root,
                                         max_model_len=serving.max_model_len)])

    @router.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's counters (the JSON twin of /metrics): KV blocks, encoder cache, requests; with
        replicas, summed, plus each replica's and the router's."""
        return await engine.current_stats()

    return router


def _tokens_router(serving: OpenAIServing, api_key: str | None) -> APIRouter:
    """vLLM's /tokenize and /detokenize (clients count a prompt's tokens before sending it), /version, and
    /tokenizer_info where the server was asked for it."""
    router = APIRouter(dependencies=[Depends(_auth_dependency(api_key))])

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return serving.detokenize(body)

    @router.get("/version")
    async def version() -> dict[str, str]:
        from mmserve import __version__

        return {"version": __version__}

    if serving.config.tokenizer_info:
        @router.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return serving.engine.frontend.processor.tokenizer.info()

    return router


def build_app(engine: Engine | ReplicaSet, config: ServerConfig) -> FastAPI:
    """A FastAPI app serving `engine` (one, or replicas already launched); its lifespan starts and stops
    the engine thread or the replicas."""
    metrics = ServerMetrics()
    async_engine: AsyncEngine | ReplicaSet
    if isinstance(engine, ReplicaSet):
        async_engine, engine.on_output = engine, metrics.observe
    else:
        async_engine = AsyncEngine(engine, on_output=metrics.observe, on_encoded=metrics.observe_encoded)
    metrics.attach_engine_stats(async_engine.stats)
    serving = OpenAIServing(async_engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="mmserve", summary="OpenAI-compatible server for vision-language models",
                  lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.serving = async_engine, metrics, serving
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    if async_engine.tracing is not None:  # outermost: the span covers the whole exchange
        app.add_middleware(TraceMiddleware, tracing=async_engine.tracing)
    if config.request_id_headers:
        @app.middleware("http")
        async def request_id_header(request: Request, call_next: Callable[[Request], Any]) -> Response:
            """X-Request-Id on every answer: the client's own, else a new one (vLLM's flag)."""
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            response = await call_next(request)
            response.headers["X-Request-Id"] = request_id
            return response
    _install_error_handlers(app)
    app.include_router(_v1_router(serving, async_engine, config.api_key))
    app.include_router(_tokens_router(serving, config.api_key))
    if config.web_ui:  # the chat page and its files need no API key: the user types it into the page
        app.include_router(web_ui_router(config.demo_model, api_key_required=config.api_key is not None))

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return _error(503, "the engine is not running", "server_error")
        stats = async_engine.stats()
        if stats.get("replicas_alive", 1) < stats.get("replicas_total", 1):  # the others still serve
            return JSONResponse({"status": "degraded", "reason": f"{stats['replicas_alive']} of "
                                 f"{stats['replicas_total']} replicas are alive"}, status_code=200)
        if stats.get("encoder_workers_alive", 1) == 0:  # text still served; images wait or time out
            return JSONResponse({"status": "degraded", "reason": "no encoder worker is alive"}, status_code=200)
        return JSONResponse({"status": "ok"}, status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _shutdown_margin_s(timeout_s: float) -> float:
    """How long before uvicorn's graceful-shutdown timeout the requests still running are cut off, so
    that each still gets its error answer before uvicorn cancels what is left."""
    return min(0.5, timeout_s / 4)


def serve(engine: Engine | ReplicaSet, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", shutdown_timeout_s: float = 30.0,
          on_ready: Callable[[], None] | None = None) -> None:
    """Serve until interrupted (blocks); `on_ready` runs once the port is bound and requests are
    answered (the CLI prints its start-up summary there). On SIGTERM or Ctrl-C the server stops accepting connections,
    lets the requests in flight finish for up to `shutdown_timeout_s`, then fails the rest with a 503
    `server_shutting_down` error (an error event on a stream) and aborts them in the engine, stops the
    engine and its workers, and returns."""
    import uvicorn

    app = build_app(engine, config)
    async_engine: AsyncEngine | ReplicaSet = app.state.engine

    def cut_off() -> None:
        error = ShuttingDownError(f"the server is shutting down: the request was still running after the "
                                  f"{shutdown_timeout_s:g} s shutdown timeout and was aborted")
        if cut := async_engine.abort_all(error):
            logger.warning("shutdown timeout: aborted %d running request(s)", cut)

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:  # the first signal starts the shutdown clock
                timer = threading.Timer(max(0.0, shutdown_timeout_s - _shutdown_margin_s(shutdown_timeout_s)),
                                        cut_off)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if on_ready is not None and self.started:  # not when binding the port failed
                on_ready()

    logger.info("serving %s on http://%s:%d", config.served_model_name, host, port)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal under the handler it found: a
    # handler that does nothing lets the process end normally (exit 0) instead of dying by the signal
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, root_path=config.root_path,
                                      timeout_graceful_shutdown=shutdown_timeout_s)).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.info("server stopped")
