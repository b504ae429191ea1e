"""Paged attention over a block-structured KV cache, for a flattened batch of mixed
prefill chunks and decodes.

Role: `PagedKVCache` owns per-layer key/value tensors shaped (num_blocks, block_size, kv_heads,
head_dim). Each layer call writes the step's new keys/values at their slots, then attends:
- a prefill with no cached context attends over its own k/v directly (causal);
- a prefill chunk after a cached prefix gathers its context blocks, bottom-right causal mask;
- the step's decodes are bucketed by context length, each bucket one padded batch over its
  gathered blocks, with the query heads of a kv head folded into the query axis (GQA without
  repeating K/V).
Slot indices, block tables and lengths are built on the CPU by the runner (`PagedAttentionMetadata`).

What it does not know: requests, scheduling, sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmserve.models.layers.attention import causal_attention


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended as one padded batch."""

    block_table: torch.Tensor  # (num, max_blocks) int64, padded with block 0
    mask: torch.Tensor  # (num, 1, 1, max_blocks * block_size) bool: key is valid
    token_index: torch.Tensor  # (num,) int64 position in the flattened batch


@dataclass
class PagedAttentionMetadata:
    query_lens: list[int]  # new tokens per sequence, batch order
    context_lens: list[int]  # tokens already cached per sequence before this step
    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat cache slot of every new token
    prefill_block_tables: list[torch.Tensor | None]  # per prefill sequence with context: its block ids
    decode_rows: list[int]  # indices (into query_lens) of the decode sequences, in batch order
    decode_groups: list[DecodeGroup]  # the decodes, bucketed by length to bound padding


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        """q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim) -> (num_tokens, heads*head_dim)."""
        key_cache = self.key[layer_idx]
        value_cache = self.value[layer_idx]
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        start = 0
        decode_set = set(meta.decode_rows)
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            end = start + q_len
            if i not in decode_set:
                table = meta.prefill_block_tables[i]
                if table is None:  # no cached context: attend over this step's own keys
                    out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end], 0)
                else:
                    keys = key_cache.index_select(0, table).flatten(0, 1)[: ctx + q_len]
                    values = value_cache.index_select(0, table).flatten(0, 1)[: ctx + q_len]
                    out[start:end] = causal_attention(q[start:end], keys, values, ctx)
            start = end
        for group in meta.decode_groups:
            out[group.token_index] = self._decode(q, key_cache, value_cache, group)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                group: DecodeGroup) -> torch.Tensor:
        # (num, max_blocks * block_size, kv_heads, head_dim) -> (num, kv_heads, keys, head_dim);
        # index_select on the flattened table: several times faster on the CPU than advanced indexing
        num = group.block_table.shape[0]
        flat = group.block_table.reshape(-1)
        keys = key_cache.index_select(0, flat).view(num, -1, *key_cache.shape[2:]).transpose(1, 2)
        values = value_cache.index_select(0, flat).view(num, -1, *value_cache.shape[2:]).transpose(1, 2)
        kv_heads = keys.shape[1]
        qd = q[group.token_index].view(num, kv_heads, -1, q.shape[-1])  # heads of a kv head as query rows
        out = F.scaled_dot_product_attention(qd, keys, values, attn_mask=group.mask)
        return out.reshape(num, -1)
