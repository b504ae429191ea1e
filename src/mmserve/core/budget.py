"""Encoder budgets, resolved once at start (docs/architecture.md §5).

Role: turn the configured encoder budgets and the model's facts into the four effective
resources — items per step, encoder tokens per step, resident output bytes, reuse-cache bytes —
lifting each to the smallest value that lets every legal item run, and saying so in one line.

What it does not know: tensors, requests; the caller passes the model's facts in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("mmserve.budget")


# Defaults, the only ones (an engine arg left unset means these):
DEFAULT_ENCODER_TOKENS_PER_STEP = 16384  # pre-merge patches; lifted to the largest atomic item
DEFAULT_ENCODER_OUTPUT_BYTES = 256 << 20  # lifted to one legal encoder step
DEFAULT_CACHE_TO_OUTPUT_RATIO = 2  # the pool holds the live outputs and as much again for reuse


@dataclass(frozen=True)
class EncoderBudget:
    max_items_per_step: int
    max_encoder_tokens_per_step: int  # pre-merge patches
    output_budget_bytes: int  # encoder outputs referenced by live requests, at most
    cache_bytes: int  # the one pool: referenced plus reusable entries
    bytes_per_row: int  # one post-merge embedding row, every embedding stream
    model_atomic_max_tokens: int  # the largest item the model accepts, in encoder tokens

    @classmethod
    def resolve(cls, *, max_items_per_step: int, max_encoder_tokens_per_step: int | None,
                output_budget_bytes: int | None, cache_bytes: int | None, bytes_per_row: int,
                model_atomic_max_tokens: int, model_atomic_max_rows: int) -> tuple[EncoderBudget, list[str]]:
        """Returns the effective budget and the warning lines it logged (one per lifted resource).

        Unset (None) budgets take the defaults above: tokens max(16384, largest item), output bytes
        max(256 MiB, one legal step), cache bytes twice the output budget."""
        if max_items_per_step < 1:
            raise ValueError(f"max_encoder_items_per_step must be >= 1, got {max_items_per_step}")
        if bytes_per_row < 1 or model_atomic_max_tokens < 1 or model_atomic_max_rows < 1:
            raise ValueError("encoder budgets and sizes must be positive")
        warnings = []
        configured_tokens = max_encoder_tokens_per_step
        for name, value in (("max_encoder_tokens_per_step", configured_tokens),
                            ("encoder_output_budget_bytes", output_budget_bytes), ("encoder_cache_bytes", cache_bytes)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset for the default), got {value}")
        tokens = configured_tokens if configured_tokens is not None else max(DEFAULT_ENCODER_TOKENS_PER_STEP,
                                                                              model_atomic_max_tokens)
        if tokens < model_atomic_max_tokens:
            tokens = model_atomic_max_tokens
            warnings.append(f"encoder token budget lifted: configured={configured_tokens} "
                            f"effective={tokens} model_atomic_max={model_atomic_max_tokens}")
        # the smallest step that must always be possible: the largest atomic item, alone
        one_step_bytes = model_atomic_max_rows * bytes_per_row
        output = output_budget_bytes if output_budget_bytes is not None else max(one_step_bytes,
                                                                                  DEFAULT_ENCODER_OUTPUT_BYTES)
        if output < one_step_bytes:
            warnings.append(f"encoder output budget lifted: configured={output} effective={one_step_bytes} "
                            f"one_encoder_step={one_step_bytes}")
            output = one_step_bytes
        cache = cache_bytes if cache_bytes is not None else DEFAULT_CACHE_TO_OUTPUT_RATIO * output
        if cache < output:
            warnings.append(f"encoder cache lifted: configured={cache} effective={output} "
                            f"output_budget={output} (the cache is the pool the outputs live in)")
            cache = output
        for line in warnings:
            logger.warning(line)
        return cls(max_items_per_step, tokens, output, cache, bytes_per_row, model_atomic_max_tokens), warnings


def bytes_per_embedding_row(dtype_bytes: int, declared_dim: int | None = None,
                            embedding_weight_shape: tuple[int, ...] | None = None,
                            config: dict | None = None) -> int:
    """Bytes of one embedding row, from (in order) the model's declared embedding dim, the text
    embedding weight, or the config's hidden_size / text_config.hidden_size."""
    tried = []
    if declared_dim:
        return declared_dim * dtype_bytes
    tried.append("the model's declared embedding dim")
    if embedding_weight_shape and len(embedding_weight_shape) == 2:
        return embedding_weight_shape[1] * dtype_bytes
    tried.append("the text embedding weight")
    config = config or {}
    hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    if hidden:
        return int(hidden) * dtype_bytes
    tried.append("config hidden_size / text_config.hidden_size")
    raise ValueError(f"cannot tell the bytes of an embedding row; tried: {', '.join(tried)}")
