"""The paged attention backend: attention for a flattened batch of mixed prefill chunks and
decodes over `PagedKVStorage`, with the mask rule of `models/layers/attention.py` (causal, or
bidirectional inside a sequence's spans; sliding-window layers keep only their window).

Role: each layer call writes the step's new keys/values at their slots, then attends:
- a prefill with no cached context attends over its own k/v directly;
- a prefill chunk after a cached prefix gathers its context blocks (bottom-right aligned mask);
- the step's decodes are bucketed by context length, each bucket one padded batch over its
  gathered blocks, with the query heads of a kv head folded into the query axis (GQA without
  repeating K/V), its key mask built once per step per window size.
Where its `CpuAttentionPlan` enables it (the CPU, a float32 cache), mmserve's kernel
(`runner/cpu/attention.py`) reads the blocks in place instead, each token a query at its own position:
one call a layer for the tokens the plan gave it (`meta.kernel_tokens`, filled by the batch builder:
decodes, and the prefill chunks of prompts the plan takes); the other prefill chunks as above; in a
compiled decode step, one call per decode bucket.
Slot indices, block tables and lengths are built on the CPU by the runner (`PagedAttentionMetadata`).

What it does not know: requests, scheduling, sampling, models; which tokens the CPU kernel takes (its
plan says).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mmserve.models.layers.attention import FULL, AttentionMetadata, LayerAttention, dense_attention
from mmserve.runner.cpu import attention as cpu_attention
from mmserve.runner.cpu.attention_plan import CpuAttentionPlan, KernelTokens
from mmserve.runner.kv_storage import PagedKVStorage
from mmserve.runner.state_storage import LinearStateStorage


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
    kernel_tokens: KernelTokens | None = None  # the tokens the CPU kernel attends (None: none this step)
    prefill_block_tables: list[torch.Tensor | None] = field(default_factory=list)  # per sequence with context
    decode_rows: list[int] = field(default_factory=list)  # indices (into query_lens) of the decode sequences
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # the decodes, bucketed by length
    # where the sliding layers' blocks are a pool of their own (core/window_kv.py): the same batch over their
    # window tables (slots, block tables, decode groups, kernel tokens), which those layers read instead
    window: PagedAttentionMetadata | None = None


class PagedAttentionBackend:
    def __init__(self, storage: PagedKVStorage, cpu_plan: CpuAttentionPlan | None = None,
                 state: LinearStateStorage | None = None) -> None:
        """`cpu_plan`: which tokens the CPU kernel takes; None: what suits `storage`. Decided once here, not
        per call: a compiled step then traces only the path taken (and a CUDA or half-precision engine
        never builds the kernel). The batch builder is given the same plan (`cpu_plan`). `state`: a hybrid
        model's recurrent-state slots, which its linear-attention layers reach through `linear_states`."""
        self.storage = storage
        self.state = state
        self.block_size = storage.block_size
        self.cpu_plan = cpu_plan if cpu_plan is not None else CpuAttentionPlan.for_storage(
            storage.device, storage.dtype, storage.fmt.quantized)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: PagedAttentionMetadata, layer: LayerAttention = FULL) -> torch.Tensor:
        """q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim) -> (num_tokens, heads*head_dim)."""
        if meta.window is not None and self.storage.in_window[layer_idx]:
            meta = meta.window
        if not layer.shared_kv:
            self.storage.write(layer_idx, meta.slot_mapping, k, v)
        key_layer = self.storage.key[layer_idx]
        tokens = meta.kernel_tokens
        kernel = tokens is not None and self.cpu_plan.enabled and cpu_attention.supports(q, key_layer)
        if kernel:  # the tokens the plan gave the kernel, one query row at a time in one call
            attended = cpu_attention.paged_attention(
                q if tokens.index is None else q[tokens.index], key_layer, self.storage.value[layer_idx],
                tokens.tables, tokens.positions, self._scale(q, layer), layer.sliding_window, rows=tokens.rows)
            if tokens.index is None:
                return attended
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if kernel:
            out[tokens.index] = attended
        start = 0
        decode_set = set(meta.decode_rows)
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            end = start + q_len
            if i not in decode_set and not (kernel and tokens.sequences[i]):
                table = meta.prefill_block_tables[i]
                if table is None:  # no cached context: attend over this step's own keys
                    keys, values = k[start:end], v[start:end]
                else:
                    keys, values = self.storage.gather(layer_idx, table, q.dtype)
                    keys, values = keys.flatten(0, 1)[:ctx + q_len], values.flatten(0, 1)[:ctx + q_len]
                out[start:end] = dense_attention(q[start:end], keys, values, ctx, layer.spans(meta.spans_of(i)),
                                                 layer)
            start = end
        if not (kernel and self.cpu_plan.takes_decodes):  # else the decodes were among the kernel's rows
            for group in meta.decode_groups:
                out[group.token_index] = self._decode(layer_idx, q, group, layer)
        return out

    def linear_states(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear-attention layer `layer_idx`'s (conv, recurrent) state over every slot (`LinearStateBackend`)."""
        assert self.state is not None, "a linear-attention layer in a model without a state pool"
        return self.state.layer(layer_idx)

    @staticmethod
    def _scale(q: torch.Tensor, layer: LayerAttention) -> float:
        return layer.scale if layer.scale is not None else q.shape[-1] ** -0.5

    def _decode(self, layer_idx: int, q: torch.Tensor, group: DecodeGroup, layer: LayerAttention) -> torch.Tensor:
        key_layer = self.storage.key[layer_idx]
        if self.cpu_plan.takes_decodes and cpu_attention.supports(q, key_layer):
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
