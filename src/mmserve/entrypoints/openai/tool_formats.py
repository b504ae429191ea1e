"""The model's tool-call syntax: parsing a finished answer, streaming a growing one, forcing a call.

Role: every format writes each call between a begin and an end tag and differs inside. `HERMES` (Qwen2.5,
Qwen3-VL, the demo model): `<tool_call>` `{"name": ..., "arguments": {...}}` `</tool_call>`. `QWEN3_XML`
(Qwen3.5, Qwen3-Coder): `<function=NAME>` then one `<parameter=KEY>\\nVALUE\\n</parameter>` per argument, a
string written raw and any other value as JSON (as their chat templates render an assistant's calls), inside
the same tags. `GEMMA4`: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>` (gemma4_syntax.py), its
tags special tokens (`special`: the answer is decoded with them kept) and its turn-end markers (`ends`) dropped
from the end of the answer. `tool_format(chat_template, parser)` picks the syntax from the template, or by
vLLM's parser name.
`ToolFormat.parse` splits a finished answer into content and calls (text that only looks like a call stays
content); `ToolFormat.structural_tag` is the xgrammar structural tag that makes `required` and named choices
always parse and match the tool's parameters; `ToolCallStream` turns a growing answer into content deltas
and whole-call deltas.
What it does not know: the engine, HTTP, sampling, pictures, how the request's tools were validated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from mmserve.engine.structured_outputs import json_schema_ebnf
from mmserve.entrypoints.openai import gemma4_syntax
from mmserve.entrypoints.openai.reasoning import partial_tag_len, without_end
from mmserve.entrypoints.openai.tools import ToolCall, ToolRequest, ToolSpec, new_call_id

BEGIN, END, SEPARATOR = "<tool_call>\n", "\n</tool_call>", "\n"


@dataclass(frozen=True)
class ToolFormat:
    """One call syntax: each call is BEGIN + a body + END, calls joined by SEPARATOR; the subclass reads
    and constrains the body."""

    name: str
    begin: str = BEGIN
    end: str = END
    separator: str = SEPARATOR
    ends: tuple[str, ...] = ()  # turn-end markers a decode that keeps special tokens leaves at the end
    special: bool = False  # the tags are special tokens: the answer must be decoded with them kept

    def parse(self, text: str, tools: ToolRequest) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer. Calls are taken only when every `begin` ... `end` block
        is a well-formed call of one of the tools and nothing but whitespace follows the last; else it is
        all content."""
        text = without_end(text, self.ends)
        start = text.find(self.begin.strip())
        if start < 0:
            return text, []
        pattern = re.escape(self.begin.strip()) + r"\s*(.*?)\s*" + re.escape(self.end.strip())
        blocks = list(re.finditer(pattern, text[start:], re.DOTALL))
        if not blocks or text[start:][blocks[-1].end():].strip():
            return text, []
        by_name = {t.name: t for t in tools.tools}
        calls = []
        for block in blocks:
            call = self.read_call(block.group(1), by_name)
            if call is None:
                return text, []
            calls.append(ToolCall(new_call_id(), call[0], json.dumps(call[1], ensure_ascii=False)))
        if not tools.parallel:  # parallel_tool_calls false: the first call only (a forced choice makes just one)
            calls = calls[:1]
        content = text[:start].strip()
        return content or None, calls

    def read_call(self, body: str, tools: dict[str, ToolSpec]) -> tuple[str, dict[str, Any]] | None:
        """(name, arguments) of one call's body, or None when it is no call of one of `tools`."""
        raise NotImplementedError

    def call_tag(self, tool: ToolSpec) -> dict[str, Any]:
        """The structural tag of one call of `tool`, its arguments held to the tool's parameters."""
        raise NotImplementedError

    def structural_tag(self, tools: ToolRequest) -> dict[str, Any]:
        """xgrammar's structural tag for a forced choice: a named choice makes exactly one call (as vLLM's
        does); `required` one, or with parallel_tool_calls one or more, of the tools."""
        return {"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": [self.call_tag(t) for t in tools.forced],
            "separator": self.separator, "at_least_one": True,
            "stop_after_first": not tools.parallel or tools.choice == "named"}}


