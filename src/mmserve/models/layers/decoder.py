"""The Qwen-style decoder shared by the families' language models, written for a serving engine.

Role: embeddings, pre-norm decoder layers (fused q/k/v with grouped-query attention through an
`AttentionBackend`, a gated MLP), the final norm and the LM head, over a flattened, unpadded batch.
What differs between families is a choice, not a copy: q/k/v and output biases, per-head q/k
RMSNorm (Qwen3), the rotary table (M-RoPE, interleaved M-RoPE, 1-D), extra embedding streams
added after the first layers (Qwen3-VL's deepstack), and sparse expert MLPs in some layers (Qwen3-VL-MoE). Parameter names follow Hugging Face's Qwen2/3
layout, so the families' weight mapping stays a prefix rename.

What it does not know: images, requests, scheduling, sampling, any family's config format (it
reads the fields of `config_reader.DecoderTextConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmserve.models.config_reader import DecoderTextConfig
from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.moe import SparseMoeBlock
from mmserve.models.layers.norms import RMSNorm
from mmserve.models.layers.rotary import apply_rotary


@dataclass(frozen=True)
class MoeOptions:
    """Sparse MLPs (`layers/moe.py`) in the layers listed; the others keep the dense MLP."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    sparse_layers: tuple[int, ...]


@dataclass(frozen=True)
class DecoderOptions:
    qkv_bias: bool = True  # Qwen2: q/k/v carry a bias, the output projection none
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotary
    sliding_window: int | None = None  # Mistral: every layer attends over the last this-many positions
    moe: MoeOptions | None = None  # Qwen3-VL-MoE: sparse expert MLPs


class Attention(nn.Module):
    def __init__(self, cfg: DecoderTextConfig, layer_idx: int, options: DecoderOptions) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k, v in one matmul: rows [q | k | v]
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=options.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=options.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if options.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if options.qk_norm else None
        self.options = LayerAttention(sliding_window=options.sliding_window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is None:  # q and k lie side by side in qkv: rotate them as one (n, heads + kv_heads) view
            qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(n, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(backend.forward(self.layer_idx, q, k, v, meta, self.options))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderTextConfig, layer_idx: int, options: DecoderOptions) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, options)
        moe = options.moe
        self.mlp = SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.top_k, moe.moe_intermediate_size,
                                  cfg.hidden_act) if moe is not None and layer_idx in moe.sparse_layers \
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied to the embeddings when configured).

    `rotary(positions, dtype) -> (cos, sin)`, each (num_tokens, head_dim), takes the positions the
    family's scheme uses: (3, num_tokens) for M-RoPE, (1, num_tokens) for 1-D RoPE."""

    def __init__(self, cfg: DecoderTextConfig, rotary: nn.Module, options: DecoderOptions = DecoderOptions()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, options) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds (num_tokens, hidden); extra_streams (num_extra, num_tokens, hidden), zero at text
        rows, or None: stream i is added after layer i. Returns the final hidden states."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        x = inputs_embeds
        num_extra = 0 if extra_streams is None else extra_streams.shape[0]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, backend, meta)
            if i < num_extra:
                x = x + extra_streams[i].to(x.dtype)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding table is the head
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)
