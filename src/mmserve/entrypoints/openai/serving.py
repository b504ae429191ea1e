"""Chat and text completions: requests in, engine outputs out, as OpenAI responses or SSE streams.

Role: check the model name, resolve media (worker thread), process the prompt (worker thread),
map the request to `SamplingParams`, submit it to the `AsyncEngine`, and turn its incremental
outputs into one response or a server-sent-event stream (`stream_options.include_usage` adds a
last chunk with usage). The first output is awaited before a stream starts, so a request the
engine refuses is still an HTTP error. A client that goes away aborts its request: a stream is
cancelled by Starlette; a non-streaming request races its generation against `http.disconnect`.

What it does not know: routing, authentication, metrics, how media is fetched or decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from mmserve.engine.async_engine import AsyncEngine, EngineDeadError, ShuttingDownError
from mmserve.engine.prompts import check_cache_salt, truncated_token_ids
from mmserve.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BYTES
from mmserve.entrypoints.openai.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    joined,
    named_by_id,
    prompt_logprobs,
)
from mmserve.entrypoints.openai.media import MediaRules, resolve_media, resolve_messages
from mmserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    FunctionCall,
    PromptTokensDetails,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallModel,
    Usage,
)
from mmserve.entrypoints.openai.reasoning import ReasoningStream, opens_thought, split
from mmserve.entrypoints.openai.tools import ToolCallStream, ToolFormat, ToolRequest, parse_tools, tool_format
from mmserve.errors import InvalidInputError, at_param
from mmserve.inputs.chat_template import thinks
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import CompletionOutput, Logprob, RequestOutput
from mmserve.sampling_params import StructuredOutputsParams

T = TypeVar("T")
CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request": nobody reads it, the logs do


@dataclass(frozen=True)
class ServerConfig:
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


def _timings(output: RequestOutput, num_completion_tokens: int) -> dict[str, float | None]:
    """Time to first token (ms) and decode speed (tokens/s) from the engine's request metrics."""
    metrics = output.metrics
    if metrics is None or metrics.first_token_time is None:
        return {}
    decode_s = (metrics.finish_time or metrics.first_token_time) - metrics.first_token_time
    rate = (num_completion_tokens - 1) / decode_s if num_completion_tokens > 1 and decode_s > 0 else None
    return {"time_to_first_token_ms": round((metrics.first_token_time - metrics.arrival_time) * 1000, 3),
            "decode_tokens_per_s": None if rate is None else round(rate, 3)}


def _usage(output: RequestOutput) -> Usage:
    prompt, completion = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    # the timings are of the sequence the metrics belong to (the choice this output moved)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 **_timings(output, len(output.outputs[output.delta_index].token_ids)),
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=output.num_cached_tokens, mm_items=output.num_mm_items,
                     cached_mm_items=output.num_encoder_cached_mm_items,
                     prefix_cached_mm_items=output.num_prefix_cached_mm_items))


