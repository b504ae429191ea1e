"""The Pixtral vision encoder and the Mistral 3 projector: patches of images of any size -> rows.

Role: patches of one or more images packed into one sequence (num_patches, C*P*P), with each image's
(h, w) patch grid, become (num_patches / merge**2, text_hidden) rows in image order. The encoder is
Pixtral's: the conv patch embedding as one matmul (no bias), `ln_pre` RMSNorm, 2-D RoPE over each
image's own patch grid (row position drives the even bands of the head's frequencies, column the
odd ones), pre-norm blocks of bias-free attention and a gated feed-forward; attention is
bidirectional within an image and blocked between images (`vision/segment_attention.py`'s bucketed segment
attention). Blocks past the configured feature layer are never built. The projector is Mistral 3's:
RMSNorm (with the text model's eps), the patch merger (each merge x merge block of patches
concatenated channel-major, as `torch.nn.functional.unfold` orders them, then a bias-free linear),
linear_1, activation, linear_2. All index bookkeeping (rotary positions, segments, merge order) is
built on the CPU from the grids.

What it does not know: tokens, prompts, `[IMG_BREAK]` rows, caches, the language model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mmserve.models.layers.activations import get_activation
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.norms import RMSNorm
from mmserve.models.layers.rotary import apply_rotary, inverse_frequencies
from mmserve.models.mistral3.config import Mistral3Config, VisionConfig
from mmserve.models.vision.segment_attention import SegmentPlan, segment_attention

GridHW = tuple[int, int]  # an image's patch grid: (rows, columns) of patches
PIXTRAL_NORM_EPS = 1e-5  # fixed in Pixtral, not a config field


def grid_positions(grids: Sequence[GridHW]) -> np.ndarray:
    """(num_patches, 2) int64 (row, column) of every patch, each image's patches row-major."""
    out = [np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"), axis=-1).reshape(-1, 2)
           for h, w in grids]
    return np.concatenate(out).astype(np.int64)


def merge_order(grids: Sequence[GridHW], merge: int) -> np.ndarray:
    """(num_patches,) int64: the packed patches regrouped merge block by merge block (blocks row-major,
    then the block's patches row-major), the order the patch merger concatenates them in."""
    out, base = [], 0
    for h, w in grids:
        idx = np.arange(h * w).reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3)
        out.append(idx.reshape(-1) + base)
        base += h * w
    return np.concatenate(out).astype(np.int64)


class PixtralRotaryEmbedding(nn.Module):
    """2-D RoPE: of the head's head_dim/2 frequencies 1/theta^(2i/head_dim), the even ones follow the
    patch row and the odd ones the patch column; the angles fill both halves ("rotate half").

    forward(hw (num_patches, 2) int64, dtype) -> cos, sin (num_patches, head_dim), computed in float32
    and cast to `dtype`, as the reference does."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta)
        self.register_buffer("row_freq", inv_freq[0::2].clone(), persistent=False)
        self.register_buffer("col_freq", inv_freq[1::2].clone(), persistent=False)

    def forward(self, hw: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        hw = hw.to(torch.float32)
        freqs = torch.cat((hw[:, :1] * self.row_freq, hw[:, 1:] * self.col_freq), dim=-1)  # (n, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class PixtralAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)  # rows [q | k | v]
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(segment_attention(q, k, v, plan))


class PixtralLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, PIXTRAL_NORM_EPS)
        self.attention = PixtralAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, PIXTRAL_NORM_EPS)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, plan)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    """Holds the blocks under the reference's name (`transformer.layers.N`)."""

    def __init__(self, cfg: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(cfg) for _ in range(num_layers))


class PixtralVisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, num_layers: int) -> None:
        """num_layers: the blocks to run (the feature layer's index; 0 takes the `ln_pre` output)."""
        super().__init__()
        self.cfg = cfg
        # the conv's (hidden, C, P, P) kernel flattened: one matmul over (C, P, P)-ordered patches
        self.patch_conv = nn.Linear(cfg.patch_input_dim, cfg.hidden_size, bias=False)
        self.ln_pre = RMSNorm(cfg.hidden_size, PIXTRAL_NORM_EPS)
        self.rotary = PixtralRotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.transformer = PixtralTransformer(cfg, num_layers)

    def forward(self, patches: torch.Tensor, grids: Sequence[GridHW]) -> torch.Tensor:
        """patches (num_patches, C*P*P), each image's patches row-major -> (num_patches, hidden)."""
        device = patches.device
        x = self.ln_pre(self.patch_conv(patches.to(self.patch_conv.weight.dtype)))
        cos, sin = self.rotary(torch.from_numpy(grid_positions(grids)).to(device, non_blocking=True), x.dtype)
        plan = SegmentPlan([h * w for h, w in grids], device)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin, plan)
        return x


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.hidden, self.merge = hidden, merge
        self.merging_layer = nn.Linear(hidden * merge * merge, hidden, bias=False)

    def forward(self, x: torch.Tensor, grids: Sequence[GridHW]) -> torch.Tensor:
        """x (num_patches, hidden) -> (num_patches / merge**2, hidden)."""
        unit = self.merge * self.merge
        order = torch.from_numpy(merge_order(grids, self.merge)).to(x.device, non_blocking=True)
        # (blocks, unit, hidden) -> channel-major (blocks, hidden * unit), as unfold lays a block out
        blocks = x.index_select(0, order).view(-1, unit, self.hidden).transpose(1, 2).reshape(-1, self.hidden * unit)
        return self.merging_layer(blocks)


class Mistral3Projector(nn.Module):
    def __init__(self, config: Mistral3Config) -> None:
        super().__init__()
        vision, text, bias = config.vision.hidden_size, config.text.hidden_size, config.multimodal_projector_bias
        self.norm = RMSNorm(vision, config.text.rms_norm_eps)  # the text model's eps, as the reference
        self.patch_merger = PatchMerger(vision, config.spatial_merge_size)
        self.linear_1 = nn.Linear(vision, text, bias=bias)
        self.act = get_activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(text, text, bias=bias)

    def forward(self, x: torch.Tensor, grids: Sequence[GridHW]) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x), grids))))
