"""The Responses API's input as a chat: input items checked and made canonical, then OpenAI chat messages.

Role: `canonical_items` checks a request's `input` (a string, or message, function_call,
function_call_output and reasoning items) and gives each item in one canonical shape (an id, content as the
client sent it: images as their URL or data URL, never decoded) — what the store keeps and
`/input_items` lists. `chat_messages` turns a conversation of canonical items (the stored history, then
the request's own) into chat messages as a chat client would have sent them: `instructions` a system
message first; `developer` is `system`; an assistant's reasoning, text and function calls one assistant
message (`reasoning_content`, `content`, `tool_calls`); a function_call_output a `tool` message (its call_id
must match an earlier function_call). `ChatSources` maps a chat field path (`messages[2].content[0]`)
back to the request's (`input[1].content[0]`), so errors name what the client sent. `chat_tools`,
`chat_tool_choice` and `chat_response_format` translate the flat function tools, tool_choice and
`text.format`; other tool types are refused naming `tools[i].type`.
What it does not know: the engine, templates, media loading, the store, HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mmserve.entrypoints.openai.protocol import RequestError
from mmserve.entrypoints.openai.responses_protocol import new_id

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# an item's keys besides its own that the SDK's item shapes carry (its dumps of earlier outputs send them):
# accepted only as null
NULL_KEYS = ("phase", "namespace", "caller", "async_", "created_by", "encrypted_content", "name")
ITEM_KEYS = {"message": ("type", "role", "content", "id", "status"),
             "function_call": ("type", "call_id", "name", "arguments", "id", "status"),
             "function_call_output": ("type", "call_id", "output", "id", "status"),
             "reasoning": ("type", "id", "summary", "content", "status")}
IMAGE_DETAILS = ("auto", "high")  # what the processor gives: the image at the model's own resolution
FUNCTION_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
# the request's fields named whole for anything in the messages they make: a string field that is one
# message's text, and the stored conversation previous_response_id names
WHOLE_SOURCES = ("input", "instructions", "previous_response_id")


def _refuse(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


def _check_keys(item: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key, value in item.items():
        if key not in allowed and not (key in NULL_KEYS and value is None):
            raise _refuse(f"{where}.{key:.64} is not supported here (an item of type {item.get('type')!r} takes "
                          f"{', '.join(allowed)})", f"{where}.{key[:64]}")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _refuse(f"{where} must be a string", where)
    return value


def _item_id(item: dict[str, Any], prefix: str, where: str) -> str:
    """The item's own id (an earlier response's output item keeps its id), else a new one."""
    return new_id(prefix) if item.get("id") is None else _text(item["id"], f"{where}.id")


def _user_part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_text":
        _check_keys(part, ("type", "text"), where)
        return {"type": "input_text", "text": _text(part.get("text"), f"{where}.text")}
    if kind == "input_image":
        _check_keys(part, ("type", "image_url", "detail", "file_id"), where)
        if part.get("file_id") is not None:
            raise _refuse(f"{where}.file_id: this server has no Files API; send the image as image_url (an http(s) "
                          "or data URL)", f"{where}.file_id")
        detail = part.get("detail") or "auto"
        if detail not in IMAGE_DETAILS:
            raise _refuse(f"{where}.detail {detail!r:.20} cannot be honoured: the model sees every image at its "
                          "processor's own resolution (detail 'auto' or 'high')", f"{where}.detail")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise _refuse(f"{where}.image_url must be an http(s) URL or a data URL", f"{where}.image_url")
        return {"type": "input_image", "image_url": url, "detail": detail}
    if kind == "input_audio":  # the chat part's shape: {"data": base64, "format": wav|mp3|flac|ogg}
        _check_keys(part, ("type", "input_audio"), where)
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            raise _refuse(f"{where}.input_audio must be an object with 'data' and 'format'", f"{where}.input_audio")
        return {"type": "input_audio", "input_audio": dict(audio)}  # checked with the chat's parts
    raise _refuse(f"{where}.type {kind!r:.40} is not supported: a message's parts are input_text, input_image or "
                  "input_audio (output_text in an assistant's)", f"{where}.type" if isinstance(part, dict) else where)


def _assistant_part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "output_text":
        raise _refuse(f"{where}.type {kind!r:.40} is not supported: an assistant message's parts are output_text",
                      f"{where}.type" if isinstance(part, dict) else where)
    _check_keys(part, ("type", "text", "annotations", "logprobs"), where)
    return {"type": "output_text", "text": _text(part.get("text"), f"{where}.text"), "annotations": [],
            "logprobs": []}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    _check_keys(item, ITEM_KEYS["message"], where)
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise _refuse(f"{where}.role {role!r:.40} is not one of user, system, developer, assistant", f"{where}.role")
    if not isinstance(content, (str, list)):
        raise _refuse(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    if role == "assistant":
        parts = [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}] \
            if isinstance(content, str) else [_assistant_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        return assistant_message(_item_id(item, "msg", where), parts)
    parts = content if isinstance(content, str) else [_user_part(p, f"{where}.content[{j}]")
                                                        for j, p in enumerate(content)]
    return {"type": "message", "id": _item_id(item, "msg", where), "role": role, "content": parts,
            "status": "completed"}


def assistant_message(item_id: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant", "content": parts}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    _check_keys(item, ITEM_KEYS["function_call"], where)
    return {"type": "function_call", "id": _item_id(item, "fc", where),
            "call_id": _text(item.get("call_id"), f"{where}.call_id"), "name": _text(item.get("name"), f"{where}.name"),
            "arguments": _text(item.get("arguments"), f"{where}.arguments"), "status": "completed"}


def _function_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    _check_keys(item, ITEM_KEYS["function_call_output"], where)
    output = item.get("output")
    if isinstance(output, list):  # input_text parts: their text, joined
        output = "".join(_text(p.get("text") if isinstance(p, dict) and p.get("type") == "input_text" else None,
                               f"{where}.output[{j}].text") for j, p in enumerate(output))
    return {"type": "function_call_output", "id": _item_id(item, "fco", where),
            "call_id": _text(item.get("call_id"), f"{where}.call_id"), "output": _text(output, f"{where}.output"),
            "status": "completed"}


def _reasoning(item: dict[str, Any], where: str) -> dict[str, Any]:
    _check_keys(item, ITEM_KEYS["reasoning"], where)
    content, summary = item.get("content") or [], item.get("summary") or []
    for key, parts, kind in (("content", content, "reasoning_text"), ("summary", summary, "summary_text")):
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == kind
                                                  and isinstance(p.get("text"), str) for p in parts):
            raise _refuse(f"{where}.{key} must be a list of {{'type': '{kind}', 'text': ...}}", f"{where}.{key}")
    return {"type": "reasoning", "id": _item_id(item, "rs", where),
            "summary": [{"type": "summary_text", "text": p["text"]} for p in summary],
            "content": [{"type": "reasoning_text", "text": p["text"]} for p in content]}


def canonical_items(raw: str | list[Any]) -> list[dict[str, Any]]:
    """The request's input as canonical items, or a 400 naming the item at fault."""
    if isinstance(raw, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "content": raw, "status": "completed"}]
    items = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind not in ITEM_TYPES:
            raise _refuse(f"{where}.type {kind!r:.40} is not supported: input items are messages, function_call, "
                          "function_call_output and reasoning items", f"{where}.type" if isinstance(item, dict)
                          else where)
        items.append({"message": _message, "function_call": _function_call,
                      "function_call_output": _function_call_output, "reasoning": _reasoning}[kind](item, where))
    return items


