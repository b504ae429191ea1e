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
import torch.nn.functional as F
from torch import nn

from mmserve.models.layers.activations import get_activation
from mmserve.models.layers.mlp import GatedMLP
from mmserve.models.layers.norms import RMSNorm
from mmserve.models.layers.rotary import VisionRotaryEmbedding, apply_rotary
from mmserve.models.qwen2_vl.config import VisionConfig

GridTHW = tuple[int, int, int]


def vision_hw_positions(grids: Sequence[GridTHW], merge: int) -> torch.Tensor:
    """(num_patches, 2) row/column of every patch, in the processor's merge-block order."""
    out = []
    for t, h, w in grids:
        hpos = np.arange(h).reshape(h // merge, merge, 1, 1).repeat(w // merge, 2).repeat(merge, 3)
        wpos = np.arange(w).reshape(1, 1, w // merge, merge).repeat(h // merge, 0).repeat(merge, 1)
        hw = np.stack([hpos.transpose(0, 2, 1, 3).ravel(), wpos.transpose(0, 2, 1, 3).ravel()], axis=-1)
        out.append(np.tile(hw, (t, 1)))
    return torch.from_numpy(np.concatenate(out, axis=0))


def frame_segments(grids: Sequence[GridTHW]) -> list[int]:
    """Full-attention segment lengths: every temporal patch of every item attends within itself."""
    return [h * w for t, h, w in grids for _ in range(t)]


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


# A segment joins a padded batch while it is at least this share of the batch's longest segment.
SEGMENT_BUCKET_FILL = 0.75


class SegmentPlan:
    """How to attend within each segment of a packed batch, computed once on the CPU per forward.

    Segments are bucketed by length; a bucket of one segment, or of equal-length contiguous
    segments, is a view of the packed rows; any other bucket is gathered into a padded batch
    with a key mask. Many small items then cost a few kernel calls instead of one each."""

    def __init__(self, segments: list[int], device: torch.device) -> None:
        starts = np.concatenate(([0], np.cumsum(segments)))[:-1]
        order = sorted(range(len(segments)), key=lambda i: -segments[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and segments[i] >= SEGMENT_BUCKET_FILL * segments[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        self.views: list[tuple[int, int, int]] = []  # (start, count, length) runs usable as views
        # (index (num, width), key mask, flat positions of the valid rows, their packed rows)
        self.gathers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for group in groups:
            group.sort()
            lengths = [segments[i] for i in group]
            contiguous = all(starts[b] == starts[a] + segments[a] for a, b in zip(group, group[1:]))
            if len(set(lengths)) == 1 and contiguous:
                self.views.append((int(starts[group[0]]), len(group), lengths[0]))
                continue
            width = max(lengths)
            offsets = np.arange(width)[None, :]
            valid = offsets < np.asarray(lengths)[:, None]
            index = np.where(valid, starts[group][:, None] + offsets, 0)
            # built here on the CPU: boolean indexing of device data would sync with the host
            flat_valid = np.flatnonzero(valid)
            self.gathers.append(tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in (
                index, valid[:, None, None, :], flat_valid, index[valid])))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """Bidirectional attention within each segment of a packed (num_patches, heads, head_dim) batch."""
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    for start, count, length in plan.views:
        end = start + count * length
        # (count, heads, length, head_dim)
        qs, ks, vs = (x[start:end].view(count, length, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(end - start, -1)
    for index, mask, flat_valid, rows in plan.gathers:
        # index_select on the flattened index: much faster on the CPU than advanced indexing
        qs, ks, vs = (x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:]).transpose(1, 2)
                      for x in (q, k, v))  # (num, heads, width, head_dim)
        res = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(1, 2)
        out.index_copy_(0, rows, res.reshape(-1, out.shape[1]).index_select(0, flat_valid))
    return out


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: SegmentPlan) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # rotary in float32, as the reference does
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        return self.proj(segment_attention(q, k, v, segments))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        if cfg.is_qwen2_5:
            self.norm1, self.norm2 = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
            self.mlp = GatedMLP(d, cfg.mlp_hidden_size, cfg.hidden_act, bias=True)
        else:
            self.norm1, self.norm2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
            self.mlp = VisionMLP(d, cfg.mlp_hidden_size, cfg.hidden_act)
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
