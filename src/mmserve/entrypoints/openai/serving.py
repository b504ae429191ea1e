"""What every generation endpoint shares: prompt processing, submission, and answering.

Role: `ServerConfig` (the server's own settings) and `OpenAIServing`, the core the endpoint modules
(chat.py, completions.py, tokens.py, ...) are built over: check the model name, run a function on a
worker thread (media), cut a prompt by truncate_prompt_tokens, map the request to `SamplingParams`,
compile its grammar off the loop, submit it to the `EngineClient` and await the first output (so a
request the engine refuses is still an HTTP error), then answer with one response or a server-sent-event
stream (streaming.py). A client that goes away aborts its request: a stream is cancelled by Starlette; a
non-streaming request races its generation against `http.disconnect`.

What it does not know: any one endpoint's request or response shape, routing, authentication, metrics,
how media is fetched or decoded, whether one engine or many serve.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from mmserve.engine.client import EngineClient
from mmserve.engine.generation_defaults import SAMPLING_FIELDS, with_defaults
from mmserve.engine.prompts import check_cache_salt, truncated_token_ids
from mmserve.entrypoints.openai.beam import run_beam
from mmserve.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BYTES
from mmserve.entrypoints.openai.logprobs import named_by_id
from mmserve.entrypoints.openai.media import MediaRules
from mmserve.entrypoints.openai.protocol import RequestError
from mmserve.entrypoints.openai.reasoning import ThoughtStart
from mmserve.entrypoints.openai.responses_store import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_CHAIN_DEPTH,
)
from mmserve.entrypoints.openai.streaming import StreamCursor, failed, stream_events
from mmserve.entrypoints.openai.tool_formats import ToolFormat
from mmserve.entrypoints.openai.tools import ToolRequest
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import StructuredOutputsParams

T = TypeVar("T")
CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request": nobody reads it, the logs do


@dataclass(frozen=True)
class ServerConfig:
    """What the server was asked to be (the CLI's server flags): the names it answers to, its media rules,
    its key, limits and optional routes."""

    served_model_name: str
    media: MediaRules
    api_key: str | None = None
    extra_model_names: tuple[str, ...] = field(default=())  # also accepted in `model` (e.g. the path)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is refused (413) before it is read
    web_ui: bool = True  # the chat page at `/` (web_ui.py)
    demo_model: bool = False  # the bundled demo model is served: the page may draw shapes pictures for it
    return_tokens_as_token_ids: bool = False  # logprobs name tokens as "token_id:N"
    request_id_headers: bool = False  # answer with X-Request-Id
    root_path: str = ""  # the prefix a proxy serves the app under
    tokenizer_info: bool = False  # GET /tokenizer_info (vLLM's; off by default: it shows the chat template)
    force_include_usage: bool = False  # every stream ends with its usage, asked or not (vLLM's flag)
    server_load_tracking: bool = False  # count generation requests in flight for GET /load (vLLM's flag)
    cors: CorsPolicy = field(default_factory=lambda: CorsPolicy())  # vLLM's CORS flags; its defaults
    tls: TlsFiles | None = None  # vLLM's --ssl-* flags: https instead of http
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser: the call syntax by name (None: the template's)
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser: gemma4 names Gemma 4's thought channel (any
    # other name, or None: the tags the template writes)
    # the Responses API's store of responses for previous_response_id (responses_store.py): its limits
    response_store_bytes: int = DEFAULT_MAX_BYTES
    response_store_age_s: float = DEFAULT_MAX_AGE_S
    response_chain_depth: int = DEFAULT_MAX_CHAIN_DEPTH
    log_stats_interval_s: float | None = None  # the periodic stats lines (stats_log.py); None: none (the CLI: 10 s)


@dataclass(frozen=True)
class CorsPolicy:
    """Which cross-origin browser calls the API answers (vLLM's --allowed-origins & co., the same defaults:
    any origin, method and header, no credentials)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class TlsFiles:
    """The server's TLS files (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs), as
    uvicorn takes them; checked when the server starts listening."""

    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = 0  # ssl.CERT_NONE; 1: optional, 2: required

    def uvicorn_kwargs(self) -> dict[str, object]:
        return {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs}


def raise_if_failed(output: RequestOutput) -> None:
    """A failed request as its HTTP error: 500 where the engine failed it, else 400."""
    if failed(output):
        if output.internal_error:  # the engine's fault, not the request's: 500, and the engine serves on
            raise RequestError(output.error or "internal error", status_code=500, type="server_error",
                               code="internal_error")
        raise RequestError(output.error or "the request failed", param=None, code="request_rejected")


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], raw: Request) -> T:
    """Await `work`, but cancel it (which aborts its request) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise RequestError("the client disconnected", status_code=CLIENT_CLOSED_STATUS)


async def last_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The request's finished output (the outputs before it are passed over)."""
    last = None
    async for output in outputs:
        last = output
    assert last is not None and last.finished
    return last