@dataclass(frozen=True)
class JsonToolFormat(ToolFormat):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (`parameters` read as `arguments`)."""

    def read_call(self, body: str, tools: dict[str, ToolSpec]) -> tuple[str, dict[str, Any]] | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("name") not in tools or not isinstance(arguments, dict):
            return None
        return call["name"], arguments

    def call_tag(self, tool: ToolSpec) -> dict[str, Any]:
        # compact JSON with no free whitespace: a small model pads forever
        return {"type": "tag", "begin": self.begin + json.dumps({"name": tool.name})[:-1] + ', "arguments": ',
                "content": {"type": "grammar", "grammar": json_schema_ebnf(tool.parameters, "tools")},
                "end": "}" + self.end}


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _xml_value(raw: str, schema: Any) -> Any:
    """One XML parameter's value: raw text where the schema says string (or does not know the parameter),
    else the JSON it holds (raw text where it holds none)."""
    if not isinstance(schema, dict):
        return raw
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    if "string" in types:
        return raw
    enum = schema.get("enum") if not types and isinstance(schema.get("enum"), list) else []
    for written in (raw, raw.strip()):  # a forced grammar lets whitespace around a value that is not a string
        if written in enum:
            return written
    if not types and "enum" not in schema and not any(k in schema for k in ("anyOf", "oneOf", "$ref")):
        return raw  # a schema that says nothing of the value's type: as written
    try:
        return json.loads(raw)
    except ValueError:
        return raw


@dataclass(frozen=True)
class XmlToolFormat(ToolFormat):
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`."""

    def read_call(self, body: str, tools: dict[str, ToolSpec]) -> tuple[str, dict[str, Any]] | None:
        match = _FUNCTION.fullmatch(body.strip())
        if match is None or match.group(1).strip() not in tools:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        if _PARAMETER.sub("", inner).strip():
            return None  # text outside the parameters: not a call
        properties = tools[name].parameters.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        arguments: dict[str, Any] = {}
        for parameter in _PARAMETER.finditer(inner):
            key = parameter.group(1).strip()
            if key in arguments:
                return None
            raw = parameter.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw  # the template's newline after the tag and before
            raw = raw[:-1] if raw.endswith("\n") else raw  # the closing one are no part of the value
            arguments[key] = _xml_value(raw, properties.get(key))
        return name, arguments

    def call_tag(self, tool: ToolSpec) -> dict[str, Any]:
        # xgrammar's Qwen XML style; one whitespace character where the template writes a newline (a small
        # model pads forever where free whitespace is allowed)
        return {"type": "tag", "begin": f"{self.begin}<function={tool.name}>\n",
                "content": {"type": "json_schema", "json_schema": tool.parameters, "style": "qwen_xml",
                            "max_whitespace_cnt": 1},
                "end": "\n</function>" + self.end}


@dataclass(frozen=True)
class Gemma4ToolFormat(ToolFormat):
    """`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`, calls written back to back."""

    begin: str = gemma4_syntax.CALL_BEGIN
    end: str = gemma4_syntax.CALL_END
    separator: str = ""
    ends: tuple[str, ...] = gemma4_syntax.TURN_ENDS
    special: bool = True

    def read_call(self, body: str, tools: dict[str, ToolSpec]) -> tuple[str, dict[str, Any]] | None:
        return gemma4_syntax.read_call(body, tools)

    def call_tag(self, tool: ToolSpec) -> dict[str, Any]:
        return {"type": "tag", "begin": self.begin + tool.name, "content": gemma4_syntax.call_content(tool.parameters),
                "end": self.end}


HERMES = JsonToolFormat("hermes")
QWEN3_XML = XmlToolFormat("qwen3_xml")
GEMMA4 = Gemma4ToolFormat("gemma4")
# vLLM's --tool-call-parser names of these syntaxes
TOOL_FORMATS: dict[str, ToolFormat] = {"hermes": HERMES, "qwen3_xml": QWEN3_XML, "qwen3_coder": QWEN3_XML,
                                       "gemma4": GEMMA4}


def tool_format(chat_template: str | None, parser: str | None = None) -> ToolFormat | None:
    """The call syntax the model's chat template renders, or the one `parser` names (None: the template
    renders no tools, so the model is never told of them)."""
    if not chat_template or "tools" not in chat_template:
        return None
    if parser not in (None, "auto"):
        return TOOL_FORMATS[parser]
    if gemma4_syntax.CALL_OPEN in chat_template:
        return GEMMA4
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return QWEN3_XML
    return HERMES if "<tool_call>" in chat_template else None


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
        text = without_end(text, self.format.ends)
        begin = self.format.begin.strip()
        start = text.find(begin)
        if start < 0:
            # hold back a tail that could be the start of a call's opening tag (or of a turn end), and
            # trailing whitespace (the content before a call is sent stripped, as the finished answer's)
            held = max(partial_tag_len(text, tag) for tag in (begin, *self.format.ends))
            safe = len(text) if finished else len(text[:len(text) - held].rstrip())
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
