"""One error shape for every failure: OpenAI's `{"error": {"message", "type", "param", "code"}}` (and
under /v1/messages Anthropic's, `{"type": "error", "error": {"type", "message"}}`).

Role: the app's exception handlers — 400 for bad input (malformed JSON and schema errors included, the
field named in `param` as `messages[0].content`), a `RequestError`'s own status (401, 404, 413, 499,
500), the router's 404 and 405 naming the route and method, 503 when the engine is down — and the error a request or a stream gets when the engine stopped
under it or the shutdown timeout cut it off (`engine_error`). A refusal (4xx) is logged with its reason.
A request to Anthropic's Messages routes (`is_messages_path`) gets the same statuses in Anthropic's shape:
the type told by the status (invalid_request_error, authentication_error, not_found_error, ...), the
field named in the message as Anthropic names it (`messages.0.content.1.source: ...`); `error_body` is
the one choice of shape (body_limit.py's 413 takes it too).
What it does not know: routes (but which paths speak Anthropic's errors), the engine, how a request is
served.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmserve.engine.client import EngineDeadError, ShuttingDownError
from mmserve.entrypoints.openai.anthropic_protocol import (
    AnthropicErrorInfo,
    AnthropicErrorResponse,
    anthropic_error_type,
    validation_message,
)
from mmserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, RequestError
from mmserve.errors import InvalidInputError

logger = logging.getLogger("mmserve.server")
# Anthropic's Messages routes (under any --root-path prefix): their errors are said in Anthropic's shape
_MESSAGES_PATH = re.compile(r"/v1/messages(/|$)")


def engine_error(exc: EngineDeadError) -> ErrorInfo:
    """The error a request gets when the engine stopped under it, or the shutdown timeout cut it off."""
    return ErrorInfo(message=str(exc), type="server_error",
                     code="server_shutting_down" if isinstance(exc, ShuttingDownError) else "engine_dead")


def is_messages_path(path: str) -> bool:
    """Is this a path of Anthropic's Messages routes (whose errors are said in Anthropic's shape)?"""
    return _MESSAGES_PATH.search(path) is not None


def error_body(path: str, status_code: int, message: str, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The error body a request to `path` gets: Anthropic's shape on its Messages routes (the field named
    in the message, the type told by the status), else OpenAI's."""
    if is_messages_path(path):
        named = message if not param or param in message else f"{param}: {message}"
        return AnthropicErrorResponse(error=AnthropicErrorInfo(type=anthropic_error_type(status_code),
                                                               message=named)).model_dump()
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


def error_response(status_code: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, request: Request | None = None) -> JSONResponse:
    """The error body (OpenAI's, or Anthropic's for its routes) with `status_code`; a 4xx is logged (with
    `request`) as the request's own fault."""
    if request is not None and 400 <= status_code < 500:  # the request's own fault: why, for whoever reads the log
        logger.info("%s %s -> %d%s: %s", request.method, request.url.path, status_code,
                    f" ({param})" if param else "", message)
    path = request.url.path if request is not None else ""
    body = error_body(path, status_code, message, type, param, code)
    return JSONResponse(body, status_code=status_code)


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
    if is_messages_path(request.url.path):  # Anthropic's style: messages.0.content.1.source
        message, param = validation_message(errors, getattr(exc, "body", None))
        return error_response(400, message, param=param, request=request)
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

    async def engine_dead(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EngineDeadError)
        info = engine_error(exc)
        return JSONResponse(error_body(request.url.path, 503, info.message, info.type, code=info.code),
                            status_code=503)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        return _validation_error(request, exc)

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(InvalidInputError, invalid_input)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(EngineDeadError, engine_dead)