class OpenAIServing:
    """The shared core of the endpoints, over one `EngineClient` (one engine or many: it never asks which)."""

    def __init__(self, client: EngineClient, config: ServerConfig) -> None:
        self.client = client
        self.config = config
        self.max_model_len = client.frontend.max_model_len
        self.tracing = client.tracing  # None: no spans (trace_middleware.py opens the request's)

    def names(self, entries: list, body: Any = None) -> list:
        """Logprob entries as the responses name their tokens: text, or "token_id:N" with the request's
        return_tokens_as_token_ids (unset: the server's flag)."""
        return named_by_id(entries) if self.token_ids_named(body) else entries

    def token_ids_named(self, body: Any = None) -> bool:
        asked = getattr(body, "return_tokens_as_token_ids", None)
        return self.config.return_tokens_as_token_ids if asked is None else asked

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.config.served_model_name, *self.config.extra_model_names)

    def check_model(self, name: str | None) -> str:
        """The served model's name: `model` absent or empty means it (vLLM answers so too)."""
        if name and name not in self.model_names:
            raise RequestError(f"The model `{name}` does not exist.", status_code=404, param="model",
                               code="model_not_found")
        return self.config.served_model_name

    def traced(self, name: str, raw: Request) -> contextlib.AbstractContextManager[Any]:
        """A child span of the request's (a no-op without tracing)."""
        trace_parent = getattr(raw.state, "trace_parent", None)
        if self.tracing is None or trace_parent is None:
            return contextlib.nullcontext()
        return self.tracing.span(name, trace_parent)

    async def in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread (media fetching and decoding block)."""
        return await asyncio.get_running_loop().run_in_executor(None, partial(fn, *args))

    async def _truncated(self, prompt: ProcessedPrompt, keep: int | None, side: str | None = None) -> ProcessedPrompt:
        """The prompt cut by truncate_prompt_tokens (at `side`) before its max_tokens default is taken (the
        engine's rule: engine/prompts.py), processed again as token ids."""
        try:
            cut = truncated_token_ids(prompt, keep, self.max_model_len, side)
        except InvalidInputError as exc:
            raise RequestError(str(exc), param=exc.param,
                               code="unsupported_parameter" if prompt.items else None) from exc
        if cut is None:
            return prompt
        truncated = await self.client.process({"prompt_token_ids": cut})
        truncated.cache_salt = prompt.cache_salt
        return truncated

    async def start(self, request_id: str, prompt: ProcessedPrompt, body: Any, raw: Request,
                    arrival_time: float, tool_grammar: StructuredOutputsParams | None = None,
                    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Submit and wait for the first output, so refusals are still HTTP errors. `tool_grammar`: the
        grammar of a forced tool choice."""
        prompt = await self._truncated(prompt, body.truncate_prompt_tokens, body.truncation_side)
        prompt.cache_salt = check_cache_salt(body.cache_salt)
        if body.use_beam_search:
            if tool_grammar is not None:
                raise RequestError("a required or named tool_choice is not supported with use_beam_search",
                                   param="tool_choice", code="unsupported_parameter")
            return await unless_disconnected(run_beam(self.client, request_id, prompt, body, self.max_model_len,
                                                      getattr(raw.state, "trace_parent", None)), raw)
        params = body.sampling_params(self.max_model_len, prompt.num_tokens)
        # generation_config.json's defaults where the request left a field unset (vLLM's --generation-config)
        unset = [name for name in SAMPLING_FIELDS.values() if name != "max_tokens" and getattr(body, name) is None]
        unset += ["max_tokens"] if body.requested_max_tokens() is None else []
        params = with_defaults(params, unset, self.client.frontend.default_sampling)
        if tool_grammar is not None:
            params = replace(params, structured_outputs=tool_grammar)
        if params.structured_outputs is not None:  # compiled off the engine's loop; refused as a 400
            try:
                await asyncio.wrap_future(self.client.frontend.structured.compile(params.structured_outputs))
            except InvalidInputError as exc:
                field_name = "tools" if tool_grammar is not None else body.structured()[1]
                raise RequestError(str(exc).replace("structured_outputs", field_name, 1), param=field_name) from exc
        outputs = self.client.generate(request_id, prompt, params, arrival_time, restartable=not body.stream,
                                       trace_parent=getattr(raw.state, "trace_parent", None))
        first = await unless_disconnected(anext(outputs), raw)
        if failed(first):
            await outputs.aclose()
            raise_if_failed(first)
        return first, outputs

    async def respond(self, request_id: str, model: str, body: Any, raw: Request, first: RequestOutput,
                      outputs: AsyncIterator[RequestOutput], chunks: Callable[..., list[BaseModel]],
                      whole: Callable[[RequestOutput], BaseModel], echo: Callable | None = None,
                      tools: tuple[ToolRequest, ToolFormat] | None = None,
                      in_thought: bool | ThoughtStart | None = None,
                      role: str = "assistant") -> Any:
        """Finish one submitted request: server-sent events rendered by `chunks`, or the answer built by
        `whole`."""
        if body.stream:
            include_usage, continuous_usage = body.stream_usage(self.config.force_include_usage)
            render = partial(chunks, request_id, model, include_usage,
                             StreamCursor(body.requested_logprobs(), echo, continuous_usage,
                                          partial(self.names, body=body),
                                          body.return_token_ids, tools, in_thought=in_thought, role=role))
            return StreamingResponse(stream_events(first, outputs, render), media_type="text/event-stream")
        final = first if first.finished else await unless_disconnected(last_output(outputs), raw)
        raise_if_failed(final)
        return JSONResponse(whole(final).model_dump())
