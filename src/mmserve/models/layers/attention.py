"""Attention for the language model over a flattened, unpadded batch.

Role: the model's attention layers hand (q, k, v) for every new token of every sequence in the
step to an `AttentionBackend`, which stores k/v in its KV cache and attends each sequence's
queries over that sequence's whole context. The batch layout is described by
`AttentionMetadata`, built on the CPU by whoever drives the model.

What it does not know: scheduling, blocks or requests. `ContiguousKVCache` is the simple
one-buffer-per-sequence backend; the engine brings a paged one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One step's ragged batch: sequence i owns tokens [query_start[i], query_start[i+1])."""

    query_lens: list[int]  # new tokens of each sequence in this step
    context_lens: list[int]  # tokens of each sequence already in the KV cache before this step
    slots: list[int] = field(default_factory=list)  # which cache slot each sequence uses

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)


class AttentionBackend(Protocol):
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim).
        Returns (num_tokens, num_heads * head_dim)."""
        ...


def fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(q_len, heads, d) -> (kv_heads, group * q_len, d): the query heads that share a kv head become
    extra query rows, row r * q_len + i being head r of the group at position i. Grouped-query
    attention then runs without repeating K/V and stays on SDPA's fast kernel, also with a mask
    (enable_gqa with a mask falls back to the slow math path on the CPU)."""
    q_len, heads, d = q.shape
    group = heads // num_kv_heads
    return q.view(q_len, num_kv_heads, group, d).permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, d)


def unfold_gqa(out: torch.Tensor, q_len: int) -> torch.Tensor:
    """Inverse of fold_gqa on the attention output: -> (q_len, heads * d)."""
    kv_heads, rows, d = out.shape
    return out.view(kv_heads, rows // q_len, q_len, d).permute(2, 0, 1, 3).reshape(q_len, -1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int) -> torch.Tensor:
    """Attend q (q_len, H, D) over k/v (context_len + q_len, KVH, D); query i sees keys <= context_len + i."""
    q_len = q.shape[0]
    # SDPA gets 4-D (batch, heads, len, dim) inputs: on the CPU 3-D inputs miss the fast kernel (2-5x slower)
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if context_len == 0 and q_len > 1:  # a fresh prefill: SDPA's own causal mask is aligned right
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kh, vh, is_causal=True,
                                             enable_gqa=q.shape[1] != kh.shape[1])
        return out[0].transpose(0, 1).reshape(q_len, -1)
    group = q.shape[1] // kh.shape[1]
    mask = None
    if q_len > 1:  # bottom-right aligned causal mask (SDPA's is_causal aligns top-left), per folded row
        mask = torch.ones(q_len, context_len + q_len, dtype=torch.bool, device=q.device).tril(context_len)
        mask = mask.repeat(group, 1)
    out = F.scaled_dot_product_attention(fold_gqa(q, kh.shape[1])[None], kh, vh, attn_mask=mask)
    return unfold_gqa(out[0], q_len)


class ContiguousKVCache:
    """One preallocated (max_len, kv_heads, head_dim) buffer per slot and layer.

    Enough for single-request generation and tests; the paged cache replaces it for serving.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        outputs = []
        start = 0
        slots = meta.slots or list(range(meta.num_sequences))
        for q_len, ctx, slot in zip(meta.query_lens, meta.context_lens, slots):
            end = start + q_len
            if ctx + q_len > self.max_len:
                raise ValueError(f"sequence of {ctx + q_len} tokens exceeds the cache length {self.max_len}")
            self.key[layer_idx, slot, ctx : ctx + q_len] = k[start:end]
            self.value[layer_idx, slot, ctx : ctx + q_len] = v[start:end]
            keys = self.key[layer_idx, slot, : ctx + q_len]
            values = self.value[layer_idx, slot, : ctx + q_len]
            outputs.append(causal_attention(q[start:end], keys, values, ctx))
            start = end
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
