"""The Responses API's output items, whole or as the event stream of `stream: true`.

Role: `output_items` makes a finished answer's items (its thought a `reasoning` item, its text a `message`,
each call a `function_call`); `ResponseEvents` makes the same items as events while the answer grows —
`response.created`, `response.in_progress`, then per item `response.output_item.added`, its parts and
deltas (`response.content_part.added`, `response.output_text.delta` / `response.reasoning_text.delta`,
their `.done`, `response.content_part.done`; a call's `response.function_call_arguments.delta` and
`.done`), `response.output_item.done`, and last `response.completed` (or `response.incomplete`, or
`response.failed` where the engine failed it) carrying the whole response — each with the next
`sequence_number`. The thought and the calls are split from the text by the chat route's own incremental
parsers (reasoning.py's `ReasoningStream`, tool_formats.py's `ToolCallStream`), so the deltas join to what
the finished answer holds.
What it does not know: the request's fields, the engine, the store, HTTP (its caller writes the SSE lines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from mmserve.entrypoints.openai.reasoning import ReasoningStream
from mmserve.entrypoints.openai.responses_protocol import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    new_id,
)
from mmserve.entrypoints.openai.tool_formats import ToolCallStream, ToolFormat
from mmserve.entrypoints.openai.tools import ToolCall, ToolRequest
from mmserve.outputs import RequestOutput


class StreamEvent(BaseModel):
    """One server-sent event: its type, its place in the stream, and the fields its type carries."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int

    def sse(self) -> str:
        return f"event: {self.type}\ndata: {self.model_dump_json()}\n\n"


def message_status(finish_reason: str | None, last: bool) -> str:
    """A message cut by max_output_tokens is incomplete (only the last item can be cut)."""
    return "incomplete" if last and finish_reason == "length" else "completed"


def output_items(reasoning: str | None, content: str | None, calls: list[ToolCall],
                 finish_reason: str | None) -> list[OutputItem]:
    """A finished answer's items: the thought (where there is one), the text (where there is some, or
    where there is nothing else), then the calls."""
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(id=new_id("rs"), content=[ReasoningText(text=reasoning)]))
    if content or (not items and not calls):
        items.append(OutputMessage(id=new_id("msg"), content=[OutputText(text=content or "")],
                                   status=message_status(finish_reason, not calls)))
    items += [FunctionCallItem(id=new_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments) for c in calls]
    return items


@dataclass
class _Open:
    """The reasoning or message item being streamed."""

    item: ReasoningItem | OutputMessage
    index: int
    text: str = ""


