"""The Qwen2-VL / Qwen2.5-VL vision tower laid out for captured graphs (runner/graphs/encoder_graphs.py).

Role: the tower's forward with static shapes. Everything that depends on the images — rotary
positions, frame contexts, Qwen2.5-VL's window order and window contexts — is computed on the CPU
(with the eager tower's own functions) and loaded into static buffers; the forward reads only those
buffers, so one capture serves every batch of its bucket. Attention kinds: "full" (each frame
attends within itself) and, on Qwen2.5-VL, "window". Padding is whole merge blocks at the tail:
zero-filled pixels in dummy contexts, kept in place by the window order, merged into rows past the
real ones. Attention is `context_attention` over `cu_seqlens` (varlen flash on CUDA in half
precision); the eager tower's bucketed segment attention computes the same values.

What it does not know: buckets beyond their shapes, graphs, the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from mmserve.models.layers.context_attention import context_attention
from mmserve.models.layers.encoder_batch import EncoderBucket, EncoderGraphBatch, EncoderPlan
from mmserve.models.layers.rotary import apply_rotary
from mmserve.models.qwen2_vl.processor import VisionInput
from mmserve.models.qwen2_vl.vision import VisionBlock, VisionTransformer, window_order
from mmserve.models.vision.segment_attention import frame_segments, vision_hw_positions

FULL, WINDOW = "full", "window"


class Qwen2VisionGraphAdapter:
    def __init__(self, visual: VisionTransformer) -> None:
        self.visual = visual
        cfg = visual.cfg
        self.merge = cfg.spatial_merge_size
        self.token_multiple = self.merge * self.merge
        self.is_windowed = cfg.is_qwen2_5
        self.attention_kinds = (FULL, WINDOW) if self.is_windowed else (FULL,)
        self.window_blocks = cfg.window_size // self.merge // cfg.patch_size if self.is_windowed else 0

    # ---- host side --------------------------------------------------------------------------
    def layout(self, payloads: Sequence[VisionInput]) -> EncoderGraphBatch:
        grids = [p.grid_thw for p in payloads]
        arrays = {"pixel_values": torch.from_numpy(np.concatenate([p.pixel_values for p in payloads])),
                  "hw_positions": vision_hw_positions(grids, self.merge)}
        contexts = [tuple(frame_segments(grids))]
        if self.is_windowed:
            order, windows = window_order(grids, self.merge, self.window_blocks)
            arrays["window_order"] = torch.from_numpy(order.astype(np.int64))
            contexts.append(tuple(windows))
        rows = tuple(t * h * w // self.token_multiple for t, h, w in grids)
        return EncoderGraphBatch(tuple(contexts), rows, arrays)

    def static_inputs(self, bucket: EncoderBucket, device: torch.device) -> dict[str, torch.Tensor]:
        tokens, blocks = bucket.total_tokens, bucket.total_tokens // self.token_multiple
        out = {"pixel_values": torch.zeros(tokens, self.visual.cfg.patch_input_dim, device=device),
               "hw_positions": torch.zeros(tokens, 2, dtype=torch.int64, device=device),
               "cu_full": torch.zeros(bucket.num_contexts[0] + 1, dtype=torch.int32, device=device)}
        if self.is_windowed:
            out["cu_window"] = torch.zeros(bucket.num_contexts[1] + 1, dtype=torch.int32, device=device)
            out["window_order"] = torch.zeros(blocks, dtype=torch.int64, device=device)
            out["window_inverse"] = torch.zeros(blocks, dtype=torch.int64, device=device)
        return out

    def host_inputs(self, batch: EncoderGraphBatch | None, plan: EncoderPlan) -> dict[str, torch.Tensor]:
        out = {"cu_full": torch.tensor(plan.cu_seqlens(0), dtype=torch.int32)}
        if batch is not None:
            # padding rows keep whatever they held: finite values, alone in their dummy contexts
            out["pixel_values"] = batch.arrays["pixel_values"]
            out["hw_positions"] = batch.arrays["hw_positions"]
        if self.is_windowed:
            out["cu_window"] = torch.tensor(plan.cu_seqlens(1), dtype=torch.int32)
            real_blocks = plan.real_tokens // self.token_multiple
            tail = torch.arange(real_blocks, plan.bucket.total_tokens // self.token_multiple)
            order = tail if batch is None else torch.cat([batch.arrays["window_order"], tail])
            out["window_order"] = order
            out["window_inverse"] = torch.argsort(order)
        return out

    # ---- device side (captured) -----------------------------------------------------------------
    def forward(self, inputs: Mapping[str, torch.Tensor], bucket: EncoderBucket) -> torch.Tensor:
        visual, unit = self.visual, self.token_multiple
        tokens = bucket.total_tokens
        x = visual.patch_embed(inputs["pixel_values"].to(visual.dtype))
        cos, sin = visual.rotary(inputs["hw_positions"])
        if self.is_windowed:  # regroup merge blocks window by window
            order = inputs["window_order"]
            x, cos, sin = (t.view(tokens // unit, unit, -1).index_select(0, order).view(tokens, -1)
                           for t in (x, cos, sin))
        # the longest context a layout of this bucket can hold: every other context has >= 1 token
        longest = [tokens - (n - 1) for n in bucket.num_contexts]
        for i, block in enumerate(visual.blocks):
            kind = 0 if not self.is_windowed or i in visual.cfg.fullatt_block_indexes else 1
            cu = inputs["cu_full"] if kind == 0 else inputs["cu_window"]
            x = _block_forward(block, x, cos, sin, cu, longest[kind])
        merged = visual.merger(x)
        if self.is_windowed:
            merged = merged.index_select(0, inputs["window_inverse"])
        return merged[None]  # (1 stream, rows, out_hidden)


def _block_forward(block: VisionBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cu_seqlens: torch.Tensor, longest: int) -> torch.Tensor:
    """`VisionBlock.forward` with the attention over device-side context starts."""
    attn = block.attn
    h = block.norm1(x)
    n = h.shape[0]
    q, k, v = attn.qkv(h).view(n, 3, attn.num_heads, attn.head_dim).unbind(1)
    q = apply_rotary(q.float(), cos, sin).to(x.dtype)  # rotary in float32, as the eager tower does
    k = apply_rotary(k.float(), cos, sin).to(x.dtype)
    x = x + attn.proj(context_attention(q, k, v, cu_seqlens, longest))
    return x + block.mlp(block.norm2(x))
