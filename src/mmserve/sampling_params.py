"""How one request wants its tokens chosen and when its generation ends.

Role: `SamplingParams`, a frozen, validated value with vLLM-compatible field names and defaults,
so an OpenAI/vLLM-style request maps onto it field for field. Validation raises
`InvalidInputError` with a message a client can act on. What it does not know: tensors, the
tokenizer (eos ids and stop strings are matched elsewhere), the scheduler.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmserve.errors import InvalidInputError

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf and the
# softmax turns into NaN, while the distribution is argmax for all practical purposes anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
SEED_RANGE = (-(2**63), 2**64)  # what a torch.Generator takes
MAX_N = 128  # choices per request (each is a sequence in the batch)
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's top_logprobs (vLLM's max_logprobs default)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI defines them
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(condition: bool, message: str) -> None:
    if not condition:  # every message starts with the field's name
        raise InvalidInputError(message, param=message.split(" ", 1)[0])


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's names; exactly one of them):
    - `json`: a JSON schema (a dict, or its JSON text); `json_object`: any JSON object;
    - `regex`: a regular expression the whole output matches; `choice`: one of these strings;
    - `grammar`: an EBNF grammar (xgrammar's dialect, GBNF-like, `root ::= ...`);
    - `structural_tag`: an xgrammar structural tag (a dict or its JSON text; tool calls are built so).
    JSON is generated compact (no whitespace between tokens) unless `any_whitespace` is true: a model
    free to pad can pad until max_tokens. After construction `json` is compact JSON text (key order kept:
    properties are generated in it), so equal schemas share one compiled grammar, and `choice` a tuple."""

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    structural_tag: str | Mapping[str, Any] | None = None
    json_object: bool = False
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        _check_field(isinstance(self.json_object, bool) and isinstance(self.any_whitespace, bool),
                     "structured_outputs", "structured_outputs json_object and any_whitespace must be true or false")
        _check_field(len(given) == 1, "structured_outputs",
                     "structured_outputs must set exactly one of json, regex, choice, grammar, structural_tag, "
                     f"json_object; got "
                     f"{given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise InvalidInputError(f"structured_outputs json is not valid JSON: {exc}",
                                            param="structured_outputs") from None
            _check_field(isinstance(schema, (Mapping, bool)), "structured_outputs",
                         f"structured_outputs json must be a JSON schema (an object), got {type(schema).__name__}")
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":")))
        if isinstance(self.structural_tag, Mapping):
            object.__setattr__(self, "structural_tag", json.dumps(self.structural_tag, separators=(",", ":")))
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _check_field(value is None or (isinstance(value, str) and value != ""), "structured_outputs",
                         f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None:
            _check_field(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                         and all(isinstance(c, str) and c for c in self.choice), "structured_outputs",
                         "structured_outputs choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: kind, canonical text, whitespace option."""
        for kind in ("json", "regex", "grammar", "structural_tag"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind), self.any_whitespace
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice)), self.any_whitespace
        return "json_object", "", self.any_whitespace