@dataclass
class _StreamCursor:
    """What a stream has sent of each choice: its role chunk, its logprob entries (each chunk carries the
    entries of the tokens new since the last), its text offset (completions) and its finish chunk."""

    num_logprobs: int | None  # top logprobs asked for (None: no logprobs)
    echo: Callable[[RequestOutput], tuple[str, CompletionLogprobs | None]] | None = None  # completions' echo
    continuous_usage: bool = False  # every chunk carries the usage so far
    names: Callable[[list], list] = list  # how entries name their tokens (text, or token ids)
    return_token_ids: bool = False  # chunks carry their new token ids (and the first, the prompt's)
    tools: tuple[ToolRequest, ToolFormat] | None = None  # chat with tools: calls are parsed out of the text
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)
    in_thought: bool | None = None  # a thinking template: does the answer start inside a thought?
    reasoning_streams: dict[int, ReasoningStream] = field(default_factory=dict)
    announced: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    sent: dict[int, int] = field(default_factory=dict)
    ids_sent: dict[int, int] = field(default_factory=dict)
    text_offset: dict[int, int] = field(default_factory=dict)

    def take(self, completion: CompletionOutput) -> tuple[list[int], list[dict[int, Logprob]]]:
        if self.num_logprobs is None or completion.logprobs is None:
            return [], []
        start = self.sent.get(completion.index, 0)
        self.sent[completion.index] = len(completion.logprobs)
        return completion.token_ids[start:len(completion.logprobs)], self.names(completion.logprobs[start:])

    def take_ids(self, completion: CompletionOutput) -> list[int] | None:
        """The choice's token ids not sent yet (with return_token_ids; else None)."""
        if not self.return_token_ids:
            return None
        start = self.ids_sent.get(completion.index, 0)
        self.ids_sent[completion.index] = len(completion.token_ids)
        return list(completion.token_ids[start:])

    def prompt_ids(self, output: RequestOutput, first: bool) -> list[int] | None:
        return list(output.prompt_token_ids) if self.return_token_ids and first else None

    def reasoning_stream(self, index: int) -> ReasoningStream:
        assert self.in_thought is not None
        if index not in self.reasoning_streams:
            self.reasoning_streams[index] = ReasoningStream(self.in_thought)
        return self.reasoning_streams[index]

    def tool_stream(self, index: int) -> ToolCallStream:
        assert self.tools is not None
        if index not in self.tool_streams:
            self.tool_streams[index] = ToolCallStream(self.tools[1], self.tools[0])
        return self.tool_streams[index]

    def first_chunk(self, index: int) -> bool:
        """Is this the choice's first chunk (then it announces the role)?"""
        new = index not in self.announced
        self.announced.add(index)
        return new

    def finishes(self, completion: CompletionOutput) -> bool:
        """Has the choice just finished (then its finish chunk goes out, once)?"""
        if completion.finish_reason is None or completion.index in self.finished:
            return False
        self.finished.add(completion.index)
        return True


def _failed(output: RequestOutput) -> bool:
    return any(c.finish_reason == "error" for c in output.outputs)


class _PromptBatch:
    """Several prompts' requests as one: choice j of prompt i is choice i * n + j; the last output holds
    every choice and counts every prompt's tokens."""

    def __init__(self, n: int, num_prompts: int) -> None:
        self.n = n
        self.latest: list[RequestOutput | None] = [None] * num_prompts
        self.failed: RequestOutput | None = None  # the first prompt's output that carried an error

    def reindex(self, i: int, output: RequestOutput) -> RequestOutput:
        self.latest[i] = output
        if output.error is not None and self.failed is None:
            self.failed = output
        if all(o is not None and o.finished for o in self.latest):
            every = [replace(c, index=p * self.n + c.index) for p, o in enumerate(self.latest) for c in o.outputs]
            ids = [t for o in self.latest for t in o.prompt_token_ids]
            failed = self.failed or output
            return replace(output, outputs=every, prompt_token_ids=ids, finished=True,
                           delta_index=i * self.n + output.delta_index, error=failed.error,
                           internal_error=failed.internal_error)
        return replace(output, outputs=[replace(c, index=i * self.n + c.index) for c in output.outputs],
                       finished=False)

    async def merged(self, started: list[tuple[RequestOutput, AsyncIterator[RequestOutput]]]
                     ) -> AsyncIterator[RequestOutput]:
        """The prompts' first outputs after the first, then every output as it comes; closing it closes
        (and so aborts) every prompt's request."""
        pending: dict[asyncio.Future, int] = {}
        try:
            for i, (first, _) in enumerate(started[1:], start=1):
                yield self.reindex(i, first)
            pending = {asyncio.ensure_future(anext(outputs)): i for i, (first, outputs) in enumerate(started)
                       if not first.finished}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    output = task.result()
                    if not output.finished:
                        pending[asyncio.ensure_future(anext(started[i][1]))] = i
                    yield self.reindex(i, output)
        finally:
            for task in pending:
                task.cancel()
            # a generator is closed only once its cancelled step has ended (else: "already running")
            await asyncio.gather(*pending, return_exceptions=True)
            for _, outputs in started:
                with contextlib.suppress(Exception):
                    await outputs.aclose()


