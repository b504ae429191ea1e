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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int) -> torch.Tensor:
    """Attend q (q_len, H, D) over k/v (context_len + q_len, KVH, D); query i sees keys <= context_len + i."""
    q_len = q.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gqa = qh.shape[0] != kh.shape[0]
    if q_len == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)
    elif context_len == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        # bottom-right aligned causal mask (SDPA's is_causal aligns top-left)
        mask = torch.ones(q_len, context_len + q_len, dtype=torch.bool, device=q.device).tril(context_len)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(0, 1).reshape(q_len, -1)


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
