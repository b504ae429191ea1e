"""The Qwen2-VL and Qwen2.5-VL vision towers.

Role: turn patchified pixels (num_patches, C*T*P*P) of one or more items, with each item's
(t, h, w) patch grid, into merged embedding rows (num_patches / merge**2, out_hidden), in item
order. All index bookkeeping (rotary positions, attention segments, window order) is computed on
the CPU from the grids. What it does not know: tokens, prompts, caches.

Qwen2-VL: LayerNorm blocks with a plain MLP, full attention within each frame.
Qwen2.5-VL: RMSNorm blocks with a gated MLP; window attention except in `fullatt_block_indexes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mmserve.models.layers.mlp import FeedForward, GatedMLP
from mmserve.models.layers.norms import RMSNorm
from mmserve.models.layers.rotary import VisionRotaryEmbedding
from mmserve.models.qwen2_vl.config import VisionConfig
from mmserve.models.vision.segment_attention import (
    GridTHW,
    SegmentPlan,
    VisionAttention,
    frame_segments,
    vision_hw_positions,
)


def window_order(grids: Sequence[GridTHW], merge: int, window_patches: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL window attention layout, in units of merge blocks.

    Returns (order, segment_lengths): `order[i]` is the merge block placed at position i when
    blocks are regrouped window by window; `segment_lengths` are the windows' sizes in patches.
    `window_patches` is the window side in merged rows (window_size // merge // patch_size).
    """
    order, segments, base = [], [], 0
    unit = merge * merge
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        idx = np.arange(t * lh * lw).reshape(t, lh, lw)
        ph, pw = -lh % window_patches, -lw % window_patches
        padded = np.pad(idx, ((0, 0), (0, ph), (0, pw)), constant_values=-1)
        nh, nw = (lh + ph) // window_patches, (lw + pw) // window_patches
        win = padded.reshape(t, nh, window_patches, nw, window_patches).transpose(0, 1, 3, 2, 4)
        win = win.reshape(t * nh * nw, window_patches * window_patches)
        for row in win:
            valid = row[row >= 0]
            if valid.size:
                order.append(valid + base)
                segments.append(int(valid.size) * unit)
        base += t * lh * lw
    return np.concatenate(order), segments


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        if cfg.is_qwen2_5:
            self.norm1, self.norm2 = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
            self.mlp = GatedMLP(d, cfg.mlp_hidden_size, cfg.hidden_act, bias=True)
        else:
            self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
            self.mlp = FeedForward(d, cfg.mlp_hidden_size, cfg.hidden_act)
        self.attn = VisionAttention(d, cfg.num_heads)

    def forward(self, x, cos, sin, segments: SegmentPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenate each merge block's patches (merge**2 of them) and project to the LM width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.merged_dim = d * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(d, 1e-6) if cfg.is_qwen2_5 else nn.LayerNorm(d, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Conv3d with stride == kernel over one patch is a matmul over the flattened patch.
        self.patch_embed = nn.Linear(cfg.patch_input_dim, cfg.embed_dim, bias=False)
        self.rotary = VisionRotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[GridTHW]) -> torch.Tensor:
        """pixel_values: (num_patches, C*T*P*P); returns (num_patches // merge**2, out_hidden)."""
        cfg = self.cfg
        merge = cfg.spatial_merge_size
        unit = merge * merge
        device = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.dtype))
        cos, sin = self.rotary(vision_hw_positions(grids, merge).to(device, non_blocking=True))
        full_segments = SegmentPlan(frame_segments(grids), device)
        window_segments, order = full_segments, None
        if cfg.is_qwen2_5:
            order_np, windows = window_order(grids, merge, cfg.window_size // merge // cfg.patch_size)
            window_segments = SegmentPlan(windows, device)
            order = torch.from_numpy(order_np).to(device, non_blocking=True)
            n = x.shape[0]
            x = x.view(n // unit, unit, -1)[order].view(n, -1)
            cos = cos.view(n // unit, unit, -1)[order].view(n, -1)
            sin = sin.view(n // unit, unit, -1)[order].view(n, -1)
        for i, block in enumerate(self.blocks):
            use_full = not cfg.is_qwen2_5 or i in cfg.fullatt_block_indexes
            x = block(x, cos, sin, full_segments if use_full else window_segments)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        return merged
