"""The KV budget split between the full pool and a window pool, resolved once at start-up.

Role: where some layers attend to a sliding window and others to the whole context (`FamilySpec.kv_window`:
Gemma 4), the sliding layers keep their blocks in a pool of their own (core/window_kv.py), which never
needs more blocks than every running request's window and step together:
    max_num_seqs * (ceil((window - 1) / block) + 2) + ceil(max_num_batched_tokens / block)
(a request computing n tokens from s holds the blocks of positions s - window + 1 .. s + n - 1). The
budget gives the window pool that many (or as many as the full pool, when the budget is smaller: a
request's window never outgrows its context), and the full pool the rest. A request of n tokens then
needs ceil(n / block) blocks of the full layers' bytes and at most ceil((window - 1) / block) + 1 of the
sliding layers'; both are logged at start-up, and the scheduler admits by both pools.

What it does not know: tensors, requests, scheduling.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.config import CacheConfig
from mmserve.engine.sizing import kv_budget_bytes, resolve_num_kv_blocks
from mmserve.models.spec import KVLayerShape
from mmserve.runner.kv_quant import KVFormat
from mmserve.runner.kv_storage import PagedKVStorage

logger = logging.getLogger("mmserve.engine")


@dataclass(frozen=True)
class KVPools:
    num_blocks: int  # the full pool's blocks (every layer's, without a window pool)
    block_size: int
    full_bytes_per_token: int  # the full pool's layers (a draft model's included)
    window_tokens: int | None = None  # None: no window pool
    num_window_blocks: int = 0
    window_bytes_per_token: int = 0  # the sliding layers'

    def request_bytes(self, num_tokens: int) -> int:
        """The KV bytes a request of `num_tokens` holds at most while it decodes."""
        blocks = -(-num_tokens // self.block_size)
        full = blocks * self.block_size * self.full_bytes_per_token
        if self.window_tokens is None:
            return full
        window_blocks = min(blocks, -(-(self.window_tokens - 1) // self.block_size) + 1)
        return full + window_blocks * self.block_size * self.window_bytes_per_token

    def log(self, max_model_len: int) -> None:
        if self.window_tokens is None:
            return
        flat = -(-max_model_len // self.block_size) * self.block_size * (self.full_bytes_per_token
                                                                         + self.window_bytes_per_token)
        logger.info("KV cache: %d blocks of %d tokens for the full-attention layers (%d bytes a token) and %d for "
                    "the sliding layers' window of %d tokens (%d bytes a token); a request of %d tokens needs "
                    "%d bytes (%d without the window pool)", self.num_blocks, self.block_size,
                    self.full_bytes_per_token, self.num_window_blocks, self.window_tokens,
                    self.window_bytes_per_token, max_model_len, self.request_bytes(max_model_len), flat)


def window_pool_cap(window_tokens: int, block_size: int, max_num_seqs: int, max_tokens_per_step: int) -> int:
    """The most window blocks the running requests hold at once."""
    per_request = -(-(window_tokens - 1) // block_size) + 2
    return max_num_seqs * per_request + -(-max_tokens_per_step // block_size)


def resolve_kv_pools(cache: CacheConfig, layers: Sequence[KVLayerShape], window: int | None, fmt: KVFormat,
                     extra_bytes_per_token: int, max_num_seqs: int, max_tokens_per_step: int,
                     device: torch.device | None = None, reserved_bytes: int = 0) -> KVPools:
    """`layers`, `window`: a family's `FamilySpec.kv_layer_shapes` and `kv_window` (None: one pool);
    `extra_bytes_per_token`: a draft model's KV, in the full pool's blocks; `max_tokens_per_step`: the
    effective max_num_batched_tokens; `reserved_bytes`: what the budget keeps for other pools."""
    bs = cache.block_size
    if window is None:
        per_token = PagedKVStorage.bytes_per_token_of(layers, fmt) + extra_bytes_per_token
        return KVPools(resolve_num_kv_blocks(cache, per_token, device, reserved_bytes), bs, per_token)
    full = PagedKVStorage.bytes_per_token_of(layers, fmt, in_window=False) + extra_bytes_per_token
    sliding = PagedKVStorage.bytes_per_token_of(layers, fmt, in_window=True)
    cap = window_pool_cap(window, bs, max_num_seqs, max_tokens_per_step)
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    else:
        budget = kv_budget_bytes(cache, device) - reserved_bytes
        if budget >= cap * bs * (full + sliding):  # the window pool gets its most, the full pool the rest
            num_blocks = (budget - cap * bs * sliding) // (bs * full)
        else:
            num_blocks = resolve_num_kv_blocks(cache, full + sliding, device, reserved_bytes)
    return KVPools(int(num_blocks), bs, full, window, min(int(num_blocks), cap), sliding)
