"""Anthropic's Messages stream: a request's outputs as Anthropic's server-sent events.

Role: `message_events` sends `message_start` (the message, no content yet, with its input tokens), a `ping`,
then each content block as `content_block_start` / `content_block_delta` / `content_block_stop` in the
order the answer writes them — the thought (`thinking_delta`), the text (`text_delta`), each tool call
whole once its end arrives (`input_json_delta`) — then `message_delta` (stop_reason, stop_sequence, the
output tokens) and `message_stop`; an `error` event where the request fails midway. The thought and the
calls are split out by chat's `ReasoningStream` and `ToolCallStream`, so the deltas join to the blocks
the same request answers with unstreamed. `stop_reason_of` is the one mapping of a finished choice to
Anthropic's stop_reason, streamed or not; `tool_use_id` the one naming of a call.
What it does not know: HTTP routing, how the request was translated, chat templates, the error shape of
HTTP errors (http_errors.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from mmserve.engine.client import EngineDeadError
from mmserve.entrypoints.openai.anthropic_protocol import (
    AnthropicErrorInfo,
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicUsage,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from mmserve.entrypoints.openai.reasoning import ReasoningStream
from mmserve.entrypoints.openai.streaming import failed
from mmserve.entrypoints.openai.tool_formats import ToolCallStream
from mmserve.outputs import CompletionOutput, RequestOutput

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason_of(completion: CompletionOutput, stop_sequences: Sequence[str],
                   called: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, the stop sequence that ended it) of a finished choice: cut at max_tokens; ended by
    one of the request's stop sequences (the engine's `stop_reason` is the string it matched); by a tool
    call; else the model's own end."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str) and completion.stop_reason in stop_sequences:
        return "stop_sequence", completion.stop_reason
    return ("tool_use" if called else "end_turn"), None


def tool_use_id(call_id: str) -> str:
    """A parsed call's id as Anthropic spells a tool_use id (`toolu_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


# ---- events -------------------------------------------------------------------------------------------
class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessage


class Ping(BaseModel):
    type: Literal["ping"] = "ping"


class BlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ThinkingBlock | TextBlock | ToolUseBlock


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class BlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: ThinkingDelta | TextDelta | InputJsonDelta


class BlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: AnthropicUsage  # cumulative, as Anthropic's: the input tokens and every output token


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


# ---- blocks -------------------------------------------------------------------------------------------
@dataclass
class BlockWriter:
    """The blocks a stream has opened: the index of the open one and its kind; a thought and tool calls
    split out where the request has them (None: all text)."""

    reasoning: ReasoningStream | None
    tool_calls: ToolCallStream | None
    index: int = -1
    open_kind: str | None = None
    sent_text: int = 0  # characters of the answer sent (without tool calls to parse)
    called: bool = False

    def events(self, completion: CompletionOutput) -> list[BaseModel]:
        """The events that the choice's text so far adds."""
        finished = completion.finish_reason is not None
        thought, answer = ("", completion.text) if self.reasoning is None else self.reasoning.update(
            completion.text, finished)
        if self.tool_calls is not None:
            text, calls = self.tool_calls.update(answer, finished)
        else:
            text, calls, self.sent_text = answer[self.sent_text:], [], len(answer)
        events: list[BaseModel] = []
        if thought:
            events += self._open("thinking")
            events.append(BlockDelta(index=self.index, delta=ThinkingDelta(thinking=thought)))
        if text:
            events += self._open("text")
            events.append(BlockDelta(index=self.index, delta=TextDelta(text=text)))
        for _, call in calls:  # each call whole: its id and name, then its arguments as one JSON delta
            events += self._close()
            self.index, self.called = self.index + 1, True
            events += [BlockStart(index=self.index, content_block=ToolUseBlock(id=tool_use_id(call.id),
                                                                               name=call.name, input={})),
                       BlockDelta(index=self.index, delta=InputJsonDelta(partial_json=call.arguments)),
                       BlockStop(index=self.index)]
        return events + (self._close() if finished else [])

    def _open(self, kind: Literal["thinking", "text"]) -> list[BaseModel]:
        if self.open_kind == kind:
            return []
        events = self._close()
        self.index, self.open_kind = self.index + 1, kind
        block = ThinkingBlock(thinking="") if kind == "thinking" else TextBlock(text="")
        return events + [BlockStart(index=self.index, content_block=block)]

    def _close(self) -> list[BaseModel]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [BlockStop(index=self.index)]


def _sse(event: BaseModel) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"  # type: ignore[attr-defined]


def _error(kind: str, message: str) -> str:
    return _sse(AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=message)))


@dataclass(frozen=True)
class StreamedMessage:
    """What the stream says of the message besides its blocks."""

    message_id: str
    model: str
    stop_sequences: tuple[str, ...]


async def message_events(message: StreamedMessage, first: RequestOutput,
                         outputs: AsyncIterator[RequestOutput], writer: BlockWriter) -> AsyncIterator[str]:
    """The request's events, from message_start to message_stop (or an error event). Closing this
    iterator closes `outputs`, which aborts the request."""
    async with contextlib.aclosing(outputs):
        input_tokens = len(first.prompt_token_ids)
        usage = AnthropicUsage(input_tokens=input_tokens, output_tokens=0)
        yield _sse(MessageStart(message=AnthropicMessage(id=message.message_id, model=message.model,
                                                         content=[], usage=usage)))
        yield _sse(Ping())
        output = first
        try:
            while True:
                if failed(output):
                    kind = "api_error" if output.internal_error else "invalid_request_error"
                    yield _error(kind, output.error or "the request failed")
                    return
                completion = output.outputs[0]
                for event in writer.events(completion):
                    yield _sse(event)
                if output.finished:
                    reason, sequence = stop_reason_of(completion, message.stop_sequences, writer.called)
                    yield _sse(MessageDelta(delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
                                            usage=AnthropicUsage(input_tokens=input_tokens,
                                                                 output_tokens=len(completion.token_ids))))
                    yield _sse(MessageStop())
                    return
                output = await anext(outputs)
        except EngineDeadError as exc:
            yield _error("overloaded_error", str(exc))