# ---- items -> chat messages ------------------------------------------------------------------------------
@dataclass
class ChatSources:
    """Where each chat message came from: its path in the request (or `previous_response_id`, or
    `instructions`) and, for a message with content parts, each part's."""

    messages: list[str] = field(default_factory=list)
    parts: dict[int, list[str]] = field(default_factory=dict)
    PATH = re.compile(r"messages\[(\d+)\](?:\.content\[(\d+)\])?((?:\.[A-Za-z_]+)*)")

    def add(self, where: str, parts: list[str] | None = None) -> None:
        if parts is not None:
            self.parts[len(self.messages)] = parts
        self.messages.append(where)

    def rename(self, text: str) -> str:
        """`text` with each chat field path replaced by the request's."""
        def one(match: re.Match[str]) -> str:
            m = int(match.group(1))
            if m >= len(self.messages):
                return match.group(0)
            if self.messages[m] in WHOLE_SOURCES:
                return self.messages[m]
            if match.group(2) is None:
                return self.messages[m] + match.group(3)
            parts = self.parts.get(m, [])
            j = int(match.group(2))
            base = parts[j] if j < len(parts) else f"{self.messages[m]}.content[{j}]"
            # a chat image part is {"image_url": {"url": ...}}; a Responses one's image_url is the URL
            return base + re.sub(r"^\.image_url(\.url)?", ".image_url", match.group(3))
        return self.PATH.sub(one, text)


