"""The Qwen3.5 hybrid decoder: Gated DeltaNet layers and gated full-attention layers in `layer_types` order.

Role: embeddings, pre-norm layers whose token mixer is either a Gated DeltaNet (`layers/gated_deltanet.py`,
its state in the runner's slots) or a gated full attention (q/k/v with per-head q/k RMSNorm, rotary on the
first `rotary_dim` of each head with interleaved M-RoPE, the attention output times SIGMOID of a gate that
`q_proj` computes beside each head's query), a gated MLP, the final norm and the LM head. Every RMSNorm of
the decoder but the DeltaNet's output norm is zero-centred: it scales by (1 + w), in float32.

KV: only the full-attention layers keep KV, and the backend numbers their caches 0, 1, ... in layer order;
the DeltaNet layers number their states the same way. Parameter names follow Hugging Face's
`Qwen3_5TextModel`, q/k/v stacked as `qkv_proj` (q's rows as the checkpoint has them: per head, the query's
head_dim rows then the gate's) and gate/up as `gate_up_proj`; the DeltaNet's four input projections stacked.

What it does not know: images, requests, scheduling, sampling, where KV and state live.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from mmserve.models.layers.gated_deltanet import GatedDeltaNet, LinearStateBackend
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.moe import SparseMoeBlock
from mmserve.models.layers.rotary import InterleavedMRotaryEmbedding, rotate_half
from mmserve.models.qwen3_5.config import LINEAR, TextConfig


class HybridBackend(AttentionBackend, LinearStateBackend, Protocol):
    """KV for the full-attention layers, state slots for the DeltaNet layers (the runner's backend is both)."""


class ZeroCentredRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32, cast back (the reference's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (n, heads, head_dim): rotate the first cos.shape[-1] dims of each head, keep the rest."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: TextConfig, kv_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_rows = 2 * self.num_heads * self.head_dim  # per head: the query, then its gate
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_rows + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.options = LayerAttention()

    def shard_sizes(self) -> list[int]:
        return [self.q_rows, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: HybridBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.shard_sizes(), dim=-1)
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = partial_rotary(self.q_norm(q), cos, sin)
        k = partial_rotary(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = backend.forward(self.kv_index, q, k, v, meta, self.options)
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, -1)))


class HybridLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == LINEAR
        kind = cfg.layer_types[:layer_idx].count(cfg.layer_types[layer_idx])  # its index among its kind
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                             cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                             cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, kind)
        else:
            self.self_attn = GatedAttention(cfg, kind)
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                                  cfg.hidden_act, cfg.shared_expert_intermediate_size) if cfg.num_experts \
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: HybridBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, backend, meta) if self.is_linear else self.self_attn(h, cos, sin, backend, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridLM(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = InterleavedMRotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: HybridBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds (num_tokens, hidden), positions (3, num_tokens); `backend` is both the attention
        backend of the full-attention layers and the `LinearStateBackend` of the DeltaNet layers."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, backend, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)
