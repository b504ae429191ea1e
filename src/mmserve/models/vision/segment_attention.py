"""Attention within the segments of a packed batch of patches, as the Qwen-style ViTs run it.

Role: a packed (num_patches, heads, head_dim) batch of one or more items attends bidirectionally within
each segment (a frame, a window, an image) and never across. `SegmentPlan` buckets the segments by
length once per forward on the CPU: a bucket of one segment, or of equal-length contiguous segments,
is a view of the packed rows; any other is gathered into a padded batch with a key mask, so many
small items cost a few SDPA calls instead of one each. `VisionAttention` is the Qwen ViT's attention
layer over it (fused q/k/v, 2-D rotary in float32); `vision_hw_positions` and `frame_segments` are
the patch positions and frame segments of (t, h, w) grids in the processor's merge-block order.
Shared by Qwen2-VL, Qwen2.5-VL, Qwen3-VL and (the plan and the attention) Mistral 3's Pixtral.

What it does not know: tokens, prompts, caches, which family's tower calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmserve.models.layers.rotary import apply_rotary

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
