"""The paged attention backend: attention for a flattened batch of mixed prefill chunks and
decodes over `PagedKVStorage`, with the mask rule of `models/layers/attention.py` (causal, or
bidirectional inside a sequence's spans; sliding-window layers keep only their window).

Role: each layer call writes the step's new keys/values at their slots, then attends:
- a prefill with no cached context attends over its own k/v directly;
- a prefill chunk after a cached prefix gathers its context blocks (bottom-right aligned mask);
- the step's decodes are bucketed by context length, each bucket one padded batch over its
  gathered blocks, with the query heads of a kv head folded into the query axis (GQA without
  repeating K/V), its key mask built once per step per window size.
On the CPU with a float32 cache, mmserve's kernel (`cpu_attention`) reads the blocks in place instead:
one call a layer for the whole step, every new token a query at its own position, when the step has
no bidirectional spans (the builder then fills `token_tables`); one call per decode bucket otherwise
(and in a compiled decode step).
Slot indices, block tables and lengths are built on the CPU by the runner (`PagedAttentionMetadata`).

What it does not know: requests, scheduling, sampling, models, the storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mmserve.models.layers.attention import FULL, AttentionMetadata, LayerAttention, dense_attention
from mmserve.runner import cpu_attention
from mmserve.runner.kv_storage import PagedKVStorage


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended as one padded batch."""

    block_table: torch.Tensor  # (num, max_blocks) int64, padded with block 0
    key_positions: torch.Tensor  # (1, max_blocks * block_size) int64: 0, 1, 2, ...
    query_positions: torch.Tensor  # (num, 1) int64: each decode's own position (keys <= it are valid)
    token_index: torch.Tensor  # (num,) int64 position in the flattened batch
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> mask, this step only

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """(num, 1, 1, keys) bool: which padded keys each decode sees."""
        if sliding_window not in self._masks:
            valid = self.key_positions <= self.query_positions
            if sliding_window is not None:
                valid &= self.key_positions > self.query_positions - sliding_window
            self._masks[sliding_window] = valid[:, None, None, :]
        return self._masks[sliding_window]


@dataclass(kw_only=True)
class PagedAttentionMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat cache slot of every new token
    # every new token as a query over its sequence's blocks, for the CPU kernel (None: the step has
    # bidirectional spans, or is not on the CPU): (sequences, width) block tables padded with block 0,
    # the table row of each token, the position of each token
    token_tables: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None
    token_positions: torch.Tensor | None = None
    prefill_block_tables: list[torch.Tensor | None] = field(default_factory=list)  # per sequence with context
    decode_rows: list[int] = field(default_factory=list)  # indices (into query_lens) of the decode sequences
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # the decodes, bucketed by length


class PagedAttentionBackend:
    def __init__(self, storage: PagedKVStorage) -> None:
        self.storage = storage
        self.block_size = storage.block_size
        # decided once here, not per call: a compiled step then traces only the path taken
        self._decode_kernel = not storage.fmt.quantized and cpu_attention.available()

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: PagedAttentionMetadata, layer: LayerAttention = FULL) -> torch.Tensor:
        """q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim) -> (num_tokens, heads*head_dim)."""
        self.storage.write(layer_idx, meta.slot_mapping, k, v)
        key_layer = self.storage.key[layer_idx]
        if meta.token_tables is not None and self._decode_kernel and cpu_attention.supports(q, key_layer):
            # the whole step, prefill chunks and decodes alike, one query row at a time in one call
            return cpu_attention.paged_attention(q, key_layer, self.storage.value[layer_idx], meta.token_tables,
                                                 meta.token_positions, self._scale(q, layer), layer.sliding_window,
                                                 rows=meta.token_rows)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        start = 0
        decode_set = set(meta.decode_rows)
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            end = start + q_len
            if i not in decode_set:
                table = meta.prefill_block_tables[i]
                if table is None:  # no cached context: attend over this step's own keys
                    keys, values = k[start:end], v[start:end]
                else:
                    keys, values = self.storage.gather(layer_idx, table, q.dtype)
                    keys, values = keys.flatten(0, 1)[:ctx + q_len], values.flatten(0, 1)[:ctx + q_len]
                out[start:end] = dense_attention(q[start:end], keys, values, ctx, meta.spans_of(i), layer)
            start = end
        for group in meta.decode_groups:
            out[group.token_index] = self._decode(layer_idx, q, group, layer)
        return out

    @staticmethod
    def _scale(q: torch.Tensor, layer: LayerAttention) -> float:
        return layer.scale if layer.scale is not None else q.shape[-1] ** -0.5

    def _decode(self, layer_idx: int, q: torch.Tensor, group: DecodeGroup, layer: LayerAttention) -> torch.Tensor:
        key_layer = self.storage.key[layer_idx]
        if self._decode_kernel and cpu_attention.supports(q, key_layer):
            return cpu_attention.paged_attention(q[group.token_index], key_layer, self.storage.value[layer_idx],
                                                 group.block_table, group.query_positions.view(-1),
                                                 self._scale(q, layer), layer.sliding_window)
        # (num, max_blocks * block_size, kv_heads, head_dim) -> (num, kv_heads, keys, head_dim)
        num = group.block_table.shape[0]
        keys, values = self.storage.gather(layer_idx, group.block_table.reshape(-1), q.dtype)
        keys = keys.view(num, -1, *keys.shape[2:]).transpose(1, 2)
        values = values.view(num, -1, *values.shape[2:]).transpose(1, 2)
        kv_heads = keys.shape[1]
        qd = q[group.token_index].view(num, kv_heads, -1, q.shape[-1])  # heads of a kv head as query rows
        out = F.scaled_dot_product_attention(qd, keys, values, attn_mask=group.mask(layer.sliding_window),
                                             scale=layer.scale)
        return out.reshape(num, -1)