@dataclass
class _Turn:
    """The assistant message a run of assistant items makes."""

    reasoning: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) if self.text else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def _chat_part(part: dict[str, Any]) -> dict[str, Any]:
    if part["type"] == "input_text":
        return {"type": "text", "text": part["text"]}
    if part["type"] == "input_audio":
        return {"type": "input_audio", "input_audio": part["input_audio"]}
    return {"type": "image_url", "image_url": {"url": part["image_url"]}}


def chat_messages(instructions: str | None, history: list[dict[str, Any]], items: list[dict[str, Any]],
                  input_is_text: bool = False) -> tuple[list[dict[str, Any]], ChatSources]:
    """The chat messages of a conversation: instructions, the stored history, then the request's items
    (`items[i]` came as `input[i]`, or as the string `input`); a 400 naming a function_call_output whose
    call_id no earlier function_call has."""
    messages: list[dict[str, Any]] = []
    sources = ChatSources()
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        sources.add("instructions")
    turn, turn_source, call_ids = None, "", set()
    located = [("previous_response_id", None, item) for item in history]
    located += [("input" if input_is_text else f"input[{i}]", i, item) for i, item in enumerate(items)]
    for where, index, item in located:
        kind = item["type"]
        assistant = kind in ("reasoning", "function_call") or (kind == "message" and item["role"] == "assistant")
        if turn is not None and (not assistant or (kind in ("reasoning", "message") and (turn.text or turn.calls))):
            messages.append(turn.message())
            sources.add(turn_source)
            turn = None
        if assistant:
            if turn is None:
                turn, turn_source = _Turn(), where
            if kind == "reasoning":
                turn.reasoning += [p["text"] for p in item["content"] if p["text"]]
            elif kind == "message":
                turn.text.append("".join(p["text"] for p in item["content"]))
            else:
                call_ids.add(item["call_id"])
                turn.calls.append({"id": item["call_id"], "type": "function",
                                   "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if item["call_id"] not in call_ids:
                raise _refuse(f"{where}.call_id {item['call_id']!r:.64} matches no earlier function_call item",
                              f"{where}.call_id" if index is not None else "previous_response_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            sources.add(where)
        else:
            content = item["content"]
            parts = None if isinstance(content, str) or index is None \
                else [f"{where}.content[{j}]" for j in range(len(content))]
            messages.append({"role": ROLES[item["role"]],
                             "content": content if isinstance(content, str) else list(map(_chat_part, content))})
            sources.add(where, parts)
    if turn is not None:
        messages.append(turn.message())
        sources.add(turn_source)
    return messages, sources


# ---- tools, tool_choice, text.format -----------------------------------------------------------------------
def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's shape; any other tool type a 400 naming `tools[i].type`."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _refuse(f"{where} must be a function tool object", where)
        if tool.get("type") != "function":
            raise RequestError(f"{where}.type {tool.get('type')!r:.40} is not supported: this server runs function "
                               "tools only (the client runs them and sends their output back)", param=f"{where}.type",
                               code="unsupported_parameter")
        _check_keys({k: v for k, v in tool.items() if not (k == "defer_loading" and v in (None, False))},
                    FUNCTION_TOOL_KEYS, where)
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """tool_choice in chat's shape: the options as they are, `{"type": "function", "name"}` as chat's."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise RequestError(f"tool_choice {choice!r:.80} is not supported: give none, auto, required or "
                       "{'type': 'function', 'name': ...}", param="tool_choice", code="unsupported_parameter")


def chat_response_format(text_format: Any) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None: plain text), or a 400 naming the field."""
    if not isinstance(text_format, dict):
        raise _refuse("text.format must be an object with a 'type'", "text.format")
    kind = text_format.get("type")
    if kind == "text":
        _check_keys(text_format, ("type",), "text.format")
        return None
    if kind == "json_object":
        _check_keys(text_format, ("type",), "text.format")
        return {"type": "json_object"}
    if kind == "json_schema":
        _check_keys(text_format, ("type", "name", "schema", "strict", "description"), "text.format")
        if not isinstance(text_format.get("name"), str) or not isinstance(text_format.get("schema"), dict):
            raise _refuse("text.format json_schema needs a 'name' and a 'schema' object", "text.format")
        return {"type": "json_schema", "json_schema": {k: text_format[k] for k in ("name", "schema", "strict")
                                                       if text_format.get(k) is not None}}
    raise _refuse(f"text.format.type must be text, json_object or json_schema, got {kind!r:.40}", "text.format.type")