def _check_field(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidInputError(message, param=param)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping options of one request.

    After construction `stop` is always a `tuple[str, ...]` and `stop_token_ids` a
    `tuple[int, ...]` (possibly empty): `__post_init__` normalises the accepted input forms
    (None, one string, a list) in place so every consumer reads one shape. The object is frozen,
    so it can be shared between the engine and the runner without copies.

    `top_k` of 0 or -1 disables top-k; `top_p` of 1.0 and `min_p` of 0.0 disable theirs.

    Penalties and biases (each neutral by default, and then costs nothing):
    - `presence_penalty` / `frequency_penalty` (OpenAI's, -2..2): subtracted from the logit of each token
      the request has generated, once / once per occurrence;
    - `repetition_penalty` (transformers' and vLLM's, > 0): the logit of each token in the prompt or the
      output is divided by it where positive, multiplied where negative;
    - `logit_bias`: token id -> -100..100, added to that token's logit; `allowed_token_ids`: only these may
      be generated; `bad_words`: strings never generated (the last token of each, where the output ends in
      the tokens before it).
    `logprobs` (0..20): per generated token, the sampled token's logprob and this many top alternatives;
    `prompt_logprobs` likewise per prompt token after the first (a request asking for them is computed
    whole: the prefix cache does not serve its prompt).
    Logprobs are of the model's raw distribution (the
    log-softmax of its logits before temperature, penalties, biases, masks or grammars), in float32.
    `structured_outputs` (a `StructuredOutputsParams`): the output must match a JSON schema, a regex, a
    choice or a grammar; only tokens that keep it matchable are sampled, and EOS only where it is complete.
    `truncate_prompt_tokens` (vLLM's): a text prompt longer than this keeps its last this many tokens (-1: as
    many as the context holds with room for one generated token; `truncation_side` "right": its first this
    many); a prompt with images or video is not cut.
    After construction `logit_bias` is a `dict[int, float]`, `allowed_token_ids` a tuple or None and
    `bad_words` a tuple of strings.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)  # a dict: not hashed
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None

    def __post_init__(self) -> None:
        self._validate_numbers()
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs must be a mmserve.StructuredOutputsParams")
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", _normalise_allowed(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", _normalise_bad_words(self.bad_words))

    def _validate_numbers(self) -> None:
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got n={self.n!r}")
        _check(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
               f"seed must be null or an integer in [-2**63, 2**64), got {self.seed!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1],
                   f"{name} must be a number in [-2, 2], got {value!r}")
        _check(_is_number(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
               and self.repetition_penalty > 0,
               f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        check_truncation_side(self.truncation_side)
        _check(self.truncation_side is None or self.truncate_prompt_tokens is not None,
               "truncation_side says which end truncate_prompt_tokens cuts: set truncate_prompt_tokens too")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def needs_penalties(self) -> bool:
        """Does any penalty change a logit (they all default to neutral)?"""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def is_greedy(self) -> bool:
        """True when the choice is deterministic argmax: temperature ~0 or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1


def check_truncation_side(value: object) -> None:
    _check(value in (None, "left", "right"), f"truncation_side must be null, \"left\" or \"right\", got {value!r:.40}")


def check_truncate_prompt_tokens(value: object) -> None:
    _check(value is None or (_is_int(value) and (value == -1 or value >= 1)),
           f"truncate_prompt_tokens must be null, -1 or an integer >= 1, got {value!r}")


def _normalise_logit_bias(bias: Mapping[int, float] | None) -> dict[int, float]:
    if bias is None:
        return {}
    _check(isinstance(bias, Mapping), f"logit_bias must map token ids to numbers, got {bias!r:.80}")
    # every bad key is named, not just the first: a client fixes them all in one go
    bad_keys = [k for k in bias if not (_is_int(k) and k >= 0)]
    _check(not bad_keys, f"logit_bias keys must be token ids (integers >= 0), got {', '.join(map(repr, bad_keys))}")
    bad_values = [k for k, v in bias.items() if not (_is_number(v) and LOGIT_BIAS_RANGE[0] <= v <= LOGIT_BIAS_RANGE[1])]
    _check(not bad_values, "logit_bias values must be numbers in [-100, 100], got "
           + ", ".join(f"{bias[k]!r} for token {k}" for k in bad_values))
    return {token_id: float(value) for token_id, value in bias.items()}


def _normalise_allowed(allowed: Sequence[int] | None) -> tuple[int, ...] | None:
    if allowed is None:
        return None
    _check(isinstance(allowed, (list, tuple)) and len(allowed) > 0,
           f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r:.80}")
    for token_id in allowed:
        _check(_is_int(token_id) and token_id >= 0, f"allowed_token_ids must be token ids (integers >= 0), got {token_id!r}")
    return tuple(dict.fromkeys(allowed))


def _normalise_bad_words(words: Sequence[str] | None) -> tuple[str, ...]:
    if words is None:
        return ()
    _check(isinstance(words, (list, tuple)), f"bad_words must be a list of strings, got {words!r:.80}")
    for word in words:
        _check(isinstance(word, str) and word.strip() != "", f"bad_words must be non-empty strings, got {word!r:.80}")
    return tuple(words)


def _normalise_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    _check(isinstance(stop, (str, list, tuple)), f"stop must be a string or a list of strings, got {stop!r:.80}")
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in strings:
        _check(isinstance(s, str), f"stop must be a string or a list of strings, got an item {s!r}")
        _check(len(s) > 0, "stop must not contain empty strings")
    return strings


def _normalise_stop_token_ids(stop_token_ids: Sequence[int] | None) -> tuple[int, ...]:
    if stop_token_ids is None:
        return ()
    _check(isinstance(stop_token_ids, (list, tuple)), f"stop_token_ids must be a list of integers, got {stop_token_ids!r:.80}")
    ids = tuple(stop_token_ids)
    for token_id in ids:
        _check(_is_int(token_id) and token_id >= 0,
               f"stop_token_ids must be non-negative integers, got {token_id!r}")
    return ids



@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search (vLLM's `BeamSearchParams`, scored as transformers' `generate(num_beams=...)`).

    `beam_width` beams are kept and the `beam_width` best hypotheses returned, best first. Each step every live
    beam is extended by one token; of the top candidates (sums of the model's raw log-probabilities) the best
    that end (an EOS id, or `max_tokens`) become hypotheses scored `sum / generated_tokens ** length_penalty`
    (the generated tokens counted with the EOS, the prompt not). `early_stopping`: True stops once
    `beam_width` hypotheses are found; False stops when the best live beam, at its current length, can no
    longer beat the worst hypothesis; "never" estimates that with the longest length (`max_tokens`) where
    `length_penalty > 0`. `ignore_eos`: EOS ends nothing. `temperature` (vLLM's field): beam search scores
    the raw distribution, so only 0 and 1 (which leave it as it is) are accepted.
    `include_stop_str_in_output`: the EOS token's text is kept in the text (its id is always in the tokens).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_N,
               f"beam_width must be an integer in [1, {MAX_N}], got {self.beam_width!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _check(isinstance(self.include_stop_str_in_output, bool),
               f"include_stop_str_in_output must be true or false, got {self.include_stop_str_in_output!r}")
        _check(_is_number(self.temperature) and self.temperature in (0, 1),
               f"temperature must be 0 or 1 with beam search (beams are scored by the model's raw "
               f"log-probabilities, as transformers' num_beams), got {self.temperature!r}")
        _check(_is_number(self.length_penalty) and math.isfinite(self.length_penalty),
               f"length_penalty must be a finite number, got {self.length_penalty!r}")
        _check(isinstance(self.early_stopping, bool) or self.early_stopping == "never",
               f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
