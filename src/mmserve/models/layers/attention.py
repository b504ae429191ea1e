"""The one protocol between the language model's attention layers and an attention backend.

Role: each attention layer hands (q, k, v) for every new token of every sequence in the step,
plus its own `LayerAttention` options (sliding window, softmax scale), to an `AttentionBackend`,
which stores k/v in its KV cache and attends each sequence's queries over that sequence's
context. The step's layout is described by `AttentionMetadata` (built on the CPU by whoever
drives the model): new tokens and cached tokens per sequence, and per sequence the spans of
tokens that attend to each other in both directions (Gemma 3's image tokens).

The mask semantics, shared by every backend and by transformers: a query at position p sees
key position j when j <= p, or when p and j lie in the same bidirectional span; a sliding-window
layer then keeps only keys with j > p - sliding_window.

Cross-attention (late fusion: text queries over an image's encoder rows as keys and values) rides on
the same metadata: `AttentionMetadata.cross` holds, per sequence, its `CrossAttentionInputs` (the
K/V of every cross-attention layer, computed once per request, and which rows each of this step's
queries sees), or None for a sequence without images, whose tokens skip those layers.

`dense_attention` is that rule over dense tensors (the reference the paged backend is tested
against, and its prefill path); `ContiguousKVCache` is the simple one-buffer-per-sequence
backend for single-request generation. The engine's paged backend lives in `runner/`.

What it does not know: scheduling, blocks, requests, models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

Span = tuple[int, int]  # [start, end) absolute token positions of one sequence


@dataclass(frozen=True)
class LayerAttention:
    """What one attention layer asks of the backend besides q/k/v."""

    sliding_window: int | None = None  # a query at p sees only keys at positions > p - sliding_window
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # False: the sequences' bidirectional spans do not apply to this layer, which stays causal (Gemma 4's
    # full-attention layers, while its sliding ones see an image both ways)
    bidirectional_spans: bool = True
    # True: the layer reads the cache of the layer whose index it passes, with that layer's keys and values
    # of this step, and writes nothing (Gemma 4's KV-shared layers)
    shared_kv: bool = False

    def spans(self, spans: tuple[Span, ...]) -> tuple[Span, ...]:
        """The spans this layer applies."""
        return spans if self.bidirectional_spans else ()


FULL = LayerAttention()


@dataclass(frozen=True)
class CrossAttentionInputs:
    """One sequence's cross-attention in this step. `kv[c]` is the (keys, values) of cross-attention
    layer c, each (num_kv_heads, num_rows, head_dim); `bias` (q_len, num_rows) is added to the scores
    (0 or -inf), None when every query sees every row; `row_gate` (q_len, 1) is 0 for a query that sees
    no row (the family decides what that drops), None when every query sees some row."""

    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    bias: torch.Tensor | None = None
    row_gate: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """One step's ragged batch: sequence i owns the next `query_lens[i]` tokens of the flattened batch,
    which sit at positions [context_lens[i], context_lens[i] + query_lens[i]) of that sequence."""

    query_lens: list[int]  # new tokens of each sequence in this step
    context_lens: list[int]  # tokens of each sequence already in the KV cache before this step
    # per sequence, its bidirectional spans (sorted, disjoint); empty: plain causal. A span a query
    # lies in must be wholly within the sequence's keys this step (the chunk policy guarantees it).
    spans: list[tuple[Span, ...]] = field(default_factory=list)
    # per sequence, its cross-attention inputs or None (no images: cross-attention layers skip it);
    # empty: no sequence cross-attends
    cross: list[CrossAttentionInputs | None] = field(default_factory=list)
    # per sequence, its recurrent-state slot (a hybrid model's linear-attention layers); empty: no such layers
    state_slots: list[int] = field(default_factory=list)
    # the same slots as an int64 tensor on the model's device, built once per step (None: built by the layer)
    state_slot_index: torch.Tensor | None = None
    # speculative decoding on a hybrid model: the sequences verifying drafts, whose linear-attention layers
    # record the state after each of their tokens (`recorded_states[(layer, sequence)]`: conv states (n, C, K - 1)
    # and recurrent states (n, H, Dk, Dv)), so the runner can take back what a rejected draft wrote
    record_states: frozenset[int] = frozenset()
    recorded_states: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        return len(self.query_lens)

    def spans_of(self, i: int) -> tuple[Span, ...]:
        return self.spans[i] if self.spans else ()

    def cross_of(self, i: int) -> CrossAttentionInputs | None:
        return self.cross[i] if self.cross else None


class AttentionBackend(Protocol):
    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                layer: LayerAttention = FULL) -> torch.Tensor:
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


def attention_mask(context_len: int, q_len: int, spans: Sequence[Span], sliding_window: int | None,
                   device: torch.device) -> torch.Tensor | None:
    """(q_len, context_len + q_len) bool mask of the rule above for queries at positions
    [context_len, context_len + q_len), or None when it is plain causal for a fresh prefill."""
    plain = not spans and (sliding_window is None or sliding_window >= context_len + q_len)
    if plain and (context_len == 0 or q_len == 1):  # causal from scratch, or a query that sees every key
        return None
    q_pos = torch.arange(context_len, context_len + q_len, device=device)[:, None]
    k_pos = torch.arange(context_len + q_len, device=device)[None, :]
    mask = k_pos <= q_pos
    for start, end in spans:
        if end <= context_len or start >= context_len + q_len:
            continue  # no query inside: causal already covers what a later query sees of it
        if end > context_len + q_len:
            raise ValueError(f"bidirectional span [{start}, {end}) runs past this step's "
                             f"{context_len + q_len} keys: a chunk ended inside it")
        mask |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                    spans: Sequence[Span] = (), layer: LayerAttention = FULL) -> torch.Tensor:
    """Attend q (q_len, H, D) at positions [context_len, context_len + q_len) over k/v
    (context_len + q_len, KVH, D) of one sequence. Returns (q_len, H * D)."""
    q_len = q.shape[0]
    # SDPA gets 4-D (batch, heads, len, dim) inputs: on the CPU 3-D inputs miss the fast kernel (2-5x slower)
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    mask = attention_mask(context_len, q_len, spans, layer.sliding_window, q.device)
    if mask is None and q_len > 1:  # a fresh causal prefill: SDPA's own causal mask (aligned top-left)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kh, vh, is_causal=True, scale=layer.scale,
                                             enable_gqa=q.shape[1] != kh.shape[1])
        return out[0].transpose(0, 1).reshape(q_len, -1)
    if mask is not None:
        mask = mask.repeat(q.shape[1] // kh.shape[1], 1)  # one mask row per folded query row
    out = F.scaled_dot_product_attention(fold_gqa(q, kh.shape[1])[None], kh, vh, attn_mask=mask, scale=layer.scale)
    return unfold_gqa(out[0], q_len)


def cross_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """q (q_len, H, D) over one sequence's cross-attention keys/values (KVH, rows, D) under `bias`
    (q_len, rows) or None. Returns (q_len, H * D)."""
    q_len, kv_heads = q.shape[0], keys.shape[0]
    mask = None if bias is None else bias.to(q.dtype)
    if q_len == 1:  # a decode step: the query heads sharing a kv head are already its rows, one mask row
        out = F.scaled_dot_product_attention(q.view(1, kv_heads, -1, q.shape[2]), keys[None], values[None],
                                             attn_mask=mask, scale=scale)
        return out.view(1, -1)
    if mask is not None:  # one mask row per folded query row
        mask = mask.repeat(q.shape[1] // kv_heads, 1)
    out = F.scaled_dot_product_attention(fold_gqa(q, kv_heads)[None], keys[None], values[None],
                                         attn_mask=mask, scale=scale)
    return unfold_gqa(out[0], q_len)


class ContiguousKVCache:
    """One preallocated (max_len, kv_heads, head_dim) buffer per sequence and layer; sequence i of the
    metadata uses buffer i.

    Enough for single-request generation and tests; the paged backend replaces it for serving.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", layers: Sequence | None = None) -> None:
        """`layers`: each layer's own (num_kv_heads, head_dim) shape (`spec.KVLayerShape`s); a layer that reads
        another's cache gets none. None: every layer (num_kv_heads, head_dim)."""
        shapes = [(s.num_kv_heads, s.head_dim, s.reads_layer) for s in layers] if layers is not None else \
            [(num_kv_heads, head_dim, None)] * num_layers
        self.key: list[torch.Tensor] = []
        self.value: list[torch.Tensor] = []
        for heads, dim, reads in shapes:
            if reads is not None:
                self.key.append(self.key[reads])
                self.value.append(self.value[reads])
                continue
            self.key.append(torch.zeros((num_slots, max_len, heads, dim), dtype=dtype, device=device))
            self.value.append(torch.zeros((num_slots, max_len, heads, dim), dtype=dtype, device=device))
        self.max_len = max_len

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                layer: LayerAttention = FULL) -> torch.Tensor:
        outputs = []
        start = 0
        for slot, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            end = start + q_len
            if ctx + q_len > self.max_len:
                raise ValueError(f"sequence of {ctx + q_len} tokens exceeds the cache length {self.max_len}")
            if not layer.shared_kv:
                self.key[layer_idx][slot, ctx:ctx + q_len] = k[start:end]
                self.value[layer_idx][slot, ctx:ctx + q_len] = v[start:end]
            keys = self.key[layer_idx][slot, :ctx + q_len]
            values = self.value[layer_idx][slot, :ctx + q_len]
            outputs.append(dense_attention(q[start:end], keys, values, ctx, layer.spans(meta.spans_of(slot)),
                                           layer))
            start = end
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
