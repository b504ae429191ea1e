"""Qwen2-VL / Qwen2.5-VL input processor: resize and patchify media, expand placeholders, M-RoPE.

Role: the family's hooks on `MultimodalProcessor`: an image or video becomes a run of
`<|image_pad|>` / `<|video_pad|>` ids, one per merged row, and a `VisionInput` payload (the
patchified pixels and the (t, h, w) patch grid); positions are the (3, num_tokens) M-RoPE table with
the decode rope delta. A video is one engine item per temporal group (`split_video`), so a growing
video reuses the encoder outputs and KV of its leading frames (`video_parts`); positions still
treat its groups as one (t, h, w) span, as transformers does. Per-request `min_pixels` / `max_pixels` (and `fps` for
video) are accepted.

What it does not know: devices, KV caches, scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmserve.inputs.items import IMAGE, VIDEO, MMItem, PromptPositions
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.processing import ItemExpansion, MultimodalProcessor
from mmserve.inputs.tokenizer import TextTokenizer
from mmserve.models.qwen2_vl.config import Qwen2VLConfig
from mmserve.models.qwen2_vl.mrope import VisionSpan, mrope_positions
from mmserve.models.vision.qwen_image_processor import (
    ImageProcessorConfig,
    Qwen2VLImageProcessor,
    video_parts,
)


@dataclass(frozen=True)
class VisionInput:
    """One item's encoder input."""

    pixel_values: np.ndarray  # (encoder_tokens, C*T*P*P) float32, in merge-block order
    grid_thw: tuple[int, int, int]  # patch grid before merging
    time_interval: float = 1.0  # M-RoPE step between temporal patches (videos on Qwen2.5-VL)


class Qwen2VLProcessor(MultimodalProcessor):
    def __init__(self, model_dir: str | Path, config: Qwen2VLConfig, limits: MediaLimits | None = None,
                 num_threads: int | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        super().__init__(model_dir, {IMAGE: config.image_token_id, VIDEO: config.video_token_id},
                         config.text.vocab_size, limits, tokenizer=tokenizer)
        self.config = config
        self.image_processor = Qwen2VLImageProcessor(ImageProcessorConfig.from_dict(self.preprocessor_config),
                                                     num_threads)
        self.merge = config.vision.spatial_merge_size

    def processing_key(self, modality: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        cfg = self.image_processor.cfg.with_overrides(kwargs, self.limits.max_image_pixels)  # validates kwargs
        return {"min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}

    def _expansion(self, modality: str, pixel_values: np.ndarray, grid: tuple[int, int, int],
                   interval: float = 1.0) -> ItemExpansion:
        rows = pixel_values.shape[0] // (self.merge * self.merge)
        return ItemExpansion([self.pad_ids[modality]] * rows, rows, pixel_values.shape[0],
                             VisionInput(pixel_values, grid, interval))

    def expand_image(self, image: Image.Image, kwargs: dict[str, Any], num_images: int) -> ItemExpansion:
        p = self.image_processor.preprocess_image(image, kwargs)
        return self._expansion(IMAGE, p.pixel_values, p.grid_thw)

    def expand_video(self, frames: list[Image.Image], fps: float, kwargs: dict[str, Any]) -> ItemExpansion:
        p = self.image_processor.preprocess_video(frames, kwargs)
        interval = 1.0
        if self.config.is_qwen2_5:  # Qwen2.5-VL spaces temporal patches by their time in the video
            interval = self.config.vision.tokens_per_second * self.config.vision.temporal_patch_size / fps
        t, h, w = p.grid_thw
        rows = h * w // (self.merge * self.merge)
        parts = video_parts(p.pixel_values, p.grid_thw, frames, self.image_processor.cfg.temporal_patch_size,
                            self.merge, [k * rows for k in range(t)],
                            lambda pixels, grid: VisionInput(pixels, grid, interval))
        return ItemExpansion([self.pad_ids[VIDEO]] * (t * rows), t * rows, p.num_patches, None, parts=parts)

    def positions(self, token_ids: list[int], items: list[MMItem]) -> PromptPositions:
        spans: list[VisionSpan] = []
        for i in items:
            if i.part:  # a later temporal group of the video before: one span, as transformers sees it
                t, h, w = spans[-1].grid_thw
                spans[-1] = VisionSpan(spans[-1].offset, (t + i.payload.grid_thw[0], h, w), spans[-1].time_interval)
            else:
                spans.append(VisionSpan(i.offset, i.payload.grid_thw, i.payload.time_interval))
        table, delta = mrope_positions(len(token_ids), spans, self.merge)
        return PromptPositions(3, table, delta)

    def largest_item_patches(self, max_video_frames: int) -> dict[str, int]:
        """Encoder tokens of the largest item per modality: an image at max_pixels; a video's largest
        item is one temporal group (two frames) at max_pixels."""
        cfg = self.image_processor.cfg
        per_frame = cfg.max_pixels // (cfg.patch_size * cfg.patch_size)
        return {IMAGE: per_frame, VIDEO: per_frame}
