"""The server's state: GET /health, GET /metrics (Prometheus) and GET /v1/stats (the same numbers as JSON).

Role: /health answers 200 `ok`, 200 `degraded` (some replicas or every encoder worker down: the rest still
serve) or 503 when no engine runs; /metrics renders the server's `ServerMetrics`; /v1/stats asks the
client for its counters as of now (with replicas: summed, plus each replica's and the router's).
What it does not know: how requests are served, authentication (the app puts /v1/stats behind the key).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mmserve.engine.client import EngineClient
from mmserve.entrypoints.openai.http_errors import error_response
from mmserve.entrypoints.openai.metrics import ServerMetrics


def stats_router(client: EngineClient) -> APIRouter:
    """/stats (the app mounts it under /v1, behind the API key)."""
    router = APIRouter()

    @router.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's counters (the JSON twin of /metrics): KV blocks, encoder cache, requests; with
        replicas, summed, plus each replica's and the router's."""
        return await client.current_stats()

    return router


def health_router(client: EngineClient, metrics: ServerMetrics) -> APIRouter:
    """/health and /metrics (no API key: probes and scrapers hold none)."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not client.is_running:
            return error_response(503, "the engine is not running", "server_error")
        stats = client.stats()
        if stats.get("replicas_alive", 1) < stats.get("replicas_total", 1):  # the others still serve
            return JSONResponse({"status": "degraded", "reason": f"{stats['replicas_alive']} of "
                                 f"{stats['replicas_total']} replicas are alive"}, status_code=200)
        if stats.get("encoder_workers_alive", 1) == 0:  # text still served; images wait or time out
            return JSONResponse({"status": "degraded", "reason": "no encoder worker is alive"}, status_code=200)
        return JSONResponse({"status": "ok"}, status_code=200)

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
