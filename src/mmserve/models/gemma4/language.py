"""Gemma 4's text decoder over a flattened, unpadded batch, attending through an `AttentionBackend`.

Role: scaled token embeddings; per-layer embeddings (PLE: a second, packed embedding table of the
token ids — the pad row at media positions — plus a projection of the input rows, normed, averaged,
one slice per layer, gated into every layer's output); decoder layers with four RMSNorms, q/k norms and
a scale-free v norm, unit softmax scale, a gated gelu-tanh MLP (twice as wide on KV-shared layers when
`use_double_wide_mlp`), sparse experts beside it on MoE checkpoints (`moe.py`) and a learned `layer_scalar`; sliding layers on their window with the default
rope, full layers with proportional (partial) rope and their own head size; the final norm, the tied
LM head and logit soft-capping.

KV sharing: the last `num_kv_shared_layers` layers have no k/v projections. Each reads the cache of the
last earlier layer of its type (its `kv_source`), passing that layer's index and this step's keys and
values to the backend with `LayerAttention.shared_kv`, so no cache is written or allocated for it.

What it does not know: pixels, audio, requests, scheduling, sampling, config files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.gemma4.blocks import Gemma4RMSNorm
from mmserve.models.gemma4.config import FULL, RopeConfig, TextConfig
from mmserve.models.gemma4.moe import Gemma4Moe
from mmserve.models.layers.activations import get_activation
from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata, LayerAttention
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.rotary import apply_rotary

# this step's (keys, values) of each layer type's store layer, for the KV-shared layers after it
SharedKV = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Gemma4Rotary(nn.Module):
    """cos/sin over a whole head: proportional rope turns only the first `partial_rotary_factor` of the
    angles (the others have frequency zero: cos 1, sin 0), as transformers' "proportional" type."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        angles = int(rope.partial_rotary_factor * head_dim // 2)
        turned = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / head_dim))
        inv_freq = torch.cat((turned, torch.zeros(head_dim // 2 - angles)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (1, num_tokens) -> cos, sin (num_tokens, head_dim) in `dtype`."""
        freqs = positions[0].to(torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        kv = cfg.layers[layer_idx]
        self.layer_type, self.kv_source = kv.layer_type, kv.kv_source
        self.shared = cfg.is_kv_shared(layer_idx)
        self.k_is_v = cfg.attention_k_eq_v and kv.layer_type == FULL
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, kv.num_kv_heads, kv.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # rows [q | k | v]; [q | k] when the keys are the values; [q] on a KV-shared layer
        widths = [self.q_size] + ([] if self.shared else [self.kv_size] * (1 if self.k_is_v else 2))
        self.widths = widths  # the stacked projection's shards, as the checkpoint loader splits it
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(widths), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps)
        if not self.shared:
            self.k_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)
        self.options = LayerAttention(sliding_window=cfg.window(layer_idx), scale=1.0,
                                      bidirectional_spans=cfg.bidirectional_vision and kv.layer_type != FULL,
                                      shared_kv=self.shared)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, shared_kv: SharedKV, stores: bool) -> torch.Tensor:
        n = x.shape[0]
        parts = self.qkv_proj(x).split(self.widths, dim=-1)
        q = apply_rotary(self.q_norm(parts[0].view(n, self.num_heads, self.head_dim)), cos, sin)
        if self.shared:
            k, v = shared_kv[self.layer_type]
        else:
            k_raw = parts[1].view(n, self.num_kv_heads, self.head_dim)
            v_raw = k_raw if self.k_is_v else parts[2].view(n, self.num_kv_heads, self.head_dim)
            k, v = apply_rotary(self.k_norm(k_raw), cos, sin), self.v_norm(v_raw)
            if stores:
                shared_kv[self.layer_type] = (k, v)
        return self.o_proj(backend.forward(self.kv_source, q, k, v, meta, self.options))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        self.self_attn = Gemma4Attention(cfg, layer_idx)
        wide = 2 if cfg.use_double_wide_mlp and cfg.is_kv_shared(layer_idx) else 1
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size * wide, cfg.hidden_act, bias=False)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.moe = None
        if cfg.enable_moe_block:  # experts beside the dense MLP, their outputs normed and added
            self.moe = Gemma4Moe(cfg)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # in the checkpoint: loaded like a weight
        self.per_layer = cfg.hidden_size_per_layer_input
        if self.per_layer:
            self.act = get_activation(cfg.hidden_act)
            self.per_layer_input_gate = nn.Linear(h, self.per_layer, bias=False)
            self.per_layer_projection = nn.Linear(self.per_layer, h, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, meta: AttentionMetadata, shared_kv: SharedKV,
                stores: bool) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, backend, meta, shared_kv, stores)
        x = x + self.post_attention_layernorm(attended)
        dense = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:
            dense = self.post_feedforward_layernorm_1(dense) + self.moe(x)
        x = x + self.post_feedforward_layernorm(dense)
        if self.per_layer:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


