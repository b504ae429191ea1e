"""The Responses API's wire format: the request body, its checks, and the Response object and its items.

Role: `ResponsesRequest` (the fields of `POST /v1/responses` this server implements; OpenAI's fields it
does not implement are accepted only at the value that asks for nothing, `NEUTRAL_FIELDS`, anything else
is a 400 naming the field, and so is a field no one defines); the top-level checks (metadata, reasoning,
text, background, truncation); and the answer's pydantic models — `ResponseObject`, its output items
(`OutputMessage`, `FunctionCallItem`, `ReasoningItem`) and `ResponseUsage` — in the `openai` SDK's shapes,
no field OpenAI does not send, `null` where OpenAI sends null.
What it does not know: how input items become a chat (responses_input.py), the engine, the store, HTTP.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mmserve.entrypoints.openai.protocol import NullMeansUnset, RequestError

# OpenAI's request fields this server does not implement, with the values that ask for nothing (a client
# may send those): anything else is refused with a 400 naming the field, never ignored
NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "truncation": (None, "disabled"), "include": (None, []),
    "top_logprobs": (None, 0), "max_tool_calls": (None,), "service_tier": (None, "auto", "default"),
    "prompt": (None,), "conversation": (None,), "context_management": (None, []),
    "prompt_cache_retention": (None, "in_memory"), "prompt_cache_options": (None,),
    "stream_options": (None, {}, {"include_obfuscation": False}), "background_options": (None,),
    "moderation": (None,), "access_programs": (None,), "image": (None,),
}
# why a field is refused, where there is more to say than "not supported"
REFUSAL_HINTS = {
    "background": ": responses run while the request is open (stream them to see them grow)",
    "truncation": ": 'auto' would drop input items to fit the context; send a shorter history instead",
    "include": ": there is nothing more to include (no encrypted reasoning, logprobs, or tool results)",
    "conversation": ": continue a conversation with previous_response_id",
}
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(NullMeansUnset):
    """`POST /v1/responses`: the fields implemented (the rest: `NEUTRAL_FIELDS`, checked by `check_fields`)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: Any = None  # a string, or a list of items (checked by check_fields and responses_input.py)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": null | "none"}
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    # who asks, never what is generated: taken whatever they say, and echoed as OpenAI does
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def check_fields(self) -> None:
        """400 for a field OpenAI defines at a value this server cannot honour, or a field no one defines."""
        extra = self.model_extra or {}
        for name, neutral in NEUTRAL_FIELDS.items():
            if name in extra and extra[name] not in neutral:
                raise RequestError(f"'{name}' is not supported by this server (got {extra[name]!r:.80})"
                                   f"{REFUSAL_HINTS.get(name, '')}", param=name, code="unsupported_parameter")
        unknown = sorted(set(extra) - set(NEUTRAL_FIELDS))
        if unknown:
            raise RequestError(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}: this server "
                               "neither implements nor ignores fields it does not know", param=unknown[0],
                               code="unsupported_parameter")
        if not isinstance(self.input, (str, list)) or not self.input:
            raise RequestError(f"input must be a non-empty string or list of input items, got {self.input!r:.40}",
                               param="input")
        self._check_metadata()
        self._check_reasoning()
        self._check_text()

    def _check_metadata(self) -> None:
        if self.metadata is None:
            return
        if len(self.metadata) > MAX_METADATA_PAIRS:
            raise RequestError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(self.metadata)}",
                               param="metadata")
        for key, value in self.metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
                raise RequestError(f"metadata keys are strings of at most {MAX_METADATA_KEY_CHARS} characters and its "
                                   f"values strings of at most {MAX_METADATA_VALUE_CHARS}; {key!r:.80} is not",
                                   param=f"metadata.{key[:64]}")

    def _check_reasoning(self) -> None:
        reasoning = self.reasoning or {}
        for key, value in reasoning.items():
            if key == "effort":
                if value not in (None, "none"):
                    raise RequestError(f"reasoning.effort {value!r:.40} cannot be honoured: a model here thinks as its "
                                       "chat template lets it, with no budget; give null, or 'none' for no thought",
                                       param="reasoning.effort", code="unsupported_parameter")
            elif key in ("summary", "generate_summary", "context", "mode"):
                if value is not None:
                    raise RequestError(f"reasoning.{key} is not supported (got {value!r:.40}): the thought comes back "
                                       "whole, as reasoning_text, never summarised", param=f"reasoning.{key}",
                                       code="unsupported_parameter")
            else:
                raise RequestError(f"unknown field reasoning.{key}", param=f"reasoning.{key[:64]}")

    def _check_text(self) -> None:
        for key, value in (self.text or {}).items():
            if key == "verbosity" and value is not None:
                raise RequestError("text.verbosity is not supported: the model writes as it writes",
                                   param="text.verbosity", code="unsupported_parameter")
            if key not in ("format", "verbosity"):
                raise RequestError(f"unknown field text.{key}", param=f"text.{key[:64]}")

    @property
    def reasoning_effort(self) -> str | None:
        return (self.reasoning or {}).get("effort")

    @property
    def text_format(self) -> dict[str, Any]:
        return (self.text or {}).get("format") or {"type": "text"}


# ---- the answer -----------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the KV prefix cache
    cache_write_tokens: int = 0  # prompt tokens in full KV blocks not cached before: the prefix cache keeps them


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # generated tokens of the thought (its closing tag included)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str = "server_error"
    message: str


class ResponseObject(BaseModel):
    """The Response object: what was generated and, echoed, what the request asked for."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool = False
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    prompt_cache_retention: None = None
    reasoning: dict[str, Any]
    safety_identifier: str | None
    service_tier: Literal["default"] = "default"
    temperature: float | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_logprobs: int = 0
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]
