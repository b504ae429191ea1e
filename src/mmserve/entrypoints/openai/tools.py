"""Tool calling on the chat route: the request's tools, the model's call syntax, the grammar of forced calls.

Role: `parse_tools` validates `tools` / `tool_choice` / `parallel_tool_calls` into a `ToolRequest`;
`tool_format(chat_template)` picks the model's call syntax from its chat template, with no flag (Qwen's and
Hermes' `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, which the bundled demo model's template
and Qwen2.5/Qwen3's render); `ToolFormat.parse` splits a finished answer into content and calls (text that
only looks like a call stays content); `ToolFormat.structural_tag` is the xgrammar structural tag that makes
`required` and named choices always parse and match the tool's parameters (whatever `strict` says, as
vLLM constrains them); `ToolCallStream` turns a
growing answer into content deltas and whole-call deltas for streaming.
What it does not know: the engine, HTTP, sampling, pictures.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mmserve.engine.structured_outputs import json_schema_ebnf
from mmserve.entrypoints.openai.reasoning import partial_tag_len
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


@dataclass(frozen=True)
class ToolFormat:
    """One call syntax: each call is `begin` + {"name": ..., "arguments": ...} + `end`, calls joined by
    `separator`."""

    name: str
    begin: str
    end: str
    separator: str

    def parse(self, text: str, tools: ToolRequest) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer. Calls are taken only when every `begin` ... `end` block
        holds a JSON object naming one of the tools with an object of arguments; else it is all content."""
        start = text.find(self.begin.strip())
        if start < 0:
            return text, []
        pattern = re.escape(self.begin.strip()) + r"\s*(.*?)\s*" + re.escape(self.end.strip())
        blocks = list(re.finditer(pattern, text[start:], re.DOTALL))
        if not blocks or text[start:][blocks[-1].end():].strip():
            return text, []
        names = {t.name for t in tools.tools}
        calls = []
        for block in blocks:
            try:
                call = json.loads(block.group(1))
            except ValueError:
                return text, []
            arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
            if not isinstance(call, dict) or call.get("name") not in names or not isinstance(arguments, dict):
                return text, []
            calls.append(ToolCall(new_call_id(), call["name"], json.dumps(arguments, ensure_ascii=False)))
        if not tools.parallel:  # parallel_tool_calls false: the first call only (a forced choice makes just one)
            calls = calls[:1]
        content = text[:start].strip()
        return content or None, calls

    def structural_tag(self, tools: ToolRequest) -> dict[str, Any]:
        """xgrammar's structural tag for a forced choice: one call (or, with parallel_tool_calls, one or
        more) of the forced tools, arguments held to the tool's parameters, with no free whitespace (a
        small model pads forever)."""
        tags = [{"type": "tag", "begin": self.begin + json.dumps({"name": t.name})[:-1] + ', "arguments": ',
                 "content": {"type": "grammar", "grammar": json_schema_ebnf(t.parameters, "tools")},
                 "end": "}" + self.end} for t in tools.forced]
        return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags,
                                                      "separator": self.separator, "at_least_one": True,
                                                      "stop_after_first": not tools.parallel}}


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n")
TOOL_FORMATS = {"hermes": HERMES}


def tool_format(chat_template: str | None) -> ToolFormat | None:
    """The call syntax the model's chat template renders (None: its template renders no tools)."""
    if chat_template and "tools" in chat_template and "<tool_call>" in chat_template:
        return HERMES
    return None


@dataclass
class ToolCallStream:
    """A growing answer as stream deltas: content until a call may have begun, then each call whole when
    its end arrives (id and name in one delta, its arguments in the next). Whatever stays unparsed at
    the end (a broken call) is sent as content."""

    format: ToolFormat
    tools: ToolRequest
    sent_content: int = 0  # characters of the text sent as content
    calls: list[ToolCall] = field(default_factory=list)

    def update(self, text: str, finished: bool) -> tuple[str, list[tuple[int, ToolCall]]]:
        """(new content, new (index, call) pairs) for the answer's text so far."""
        begin = self.format.begin.strip()
        start = text.find(begin)
        if start < 0:
            # hold back a tail that could be the start of a call's opening tag
            safe = len(text) - (0 if finished else partial_tag_len(text, begin))
            new, self.sent_content = text[self.sent_content:safe], max(self.sent_content, safe)
            return new, []
        content_end = len(text[:start].rstrip())
        new_content = text[self.sent_content:content_end] if content_end > self.sent_content else ""
        self.sent_content = max(self.sent_content, content_end)
        calls = self.format.parse(text, self.tools)[1] if finished else self._complete_calls(text[start:])
        if finished and not calls:  # not calls after all: the rest is content
            rest, self.sent_content = text[self.sent_content:], len(text)
            return new_content + rest, []
        fresh = [(len(self.calls) + i, c) for i, c in enumerate(calls[len(self.calls):])]
        self.calls.extend(c for _, c in fresh)
        return new_content, fresh

    def _complete_calls(self, tail: str) -> list[ToolCall]:
        """The calls whose end tag has arrived (only those past the ones already sent are used)."""
        end = self.format.end.strip()
        cut = tail.rfind(end)
        return [] if cut < 0 else self.format.parse(tail[:cut + len(end)], self.tools)[1]
