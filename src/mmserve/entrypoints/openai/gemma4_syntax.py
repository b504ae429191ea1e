"""Gemma 4's answer syntax: its markers, and the notation of a tool call's arguments.

Role: Gemma 4 (Google, 2026) thinks in `<|channel>thought\\n` ... `<channel|>`, calls a tool as
`<|tool_call>call:NAME{key:value,...}<tool_call|>` (several in a row for parallel calls) and ends its turn
with `<turn|>` (or `<|tool_response>`, handing over to the tool; `<eos>`). Inside a call the arguments are a
JSON-like object whose keys are unquoted at every level and whose strings are written raw between `<|"|>`
delimiters (no escapes: a string holds any text but the delimiter); numbers, true, false, null, arrays and
objects are written as JSON writes them. `read_call` reads one call's body (`NAME{...}`) strictly: anything
else (a bare word where a value belongs, a trailing comma, a repeated key, text after the object) is no call.
`call_content` is the xgrammar structural-tag content that forces such arguments to follow a JSON schema
(xgrammar's own `gemma` style). Every marker here is a special token of Gemma 4's tokenizer: a decode that
skips special tokens loses them all.
What it does not know: tools beyond their names and schemas, streaming, the engine, other models.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container
from typing import Any

from mmserve.inputs.chat_template import CHANNEL_CLOSE, CHANNEL_OPEN

THOUGHT_LABEL = "thought\n"  # what follows CHANNEL_OPEN when the channel is a thought
CALL_OPEN, CALL_END = "<|tool_call>", "<tool_call|>"
CALL_BEGIN = CALL_OPEN + "call:"  # what a call's text starts with, its name right after
STRING_DELIMITER = '<|"|>'
# where a Gemma 4 turn ends (transformers' response parser closes the content at each): the text of the
# stop token itself where the answer is decoded with its special tokens kept
TURN_ENDS = ("<turn|>", "<|tool_response>", "<eos>")
# what a forced call's strings and keys may not hold: a marker there would end the call (or a thought) early
# in the parser that reads it back (xgrammar's builtin Gemma 4 tag excludes the same)
_ARGUMENT_EXCLUDES = (CALL_OPEN, CALL_END, CHANNEL_OPEN, CHANNEL_CLOSE)

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_BARE_KEY = re.compile(r"[^\s:,{}\[\]<>\"]+")
_LITERALS = (("true", True), ("false", False), ("null", None))


class _Malformed(ValueError):
    """The text is not in the notation (the call stays content)."""


class _Reader:
    """A cursor over one arguments object, reading values recursively."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def take(self, literal: str) -> bool:
        self.skip_space()
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def expect(self, literal: str) -> None:
        if not self.take(literal):
            raise _Malformed(literal)

    def string(self) -> str:
        start = self.pos + len(STRING_DELIMITER)
        end = self.text.find(STRING_DELIMITER, start)
        if end < 0:
            raise _Malformed("an unterminated string")
        self.pos = end + len(STRING_DELIMITER)
        return self.text[start:end]

    def key(self) -> str:
        self.skip_space()
        if self.text.startswith(STRING_DELIMITER, self.pos):  # the template's own `escape_keys` spelling
            return self.string()
        match = _BARE_KEY.match(self.text, self.pos)
        if match is None:
            raise _Malformed("a key")
        self.pos = match.end()
        return match.group()

    def value(self) -> Any:
        self.skip_space()
        if self.text.startswith(STRING_DELIMITER, self.pos):
            return self.string()
        if self.take("{"):
            return self.members()
        if self.take("["):
            return self.items()
        for word, value in _LITERALS:
            if self.text.startswith(word, self.pos):
                self.pos += len(word)
                return value
        number = _NUMBER.match(self.text, self.pos)
        if number is None:
            raise _Malformed("a value")  # a bare word: Gemma writes every string between delimiters
        self.pos = number.end()
        return json.loads(number.group())

    def members(self) -> dict[str, Any]:
        """An object's members, after its `{`."""
        members: dict[str, Any] = {}
        if self.take("}"):
            return members
        while True:
            key = self.key()
            self.expect(":")
            if key in members:
                raise _Malformed("a repeated key")
            members[key] = self.value()
            if self.take("}"):
                return members
            self.expect(",")

    def items(self) -> list[Any]:
        """An array's items, after its `[`."""
        items: list[Any] = []
        if self.take("]"):
            return items
        while True:
            items.append(self.value())
            if self.take("]"):
                return items
            self.expect(",")


def parse_arguments(text: str) -> dict[str, Any] | None:
    """The arguments object written in Gemma 4's notation (`{key:<|"|>text<|"|>,n:3}`), or None where `text`
    is anything more or less than one such object."""
    reader = _Reader(text)
    try:
        reader.expect("{")
        arguments = reader.members()
        reader.skip_space()
    except (_Malformed, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return None
    return arguments if reader.pos == len(text) else None


def read_call(body: str, names: Container[str]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one call's body, `NAME{...}` (what follows `<|tool_call>call:`), or None where it
    is not a well-formed call of one of `names`."""
    brace = body.find("{")
    if brace <= 0 or body[:brace] not in names:
        return None
    arguments = parse_arguments(body[brace:])
    return None if arguments is None else (body[:brace], arguments)


def call_content(schema: dict[str, Any]) -> dict[str, Any]:
    """The structural-tag content of a call's arguments (the `{...}` after its name), held to `schema`:
    xgrammar's `gemma` style of JSON schema (unquoted keys, `<|"|>` strings at every level), the properties in
    the schema's order, at most one whitespace character in a row (the template writes none; a small model
    pads forever where free whitespace is allowed)."""
    return {"type": "json_schema", "json_schema": schema, "style": "gemma", "max_whitespace_cnt": 1,
            "excludes": list(_ARGUMENT_EXCLUDES)}
