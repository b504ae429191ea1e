"""What an engine's pools and limits come to, resolved once at start from the engine args and the family.

Role: the KV cache's blocks (from `kv_cache_bytes` and the bytes a token takes in the KV format, or
`num_kv_blocks`, or on CUDA `gpu_memory_utilization`: a fraction of the device's memory), the context a request may reach (`max_model_len`: the configured one, else the
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
from mmserve.core.state_slots import StateSlotLayout
from mmserve.envs import ALLOW_LONG_MAX_MODEL_LEN, VLLM_ALLOW_LONG_MAX_MODEL_LEN, allow_long_max_model_len
from mmserve.errors import InvalidInputError
from mmserve.models.spec import FamilySpec

logger = logging.getLogger("mmserve.engine")


# of the memory gpu_memory_utilization grants, the share kept for activations (vLLM measures them by
# profiling a forward pass; mmserve keeps this share free instead)
ACTIVATION_SHARE = 0.05


def kv_bytes_from_utilization(fraction: float, device: torch.device) -> int:
    """vLLM's --gpu-memory-utilization: of the device's memory, `fraction` may be taken by this engine;
    what the device already holds (the weights just loaded, the CUDA context, other processes) comes out
    of it, and so does ACTIVATION_SHARE of it; the KV cache gets the rest."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    granted = total_bytes * fraction
    kv_bytes = int(granted - (total_bytes - free_bytes) - ACTIVATION_SHARE * granted)
    if kv_bytes <= 0:
        raise ValueError(f"gpu_memory_utilization={fraction} grants {granted / 2**30:.1f} GiB of the device's "
                         f"{total_bytes / 2**30:.1f} GiB, but {(total_bytes - free_bytes) / 2**30:.1f} GiB is "
                         "already in use (weights, CUDA context, other processes): raise it")
    logger.info("KV cache from gpu_memory_utilization=%.2f: %d bytes", fraction, kv_bytes)
    return kv_bytes


def kv_budget_bytes(cache: CacheConfig, device: torch.device | None = None) -> int:
    """The bytes of the one KV budget (KV blocks, and a hybrid model's state slots inside it)."""
    if cache.gpu_memory_utilization is not None and device is not None and device.type == "cuda":
        return kv_bytes_from_utilization(cache.gpu_memory_utilization, device)
    return cache.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES


def resolve_state_slots(cache: CacheConfig, bytes_per_slot: int, max_num_seqs: int,
                        device: torch.device | None = None) -> StateSlotLayout:
    """A hybrid model's state: one slot per sequence a step may run (`max_num_seqs`), inside the KV budget but
    never more than half of it (fewer slots then: fewer requests run at once), and with prefix caching on, as
    many state snapshots as a quarter of the budget holds; with `num_kv_blocks` given, they come on top of the
    blocks. Logged once with the split."""
    budget = kv_budget_bytes(cache, device)
    slots = max_num_seqs if cache.num_kv_blocks is not None else min(max_num_seqs, budget // 2 // bytes_per_slot)
    if slots < 1:
        raise ValueError(f"kv_cache_bytes={budget} cannot hold one request's recurrent state ({bytes_per_slot} "
                         "bytes) beside its KV: raise kv_cache_bytes")
    snapshots = budget // 4 // bytes_per_slot if cache.enable_prefix_caching else 0
    layout = StateSlotLayout(slots, bytes_per_slot, snapshots)
    logger.info("hybrid model: %d state slots and %d prefix snapshots of %d bytes each (%d bytes) in the KV budget "
                "of %d bytes, the rest for KV blocks%s", slots, snapshots, bytes_per_slot, layout.total_bytes, budget,
                "" if slots == max_num_seqs else f"; at most {slots} requests run at once (max_num_seqs={max_num_seqs})")
    return layout


def resolve_num_kv_blocks(cache: CacheConfig, kv_bytes_per_token: int, device: torch.device | None = None,
                          reserved_bytes: int = 0) -> int:
    """`reserved_bytes`: what the budget keeps for other pools (a hybrid model's state slots)."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    per_block = kv_bytes_per_token * cache.block_size
    kv_bytes = kv_budget_bytes(cache, device) - reserved_bytes
    num = kv_bytes // per_block
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
    run (vLLM refuses such a configuration at start too). A configured length past the model's positions
    is refused unless the environment says it is meant (as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    if configured and configured > model_len:
        if not allow_long_max_model_len():
            raise InvalidInputError(
                f"max_model_len={configured} is longer than the model's {model_len} positions "
                "(max_position_embeddings in config.json): outputs past them are likely wrong. Lower max_model_len, "
                f"or set {ALLOW_LONG_MAX_MODEL_LEN}=1 (or vLLM's {VLLM_ALLOW_LONG_MAX_MODEL_LEN}=1) if you mean it",
                param="max_model_len", setting="max_model_len")
        logger.warning("max_model_len=%d is past the model's %d positions (allowed by the environment)",
                       configured, model_len)
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
