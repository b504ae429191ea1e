"""Anthropic's Messages API: its wire format (pydantic models).

Role: the request of POST /v1/messages (`MessagesRequest`) and of /v1/messages/count_tokens
(`CountTokensRequest`: the same conversation, no generation fields), their content blocks (text, image,
tool_use, tool_result, thinking: a discriminated union on `type`, so a wrong block is refused naming
`messages.0.content.1.type`), tools, tool_choice and thinking; the answer (`AnthropicMessage` and its
blocks) and Anthropic's error body. Every model forbids keys it does not define (a 400 naming them),
except the two requests, whose extra fields `refuse_extra_fields` names: the ones Anthropic defines and
this server does not implement (service_tier, container, mcp_servers, ...) and the unknown ones. A
field with a default takes `null` as that default (`NullMeansUnset`).
What it does not know: chat completions, the engine, HTTP routing, streaming.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mmserve.entrypoints.openai.protocol import NullMeansUnset, RequestError

# Anthropic's request fields this server does not implement: refused with a 400 naming them
UNIMPLEMENTED_FIELDS = ("service_tier", "container", "mcp_servers", "context_management", "output_config",
                        "output_format", "inference_geo", "cache_control", "speed", "diagnostics",
                        "user_profile_id", "workspace_id", "betas")
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # Anthropic's names that OpenAI's tools also take


class Strict(NullMeansUnset):
    model_config = ConfigDict(extra="forbid")  # a key no one defines is a 400 naming it, never ignored


class CacheControl(Strict):
    """A prompt-caching breakpoint: accepted, as every prefix is cached here without one."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# ---- content blocks ----------------------------------------------------------------------------------
class TextBlockParam(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # citations are not implemented: only null is taken


class Base64ImageSource(Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str

    @field_validator("data")
    @classmethod
    def _decodes(cls, data: str) -> str:
        try:
            base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"the image data is not valid base64 ({exc})") from None
        return data

    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{self.data}"


class UrlImageSource(Strict):
    type: Literal["url"]
    url: str


class ImageBlockParam(Strict):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | UrlImageSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None


class ToolUseBlockParam(Strict):
    """An assistant turn's call of a tool."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockParam(Strict):
    """A user turn's answer to an earlier tool_use of the same id."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlockParam] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        """The result as the chat template renders it: its text blocks joined, as Anthropic places them."""
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlockParam(Strict):
    """An assistant turn's thought, given back: the chat template's `reasoning_content`."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # Anthropic's; this server signs nothing and checks nothing


ContentBlock = Annotated[TextBlockParam | ImageBlockParam | ToolUseBlockParam | ToolResultBlockParam
                         | ThinkingBlockParam, Field(discriminator="type")]


class MessageParam(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _string_or_blocks(cls, content: Any) -> Any:
        if not isinstance(content, (str, list)):  # one error naming the field, not one per union member
            raise ValueError("content must be a string or a list of content blocks")
        return content


# ---- tools, tool choice, thinking ---------------------------------------------------------------------
class ToolParam(Strict):
    """A client tool (`type` absent or "custom"); Anthropic's server tools are refused by their type."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None  # a forced call is held to its schema either way (tools.py)
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _an_object_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema of type 'object'")
        return schema


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class ThinkingEnabled(Strict):
    type: Literal["enabled"]
    # checked, but the thought is bounded by max_tokens only (no engine budget for thoughts)
    budget_tokens: int = Field(ge=1, strict=True)


class ThinkingAdaptive(Strict):
    type: Literal["adaptive"]  # the model decides how much to think: a thinking template's thought


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


ThinkingConfig = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class Metadata(Strict):
    user_id: str | None = None  # who asks: taken, never echoed, never what is generated


# ---- requests -----------------------------------------------------------------------------------------
class CountTokensRequest(NullMeansUnset):
    """A conversation as /v1/messages/count_tokens takes it (and /v1/messages, with generation fields)."""

    model_config = ConfigDict(extra="allow")  # refuse_extra_fields names what is not defined here
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_string_or_blocks(cls, system: Any) -> Any:
        if system is not None and not isinstance(system, (str, list)):
            raise ValueError("system must be a string or a list of text blocks")
        return system

    def refuse_extra_fields(self) -> None:
        """A 400 naming the first field no model field declares (null ones count as absent)."""
        for name, value in (self.model_extra or {}).items():
            if value is None:
                continue
            if name in UNIMPLEMENTED_FIELDS:
                raise RequestError(f"{name}: this field is not implemented by this server "
                                   f"(got {value!r:.80})", param=name, code="unsupported_parameter")
            raise RequestError(f"{name}: unknown field: this server neither implements nor ignores fields it "
                               "does not know", param=name, code="unsupported_parameter")

    def system_text(self) -> str | None:
        """The system prompt: its text blocks joined, as Anthropic places them (a block may end only
        where a cache breakpoint was set, mid-sentence)."""
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(block.text for block in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, strict=True)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None


# ---- responses ----------------------------------------------------------------------------------------
class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def anthropic_error_type(status_code: int) -> str:
    """Anthropic's error type for an HTTP status."""
    named = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
             503: "overloaded_error", 529: "overloaded_error"}
    return named.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")


# ---- error locations ----------------------------------------------------------------------------------
_TYPE_LABELS = ("str", "int", "float", "bool", "none", "dict", "list")


def _is_label(part: str) -> bool:
    """A union member's label that pydantic puts in an error's location ('str', 'list[...]', a class name):
    never one of these models' field names, which are snake_case words."""
    return "[" in part or part in _TYPE_LABELS or part[:1].isupper()


def field_path(loc: Sequence[Any], body: Any) -> str:
    """An error's location as Anthropic's style names a field, `messages.0.content.1.source`: dotted, indices
    bare, without what pydantic adds for a union (a member's type, and a tagged union's tag such as `image`).
    A tag is told from a field of the same name by walking the request body: it comes first at the block
    whose `type` it is, and never last."""
    path: list[str] = []
    node, tagged = body, False
    for k, part in enumerate(loc):
        if isinstance(node, list) and isinstance(part, int):
            path.append(str(part))
            node, tagged = (node[part] if 0 <= part < len(node) else None), False
        elif isinstance(node, dict) and part == node.get("type") and not tagged and k < len(loc) - 1:
            tagged = True  # the tag of the member the block was read as
        elif isinstance(node, dict) and part in node:
            path.append(str(part))
            node, tagged = node[part], False
        elif not (isinstance(part, str) and _is_label(part)):
            path.append(str(part))  # a field the body lacks (required) or should not have (extra)
            node = None
    return ".".join(path)


def validation_message(errors: Sequence[dict[str, Any]], body: Any) -> tuple[str, str | None]:
    """(message, field) for a request's validation errors, the most specific first: an error about a
    union's other member (`content` is no string, where it is a list with a bad block) is left out where
    another names a field inside it."""
    located = []
    for error in errors:
        loc = list(error.get("loc", ()))
        path = field_path(loc[1:] if loc[:1] == ["body"] else loc, body)
        if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):
            path = f"{path}.type" if path else "type"
        located.append((path, str(error.get("msg", "invalid")).removeprefix("Value error, ")))
    specific = [(p, m) for p, m in located if not any(o.startswith(p + ".") for o, _ in located if p)]
    specific.sort(key=lambda pm: -pm[0].count("."))
    shown = list(dict.fromkeys(f"{p or 'the request body'}: {m}" for p, m in specific))[:3]
    return "; ".join(shown) or "invalid request", (specific[0][0] or None) if specific else None
