"""The wire format every OpenAI endpoint shares (pydantic models).

Role: errors (`RequestError` and OpenAI's error body), `GenerationRequest` — the sampling fields chat and
text completions share, and the one mapping from them to `SamplingParams` — and the response parts both
answer with (usage, logprobs). A request field with a default takes `null` as that default
(`NullMeansUnset`); a response part may leave out its null fields (`WireModel`). Each endpoint's own
request and response bodies live in its module (chat.py, completions.py, tokens.py, models.py). No field
is accepted and ignored: OpenAI's and vLLM's fields mmserve does not implement (`UNSUPPORTED_FIELDS`:
audio, priority, ...) are accepted only at their neutral value (what a client sends when it asks for
nothing), anything else is refused with a 400 that names them, and so is a field no one defines; only
`IDENTITY_FIELDS` (`user`: who asks, never what is generated, as at OpenAI) are taken whatever they say.
What it does not know: the engine, media, HTTP routing, any one endpoint.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from mmserve.errors import InvalidInputError
from mmserve.sampling_params import SamplingParams, StructuredOutputsParams


class RequestError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.type, self.param, self.code = message, status_code, type, param, code


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests -------------------------------------------------------------------------------------
class NullMeansUnset(BaseModel):
    """A request body in which an explicit `null` for a field with a default means the default, as OpenAI
    and vLLM document their nullable fields (clients such as LangChain send `"n": null`). A required
    field's null stays an error naming it."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if not (v is None and k in defaulted)}

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        """The OpenAPI schema says so too: every field with a default also takes `null` (a client that
        checks requests against /openapi.json may send it)."""
        schema = handler(core_schema)
        properties = handler.resolve_ref_schema(schema).get("properties", {})
        for name, field in cls.model_fields.items():
            prop = properties.get(field.alias or name)
            if field.is_required() or prop is None or _takes_null(prop):
                continue
            meta = {key: prop.pop(key) for key in ("title", "default", "description") if key in prop}
            properties[field.alias or name] = {"anyOf": [prop, {"type": "null"}], **meta}
        return schema


def _takes_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or any(_takes_null(p) for p in prop.get("anyOf", ()))


class StreamOptions(NullMeansUnset):
    model_config = ConfigDict(extra="forbid")  # an option no one defines is a 400, never ignored
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


# OpenAI request fields mmserve does not implement, with the values that ask for nothing (a client may send
# those): any other value is refused with a 400 naming the field, never silently ignored
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"), "best_of": (None, 1),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "guided_decoding_backend": (None, "xgrammar", "auto"),  # vLLM's older name for the one backend there is
    # OpenAI's: stored completions, service tiers
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    # vLLM's
    "spaces_between_special_tokens": (None, True), "priority": (None, 0), "include_reasoning": (None, True),
    "documents": (None, []), "chat_template": (None,), "media_io_kwargs": (None, {}), "vllm_xargs": (None, {}),
    "kv_transfer_params": (None,), "logprob_token_ids": (None,), "prompt_embeds": (None,), "request_id": (None,),
    "thinking_token_budget": (None,), "watermarking": (None, False), "logits_processors": (None, []),
}
# OpenAI's fields that say who asks, never what is generated (OpenAI uses them to watch for abuse)
IDENTITY_FIELDS = ("user", "safety_identifier", "prompt_cache_key")
# vLLM's older names of structured_outputs' keys
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object", "any_whitespace")
STRUCTURED_ALIASES = ("disable_any_whitespace",)
INT64_RANGE = (-(2**63), 2**63)  # OpenAI's seed
# what a refusal adds, where there is a way to get the same
UNSUPPORTED_HINTS = {"best_of": ": ask for n choices instead (vLLM removed best_of too)"}


