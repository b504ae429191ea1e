"""Speculative decoding's configuration, as vLLM spells it: `speculative_config={"method": "ngram", ...}`.

Role: `SpeculativeConfig.parse` (a dict or its JSON text, the `--speculative-config` flag's value) checks
every key and refuses what mmserve does not do with a message naming it; `speculates(params)`: whether a
request's sampling lets drafts be verified (greedily, or by rejection sampling under temperature, top-k,
top-p and min-p: runner/speculation.py), with no logprobs and nothing else that changes a logit.
What it does not know: how drafts are proposed (core/drafts.py) or verified (runner/speculation.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mmserve.sampling_params import SamplingParams

METHODS = ("ngram",)
LATER_METHODS = ("draft_model", "mtp", "eagle", "eagle3", "medusa", "suffix")  # vLLM's, not here yet
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
DEFAULT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
# at batch 32 a CPU step is compute-bound and a rejected draft costs a token's compute (benchmarks/engine/
# speculative.py, 2 cores: 0.74x of speculation off before verification took the decode kernel, 1.05x after on
# prompts that quote themselves): the cutoff guards busy batches whose drafts are mostly rejected
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram (prompt lookup) speculation: each decoding request's last n tokens (n from
    `prompt_lookup_max` down to `prompt_lookup_min`) are looked up in its earlier tokens, and the
    `num_speculative_tokens` that followed the latest match are verified in one forward."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE  # no drafts while this many run (vLLM's)

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        batch = self.disable_by_batch_size
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be a positive integer, got {batch!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, Mapping):
            raise ValueError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config key(s) {', '.join(unknown)} are not supported by mmserve (it "
                             f"reads {', '.join(KEYS)})")
        method = value.get("method")
        if method in LATER_METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not supported by mmserve yet: it speculates "
                             "with method 'ngram' (prompt lookup)")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (low or high or DEFAULT_LOOKUP), (high or low or DEFAULT_LOOKUP)  # vLLM's: one bound sets both
        return cls(value["num_speculative_tokens"], method, high, low,
                   value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE))


def speculates(params: SamplingParams) -> bool:
    """Can a request with these options take drafts? Its distribution at each position must be the logits'
    own under temperature, top-k, top-p and min-p (verification applies those, nothing else), nothing may be
    reported per token that a verification does not compute, and a seeded request keeps its one draw per
    token (the same tokens whatever the batch)."""
    return (params.logprobs is None and not params.needs_penalties and params.allowed_token_ids is None
            and not params.logit_bias and not params.bad_words and params.min_tokens == 0
            and params.structured_outputs is None and (params.seed is None or params.temperature == 0.0))
