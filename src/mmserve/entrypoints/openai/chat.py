"""Chat completions: POST /v1/chat/completions, its request and response bodies, and how it is served.

Role: the chat request (messages, tools, logprobs as chat asks for them) and its answer and stream
chunks; `ChatServing` resolves the messages' media (on a worker thread), renders the chat template (the
request's tools included), submits the prompt through the shared core (serving.py), and answers with the
message — its thought apart as `reasoning` (and `reasoning_content`, the same) where the template thinks, its
tool calls parsed out where the request has tools — or a stream of deltas as vLLM sends them (the role
first, then content, calls whole once their end arrives, the finish reason on the last; null fields left
out).
What it does not know: the engine behind the client, routing beyond its own route, authentication.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from mmserve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from mmserve.entrypoints.openai.media import resolve_messages
from mmserve.entrypoints.openai.protocol import (
    ChatLogprobs,
    GenerationRequest,
    PromptLogprobs,
    RequestError,
    Usage,
    WireModel,
)
from mmserve.entrypoints.openai.reasoning import ThoughtStart, ThoughtTags, opens_thought, split, thought_tags
from mmserve.entrypoints.openai.serving import OpenAIServing
from mmserve.entrypoints.openai.streaming import StreamCursor, choice_usage, usage_of
from mmserve.entrypoints.openai.tool_formats import ToolFormat, tool_format
from mmserve.entrypoints.openai.tools import ToolRequest, parse_tools, parsed_tool_arguments
from mmserve.errors import InvalidInputError
from mmserve.inputs.items import ProcessedPrompt
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import MAX_LOGPROBS, StructuredOutputsParams


# ---- the wire format -------------------------------------------------------------------------------
class ChatCompletionRequest(GenerationRequest):
    # vLLM's: the chat template writes the special tokens (none more); the prompt is what /tokenize shows
    route_unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {"add_special_tokens": (None, False)}
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None  # OpenAI's: [{"type": "function", "function": {name, parameters, strict}}]
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None
    # vLLM's: end the prompt with the assistant's turn opened (the default), or continue the last message
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the answer starts with the last message's content where that message has the answer's role
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs not in (None, 0):
                raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
            return None
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise RequestError(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}",
                               param="top_logprobs")
        return top


class FunctionCall(WireModel):
    omit_if_none = ("name", "arguments")  # a stream's later delta of a call carries its arguments only
    name: str | None = None
    arguments: str | None = None


class ToolCallModel(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(WireModel):
    omit_if_none = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ChatMessage(WireModel):
    omit_if_none = ("tool_calls",)
    role: str = "assistant"  # the last message's, with add_generation_prompt false (as vLLM)
    content: str | None
    reasoning: str | None = None  # a thinking model's thought (vLLM's field)
    reasoning_content: str | None = None  # the same thought under vLLM's older name, which clients still read
    tool_calls: list[ToolCallModel] | None = None  # left out where there is no call, as vLLM does


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs (vLLM's field)
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(WireModel):
    """One chunk's change to the message: only what it carries is sent (as vLLM's deltas)."""

    omit_if_none = ("role", "content", "reasoning", "reasoning_content", "tool_calls")
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(WireModel):
    omit_if_none = ("token_ids",)
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the tokens new in this chunk


class ChatCompletionChunk(WireModel):
    omit_if_none = ("usage", "prompt_token_ids")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, in each choice's first chunk


# ---- serving ---------------------------------------------------------------------------------------
def _role(body: ChatCompletionRequest) -> str:
    """The answer's role: the assistant's, or with add_generation_prompt false the last message's (vLLM's)."""
    last = body.messages[-1] if body.messages else {}
    if body.add_generation_prompt or not isinstance(last, dict) or not isinstance(last.get("role"), str):
        return "assistant"
    return last["role"]


def _echoed(body: ChatCompletionRequest) -> str:
    """With echo: the last message's text (its text parts joined by newlines) where its role is the
    answer's, else nothing (vLLM's rule)."""
    last = body.messages[-1] if body.messages else None
    if not body.echo or not isinstance(last, dict) or last.get("role") != _role(body):
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


@dataclass
class SubmittedChat:
    """A chat submitted to the engine: its first output, the rest to come, its tools (the request's and the
    model's call syntax; None without tools) and whether the answer starts inside a thought, with the tags
    the model writes one with (None: the template does not think)."""

    first: RequestOutput
    outputs: AsyncIterator[RequestOutput]
    tools: tuple[ToolRequest, ToolFormat] | None
    in_thought: ThoughtStart | None


class ChatServing:
    """POST /v1/chat/completions over the shared core."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def chat_prompt(self, body: ChatCompletionRequest, tools: ToolRequest | None = None) -> ProcessedPrompt:
        messages = await self.serving.in_worker(resolve_messages, parsed_tool_arguments(body.messages),
                                                self.serving.config.media, body.mm_processor_kwargs)
        template_kwargs = dict(body.chat_template_kwargs or {})
        if tools is not None:
            template_kwargs["tools"] = list(tools.template_tools)
        return await self.serving.client.process_chat(messages, body.mm_processor_kwargs,
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      continue_final_message=body.continue_final_message,
                                                      **template_kwargs)

    def request_tools(self, body: ChatCompletionRequest) -> tuple[ToolRequest, ToolFormat] | None:
        """The request's tools and the model's call syntax (None: no tools), or a 400 naming the field."""
        try:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except InvalidInputError as exc:
            raise RequestError(str(exc), param=exc.param) from exc
        if tools is None:
            return None
        fmt = tool_format(self.serving.client.frontend.processor.tokenizer.chat_template,
                          self.serving.config.tool_call_parser)
        if fmt is None:
            raise RequestError("this model's chat template renders no tools, so it cannot call them", param="tools",
                               code="unsupported_parameter")
        if tools.forced and body.structured()[0] is not None:
            raise RequestError("tool_choice required or a named function is a grammar of its own: it cannot be "
                               "combined with response_format or structured_outputs", param="tool_choice")
        return tools, fmt

    def thought_tags(self) -> ThoughtTags | None:
        """The tags the model thinks in: its template's, or --reasoning-parser's (None: it does not think)."""
        return thought_tags(self.serving.client.frontend.processor.tokenizer.chat_template,
                            self.serving.config.reasoning_parser)

    def _in_thought(self, output: RequestOutput, tags: ThoughtTags | None) -> ThoughtStart | None:
        """For a thinking template: does the answer start inside a thought (None: the template does not think)?"""
        if tags is None:
            return None
        tokenizer = self.serving.client.frontend.processor.tokenizer
        return ThoughtStart(opens_thought(tokenizer.decode(list(output.prompt_token_ids[-8:]),
                                                           skip_special_tokens=False), tags), tags)

    @staticmethod
    def message_of(completion: CompletionOutput, tools: tuple[ToolRequest, ToolFormat] | None,
                 in_thought: bool | ThoughtStart | None = None) -> tuple[ChatMessage, str | None]:
        """The choice's message (its thought apart, its calls parsed out, where the request has tools) and
        finish reason. A forced choice (required, named) has content "" rather than null, as vLLM answers."""
        reasoning, text = (None, completion.text) if in_thought is None else split(completion.text, in_thought)
        thought = {"reasoning": reasoning, "reasoning_content": reasoning}
        if tools is None or tools[0].choice == "none":
            return ChatMessage(content=text, **thought), completion.finish_reason
        content, calls = tools[1].parse(text, tools[0])
        if not calls:  # the whole answer is content (less a turn-end marker the syntax drops)
            return ChatMessage(content=content, **thought), completion.finish_reason
        message = ChatMessage(content=content or ("" if tools[0].forced else None), **thought, tool_calls=[
            ToolCallModel(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls])
        return message, tool_finish_reason(completion.finish_reason, tools[0])

    async def submit(self, body: ChatCompletionRequest, raw: Request, request_id: str) -> SubmittedChat:
        """Build the chat's prompt (its tools rendered, its media loaded), submit it and wait for the first
        output: what every route that speaks in messages (chat, Responses, Messages) runs, so the same
        conversation is the same prompt and the same answer whichever route it came by."""
        arrival_time = time.time()
        raw.state.request_id = request_id
        # the media and the processed prompt live in no frame of this request past submission: once
        # encoded, the engine releases the pixels and nothing else holds them
        tools = self.request_tools(body)
        tags = self.thought_tags()
        if _parses_special_tokens(tools, tags):
            # the markers the parsers read are special tokens: decoded with them kept, as vLLM's gemma4
            # parsers ask (the parsers leave none in the content they return)
            body.skip_special_tokens = False
        grammar = None
        if tools is not None and tools[0].forced:
            grammar = StructuredOutputsParams(structural_tag=tools[1].structural_tag(tools[0]))
        # fetching and decoding the media, the template, the processor
        with self.serving.traced("media_load", raw):
            prompt = await self.chat_prompt(body, tools and tools[0])
        first, outputs = await self.serving.start(request_id, prompt, body, raw, arrival_time, grammar)
        return SubmittedChat(first, outputs, tools, self._in_thought(first, tags))

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Any:
        """Answer one chat request: a JSON response, or a stream of chunks with `stream`."""
        model = self.serving.check_model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        submitted = await self.submit(body, raw, request_id)
        first, outputs, tools, in_thought = submitted.first, submitted.outputs, submitted.tools, submitted.in_thought
        num_logprobs = body.requested_logprobs()
        role, echoed = _role(body), _echoed(body)

        def whole(final: RequestOutput) -> BaseModel:
            choices = []
            for c in final.outputs:
                message, finish_reason = self.message_of(c, tools, in_thought)
                message.role = role
                if echoed:
                    message.content = echoed + (message.content or "")
                choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                          logprobs=None if num_logprobs is None else chat_logprobs(
                                              c.token_ids, self.serving.names(c.logprobs, body), num_logprobs),
                                          token_ids=list(c.token_ids) if body.return_token_ids else None))
            return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage_of(final),
                                          prompt_logprobs=None if body.prompt_logprobs is None
                                          else prompt_logprobs(self.serving.names(final.prompt_logprobs, body)),
                                          prompt_token_ids=list(final.prompt_token_ids) if body.return_token_ids
                                          else None)

        return await self.serving.respond(request_id, model, body, raw, first, outputs, self._chunks, whole,
                                          echo=(lambda _: (echoed, None)) if echoed else None,
                                          tools=tools if tools is not None and tools[0].choice != "none" else None,
                                          in_thought=in_thought, role=role)

    @staticmethod
    def _chunks(request_id: str, model: str, include_usage: bool, cursor: StreamCursor,
                output: RequestOutput) -> list[BaseModel]:
        """The chunks of the choice this output moved (`delta_index`): its role first, as OpenAI's
        stream has it, then its text and logprobs, the finish reason on the chunk with the last of them
        (as vLLM sends it); the usage after the last."""
        completion = output.outputs[output.delta_index]
        index = completion.index
        no_ids = [] if cursor.return_token_ids else None
        first = cursor.first_chunk(index)
        # (choice, completion tokens its usage counts): the role chunk counts none, as vLLM's
        choices = [(ChatChunkChoice(index=index, delta=DeltaMessage(role=cursor.role, content=""), token_ids=no_ids),
                    0)] if first else []
        if first and cursor.echo is not None:  # the echoed message, before anything generated (as vLLM)
            choices.append((ChatChunkChoice(index=index, delta=DeltaMessage(content=cursor.echo(output)[0])), 0))
        deltas, finish_reason = ChatServing._deltas(cursor, output, completion)
        if cursor.finishes(completion):
            deltas = deltas or [ChatChunkChoice(index=index, delta=DeltaMessage(), token_ids=no_ids)]
            deltas[-1].finish_reason = finish_reason
        choices += [(c, len(completion.token_ids)) for c in deltas]
        out = [ChatCompletionChunk(id=request_id, model=model, choices=[c],
                                   usage=choice_usage(output, counted) if cursor.continuous_usage else None,
                                   prompt_token_ids=cursor.prompt_ids(output, first and i == 0))
               for i, (c, counted) in enumerate(choices)]
        if output.finished and include_usage:
            out.append(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage_of(output)))
        return out

    @staticmethod
    def _deltas(cursor: StreamCursor, output: RequestOutput, completion: CompletionOutput,
                ) -> tuple[list[ChatChunkChoice], str | None]:
        """The choice's new text (its thought as reasoning), logprobs and whole tool calls as chunk choices,
        and its finish reason (tool_calls where a call was made and the choice was not named)."""
        index = completion.index
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
            if stream.calls:
                finish_reason = tool_finish_reason(finish_reason, cursor.tools[0])
        choices = []
        if text or thought or entries or new_ids:
            logprobs = chat_logprobs(token_ids, entries, cursor.num_logprobs) if entries else None
            delta = DeltaMessage(content=None if thought and not text else text, reasoning=thought or None,
                                 reasoning_content=thought or None)
            choices.append(ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, token_ids=new_ids))
        for i, call in calls:  # id and name first, then the arguments, as OpenAI streams them
            for delta in (DeltaToolCall(index=i, id=call.id, type="function",
                                        function=FunctionCall(name=call.name, arguments="")),
                          DeltaToolCall(index=i, function=FunctionCall(arguments=call.arguments))):
                choices.append(ChatChunkChoice(index=index, delta=DeltaMessage(tool_calls=[delta])))
        return choices, finish_reason


def _parses_special_tokens(tools: tuple[ToolRequest, ToolFormat] | None, tags: ThoughtTags | None) -> bool:
    """Do the parsers this answer goes through read special tokens (Gemma 4's thought channel, or its call
    syntax where the request may call a tool)?"""
    calls = tools is not None and tools[0].choice != "none" and tools[1].special
    return calls or (tags is not None and tags.special)


def tool_finish_reason(finish_reason: str | None, tools: ToolRequest) -> str | None:
    """A choice that called a tool ends with `tool_calls` (OpenAI's and vLLM's rule), except a named
    choice, which ends with `stop`; a cut-off choice keeps `length`."""
    return "tool_calls" if finish_reason == "stop" and tools.choice != "named" else finish_reason


def chat_router(serving: OpenAIServing) -> APIRouter:
    """The chat route (the app mounts it under /v1, behind the API key)."""
    endpoint = ChatServing(serving)
    router = APIRouter()

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await endpoint.create(body, raw)

    return router