def _parsed_tool_arguments(messages: Any) -> Any:
    """The messages with assistant tool calls' `arguments` as objects, as templates render them (OpenAI
    sends them as JSON text; vLLM parses them the same way); text that is not JSON is left as it is."""
    if not isinstance(messages, list):
        return messages
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            parsed = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    try:
                        call = {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
                    except ValueError:
                        pass
                parsed.append(call)
            message = {**message, "tool_calls": parsed}
        out.append(message)
    return out


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def engine_error(exc: EngineDeadError) -> ErrorInfo:
    """The error a request gets when the engine stopped under it, or the shutdown timeout cut it off."""
    return ErrorInfo(message=str(exc), type="server_error",
                     code="server_shutting_down" if isinstance(exc, ShuttingDownError) else "engine_dead")


def _raise_if_failed(output: RequestOutput) -> None:
    if _failed(output):
        if output.internal_error:  # the engine's fault, not the request's: 500, and the engine serves on
            raise RequestError(output.error or "internal error", status_code=500, type="server_error",
                               code="internal_error")
        raise RequestError(output.error or "the request failed", param=None, code="request_rejected")


async def _wait_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(work: Awaitable[T], raw: Request) -> T:
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


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in outputs:
        last = output
    assert last is not None and last.finished
    return last


async def _stream_events(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                         render: Callable[[RequestOutput], list[BaseModel]]) -> AsyncIterator[str]:
    """SSE lines for each output (`render(output)` makes its chunks), an error event if the request fails
    mid-stream, then `[DONE]`. Closing this iterator closes `outputs`, which aborts the request."""
    async with contextlib.aclosing(outputs):
        output = first
        try:
            while True:
                if _failed(output):
                    error = ErrorInfo(message=output.error or "the request failed", type="server_error")
                    yield _sse(ErrorResponse(error=error))
                    break
                for chunk in render(output):
                    yield _sse(chunk)
                if output.finished:
                    break
                output = await anext(outputs)
        except EngineDeadError as exc:
            yield _sse(ErrorResponse(error=engine_error(exc)))
        yield "data: [DONE]\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.max_model_len = engine.frontend.max_model_len
        self.tracing = engine.tracing  # None: no spans (trace_middleware.py opens the request's)

    def _names(self, entries: list) -> list:
        """Logprob entries as the responses name their tokens: text, or "token_id:N" with the flag."""
        return named_by_id(entries) if self.config.return_tokens_as_token_ids else entries

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.config.served_model_name, *self.config.extra_model_names)

    def _check_model(self, name: str | None) -> str:
        """The served model's name: `model` absent or empty means it (vLLM answers so too)."""
        if name and name not in self.model_names:
            raise RequestError(f"The model `{name}` does not exist.", status_code=404, param="model",
                               code="model_not_found")
        return self.config.served_model_name

    def _traced(self, name: str, raw: Request) -> contextlib.AbstractContextManager[Any]:
        """A child span of the request's (a no-op without tracing)."""
        trace_parent = getattr(raw.state, "trace_parent", None)
        if self.tracing is None or trace_parent is None:
            return contextlib.nullcontext()
        return self.tracing.span(name, trace_parent)

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, partial(fn, *args))

    async def _truncated(self, prompt: ProcessedPrompt, keep: int | None) -> ProcessedPrompt:
        """The prompt cut by truncate_prompt_tokens before its max_tokens default is taken (the engine's
        rule: engine/prompts.py), processed again as token ids."""
        try:
            cut = truncated_token_ids(prompt, keep, self.max_model_len)
        except InvalidInputError as exc:
            raise RequestError(str(exc), param=exc.param,
                               code="unsupported_parameter" if prompt.items else None) from exc
        if cut is None:
            return prompt
        truncated = await self.engine.process({"prompt_token_ids": cut})
        truncated.cache_salt = prompt.cache_salt
        return truncated

    async def _start(self, request_id: str, prompt: ProcessedPrompt, body: Any, raw: Request,
                     arrival_time: float, tool_grammar: StructuredOutputsParams | None = None,
                     ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Submit and wait for the first output, so refusals are still HTTP errors. `tool_grammar`: the
        grammar of a forced tool choice."""
        prompt = await self._truncated(prompt, body.truncate_prompt_tokens)
        params = body.sampling_params(self.max_model_len, prompt.num_tokens)
        if tool_grammar is not None:
            params = replace(params, structured_outputs=tool_grammar)
        prompt.cache_salt = check_cache_salt(body.cache_salt)
        if params.structured_outputs is not None:  # compiled off the engine's loop; refused as a 400
            try:
                await asyncio.wrap_future(self.engine.frontend.structured.compile(params.structured_outputs))
            except InvalidInputError as exc:
                field_name = "tools" if tool_grammar is not None else body.structured()[1]
                raise RequestError(str(exc).replace("structured_outputs", field_name, 1), param=field_name) from exc
        outputs = self.engine.generate(request_id, prompt, params, arrival_time, restartable=not body.stream,
                                       trace_parent=getattr(raw.state, "trace_parent", None))
        first = await _unless_disconnected(anext(outputs), raw)
        if _failed(first):
            await outputs.aclose()
            _raise_if_failed(first)
        return first, outputs

    # ---- chat -------------------------------------------------------------------------------------
    async def _chat_prompt(self, body: ChatCompletionRequest, tools: ToolRequest | None = None) -> ProcessedPrompt:
        messages = await self._in_worker(resolve_messages, _parsed_tool_arguments(body.messages), self.config.media,
                                         body.mm_processor_kwargs)
        template_kwargs = {} if tools is None else {"tools": list(tools.template_tools)}
        return await self.engine.process_chat(messages, body.mm_processor_kwargs,
                                              add_generation_prompt=body.add_generation_prompt,
                                              continue_final_message=body.continue_final_message, **template_kwargs)

    def _tools(self, body: ChatCompletionRequest) -> tuple[ToolRequest, ToolFormat] | None:
        """The request's tools and the model's call syntax (None: no tools), or a 400 naming the field."""
        try:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except InvalidInputError as exc:
            raise RequestError(str(exc), param=exc.param) from exc
        if tools is None:
            return None
        fmt = tool_format(self.engine.frontend.processor.tokenizer.chat_template)
        if fmt is None:
            raise RequestError("this model's chat template renders no tools, so it cannot call them", param="tools",
                               code="unsupported_parameter")
        if tools.forced and body.structured()[0] is not None:
            raise RequestError("tool_choice required or a named function is a grammar of its own: it cannot be "
                               "combined with response_format or structured_outputs", param="tool_choice")
        return tools, fmt

    def _in_thought(self, output: RequestOutput) -> bool | None:
        """For a thinking template: does the answer start inside a thought (None: the template does not think)?"""
        tokenizer = self.engine.frontend.processor.tokenizer
        if not thinks(tokenizer.chat_template):
            return None
        return opens_thought(tokenizer.decode(list(output.prompt_token_ids[-8:]), skip_special_tokens=False))

    @staticmethod
    def _message(completion: CompletionOutput, tools: tuple[ToolRequest, ToolFormat] | None,
                 in_thought: bool | None = None) -> tuple[ChatMessage, str | None]:
        """The choice's message (its thought apart, its calls parsed out, where the request has tools) and
        finish reason."""
        reasoning, text = (None, completion.text) if in_thought is None else split(completion.text, in_thought)
        if tools is None or tools[0].choice == "none":
            return ChatMessage(content=text, reasoning_content=reasoning), completion.finish_reason
        content, calls = tools[1].parse(text, tools[0])
        if not calls:
            return ChatMessage(content=text, reasoning_content=reasoning), completion.finish_reason
        message = ChatMessage(content=content, reasoning_content=reasoning, tool_calls=[
            ToolCallModel(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])
        return message, "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Any:
        arrival_time = time.time()
        model = self._check_model(body.model)
        request_id = raw.state.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        # the media and the processed prompt live in no frame of this request past submission: once
        # encoded, the engine releases the pixels and nothing else holds them
        tools = self._tools(body)
        grammar = None
        if tools is not None and tools[0].forced:
            grammar = StructuredOutputsParams(structural_tag=tools[1].structural_tag(tools[0]))
        with self._traced("media_load", raw):  # fetching and decoding the media, the template, the processor
            prompt = await self._chat_prompt(body, tools and tools[0])
        first, outputs = await self._start(request_id, prompt, body, raw, arrival_time, grammar)

        num_logprobs = body.requested_logprobs()
        in_thought = self._in_thought(first)

        def whole(final: RequestOutput) -> BaseModel:
            choices = []
            for c in final.outputs:
                message, finish_reason = self._message(c, tools, in_thought)
                choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                          logprobs=None if num_logprobs is None else chat_logprobs(
                                              c.token_ids, self._names(c.logprobs), num_logprobs),
                                          token_ids=list(c.token_ids) if body.return_token_ids else None))
            return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(final),
                                          prompt_logprobs=None if body.prompt_logprobs is None
                                          else prompt_logprobs(self._names(final.prompt_logprobs)),
                                          prompt_token_ids=list(final.prompt_token_ids) if body.return_token_ids
                                          else None)

        return await self._respond(request_id, model, body, raw, first, outputs, self._chat_chunks, whole,
                                   tools=tools if tools is not None and tools[0].choice != "none" else None,
                                   in_thought=in_thought)

    async def _respond(self, request_id: str, model: str, body: Any, raw: Request, first: RequestOutput,
                       outputs: AsyncIterator[RequestOutput], chunks: Callable[..., list[BaseModel]],
                       whole: Callable[[RequestOutput], BaseModel], echo: Callable | None = None,
                       tools: tuple[ToolRequest, ToolFormat] | None = None, in_thought: bool | None = None) -> Any:
        """Finish one submitted request: server-sent events rendered by `chunks`, or the answer built by
        `whole`."""
        if body.stream:
            render = partial(chunks, request_id, model, body.include_usage,
                             _StreamCursor(body.requested_logprobs(), echo, body.continuous_usage, self._names,
                                           body.return_token_ids, tools, in_thought=in_thought))
            return StreamingResponse(_stream_events(first, outputs, render), media_type="text/event-stream")
        final = first if first.finished else await _unless_disconnected(_last(outputs), raw)
        _raise_if_failed(final)
        return JSONResponse(whole(final).model_dump())

    @staticmethod
    def _chat_chunks(request_id: str, model: str, include_usage: bool, cursor: _StreamCursor,
                     output: RequestOutput) -> list[BaseModel]:
        """The chunks of the choice this output moved (`delta_index`): its role first, as OpenAI's
        stream has it, then its text and logprobs, then its finish reason; the usage after the last."""
        completion = output.outputs[output.delta_index]
        index = completion.index
        choices = []
        first = cursor.first_chunk(index)
        if first:
            choices.append(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""),
                                           token_ids=[] if cursor.return_token_ids else None))
        token_ids, entries = cursor.take(completion)
        new_ids = cursor.take_ids(completion)
        text, calls, finish_reason = output.delta_text, [], completion.finish_reason
        finished, thought, answer = completion.finish_reason is not None, "", completion.text
        if cursor.in_thought is not None:  # the thought as reasoning, then the answer
            reasoning = cursor.reasoning_stream(index)
            thought, answer = reasoning.update(completion.text, finished)
            text = reasoning.take_content(answer)
        if cursor.tools is not None:  # content until a call may begin; each call whole once its end arrives
            stream = cursor.tool_stream(index)
            text, calls = stream.update(answer, finished)
            if stream.calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if text or thought or entries or new_ids:
            logprobs = chat_logprobs(token_ids, entries, cursor.num_logprobs) if entries else None
            choices.append(ChatChunkChoice(index=index, delta=DeltaMessage(content=text, reasoning_content=thought or None),
                                           logprobs=logprobs, token_ids=new_ids))
        for i, call in calls:  # id and name first, then the arguments, as OpenAI streams them
            for delta in (DeltaToolCall(index=i, id=call.id, type="function",
                                        function=FunctionCall(name=call.name, arguments="")),
                          DeltaToolCall(index=i, function=FunctionCall(arguments=call.arguments))):
                choices.append(ChatChunkChoice(index=index, delta=DeltaMessage(tool_calls=[delta])))
        if cursor.finishes(completion):
            choices.append(ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason=finish_reason,
                                           token_ids=[] if cursor.return_token_ids else None))
        usage = _usage(output) if cursor.continuous_usage else None
        out = [ChatCompletionChunk(id=request_id, model=model, choices=[c], usage=usage,
                                   prompt_token_ids=cursor.prompt_ids(output, first and i == 0))
               for i, c in enumerate(choices)]
        if output.finished and include_usage:
            out.append(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=_usage(output)))
        return out

    # ---- text completions -------------------------------------------------------------------------
    def _raw_prompts(self, body: CompletionRequest) -> list[dict[str, Any]]:
        """The request's prompts: a string, a list of strings, token ids, or a list of token-id lists."""
        if body.suffix:
            raise RequestError("suffix is not supported", param="suffix", code="unsupported_parameter")
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise RequestError("prompt must not be empty", param="prompt")
        if len(prompts) > 1:
            for name, asked in (("echo", body.echo), ("prompt_logprobs", body.prompt_logprobs is not None),
                                ("media", bool(body.media)), ("return_token_ids", body.return_token_ids)):
                if asked:
                    raise RequestError(f"{name} is not supported with several prompts: send one request per "
                                       "prompt", param=name, code="unsupported_parameter")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts]

    async def _start_several(self, request_id: str, raw_prompts: list[dict[str, Any]], body: CompletionRequest,
                             raw: Request, arrival_time: float) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """One engine request per prompt; their outputs as one request's, choice j of prompt i being choice
        i * n + j (as OpenAI numbers them). A prompt refused aborts the ones already started."""
        prompts = []
        for i, raw_prompt in enumerate(raw_prompts):
            with at_param(f"prompt[{i}]"):
                prompts.append(await self._completion_prompt(body, raw_prompt))
        # submitted together, so their prefills share steps
        results = await asyncio.gather(*(self._start(f"{request_id}-{i}", prompt, body, raw, arrival_time)
                                         for i, prompt in enumerate(prompts)), return_exceptions=True)
        started = [r for r in results if not isinstance(r, BaseException)]
        refused = next((r for r in results if isinstance(r, BaseException)), None)
        if refused is not None:
            for _, outputs in started:
                await outputs.aclose()
            raise refused
        batch = _PromptBatch(body.n, len(started))
        return batch.reindex(0, started[0][0]), batch.merged(started)

    async def _completion_prompt(self, body: CompletionRequest, raw_prompt: dict[str, Any]) -> ProcessedPrompt:
        if not body.media:
            return await self.engine.process(raw_prompt, body.mm_processor_kwargs)
        media = await self._in_worker(resolve_media, body.media, self.config.media, body.mm_processor_kwargs)
        raw_prompt["multi_modal_data"] = {"image": media.images, "video": media.videos}
        raw_prompt["multi_modal_uuids"] = media.uuids
        return await self.engine.process(raw_prompt, body.mm_processor_kwargs, media.params)

    async def completions(self, body: CompletionRequest, raw: Request) -> Any:
        arrival_time = time.time()
        model = self._check_model(body.model)
        request_id = raw.state.request_id = f"cmpl-{uuid.uuid4().hex}"
        raw_prompts = self._raw_prompts(body)
        if len(raw_prompts) == 1:
            with self._traced("media_load", raw):
                prompt = await self._completion_prompt(body, raw_prompts[0])
            first, outputs = await self._start(request_id, prompt, body, raw, arrival_time)
        else:
            first, outputs = await self._start_several(request_id, raw_prompts, body, raw, arrival_time)

        num_logprobs = body.requested_logprobs()
        echo = self._echo(num_logprobs) if body.echo else None

        def whole(final: RequestOutput) -> BaseModel:
            echoed, echoed_logprobs = echo(final) if echo else ("", None)
            choices = []
            for c in final.outputs:
                logprobs = None
                if num_logprobs is not None:
                    logprobs = completion_logprobs(c.token_ids, self._names(c.logprobs), num_logprobs)
                    logprobs = joined(echoed_logprobs, logprobs) if echoed_logprobs else logprobs
                choices.append(CompletionChoice(
                    index=c.index, text=echoed + c.text, finish_reason=c.finish_reason, logprobs=logprobs,
                    prompt_logprobs=None if body.prompt_logprobs is None
                    else prompt_logprobs(self._names(final.prompt_logprobs)),
                    token_ids=list(c.token_ids) if body.return_token_ids else None,
                    prompt_token_ids=list(final.prompt_token_ids) if body.return_token_ids else None))
            return CompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(final))

        return await self._respond(request_id, model, body, raw, first, outputs, self._completion_chunks, whole, echo)

    def _echo(self, num_logprobs: int | None) -> Callable[[RequestOutput], tuple[str, CompletionLogprobs | None]]:
        """The prompt's text as echoed, and its logprobs in the legacy shape (with logprobs)."""
        tokenizer = self.engine.frontend.processor.tokenizer

        def echo(output: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
            ids = output.prompt_token_ids
            text = output.prompt if output.prompt is not None else tokenizer.decode(ids, skip_special_tokens=False)
            if num_logprobs is None or output.prompt_logprobs is None:
                return text, None
            first = f"token_id:{ids[0]}" if self.config.return_tokens_as_token_ids else tokenizer.decode(
                ids[:1], skip_special_tokens=False)
            return text, echo_logprobs(ids, self._names(output.prompt_logprobs), num_logprobs, first)
        return echo

    @staticmethod
    def _completion_chunks(request_id: str, model: str, include_usage: bool, cursor: _StreamCursor,
                           output: RequestOutput) -> list[BaseModel]:
        completion = output.outputs[output.delta_index]
        index = completion.index
        finish = completion.finish_reason if cursor.finishes(completion) else None
        out: list[BaseModel] = []
        first = cursor.first_chunk(index)
        echoed, echoed_logprobs = cursor.echo(output) if cursor.echo and first else ("", None)
        token_ids, entries = cursor.take(completion)
        new_ids = cursor.take_ids(completion)
        if echoed or output.delta_text or finish is not None or entries or new_ids or (first and cursor.return_token_ids):
            logprobs = None
            if entries:
                logprobs = completion_logprobs(token_ids, entries, cursor.num_logprobs, cursor.text_offset.get(index, 0))
            if echoed_logprobs is not None:
                logprobs = joined(echoed_logprobs, logprobs) if logprobs else echoed_logprobs
            if logprobs is not None:
                cursor.text_offset[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            choice = CompletionChoice(index=index, text=echoed + output.delta_text, finish_reason=finish,
                                      logprobs=logprobs, token_ids=new_ids, prompt_token_ids=cursor.prompt_ids(output, first))
            out.append(CompletionResponse(id=request_id, model=model, choices=[choice],
                                          usage=_usage(output) if cursor.continuous_usage else None))
        if output.finished and include_usage:
            out.append(CompletionResponse(id=request_id, model=model, choices=[], usage=_usage(output)))
        return out

    # ---- tokens ---------------------------------------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """The prompt's token ids exactly as /v1/completions (`prompt`) or /v1/chat/completions (`messages`)
        would run them: pictures expanded to their placeholder rows, the chat template applied."""
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            if body.add_special_tokens is False:
                raise RequestError("add_special_tokens=false is not supported: the tokens are what "
                                   "/v1/completions runs", param="add_special_tokens", code="unsupported_parameter")
            prompt = await self.engine.process({"prompt": body.prompt}, body.mm_processor_kwargs)
        else:
            if body.add_special_tokens:
                raise RequestError("add_special_tokens=true is not supported with messages: the chat template "
                                   "writes them", param="add_special_tokens", code="unsupported_parameter")
            messages = await self._in_worker(resolve_messages, body.messages, self.config.media,
                                             body.mm_processor_kwargs)
            prompt = await self.engine.process_chat(messages, body.mm_processor_kwargs,
                                                    add_generation_prompt=body.add_generation_prompt,
                                                    continue_final_message=body.continue_final_message)
        ids = list(prompt.prompt_token_ids)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        tokenizer = self.engine.frontend.processor.tokenizer
        vocab_size = self.engine.frontend.spec.vocab_size
        outside = [t for t in body.tokens if not 0 <= t < vocab_size]
        if outside:
            raise RequestError(f"tokens holds {outside[0]}, outside the vocabulary (ids 0..{vocab_size - 1})",
                               param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))
