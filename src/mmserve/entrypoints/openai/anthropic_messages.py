"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, served by the chat route.

Role: `to_chat` translates a Messages request into the chat completions request of the same conversation —
the system prompt a system message; a user turn's text and images (data URL or URL) its content parts and
its tool_result blocks `tool` messages; an assistant turn's text its content, its thinking blocks its
`reasoning_content`, its tool_use blocks `tool_calls`; a last assistant turn continued (Anthropic's
prefill); tools and tool_choice as OpenAI's; thinking as the template's `enable_thinking` — and
`MessagesServing` runs it through `ChatServing.submit`, so the prompt and the greedy answer are exactly
chat's, and answers with Anthropic's message (thinking, text and tool_use blocks) or its event stream
(anthropic_stream.py). count_tokens builds the same prompt and generates nothing. An error about the chat
request (an image that does not decode, a template that refuses the conversation) is said with the
Anthropic request's field (`ChatPaths`).
What it does not know: the engine, chat templates, call syntaxes (chat.py, tool_formats.py), the error
shape (http_errors.py renders Anthropic's for these routes), authentication.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mmserve.entrypoints.openai.anthropic_protocol import (
    AnthropicMessage,
    AnthropicUsage,
    Base64ImageSource,
    CountTokensRequest,
    CountTokensResponse,
    ImageBlockParam,
    MessageParam,
    MessagesRequest,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ThinkingBlockParam,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from mmserve.entrypoints.openai.anthropic_stream import (
    BlockWriter,
    StreamedMessage,
    message_events,
    stop_reason_of,
    tool_use_id,
)
from mmserve.entrypoints.openai.chat import ChatCompletionRequest, ChatServing, SubmittedChat
from mmserve.entrypoints.openai.protocol import RequestError
from mmserve.entrypoints.openai.reasoning import ReasoningStream
from mmserve.entrypoints.openai.serving import (
    OpenAIServing,
    last_output,
    raise_if_failed,
    unless_disconnected,
)
from mmserve.entrypoints.openai.tool_formats import ToolCallStream
from mmserve.errors import InvalidInputError
from mmserve.outputs import CompletionOutput

_CHAT_PATH = re.compile(r"messages\[\d+\](?:\.content\[\d+\](?:\.image_url)?)?|tools\[(\d+)\]")
CHAT_FIELDS = {"stop": "stop_sequences"}  # chat's names of the request fields whose names differ


# ---- the chat request of the same conversation ----------------------------------------------------------
@dataclass
class ChatPaths:
    """Where each chat message and content part came from in the Anthropic request
    ('messages[2].content[0]' -> 'messages.1.content.0'), so an error about the chat request names the
    field the client sent."""

    paths: dict[str, str] = field(default_factory=dict)

    def add(self, chat_path: str, path: str) -> None:
        self.paths[chat_path] = path

    def rewrite(self, text: str | None) -> str | None:
        """`text` (a field path, or a message naming some) with chat's paths as the Anthropic request's."""
        if text is None:
            return None
        if text in CHAT_FIELDS:
            return CHAT_FIELDS[text]
        return _CHAT_PATH.sub(lambda m: f"tools.{m.group(1)}" if m.group(1) is not None
                              else self.paths.get(m.group(0), m.group(0)), text)

    def reworded(self, exc: RequestError | InvalidInputError) -> Exception:
        """The same error, its message and field in the Anthropic request's terms."""
        if isinstance(exc, InvalidInputError):
            out = exc.reworded(self.rewrite(str(exc)) or "")
            out.param = self.rewrite(exc.param)
            return out
        return RequestError(self.rewrite(exc.message) or "", exc.status_code, exc.type,
                            self.rewrite(exc.param), exc.code)


@dataclass
class ChatTranslation:
    request: ChatCompletionRequest
    paths: ChatPaths


def _user_turn(turn: MessageParam, where: str, called: set[str], paths: ChatPaths, start: int) -> list[dict]:
    """A user turn's chat messages from index `start`: its text and images as content parts, each run of
    tool_result blocks as `tool` messages, in the turn's order."""
    if isinstance(turn.content, str):
        paths.add(f"messages[{start}]", where)
        return [{"role": "user", "content": turn.content}]
    if not turn.content:
        raise RequestError(f"{where}.content: a user turn needs at least one content block",
                           param=f"{where}.content")
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(turn.content):
        at = f"{where}.content.{j}"
        if isinstance(block, ToolResultBlockParam):
            if block.tool_use_id not in called:
                raise RequestError(f"{at}.tool_use_id: no earlier assistant turn has a tool_use with the id "
                                   f"{block.tool_use_id!r:.80}", param=f"{at}.tool_use_id")
            if parts:
                messages.append({"role": "user", "content": parts})
                parts = []
            paths.add(f"messages[{start + len(messages)}]", at)
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif isinstance(block, (TextBlockParam, ImageBlockParam)):
            chat_at = f"messages[{start + len(messages)}]"
            if not parts:  # the chat message these parts will make
                paths.add(chat_at, where)
            chat_at += f".content[{len(parts)}]"
            paths.add(chat_at, at)
            if isinstance(block, TextBlockParam):
                parts.append({"type": "text", "text": block.text})
            else:
                paths.add(f"{chat_at}.image_url", f"{at}.source")
                source = block.source
                url = source.data_url() if isinstance(source, Base64ImageSource) else source.url
                parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise RequestError(f"{at}.type: a {block.type} block belongs in an assistant turn, not a user's",
                               param=f"{at}.type")
    return messages + ([{"role": "user", "content": parts}] if parts else [])


def _assistant_turn(turn: MessageParam, where: str, called: set[str], last: bool) -> dict[str, Any]:
    """An assistant turn's chat message: its text, its thought as `reasoning_content`, its calls."""
    if isinstance(turn.content, str):
        return {"role": "assistant", "content": turn.content}
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(turn.content):
        at = f"{where}.content.{j}"
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlockParam):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlockParam):
            if last:
                raise RequestError(f"{at}: the answer continues a last assistant turn, which cannot end in a "
                                   "tool_use: answer the call with a user turn's tool_result", param=at)
            if block.id in called:
                raise RequestError(f"{at}.id: an earlier tool_use has the id {block.id!r:.80}",
                                   param=f"{at}.id")
            called.add(block.id)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            raise RequestError(f"{at}.type: a {block.type} block belongs in a user turn, not an assistant's",
                               param=f"{at}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    return message


def _chat_messages(body: CountTokensRequest, paths: ChatPaths) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = body.system_text()
    if system is not None:
        paths.add("messages[0]", "system")
        messages.append({"role": "system", "content": system})
    called: set[str] = set()  # the tool_use ids so far: a tool_result answers one of them
    for i, turn in enumerate(body.messages):
        if turn.role == "user":
            messages += _user_turn(turn, f"messages.{i}", called, paths, len(messages))
        else:
            paths.add(f"messages[{len(messages)}]", f"messages.{i}")
            messages.append(_assistant_turn(turn, f"messages.{i}", called, last=i == len(body.messages) - 1))
    return messages


def _chat_tool(tool: ToolParam) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _chat_tool_choice(body: CountTokensRequest) -> dict[str, Any]:
    """tool_choice as chat's: auto, any (required), a named tool, none; disable_parallel_tool_use as
    parallel_tool_calls false."""
    choice = body.tool_choice
    if choice is None:
        return {}
    if isinstance(choice, ToolChoiceNone):
        return {"tool_choice": "none"}
    if isinstance(choice, ToolChoiceTool):
        chat_choice: Any = {"type": "function", "function": {"name": choice.name}}
    else:
        chat_choice = {"auto": "auto", "any": "required"}[choice.type]
    return {"tool_choice": chat_choice,
            "parallel_tool_calls": False if choice.disable_parallel_tool_use else None}


def to_chat(body: CountTokensRequest) -> ChatTranslation:
    """The chat completions request of the same conversation (the generation fields with a Messages
    request), or a 400 naming the Anthropic request's field."""
    body.refuse_extra_fields()
    paths = ChatPaths()
    messages = _chat_messages(body, paths)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, **_chat_tool_choice(body)}
    if body.tools is not None:
        fields["tools"] = [_chat_tool(tool) for tool in body.tools]
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    if body.messages[-1].role == "assistant":  # Anthropic's prefill: the answer continues that turn
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k, stop=body.stop_sequences, stream=body.stream)
    return ChatTranslation(ChatCompletionRequest(**fields), paths)