def _dtype_scales(value: float) -> dict[torch.dtype, float]:
    """`value` rounded to each weight dtype, as transformers' scaled embeddings multiply by it (sqrt(1536)
    is 39.25 in bfloat16); then a plain scalar, so a compiled step reads a constant."""
    return {dtype: torch.tensor(value, dtype=dtype).item() for dtype in (torch.float32, torch.bfloat16, torch.float16)}


class Gemma4TextModel(nn.Module):
    def __init__(self, cfg: TextConfig, media_token_ids: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = nn.ModuleDict({"sliding_attention": Gemma4Rotary(cfg.head_dim, cfg.sliding_rope),
                                     FULL: Gemma4Rotary(cfg.global_head_dim, cfg.full_rope)})
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.embed_scales = _dtype_scales(cfg.hidden_size ** 0.5)
        # the store layers: the last unshared layer of each type whose cache a KV-shared layer reads
        self.stores = frozenset(kv.kv_source for i, kv in enumerate(cfg.layers) if cfg.is_kv_shared(i))
        self.register_buffer("media_token_ids", torch.tensor(media_token_ids or (-1,), dtype=torch.long),
                             persistent=False)
        self.per_layer = cfg.hidden_size_per_layer_input
        if self.per_layer:
            total = cfg.num_hidden_layers * self.per_layer
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, total)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, total, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer, cfg.rms_norm_eps)
            self.per_layer_scales = _dtype_scales(self.per_layer ** 0.5)

    def _text_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The ids with every media token read as the pad token, as transformers reads them: at a prompt's
        media rows (which the encoder's rows then replace) and where the model generated a media token."""
        is_media = torch.isin(token_ids, self.media_token_ids)
        return torch.where(is_media, torch.full_like(token_ids, self.cfg.pad_token_id), token_ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(self._text_ids(input_ids)) * self.embed_scales[self.embed_tokens.weight.dtype]

    def per_layer_inputs(self, token_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """(num_tokens, layers, per_layer) PLE inputs: the token-identity rows (a media token reads the pad
        row) plus the normed projection of the input rows, times 1/sqrt(2)."""
        n, shape = token_ids.shape[0], (token_ids.shape[0], self.cfg.num_hidden_layers, self.per_layer)
        ids = self._text_ids(token_ids)
        table = self.embed_tokens_per_layer
        identity = (table(ids) * self.per_layer_scales[table.weight.dtype]).view(shape)
        projected = self.per_layer_model_projection(inputs_embeds) * self.cfg.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.view(n, *shape[1:]))
        return (projected + identity) * 2.0 ** -0.5

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds (num_tokens, hidden): scaled text embeddings with media rows fused in; positions
        (1, num_tokens); token_ids (num_tokens,): the step's ids (PLE reads them). Returns the final hidden
        states (num_tokens, hidden)."""
        dtype = inputs_embeds.dtype
        tables = {kind: rotary(positions, dtype) for kind, rotary in self.rotary.items()}
        per_layer = None
        if self.per_layer:
            if token_ids is None:
                raise ValueError("Gemma 4's per-layer embeddings need the step's token ids")
            per_layer = self.per_layer_inputs(token_ids, inputs_embeds)
        shared_kv: SharedKV = {}
        x = inputs_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, None if per_layer is None else per_layer[:, i], *tables[layer.layer_type], backend, meta,
                      shared_kv, i in self.stores)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
