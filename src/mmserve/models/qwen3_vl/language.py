"""The Qwen3 decoder of Qwen3-VL: q/k RMSNorm, explicit head_dim, interleaved M-RoPE, deepstack.

Role: forward a flattened, unpadded batch of input embeddings with explicit (3, num_tokens) M-RoPE
positions; attention goes through an `AttentionBackend` that owns the KV cache. Deepstack: after
decoder layer i (i < number of extra streams) the i-th extra embedding stream is added to the
hidden states; the streams are zero at text rows, so only media rows change.
What it does not know: images, requests, scheduling, sampling.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.norms import RMSNorm
from mmserve.models.layers.rotary import MRotaryEmbedding, apply_rotary
from mmserve.models.qwen3_vl.config import TextConfig


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE with the (t, h, w) sections interleaved over the frequency bands, as Qwen3-VL does:
    band j follows h when j % 3 == 1 and j < 3 * h_section, w when j % 3 == 2 and j < 3 * w_section,
    and t otherwise."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, int, int]) -> None:
        super().__init__(head_dim, theta, mrope_section)
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        for row, offset in ((1, 1), (2, 2)):
            axis[offset:3 * mrope_section[row]:3] = row
        self.register_buffer("band_axis", axis, persistent=False)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k, v in one matmul: rows [q | k | v]
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, before the rotary
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.view(n, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(backend.forward(self.layer_idx, q, k, v, meta))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3LanguageModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied to the embeddings when configured)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = InterleavedMRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds: (num_tokens, hidden); positions: (3, num_tokens); extra_streams:
        (num_deepstack, num_tokens, hidden), zero at text rows, or None. Returns final hidden states."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        x = inputs_embeds
        num_extra = 0 if extra_streams is None else extra_streams.shape[0]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, backend, meta)
            if i < num_extra:
                x = x + extra_streams[i].to(x.dtype)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)
