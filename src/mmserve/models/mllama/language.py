"""Llama 3.2 Vision's language model: a Llama 3 decoder whose `cross_attention_layers` cross-attend to the
image's encoder rows, written for a serving engine.

Role: embeddings (8 rows past the logits' vocabulary: `<|image|>` keeps an embedding of its own), the
self-attention layers (the shared `layers.decoder.DecoderLayer`, numbered by their place among the
self-attention layers: that is their KV cache layer) with Llama 3's scaled RoPE, the cross-attention
layers, the final norm and the LM head. A cross-attention layer, as transformers' `MllamaCrossAttention
DecoderLayer`: q from the text with a per-head RMSNorm, keys and values from the image rows (k with its
own per-head norm, no RoPE), the attention output added through tanh(attn gate), then the MLP output
times the query's row gate (0 where the query sees no image row) added through tanh(mlp gate).

Per sequence, a cross-attention layer runs only where `AttentionMetadata.cross` has inputs for it: a
sequence without images skips the layer and its MLP, as transformers skips them for a text-only
batch. The image's keys and values are computed once per request (`cross_attention_kv`), not here.

What it does not know: pixels, requests, scheduling, which rows a query sees (the metadata says).
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata, cross_attention
from mmserve.models.layers.decoder import DecoderLayer, DecoderOptions
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.norms import RMSNorm
from mmserve.models.layers.rotary import RotaryEmbedding, inverse_frequencies, llama3_scaled
from mmserve.models.mllama.config import MllamaTextConfig

SELF_ATTENTION = DecoderOptions(qkv_bias=False)


def llama3_rotary(cfg: MllamaTextConfig) -> RotaryEmbedding:
    rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
    if cfg.rope_llama3 is not None:
        rotary.inv_freq = llama3_scaled(inverse_frequencies(cfg.head_dim, cfg.rope_theta), *cfg.rope_llama3)
    return rotary


class CrossAttention(nn.Module):
    def __init__(self, cfg: MllamaTextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def kv(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Image rows (rows, hidden) -> this layer's keys and values, each (num_kv_heads, rows, head_dim)."""
        rows = states.shape[0]
        k = self.k_norm(self.k_proj(states).view(rows, self.num_kv_heads, self.head_dim))
        v = self.v_proj(states).view(rows, self.num_kv_heads, self.head_dim)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x (tokens, hidden) -> normed queries (tokens, heads, head_dim)."""
        return self.q_norm(self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """One sequence's queries (q_len, heads, head_dim) -> (q_len, heads * head_dim), before o_proj."""
        return cross_attention(q, keys, values, bias, self.scale)


class CrossAttentionDecoderLayer(nn.Module):
    def __init__(self, cfg: MllamaTextConfig, cross_index: int) -> None:
        super().__init__()
        self.cross_index = cross_index  # which of the request's cross-attention K/V this layer reads
        self.cross_attn = CrossAttention(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x (num_tokens, hidden) of the whole step: only the sequences with cross-attention inputs change.
        Their tokens go through the norms, projections and MLP together; only the attention itself runs per
        sequence, over that sequence's image keys and values."""
        if not meta.cross:  # no sequence of the step cross-attends (a captured or compiled step's case)
            return x
        segments, start = [], 0  # (first token, tokens, inputs) of each sequence that cross-attends
        for i, q_len in enumerate(meta.query_lens):
            if meta.cross_of(i) is not None:
                segments.append((start, q_len, meta.cross_of(i)))
            start += q_len
        if not segments:
            return x
        every = sum(q_len for _, q_len, _ in segments) == x.shape[0]
        index = None if every else torch.cat([torch.arange(s, s + n) for s, n, _ in segments]).to(
            x.device, non_blocking=True)  # built on the CPU
        rows = x if index is None else x.index_select(0, index)  # (cross tokens, hidden)
        q = self.cross_attn.query(self.input_layernorm(rows))
        attn, offset = [], 0
        for _, q_len, cross in segments:
            keys, values = cross.kv[self.cross_index]
            attn.append(self.cross_attn.attend(q[offset:offset + q_len], keys, values, cross.bias))
            offset += q_len
        rows = rows + self.cross_attn_attn_gate.tanh() * self.cross_attn.o_proj(torch.cat(attn) if len(attn) > 1
                                                                                else attn[0])
        mlp = self.mlp(self.post_attention_layernorm(rows))
        if any(cross.row_gate is not None for _, _, cross in segments):
            gates = [cross.row_gate if cross.row_gate is not None else mlp.new_ones(q_len, 1)
                     for _, q_len, cross in segments]
            mlp = torch.cat(gates).to(mlp.dtype) * mlp
        rows = rows + self.cross_attn_mlp_gate.tanh() * mlp
        return rows if index is None else x.index_copy(0, index, rows)


class MllamaTextModel(nn.Module):
    def __init__(self, cfg: MllamaTextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.num_embeddings, cfg.hidden_size)
        cross = sorted(set(cfg.cross_attention_layers))
        self_layers = cfg.self_attention_layers
        self.layers = nn.ModuleList(
            CrossAttentionDecoderLayer(cfg, cross.index(i)) if i in cross
            else DecoderLayer(cfg, self_layers.index(i), SELF_ATTENTION)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = llama3_rotary(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def cross_layers(self) -> list[CrossAttentionDecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, CrossAttentionDecoderLayer)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def cross_attention_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A request's image rows (rows, hidden), its images one after the other -> the keys and values of
        every cross-attention layer, in layer order."""
        return [layer.cross_attn.kv(states) for layer in self.cross_layers]

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, meta) if isinstance(layer, CrossAttentionDecoderLayer) else layer(x, cos, sin, backend, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding table's first vocab_size rows are the head
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight[:self.cfg.vocab_size])
        return self.lm_head(hidden)
