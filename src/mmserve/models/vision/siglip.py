"""The SigLIP vision tower (LLaVA-OneVision's and Gemma 3's), run up to the selected feature layer.

Role: square tiles (num_tiles, C, S, S) in, per-patch features of the selected hidden states out
(num_tiles, (S/P)^2, hidden * len(feature_layers)). The conv patch embedding is one matmul over
flattened patches, learned position embeddings are added, and the encoder layers attend
bidirectionally within a tile with SDPA. Every tile has the same shape, so the tiles of many items
run as one batch. Layers past the deepest feature layer, the post-layernorm and the pooling head
are never built: the selected hidden states are taken before them, as the reference does.
What it does not know: anyres layouts, projectors, the language model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.layers.mlp import FeedForward
from mmserve.models.vision.siglip_config import SiglipVisionConfig


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # rows [q | k | v]
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (tiles, patches, hidden) -> (tiles, patches, hidden)."""
        b, n, d = x.shape
        # (3, tiles, heads, patches, head_dim)
        qkv = self.qkv_proj(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = FeedForward(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig, feature_layers: tuple[int, ...]) -> None:
        """feature_layers: non-negative indices into [embeddings, layer 1 output, ...]."""
        super().__init__()
        self.cfg = cfg
        self.feature_layers = feature_layers
        # the conv's (hidden, C, P, P) kernel flattened: one matmul over (C, P, P)-ordered patches
        self.patch_embedding = nn.Linear(cfg.patch_input_dim, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.patches_per_side ** 2, cfg.hidden_size)
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(max(feature_layers)))

    def patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        """(tiles, C, S, S) -> (tiles, (S/P)^2, C*P*P), patches in row-major order."""
        t, c, s, _ = pixels.shape
        p, g = self.cfg.patch_size, s // self.cfg.patch_size
        return pixels.view(t, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(t, g * g, c * p * p)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: (tiles, C, S, S) -> (tiles, (S/P)^2, hidden * len(feature_layers))."""
        if pixels.shape[-1] != self.cfg.image_size or pixels.shape[-2] != self.cfg.image_size:
            raise ValueError(f"tiles must be {self.cfg.image_size}x{self.cfg.image_size}, got {tuple(pixels.shape)}")
        x = self.patch_embedding(self.patchify(pixels.to(self.patch_embedding.weight.dtype)))
        x = x + self.position_embedding.weight
        selected = [x] if 0 in self.feature_layers else []
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            if i in self.feature_layers:
                selected.append(x)
        # selected holds the hidden states by increasing index; concatenate them in the config's order
        by_index = dict(zip(sorted(set(self.feature_layers)), selected))
        if len(self.feature_layers) == 1:
            return by_index[self.feature_layers[0]]
        return torch.cat([by_index[i] for i in self.feature_layers], dim=-1)
