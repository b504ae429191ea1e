"""Tool calling on the chat route: the request's tools, validated.

Role: `parse_tools` validates `tools` / `tool_choice` / `parallel_tool_calls` into a `ToolRequest` (the
tools, the functions a forced choice allows, whether calls may come in parallel); `ToolCall` is one parsed
call. The model's call syntax (JSON or XML inside `<tool_call>`), its parsing, streaming and forced-call
grammar live in tool_formats.py.
What it does not know: the engine, HTTP, sampling, pictures, any call syntax.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidInputError


@dataclass(frozen=True)
class ToolSpec:
    name: str
    # a JSON schema of the arguments object, which a forced call's arguments are held to (OpenAI's
    # `strict` changes nothing here: a forced call is always held to it, as vLLM holds it)
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[ToolSpec, ...]
    template_tools: tuple[dict[str, Any], ...]  # as the chat template receives them (OpenAI's shape)
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None  # the function a named choice forces
    parallel: bool

    @property
    def forced(self) -> tuple[ToolSpec, ...]:
        """The tools a grammar must choose among (required: any; named: that one); none for auto/none."""
        if self.choice == "required":
            return self.tools
        if self.choice == "named":
            return tuple(t for t in self.tools if t.name == self.named)
        return ()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The request's tools (None when it has none and no choice), or InvalidInputError naming the field."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidInputError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidInputError("tools must be a list of {'type': 'function', 'function': {...}}", param="tools")
    specs, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidInputError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
            raise InvalidInputError(f"{where}.function.name must be 1-64 letters, digits, _ . : or -", param=where)
        if name in names:
            raise InvalidInputError(f"{where}: two tools are named {name!r}", param=where)
        names.add(name)
        parameters = function.get("parameters")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        if not isinstance(parameters, dict):
            raise InvalidInputError(f"{where}.function.parameters must be a JSON schema object", param=where)
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise InvalidInputError(f"{where}.function.strict must be true, false or null", param=where)
        # `strict` written inside the schema (a common slip) is no JSON-schema keyword: not a constraint
        specs.append(ToolSpec(name, {k: v for k, v in parameters.items() if k != "strict"}))
    choice, named = tool_choice if tool_choice is not None else "auto", None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or "name" not in function:
            raise InvalidInputError("tool_choice must be none, auto, required or {'type': 'function', "
                                    "'function': {'name': ...}}", param="tool_choice")
        named = function["name"]
        if named not in names:
            raise InvalidInputError(f"tool_choice names {named!r:.64}, which is not among the tools",
                                    param="tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise InvalidInputError(f"tool_choice must be none, auto, required or a named function, got {choice!r:.40}",
                                param="tool_choice")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidInputError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    return ToolRequest(tuple(specs), tuple(tools), choice, named,
                       True if parallel_tool_calls is None else parallel_tool_calls)


def parsed_tool_arguments(messages: Any) -> Any:
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
