"""The OpenAI-compatible HTTP server: the app's assembly (`build_app`) and `serve()`.

Role: put the app together from its parts — each endpoint module's routes (chat.py, completions.py,
anthropic_messages.py, responses.py, models.py and health.py's /v1/stats under `/v1`; pooling_routes.py's
under `/v1` and at the root (each runner's routes refused on the other's server); tokens.py's at the root;
health.py's /health and /metrics; the web chat's from web_ui.py unless it is turned off), HEAD beside
every GET (head_requests.py: a HEAD goes on as GET, its body dropped), the `--root-path` prefix (served
with and without it), Bearer-token (or Anthropic's `x-api-key`) authentication
on all but /health, /metrics and the web chat, the request body limit (`body_limit.py`), the trace
middleware, X-Request-Id where asked, and one error shape for every failure (http_errors.py). The client's engine
thread or replicas start and stop with the app's lifespan. All state lives on the app (no module
globals). `serve()` runs it under uvicorn with a graceful shutdown.

What it does not know: how requests are turned into prompts and responses (the endpoint modules over
serving.py), media (media.py), or whether one engine or many are behind the `EngineClient`.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import signal
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from mmserve.engine.client import EngineClient, ShuttingDownError
from mmserve.entrypoints.openai.anthropic_messages import messages_router
from mmserve.entrypoints.openai.body_limit import BodyLimit
from mmserve.entrypoints.openai.chat import chat_router
from mmserve.entrypoints.openai.completions import completions_router
from mmserve.entrypoints.openai.head_requests import HeadAsGet
from mmserve.entrypoints.openai.health import health_router, stats_router
from mmserve.entrypoints.openai.http_errors import install_error_handlers
from mmserve.entrypoints.openai.load import LoadCounter, ServerLoad, load_router
from mmserve.entrypoints.openai.metrics import ServerMetrics, cache_info
from mmserve.entrypoints.openai.models import models_router
from mmserve.entrypoints.openai.pooling_routes import pooling_router, runner_guard
from mmserve.entrypoints.openai.protocol import RequestError
from mmserve.entrypoints.openai.responses import responses_router
from mmserve.entrypoints.openai.responses_store import ResponseStore
from mmserve.entrypoints.openai.serving import OpenAIServing, ServerConfig
from mmserve.entrypoints.openai.stats_log import log_stats_every
from mmserve.entrypoints.openai.tokens import tokens_router
from mmserve.entrypoints.openai.trace_middleware import TraceMiddleware
from mmserve.entrypoints.openai.web_ui import web_ui_router

logger = logging.getLogger("mmserve.server")


def _auth_dependency(api_key: str | None) -> Callable[[Request], Any]:
    """The API key, sent as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>`
    (Anthropic's)."""
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        for sent in (bearer, request.headers.get("x-api-key")):
            if sent is not None and hmac.compare_digest(sent.strip().encode(), api_key.encode()):
                return
        raise RequestError("Incorrect or missing API key; send 'Authorization: Bearer <key>' or "
                           "'x-api-key: <key>'.", status_code=401, code="invalid_api_key")
    return check


def _include_routes(app: FastAPI, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    """Each endpoint module's routes; adding an endpoint is adding its router here."""
    client, config = serving.client, serving.config
    auth = [Depends(_auth_dependency(config.api_key))]
    # each runner's routes answer a server of the other runner with a 400 naming the runner that serves them
    generating = [*auth, Depends(runner_guard(serving, "generate"))]
    for router in (chat_router(serving), completions_router(serving), messages_router(serving),
                   responses_router(serving, app.state.response_store)):
        app.include_router(router, prefix="/v1", dependencies=generating)
    for router in (models_router(serving), stats_router(client)):
        app.include_router(router, prefix="/v1", dependencies=auth)
    pooling_v1, pooling_root = pooling_router(serving)
    pooling = [*auth, Depends(runner_guard(serving, "pooling"))]
    app.include_router(pooling_v1, prefix="/v1", dependencies=pooling)
    app.include_router(pooling_root, dependencies=pooling)
    app.include_router(tokens_router(serving), dependencies=auth)
    if config.web_ui:  # the chat page and its files need no API key: the user types it into the page
        # the media the page offers to attach: what the model takes, less what --limit-mm-per-prompt turns off
        takes = [m for m in getattr(client.frontend.processor, "modalities", ())
                 if config.media.limit_per_prompt.get(m, 1) > 0]
        app.include_router(web_ui_router(config.demo_model, api_key_required=config.api_key is not None,
                                         input_modalities=takes))
    app.include_router(health_router(client, metrics))


def build_app(client: EngineClient, config: ServerConfig) -> FastAPI:
    """A FastAPI app serving `client` (one engine, or replicas already launched); its lifespan starts and
    stops the client's engine thread or replicas."""
    frontend = client.frontend
    metrics = ServerMetrics(config.served_model_name, frontend.max_model_len, cache_info(frontend.config.cache))
    client.observe(metrics.observe, metrics.observe_encoded, metrics.vllm.observe_step)
    metrics.attach_engine_stats(client.stats)
    serving = OpenAIServing(client, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client.start()
        interval = config.log_stats_interval_s
        stats_task = None if not interval else asyncio.create_task(log_stats_every(client.stats, interval, asyncio.sleep))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            client.shutdown()

    app = FastAPI(title="mmserve", summary="OpenAI-compatible server for vision-language models",
                  lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.serving = client, metrics, serving
    app.state.response_store = ResponseStore(config.response_store_bytes, config.response_store_age_s,
                                             config.response_chain_depth)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    if client.tracing is not None:  # outermost: the span covers the whole exchange
        app.add_middleware(TraceMiddleware, tracing=client.tracing)
    if config.request_id_headers:
        @app.middleware("http")
        async def request_id_header(request: Request, call_next: Callable[[Request], Any]) -> Response:
            """X-Request-Id on every answer: the client's own, else a new one (vLLM's flag)."""
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            response = await call_next(request)
            response.headers["X-Request-Id"] = request_id
            return response
    app.add_middleware(HeadAsGet)
    cors = config.cors
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins), allow_methods=list(cors.allowed_methods),
                       allow_headers=list(cors.allowed_headers), allow_credentials=cors.allow_credentials)
    load = LoadCounter()
    if config.server_load_tracking:  # vLLM's --enable-server-load-tracking; GET /load answers either way
        app.add_middleware(ServerLoad, counter=load)
    install_error_handlers(app)
    _include_routes(app, serving, metrics)
    app.include_router(load_router(load))
    # vLLM's --root-path: FastAPI's root_path, read at routing time, so the app answers both under the
    # prefix (/llm/v1/models: a proxy that passes the path on) and without it (a proxy that strips it)
    app.root_path = config.root_path
    return app


def _shutdown_margin_s(timeout_s: float) -> float:
    """How long before uvicorn's graceful-shutdown timeout the requests still running are cut off, so
    that each still gets its error answer before uvicorn cancels what is left."""
    return min(0.5, timeout_s / 4)


class PortTakenError(OSError):
    """The server's address cannot be bound (in use, not this machine's, or a port below 1024)."""


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and not yet listening, as uvicorn and vLLM bind theirs (SO_REUSEADDR,
    so a restart is not refused for the last run's connections in TIME_WAIT). The CLI binds before loading
    the model, so a taken port fails at once; until `serve` listens, connections are refused (vLLM's
    behaviour: a client's wait loop sees "refused" until the server is ready, never a hanging request)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise PortTakenError(exc.errno, f"cannot serve on {host}:{port}: {reason}") from None
    return sock


def serve(client: EngineClient, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", shutdown_timeout_s: float = 30.0,
          on_ready: Callable[[], None] | None = None, sock: socket.socket | None = None) -> None:
    """Serve until interrupted (blocks) on `sock` (bound by `bind_port`; None: host:port is bound here);
    `on_ready` runs once the port listens and requests are
    answered (the CLI prints its start-up summary there). On SIGTERM or Ctrl-C the server stops accepting connections,
    lets the requests in flight finish for up to `shutdown_timeout_s`, then fails the rest with a 503
    `server_shutting_down` error (an error event on a stream) and aborts them in the engine, stops the
    engine and its workers, and returns."""
    import uvicorn

    app = build_app(client, config)

    def cut_off() -> None:
        error = ShuttingDownError(f"the server is shutting down: the request was still running after the "
                                  f"{shutdown_timeout_s:g} s shutdown timeout and was aborted")
        if cut := client.abort_all(error):
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
            if sockets is not None and self.started:  # uvicorn's line, which it leaves out for given sockets
                self._log_started_message(sockets)
            if on_ready is not None and self.started:  # not when binding the port failed
                on_ready()

    sock = sock if sock is not None else bind_port(host, port)
    logger.info("serving %s on %s://%s:%d", config.served_model_name, "https" if config.tls else "http", host,
                sock.getsockname()[1])
    # uvicorn shuts down gracefully on SIGTERM and SIGINT (Ctrl-C), then re-raises the signal under the handler
    # it found: a handler that does nothing lets the process end normally (exit 0) instead of dying by the
    # signal or raising KeyboardInterrupt (exit 130)
    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stops}
    try:
        # no root_path for uvicorn: it would prepend it to every path, and /llm/v1/... would miss (the app has it)
        GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                      timeout_graceful_shutdown=shutdown_timeout_s,
                                      **(config.tls.uvicorn_kwargs() if config.tls else {}))).run(sockets=[sock])
    finally:
        for sig in stops:
            signal.signal(sig, previous[sig])
    logger.info("server stopped")