# ---- serving --------------------------------------------------------------------------------------------
def answer_blocks(completion: CompletionOutput, submitted: SubmittedChat,
                  ) -> list[ThinkingBlock | TextBlock | ToolUseBlock]:
    """A finished choice's blocks, as chat's message splits it: its thought, its text, its calls (a block
    only where there is something in it)."""
    message, _ = ChatServing.message_of(completion, submitted.tools, submitted.in_thought)
    blocks: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
    if message.reasoning:
        blocks.append(ThinkingBlock(thinking=message.reasoning))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls or []:
        blocks.append(ToolUseBlock(id=tool_use_id(call.id), name=call.function.name or "",
                                   input=json.loads(call.function.arguments or "{}")))
    return blocks


def _writer(submitted: SubmittedChat) -> BlockWriter:
    """A stream's block writer: the thought split out where the template thinks, the calls where the
    request has tools (and a choice other than none)."""
    tools = submitted.tools if submitted.tools is not None and submitted.tools[0].choice != "none" else None
    return BlockWriter(None if submitted.in_thought is None else ReasoningStream(submitted.in_thought),
                       None if tools is None else ToolCallStream(tools[1], tools[0]))


class MessagesServing:
    """POST /v1/messages and /v1/messages/count_tokens over the chat route."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.chat = ChatServing(serving)

    async def create(self, body: MessagesRequest, raw: Request) -> Response:
        """Answer one Messages request: the message as JSON, or its event stream with `stream`."""
        model = self.serving.check_model(body.model)
        translation = to_chat(body)
        message_id = f"msg_{uuid.uuid4().hex}"
        try:
            submitted = await self.chat.submit(translation.request, raw, message_id)
        except (RequestError, InvalidInputError) as exc:
            raise translation.paths.reworded(exc) from exc
        stop_sequences = tuple(body.stop_sequences or ())
        if body.stream:
            return StreamingResponse(message_events(StreamedMessage(message_id, model, stop_sequences),
                                                    submitted.first, submitted.outputs, _writer(submitted)),
                                     media_type="text/event-stream")
        first = submitted.first
        final = first if first.finished else await unless_disconnected(last_output(submitted.outputs), raw)
        raise_if_failed(final)
        completion = final.outputs[0]
        blocks = answer_blocks(completion, submitted)
        called = any(b.type == "tool_use" for b in blocks)
        reason, sequence = stop_reason_of(completion, stop_sequences, called)
        answer = AnthropicMessage(id=message_id, model=model, content=blocks, stop_reason=reason,
                                  stop_sequence=sequence, usage=AnthropicUsage(
                                      input_tokens=len(final.prompt_token_ids),
                                      output_tokens=len(completion.token_ids)))
        return JSONResponse(answer.model_dump())

    async def count_tokens(self, body: CountTokensRequest) -> CountTokensResponse:
        """The prompt tokens /v1/messages would run for the same conversation (nothing generated)."""
        self.serving.check_model(body.model)
        translation = to_chat(body)
        try:
            tools = self.chat.request_tools(translation.request)
            prompt = await self.chat.chat_prompt(translation.request, tools and tools[0])
        except (RequestError, InvalidInputError) as exc:
            raise translation.paths.reworded(exc) from exc
        return CountTokensResponse(input_tokens=prompt.num_tokens)


def messages_router(serving: OpenAIServing) -> APIRouter:
    """The Messages routes (the app mounts them under /v1, behind the API key, which Anthropic's clients
    send as `x-api-key`)."""
    endpoint = MessagesServing(serving)
    router = APIRouter()

    @router.post("/messages")
    async def messages(body: MessagesRequest, raw: Request) -> Any:
        return await endpoint.create(body, raw)

    @router.post("/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await endpoint.count_tokens(body)

    return router
