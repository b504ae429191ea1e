"""The Qwen3-VL vision tower (Qwen3.5's too, with no deepstack taps): patches -> merged rows, plus one
deepstack stream per tapped block.

Role: turn patchified pixels (num_patches, C*T*P*P) of one or more items, with each item's (t, h, w)
patch grid, into (1 + num_deepstack, num_patches / merge**2, out_hidden) rows in item order: stream 0
is the final merger's output, stream 1.. the deepstack mergers' outputs of the blocks listed in
`deepstack_visual_indexes` (in block order). A learned square grid of position embeddings is
bilinearly resampled (align_corners) to every item's grid, as transformers does; attention is
full within each temporal patch, with 2-D axial rotary. All index bookkeeping (resampling taps,
rotary positions, attention segments) is built on the CPU from the grids.

What it does not know: tokens, prompts, caches, the language model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from mmserve.models.layers.activations import get_activation
from mmserve.models.layers.rotary import VisionRotaryEmbedding
from mmserve.models.vision.qwen3_vision_config import VisionConfig
from mmserve.models.vision.segment_attention import (
    GridTHW,
    SegmentPlan,
    VisionAttention,
    frame_segments,
    vision_hw_positions,
)


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Two bilinear taps (align_corners) into a `side`-long table for target positions `index` on an
    axis of length `size` (per element). float32 arithmetic in the reference's order."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    distance = np.abs((src - floor)[:, None] - offsets.astype(np.float32))
    return taps, np.maximum(np.float32(1) - distance, np.float32(0))


def position_embedding_taps(grids: Sequence[GridTHW], side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(num_patches, 4) indices into the flattened (side, side) position table and (num_patches, 4)
    float32 weights: bilinear resampling of the table to each item's (h, w) grid, patches in the
    processor's merge-block order, repeated over the item's temporal patches."""
    hw = vision_hw_positions(grids, merge).numpy()  # (num_patches, 2) row, column
    heights = np.concatenate([np.full(t * h * w, h) for t, h, w in grids])
    widths = np.concatenate([np.full(t * h * w, w) for t, h, w in grids])
    h_taps, h_weights = _axis_taps(hw[:, 0], heights, side)
    w_taps, w_weights = _axis_taps(hw[:, 1], widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.attn = VisionAttention(d, cfg.num_heads)
        self.mlp = VisionMLP(d, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: SegmentPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenate each merge block's patches and project to the LM width. The final merger
    normalises each patch before concatenating; the deepstack mergers ("postshuffle") after."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_dim)) if self.postshuffle else self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Conv3d with stride == kernel over one patch is a matmul over the flattened patch.
        self.patch_embed = nn.Linear(cfg.patch_input_dim, cfg.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.rotary = VisionRotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True)
                                                   for _ in cfg.deepstack_visual_indexes)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[GridTHW]) -> torch.Tensor:
        """pixel_values: (num_patches, C*T*P*P); returns (1 + num_deepstack, num_patches // merge**2,
        out_hidden): the final merger's rows, then each deepstack merger's, in block order."""
        cfg = self.cfg
        merge = cfg.spatial_merge_size
        device = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.dtype))
        indices, weights = position_embedding_taps(grids, cfg.num_grid_per_side, merge)
        taps = self.pos_embed(torch.from_numpy(indices).to(device, non_blocking=True))  # (patches, 4, hidden)
        weights_t = torch.from_numpy(weights).to(device, non_blocking=True)
        # weights stay float32, as the reference's; the sum is cast to the tower's dtype
        x = x + (taps * weights_t[:, :, None]).sum(1).to(x.dtype)
        cos, sin = self.rotary(vision_hw_positions(grids, merge).to(device, non_blocking=True))
        segments = SegmentPlan(frame_segments(grids), device)
        streams: list[torch.Tensor | None] = [None] * (1 + len(cfg.deepstack_visual_indexes))
        taps_at = {layer: n for n, layer in enumerate(cfg.deepstack_visual_indexes)}
        order = sorted(taps_at)  # the reference hands the decoder the taps in block order
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, segments)
            if i in taps_at:
                streams[1 + order.index(i)] = self.deepstack_merger_list[taps_at[i]](x)
        streams[0] = self.merger(x)
        return torch.stack(streams)


_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "language_model."),
             ("lm_head.", "language_model.lm_head."))


class Qwen3StyleCalls:
    """What a Qwen3-VL-style family model does alike (mix in before LanguageModelCalls): encode items with its
    `visual` tower, and map Hugging Face names (`model.visual.*`, `model.language_model.*`, `lm_head.*`)."""

    config: Any
    visual: VisionTransformer
    encoder_device: torch.device

    def encode_items(self, payloads: Sequence[Any]) -> list[torch.Tensor]:
        """One (streams, rows, hidden) tensor per item (streams: 1 + deepstack taps): views into one output."""
        pixels = torch.from_numpy(np.concatenate([p.pixel_values for p in payloads]))
        grids = [p.grid_thw for p in payloads]
        unit = self.config.vision.spatial_merge_size ** 2
        streams = self.visual(pixels.to(self.encoder_device, non_blocking=True), grids)  # (streams, rows, hidden)
        return list(streams.split([t * h * w // unit for t, h, w in grids], dim=1))

    def _rename(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Hugging Face parameter name -> this module's name (before stacking), or None to skip it."""
        name = hf_name
        for prefix, ours in _PREFIXES:
            if hf_name.startswith(prefix):
                name = ours + hf_name[len(prefix):]
                break
        name = name.replace("visual.patch_embed.proj.", "visual.patch_embed.")
        if name == "language_model.lm_head.weight" and self.config.text.tie_word_embeddings:
            return None  # tied: the embedding matrix is the head
        if name == "visual.patch_embed.weight":
            tensor = tensor.reshape(tensor.shape[0], -1)  # (out, C, T, P, P) -> (out, C*T*P*P)
        return name, tensor
