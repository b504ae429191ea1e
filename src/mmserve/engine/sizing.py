"""What an engine's pools and limits come to, resolved once at start from the engine args and the family.

Role: the KV cache's blocks (from `kv_cache_bytes` and the bytes a token takes in the KV format, or
`num_kv_blocks`), the context a request may reach (`max_model_len`: the configured one, else the
model's, never more than the KV cache holds), and the encoder budgets (lifted to the largest legal
item, logged once), and the cross-attention KV pool of a family that cross-attends (`cross_kv_cache_bytes`,
else as many bytes as the KV cache, lifted to one largest image).

What it does not know: devices, the runner, scheduling.
"""

from __future__ import annotations

import logging

import torch

from mmserve.config import DEFAULT_KV_CACHE_BYTES, CacheConfig, EncoderConfig
from mmserve.core.budget import EncoderBudget, bytes_per_embedding_row
from mmserve.models.spec import FamilySpec

logger = logging.getLogger("mmserve.engine")


def resolve_num_kv_blocks(cache: CacheConfig, kv_bytes_per_token: int) -> int:
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = kv_bytes_per_token * cache.block_size
    num = (cache.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // per_block
    if num < 1:
        raise ValueError(f"kv_cache_bytes={cache.kv_cache_bytes} is smaller than one block ({per_block} bytes)")
    return int(num)


def resolve_cross_kv_bytes(cache: CacheConfig, spec: FamilySpec, dtype: torch.dtype) -> int | None:
    """The cross-attention KV pool's bytes, or None for a family that does not cross-attend."""
    if spec.cross_attention is None:
        return None
    one_image = spec.max_item_rows * spec.cross_attention.bytes_per_row(torch.empty((), dtype=dtype).element_size())
    configured = cache.cross_kv_cache_bytes or cache.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
    if configured < one_image:
        logger.warning("cross_kv_cache_bytes lifted to one image: configured=%d effective=%d", configured, one_image)
        return one_image
    return configured


def resolve_max_model_len(configured: int | None, model_len: int, kv_capacity_tokens: int) -> int:
    """The longest sequence (prompt plus output) one request may reach: the configured length, else the
    model's, but never more than the KV cache holds — a request that cannot fit it alone could never
    run (vLLM refuses such a configuration at start too)."""
    length = configured or model_len
    if length <= kv_capacity_tokens:
        return length
    if configured:
        raise ValueError(f"max_model_len={configured} does not fit the KV cache, which holds {kv_capacity_tokens} "
                         "tokens: raise kv_cache_bytes (or num_kv_blocks) or lower max_model_len")
    logger.warning("max_model_len lowered: model=%d effective=%d kv_capacity_tokens=%d", length,
                   kv_capacity_tokens, kv_capacity_tokens)
    return kv_capacity_tokens


def resolve_encoder_budget(enc: EncoderConfig, spec: FamilySpec, dtype: torch.dtype) -> EncoderBudget:
    element = torch.empty((), dtype=dtype).element_size()
    row_bytes = bytes_per_embedding_row(element, spec.embed_dim * spec.num_embedding_streams)
    budget, _ = EncoderBudget.resolve(
        max_items_per_step=enc.max_encoder_items_per_step,
        max_encoder_tokens_per_step=enc.max_encoder_tokens_per_step,
        output_budget_bytes=enc.encoder_output_budget_bytes, cache_bytes=enc.encoder_cache_bytes,
        bytes_per_row=row_bytes, model_atomic_max_tokens=spec.max_item_encoder_tokens,
        model_atomic_max_rows=spec.max_item_rows)
    logger.info("encoder budgets: items/step=%d tokens/step=%d output=%dB cache=%dB row=%dB atomic_max=%d",
                budget.max_items_per_step, budget.max_encoder_tokens_per_step, budget.output_budget_bytes,
                budget.cache_bytes, budget.bytes_per_row, budget.model_atomic_max_tokens)
    return budget
