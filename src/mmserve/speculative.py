"""Speculative decoding's configuration, as vLLM spells it: `speculative_config={"method": "ngram", ...}` or
`{"method": "draft_model", "model": DIR, ...}`.

Role: `SpeculativeConfig.parse` (a dict or its JSON text, the `--speculative-config` flag's value) checks
every key and refuses what mmserve does not do with a message naming it (the draft model's checkpoint is
checked against the target's where it is loaded: engine/drafter_loading.py); `speculates(params)`: whether a
request's sampling lets drafts be verified (greedily, or by rejection sampling: runner/speculation.py).
What it does not know: how drafts are proposed (core/drafts.py, runner/draft_model.py) or verified
(runner/speculation.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mmserve.errors import ConfigError
from mmserve.sampling_params import SamplingParams

METHODS = ("ngram", "draft_model", "mtp")
# vLLM's other methods, and why mmserve refuses each
LATER_METHODS = {
    "eagle": "EAGLE drafters are not loaded by mmserve yet", "eagle3": "EAGLE-3 drafters are not loaded by mmserve yet",
    "medusa": "Medusa heads are not loaded by mmserve yet", "suffix": "suffix decoding is not built into mmserve yet",
}
NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
KEYS = ("method", "model", "num_speculative_tokens", *NGRAM_KEYS, "disable_by_batch_size")
DEFAULT_LOOKUP = 5  # vLLM's n-gram size when neither bound is given
# at batch 32 a CPU step is compute-bound and a rejected draft costs a token's compute (benchmarks/engine/
# speculative.py, 2 cores: 0.74x of speculation off before verification took the decode kernel, 1.05x after on
# prompts that quote themselves): the cutoff guards busy batches whose drafts are mostly rejected
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram (prompt lookup) speculation: each decoding request's last n tokens (n from
    `prompt_lookup_max` down to `prompt_lookup_min`) are looked up in its earlier tokens, and the
    `num_speculative_tokens` that followed the latest match are verified in one forward. draft_model: a
    smaller checkpoint (`model`, with the target's vocabulary) proposes them greedily; mtp: the target
    checkpoint's own multi-token-prediction head does (Qwen3.5's `mtp.*`)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE  # no drafts while this many run (vLLM's)
    model: str | None = None  # draft_model's checkpoint: a directory or a hub id

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config.{name} must be a positive integer, got {value!r}",
                                  key=f"speculative_config.{name}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must be <= "
                              f"prompt_lookup_max={self.prompt_lookup_max}", key="speculative_config.prompt_lookup_min")
        batch = self.disable_by_batch_size
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise ConfigError(f"speculative_config.disable_by_batch_size must be a positive integer, got {batch!r}",
                              key="speculative_config.disable_by_batch_size")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative_config.model is required with method 'draft_model' (a checkpoint directory "
                              "or hub id) and read by no other method", key="speculative_config.model")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, Mapping):
            raise ConfigError("speculative_config must be a JSON object", key="speculative_config")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ConfigError(f"speculative_config key(s) {', '.join(unknown)} are not supported by mmserve (it "
                              f"reads {', '.join(KEYS)})", key=f"speculative_config.{unknown[0]}")
        # vLLM's: a model without a method is a draft model
        method = value.get("method", "draft_model" if value.get("model") is not None else None)
        if method in LATER_METHODS:
            raise ConfigError(f"speculative_config.method={method!r} is not supported by mmserve yet: "
                              f"{LATER_METHODS[method]}; it speculates with {', '.join(METHODS)}",
                              key="speculative_config.method")
        if method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}",
                              key="speculative_config.method")
        if "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config.num_speculative_tokens is required",
                              key="speculative_config.num_speculative_tokens")
        misplaced = [key for key in NGRAM_KEYS if key in value and method != "ngram"]
        if misplaced:
            raise ConfigError(f"speculative_config.{misplaced[0]} is read by method 'ngram' only, not {method!r}",
                              key=f"speculative_config.{misplaced[0]}")
        model = value.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ConfigError(f"speculative_config.model must be a checkpoint directory or hub id, got {model!r}",
                              key="speculative_config.model")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (low or high or DEFAULT_LOOKUP), (high or low or DEFAULT_LOOKUP)  # vLLM's: one bound sets both
        return cls(value["num_speculative_tokens"], method, high, low,
                   value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE), model)


def speculates(params: SamplingParams, logprobs_mode: str = "raw_logprobs") -> bool:
    """Can a request with these options take drafts? Verification processes each row as the sampler would
    (temperature, top-k, top-p, min-p, its grammar, penalties, bans, logit bias, allowed tokens, each as if the
    drafts before it were generated); its logprobs (if it asks for them) must be the raw distribution's, which
    a verification's rows give (not the processed one's, `logprobs_mode` processed_*), and a seeded sampled
    request keeps its one draw per token (the same tokens whatever the batch)."""
    return ((params.logprobs is None or logprobs_mode.startswith("raw"))
            and (params.seed is None or params.temperature == 0.0))