@dataclass
class ResponseEvents:
    """The events of one streamed response (module docstring). `snapshot(status, output, final)` is the
    response as it stands (`final`: the finished output, for its usage)."""

    snapshot: Callable[[str, list[OutputItem], RequestOutput | None], ResponseObject]
    tools: tuple[ToolRequest, ToolFormat] | None  # None: no tools, or tool_choice none
    in_thought: bool | None  # None: the template does not think
    sequence_number: int = 0
    items: list[OutputItem] = field(default_factory=list)  # the items done, in order
    open: _Open | None = None
    sent_chars: int = 0  # of the text, where neither parser runs
    reasoning_stream: ReasoningStream | None = None
    tool_stream: ToolCallStream | None = None
    final: ResponseObject | None = None  # the finished response, once the last output came

    def __post_init__(self) -> None:
        if self.in_thought is not None:
            self.reasoning_stream = ReasoningStream(self.in_thought)
        if self.tools is not None:
            self.tool_stream = ToolCallStream(self.tools[1], self.tools[0])

    def event(self, type: str, **fields: Any) -> StreamEvent:
        event = StreamEvent(type=type, sequence_number=self.sequence_number,
                            **{k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()})
        self.sequence_number += 1
        return event

    def start(self) -> list[StreamEvent]:
        response = self.snapshot("in_progress", [], None)
        return [self.event("response.created", response=response), self.event("response.in_progress", response=response)]

    def update(self, output: RequestOutput) -> list[StreamEvent]:
        """The events of what this output added; with the last, the items' ends and the final response."""
        completion = output.outputs[0]
        finished = completion.finish_reason is not None
        thought, text, calls = self._split(completion.text, finished)
        events = []
        if thought:
            events += self._grow(ReasoningItem, thought)
        if text:
            events += self._grow(OutputMessage, text)
        for call in calls:
            events += self._close(completion.finish_reason, last=False)
            events += self._call(call)
        if finished:
            if not self.items and self.open is None:  # nothing at all: one empty message, as output_items gives
                events += self._open(OutputMessage)
            events += self._close(completion.finish_reason, last=True)
            status = "incomplete" if completion.finish_reason == "length" else "completed"
            self.final = self.snapshot(status, self.items, output)
            events.append(self.event(f"response.{status}", response=self.final))
        return events

    def failed(self, message: str) -> StreamEvent:
        response = self.snapshot("failed", self.items, None)
        response.error = ResponseError(message=message)
        return self.event("response.failed", response=response)

    def _split(self, text: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        """(new thought, new text, new whole calls) of the answer so far (as chat.py's stream splits it)."""
        thought, answer = "", text
        if self.reasoning_stream is not None:
            thought, answer = self.reasoning_stream.update(text, finished)
            new_text = self.reasoning_stream.take_content(answer)
        else:
            new_text, self.sent_chars = text[self.sent_chars:], len(text)
        if self.tool_stream is None:
            return thought, new_text, []
        new_text, calls = self.tool_stream.update(answer, finished)
        return thought, new_text, [call for _, call in calls]

    def _open(self, kind: type[ReasoningItem] | type[OutputMessage]) -> list[StreamEvent]:
        index = len(self.items)
        if kind is ReasoningItem:
            item: ReasoningItem | OutputMessage = ReasoningItem(id=new_id("rs"), content=[])
            part: BaseModel = ReasoningText(text="")
        else:
            item, part = OutputMessage(id=new_id("msg"), status="in_progress", content=[]), OutputText(text="")
        self.open = _Open(item, index)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item.id, output_index=index, content_index=0,
                           part=part)]

    def _grow(self, kind: type[ReasoningItem] | type[OutputMessage], delta: str) -> list[StreamEvent]:
        events = []
        if self.open is not None and not isinstance(self.open.item, kind):
            events += self._close(None, last=False)
        if self.open is None:
            events += self._open(kind)
        assert self.open is not None
        self.open.text += delta
        where = {"item_id": self.open.item.id, "output_index": self.open.index, "content_index": 0, "delta": delta}
        if kind is ReasoningItem:
            return [*events, self.event("response.reasoning_text.delta", **where)]
        return [*events, self.event("response.output_text.delta", **where, logprobs=[])]

    def _close(self, finish_reason: str | None, last: bool) -> list[StreamEvent]:
        if self.open is None:
            return []
        opened, self.open = self.open, None
        where = {"item_id": opened.item.id, "output_index": opened.index, "content_index": 0}
        if isinstance(opened.item, ReasoningItem):
            part: BaseModel = ReasoningText(text=opened.text)
            item: OutputItem = ReasoningItem(id=opened.item.id, content=[part])
            events = [self.event("response.reasoning_text.done", **where, text=opened.text)]
        else:
            part = OutputText(text=opened.text)
            item = OutputMessage(id=opened.item.id, content=[part], status=message_status(finish_reason, last))
            events = [self.event("response.output_text.done", **where, text=opened.text, logprobs=[])]
        self.items.append(item)
        return [*events, self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=opened.index, item=item)]

    def _call(self, call: ToolCall) -> list[StreamEvent]:
        index = len(self.items)
        item = FunctionCallItem(id=new_id("fc"), call_id=call.id, name=call.name, arguments="", status="in_progress")
        done = item.model_copy(update={"arguments": call.arguments, "status": "completed"})
        self.items.append(done)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                           delta=call.arguments),
                self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                           arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=done)]
