"""What chat and text completions share in answering: usage, and server-sent-event streams.

Role: `usage_of` (token counts, the server-measured timings, cache details), `StreamCursor` (what a stream has
sent of each choice so far), and `stream_events`, which turns a request's outputs into SSE lines, ends a
stream that fails midway with an error event, and always ends with `[DONE]`.
What it does not know: any one endpoint's chunk shape (the endpoint renders its chunks), HTTP routing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from mmserve.engine.client import EngineDeadError
from mmserve.entrypoints.openai.http_errors import engine_error
from mmserve.entrypoints.openai.protocol import (
    CompletionLogprobs,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    Usage,
)
from mmserve.entrypoints.openai.reasoning import ReasoningStream
from mmserve.entrypoints.openai.tool_formats import ToolCallStream, ToolFormat
from mmserve.entrypoints.openai.tools import ToolRequest
from mmserve.outputs import CompletionOutput, Logprob, RequestOutput


def _timings(output: RequestOutput, num_completion_tokens: int) -> dict[str, float | None]:
    """Time to first token (ms) and decode speed (tokens/s) from the engine's request metrics."""
    metrics = output.metrics
    if metrics is None or metrics.first_token_time is None:
        return {}
    decode_s = (metrics.finish_time or metrics.first_token_time) - metrics.first_token_time
    rate = (num_completion_tokens - 1) / decode_s if num_completion_tokens > 1 and decode_s > 0 else None
    return {"time_to_first_token_ms": round((metrics.first_token_time - metrics.arrival_time) * 1000, 3),
            "decode_tokens_per_s": None if rate is None else round(rate, 3)}


def usage_of(output: RequestOutput) -> Usage:
    """The request's token counts, timings and cache details (every choice's tokens counted)."""
    prompt, completion = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    # the timings are of the sequence the metrics belong to (the choice this output moved)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 **_timings(output, len(output.outputs[output.delta_index].token_ids)),
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=output.num_cached_tokens, mm_items=output.num_mm_items,
                     cached_mm_items=output.num_encoder_cached_mm_items,
                     prefix_cached_mm_items=output.num_prefix_cached_mm_items))


def choice_usage(output: RequestOutput, num_completion_tokens: int) -> Usage:
    """The usage so far that a stream chunk carries with continuous_usage_stats: the prompt and the
    tokens of the chunk's choice so far (as vLLM counts them: its role chunk, none)."""
    prompt = len(output.prompt_token_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=num_completion_tokens,
                 total_tokens=prompt + num_completion_tokens)


@dataclass
class StreamCursor:
    """What a stream has sent of each choice: its role chunk, its logprob entries (each chunk carries the
    entries of the tokens new since the last), its text offset (completions) and its finish chunk."""

    num_logprobs: int | None  # top logprobs asked for (None: no logprobs)
    # the echoed text (and, completions, its logprobs) sent before the choice's own
    echo: Callable[[RequestOutput], tuple[str, CompletionLogprobs | None]] | None = None
    continuous_usage: bool = False  # every chunk carries the usage so far
    names: Callable[[list], list] = list  # how entries name their tokens (text, or token ids)
    return_token_ids: bool = False  # chunks carry their new token ids (and the first, the prompt's)
    tools: tuple[ToolRequest, ToolFormat] | None = None  # chat with tools: calls are parsed out of the text
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)
    in_thought: bool | None = None  # a thinking template: does the answer start inside a thought?
    reasoning_streams: dict[int, ReasoningStream] = field(default_factory=dict)
    role: str = "assistant"  # chat: the role its first chunk announces
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


def failed(output: RequestOutput) -> bool:
    """Did a choice of this output end in an error?"""
    return any(c.finish_reason == "error" for c in output.outputs)


def _sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


async def stream_events(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                        render: Callable[[RequestOutput], list[BaseModel]]) -> AsyncIterator[str]:
    """SSE lines for each output (`render(output)` makes its chunks), an error event if the request fails
    mid-stream, then `[DONE]`. Closing this iterator closes `outputs`, which aborts the request."""
    async with contextlib.aclosing(outputs):
        output = first
        try:
            while True:
                if failed(output):
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
