"""Gemma 3's text decoder over a flattened, unpadded batch, attending through an `AttentionBackend`.

Role: scaled token embeddings (times sqrt(hidden_size), the factor rounded to the weights' dtype as
transformers does), decoder layers with four Gemma RMSNorms each (pre/post attention, pre/post
feed-forward), per-head q/k norms, grouped-query attention with the softmax scale
`query_pre_attn_scalar ** -0.5`, a gated gelu-tanh MLP, the final norm and the LM head (tied to the
embeddings by default), with final-logit softcapping when configured. Sliding layers attend over
their window with the local rope table; full layers over everything with the global one (default
or linear scaling). Each layer hands its own `LayerAttention` to the backend, which applies the
window and the bidirectional image spans of `AttentionMetadata`.

The shared `layers/decoder.py` decoder is not used: Gemma's layer has two more norms, (1 + w) norms,
per-layer windows and rope tables, and a scaled embedding. Parameter names follow Hugging Face's
Gemma 3 layout with q/k/v and gate/up stacked, so the weight mapping stays a prefix rename.

What it does not know: images, requests, scheduling, sampling, config files.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.gemma3.config import SLIDING, RopeConfig, TextConfig
from mmserve.models.gemma3.norm import GemmaRMSNorm
from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.rotary import RotaryEmbedding, apply_rotary


def rotary_table(head_dim: int, rope: RopeConfig) -> RotaryEmbedding:
    """A 1-D rope table; linear scaling divides the inverse frequencies by the factor (as transformers does)."""
    table = RotaryEmbedding(head_dim, rope.theta)
    if rope.rope_type == "linear":
        table.inv_freq.div_(rope.factor)
    return table


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k, v in one matmul: rows [q | k | v]
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.options = LayerAttention(sliding_window=cfg.window(layer_idx), scale=cfg.query_pre_attn_scalar ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(backend.forward(self.layer_idx, q, k, v, meta, self.options))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_sliding = cfg.layer_types[layer_idx] == SLIDING
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, backend, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.local_rotary = rotary_table(cfg.head_dim, cfg.local_rope)
        self.global_rotary = rotary_table(cfg.head_dim, cfg.global_rope)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the normalizer rounded to the weights' dtype, as transformers does (in bfloat16 sqrt(3072) becomes
        # 55.5); rounded here, once per dtype, then a plain scalar: the product is the same, no tensor is
        # shipped, and a compiled step reads a constant (no `.item()` in it)
        self.embed_scales = {dtype: torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype).item()
                             for dtype in (torch.float32, torch.bfloat16, torch.float16)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scales[self.embed_tokens.weight.dtype]

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds (num_tokens, hidden), already scaled (text) or encoder rows (images);
        positions (1, num_tokens); extra_streams: always None (one embedding stream). Returns the final
        hidden states (num_tokens, hidden)."""
        dtype = inputs_embeds.dtype
        tables = {True: self.local_rotary(positions, dtype), False: self.global_rotary(positions, dtype)}
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, *tables[layer.is_sliding], backend, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding table is the head
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