class GenerationRequest(NullMeansUnset):
    """Fields shared by chat and text completions (vLLM's extensions included)."""

    model_config = ConfigDict(extra="allow")
    # fields another route implements that this one refuses (with their harmless values)
    route_unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {}
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are: a string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # vLLM's: top logprobs per prompt token
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: the context)
    response_format: dict[str, Any] | None = None  # OpenAI's: text, json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object
    # vLLM's: which end truncate_prompt_tokens keeps ("left" cuts the left: the last tokens stay; the default)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprobs name tokens "token_id:N" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's beam search (beam.py): the n best of n beams, scored as transformers' num_beams
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """What the output must match, and the field that asked (errors name it): response_format,
        structured_outputs, or one of vLLM's older guided_* fields."""
        extra = self.model_extra or {}
        asked = [(name, value) for name, value in (("response_format", self.response_format),
                                                   ("structured_outputs", self.structured_outputs),
                                                   *((g, extra.get(g)) for g in GUIDED_FIELDS))
                 if value is not None and not (name == "response_format" and value == {"type": "text"})]
        if not asked:
            return None, None
        if len(asked) > 1:
            raise RequestError(f"give one of {', '.join(n for n, _ in asked)}: each constrains the output",
                               param=asked[1][0])
        name, value = asked[0]
        try:
            return self._structured_params(name, value), name
        except InvalidInputError as exc:
            raise RequestError(str(exc).replace("structured_outputs", name, 1), param=name) from exc

    @staticmethod
    def _structured_params(name: str, value: Any) -> StructuredOutputsParams:
        if name in GUIDED_FIELDS:
            return StructuredOutputsParams(**{GUIDED_FIELDS[name]: value})
        if not isinstance(value, dict):
            raise InvalidInputError(f"{name} must be an object", param=name)
        if name == "structured_outputs":
            unknown = sorted(set(value) - set(STRUCTURED_KEYS) - set(STRUCTURED_ALIASES))
            if unknown:
                raise InvalidInputError(f"structured_outputs has unknown keys {unknown}: it takes "
                                        f"{', '.join(STRUCTURED_KEYS + STRUCTURED_ALIASES)}", param=name)
            fields = {k: v for k, v in value.items() if k in STRUCTURED_KEYS and v is not None}
            if value.get("disable_any_whitespace") is not None:
                fields["any_whitespace"] = not value["disable_any_whitespace"]
            return StructuredOutputsParams(**fields)
        kind = value.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = value.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(spec, dict) or not isinstance(schema, (dict, bool, type(None))):
                raise InvalidInputError("response_format json_schema must be an object with a 'schema' object",
                                        param=name)
            # OpenAI's schema may be absent or null (any JSON object)
            return StructuredOutputsParams(json={"type": "object"} if schema is None else schema)
        raise InvalidInputError(f"response_format type must be text, json_object or json_schema, got {kind!r:.40}",
                                param=name)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Top logprobs per generated token (None: no logprobs)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token (None: none)."""
        self._check_prompt_logprobs()
        return self.prompt_logprobs

    def _check_prompt_logprobs(self) -> None:
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: they would come before any token
            raise RequestError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias, bad = {}, []
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                bad.append(key)
        if bad:  # every bad key named, not just the first
            raise RequestError(f"logit_bias keys must be token ids, got {', '.join(repr(k[:40]) for k in bad)}",
                               param="logit_bias")
        return bias

    def sampling_params(self, max_model_len: int, num_prompt_tokens: int) -> SamplingParams:
        """SamplingParams for this request; max_tokens defaults to the rest of the context and may
        not exceed it."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options needs stream set to true", param="stream_options")
        if self.seed is not None and not INT64_RANGE[0] <= self.seed < INT64_RANGE[1]:
            raise RequestError(f"seed must be a 64-bit signed integer, got {self.seed}", param="seed")
        self._check_extra_fields()
        self._check_modifiers()
        room = max_model_len - num_prompt_tokens
        requested = self.requested_max_tokens()
        if room < 1 or (requested is not None and requested > room):
            raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                               f"requested {num_prompt_tokens + (requested or 1)} tokens ({num_prompt_tokens} in "
                               f"the prompt, {requested or 1} for the completion). Please reduce the length of "
                               "the prompt or the completion.", param="max_tokens",
                               code="context_length_exceeded")
        fields: dict[str, Any] = {"n": self.n, "max_tokens": requested if requested is not None else room,
                                  "min_tokens": self.min_tokens, "stop": self.stop,
                                  "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                                  "skip_special_tokens": self.skip_special_tokens, "seed": self.seed,
                                  "include_stop_str_in_output": self.include_stop_str_in_output,
                                  "logit_bias": self._logit_bias(), "allowed_token_ids": self.allowed_token_ids,
                                  "bad_words": self.bad_words, "logprobs": self.requested_logprobs(),
                                  "prompt_logprobs": self.requested_prompt_logprobs(),
                                  "structured_outputs": self.structured()[0]}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        try:
            return SamplingParams(**fields)
        except InvalidInputError as exc:
            raise RequestError(str(exc), param=exc.param) from exc

    def stream_usage(self, force: bool = False) -> tuple[bool, bool]:
        """(a usage chunk ends the stream, every chunk carries the usage so far), as vLLM decides them:
        `include_usage` (or the server's `force`) for the first; the second only with the first."""
        options = self.stream_options
        include = force or bool(options and options.include_usage)
        return include, include and bool(options and options.continuous_usage_stats)

    def _check_extra_fields(self) -> None:
        """The fields no model field declares: known ones at their neutral value, else a 400 naming them."""
        extra = self.model_extra or {}
        for name, harmless in {**UNSUPPORTED_FIELDS, **self.route_unsupported_fields}.items():
            if name in extra and extra[name] not in harmless:
                raise RequestError(f"'{name}' is not supported by this server (got {extra[name]!r:.80})"
                                   f"{UNSUPPORTED_HINTS.get(name, '')}", param=name, code="unsupported_parameter")
        unknown = sorted(set(extra) - set(UNSUPPORTED_FIELDS) - set(self.route_unsupported_fields)
                         - set(GUIDED_FIELDS) - set(IDENTITY_FIELDS))
        if unknown:
            raise RequestError(f"unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}: this server "
                               "neither implements nor ignores fields it does not know", param=unknown[0],
                               code="unsupported_parameter")

    def _check_modifiers(self) -> None:
        """Fields that only modify another: refused (400) where that other is not asked for."""
        if not self.use_beam_search:
            for name, neutral in (("length_penalty", 1.0), ("early_stopping", False)):
                if getattr(self, name) != neutral:
                    raise RequestError(f"{name} applies to beam search only: set use_beam_search to true",
                                       param=name)
        if self.truncation_side is not None and self.truncate_prompt_tokens is None:
            raise RequestError("truncation_side says which end truncate_prompt_tokens cuts: set "
                               "truncate_prompt_tokens too", param="truncation_side")
        if self.return_tokens_as_token_ids and self.requested_logprobs() is None and self.prompt_logprobs is None:
            raise RequestError("return_tokens_as_token_ids names the tokens of logprobs: ask for logprobs (or "
                               "prompt_logprobs) too", param="return_tokens_as_token_ids")


# ---- responses ------------------------------------------------------------------------------------
class WireModel(BaseModel):
    """A response part whose fields in `omit_if_none` are left out, not sent as null, when unset (as vLLM
    leaves them out of its stream chunks)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler: Any) -> Any:
        data = handler(self)
        for name in self.omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the KV prefix cache
    # extensions: media items in the prompt, and of those, the ones whose encoder output came from the
    # encoder cache, and the ones wholly inside `cached_tokens` (neither kind was encoded for this request)
    mm_items: int = 0
    cached_mm_items: int = 0
    prefix_cached_mm_items: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # extensions, measured in the server: from the request's arrival to its first generated token, and
    # the generated tokens after the first over the time after it (None where there is nothing to measure)
    time_to_first_token_ms: float | None = None
    decode_tokens_per_s: float | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one prompt token's logprob entry (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]
