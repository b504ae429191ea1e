"""The Qwen2 decoder with M-RoPE and grouped-query attention, written for a serving engine.

Role: forward a flattened, unpadded batch of tokens (ids or ready-made input embeddings) with
explicit (3, num_tokens) M-RoPE positions; attention goes through an `AttentionBackend` that owns
the KV cache. What it does not know: images, requests, scheduling, sampling.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.norms import RMSNorm
from mmserve.models.layers.rotary import MRotaryEmbedding, apply_rotary
from mmserve.models.qwen2_vl.config import TextConfig


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k, v in one matmul: rows [q | k | v]
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(backend.forward(self.layer_idx, q, k, v, meta))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, backend: AttentionBackend, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2LanguageModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied to the embeddings when configured).

    The rotary table is M-RoPE unless another is given (a family with 1-D positions passes its own:
    `rotary(positions, dtype) -> (cos, sin)` of shape (num_tokens, head_dim))."""

    def __init__(self, cfg: TextConfig, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary or MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """inputs_embeds: (num_tokens, hidden); positions: (3, num_tokens) for M-RoPE, (1, num_tokens) for a
        1-D rotary. Returns final hidden states."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, backend, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)
