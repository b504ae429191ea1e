"""One error shape for every failure: OpenAI's `{"error": {"message", "type", "param", "code"}}`.

Role: the app's exception handlers — 400 for bad input (malformed JSON and schema errors included, the
field named in `param` as `messages[0].content`), a `RequestError`'s own status (401, 404, 413, 499,
500), the router's 404 and 405 naming the route and method, 503 when the engine is down — and the error a request or a stream gets when the engine stopped
under it or the shutdown timeout cut it off (`engine_error`). A refusal (4xx) is logged with its reason.
What it does not know: routes, the engine, how a request is served.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmserve.engine.client import EngineDeadError, ShuttingDownError
from mmserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, RequestError
from mmserve.errors import InvalidInputError

logger = logging.getLogger("mmserve.server")


def engine_error(exc: EngineDeadError) -> ErrorInfo:
    """The error a request gets when the engine stopped under it, or the shutdown timeout cut it off."""
    return ErrorInfo(message=str(exc), type="server_error",
                     code="server_shutting_down" if isinstance(exc, ShuttingDownError) else "engine_dead")


def error_response(status_code: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, request: Request | None = None) -> JSONResponse:
    """OpenAI's error body with `status_code`; a 4xx is logged (with `request`) as the request's own fault."""
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
        return error_response(400, f"the request body is not valid JSON: {first.get('msg', '')}",
                              code="invalid_json", request=request)
    message = "; ".join(f"{where(e)}: {e.get('msg')}" for e in errors[:5]) or "invalid request"
    return error_response(400, message, param=where(first) or None, request=request)


def _routing_message(request: Request, exc: StarletteHTTPException) -> tuple[str, str | None]:
    """The router's own 404 and 405 (no route, or not this method) said with the route and method; any
    other HTTP error keeps its detail."""
    if str(exc.detail) != HTTPStatus(exc.status_code).phrase:
        return str(exc.detail), None
    path = request.url.path
    if exc.status_code == 404:
        return f"no route {path}: see GET /openapi.json for the routes this server answers", "route_not_found"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        method = "HEAD" if request.scope.get("head_request") else request.method
        return (f"method {method} is not allowed on {path}" + (f" (allowed: {allowed})" if allowed else ""),
                "method_not_allowed")
    return str(exc.detail), None


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answered in OpenAI's error shape."""
    async def request_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestError)
        return error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code, request)

    async def invalid_input(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidInputError)
        return error_response(400, _client_message(exc), param=exc.param, request=request)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message, code = _routing_message(request, exc)
        response = error_response(exc.status_code, message, kind, code=code, request=request)
        if exc.status_code == 405 and exc.headers and "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response

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
