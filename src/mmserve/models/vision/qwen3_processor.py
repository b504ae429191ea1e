"""The Qwen3-VL input processor (Qwen3.5 uses it unchanged): resize and patchify media, expand placeholders, M-RoPE positions.

Role: the family's hooks on `MultimodalProcessor`. An image becomes a run of `<|image_pad|>` ids,
one per merged row (Qwen2-VL's smart resize and patchify, with Qwen3-VL's preprocessor_config.json:
16-pixel patches, its own mean/std and pixel bounds). A video (frames already sampled, at `fps`
frames per second) is resized with Qwen3-VL's video rule (the pixel budget covers all frames
together; video_preprocessor_config.json) and becomes, per temporal patch, `<t seconds>` text, then
`<|vision_start|>`, that patch's `<|video_pad|>` rows, `<|vision_end|>`, as transformers'
`Qwen3VLProcessor` writes it (the template's own start/end markers around the video stay). Each
temporal patch is its own engine item (`video_parts`): a growing video reuses its leading frames'
encoder outputs and KV, as long as the frame-count-aware resize keeps their size. Positions are the (3, num_tokens) M-RoPE table of `mrope.py` with its decode delta. Per-request
`min_pixels` / `max_pixels` (overriding the image or the video bounds) and `fps` are accepted.

What it does not know: devices, KV caches, scheduling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.inputs.items import IMAGE, VIDEO, MMItem, PromptPositions
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.processing import ItemExpansion, MultimodalProcessor
from mmserve.inputs.tokenizer import TextTokenizer, read_json
from mmserve.models.vision.qwen3_mrope import FrameRun, mrope_positions
from mmserve.models.vision.qwen3_vision_config import VisionConfig
from mmserve.models.vision.qwen_image_processor import (
    MAX_ASPECT_RATIO,
    ImageProcessorConfig,
    PatchifiedItem,
    Qwen2VLImageProcessor,
    video_parts,
)

# transformers' Qwen3VLVideoProcessor defaults, for checkpoints without video_preprocessor_config.json
VIDEO_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType({
    "size": MappingProxyType({"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}),
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5), "fps": 2.0,
})


@dataclass(frozen=True)
class VisionInput:
    """One item's encoder input."""

    pixel_values: np.ndarray  # (encoder_tokens, C*T*P*P) float32, in merge-block order
    grid_thw: tuple[int, int, int]  # patch grid before merging


def video_target_size(num_frames: int, height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """Qwen3-VL's video smart resize: (height, width), multiples of the merged patch size, with the
    pixels of all frames together in [min_pixels, max_pixels]. Fewer frames than a temporal patch
    count as one temporal patch (transformers refuses such videos)."""
    factor, temporal = cfg.factor, cfg.temporal_patch_size
    num_frames = max(num_frames, temporal)
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInputError(f"video aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
                                f"{MAX_ASPECT_RATIO} ({width}x{height})")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > cfg.max_pixels:
        beta = math.sqrt(num_frames * height * width / cfg.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_timestamps(num_frames: int, fps: float, temporal: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's time (the frame count
    is padded with the last frame to a multiple of `temporal`)."""
    indices = list(range(num_frames)) + [num_frames - 1] * (-num_frames % temporal)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


class Qwen3VLVideoProcessor(Qwen2VLImageProcessor):
    """Qwen2-VL's resize and patchify, with Qwen3-VL's frame-count-aware target size."""

    def preprocess_video(self, frames: list[Image.Image], overrides: dict[str, Any] | None = None) -> PatchifiedItem:
        if not frames:
            raise InvalidInputError("video has no frames")
        cfg = self.cfg.with_overrides(overrides)
        size = video_target_size(len(frames), frames[0].height, frames[0].width, cfg)
        arrays = [self._resized(frame, cfg, size) for frame in frames]
        while len(arrays) % cfg.temporal_patch_size:  # pad with the last frame, as the reference does
            arrays.append(arrays[-1])
        return self._patchify(np.stack(arrays), cfg)



class PromptConfig(Protocol):
    """What the processor reads of a family's config (Qwen3-VL's and Qwen3.5's alike)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    vision: VisionConfig

    @property
    def vocab_size(self) -> int: ...


class Qwen3VLProcessor(MultimodalProcessor):
    def __init__(self, model_dir: str | Path, config: PromptConfig, limits: MediaLimits | None = None,
                 num_threads: int | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        super().__init__(model_dir, {IMAGE: config.image_token_id, VIDEO: config.video_token_id},
                         config.vocab_size, limits, tokenizer=tokenizer)
        self.config = config
        self.merge = config.vision.spatial_merge_size
        self.image_processor = Qwen2VLImageProcessor(ImageProcessorConfig.from_dict(self.preprocessor_config),
                                                     num_threads)
        video_raw = {**VIDEO_DEFAULTS, **read_json(Path(model_dir) / "video_preprocessor_config.json")}
        self.video_processor = Qwen3VLVideoProcessor(ImageProcessorConfig.from_dict(video_raw), num_threads)
        self.default_video_fps = float(video_raw.get("fps") or VIDEO_DEFAULTS["fps"])
        self.start_id, self.end_id = config.vision_start_token_id, config.vision_end_token_id

    def processing_key(self, modality: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        proc = self.image_processor if modality == IMAGE else self.video_processor
        cfg = proc.cfg.with_overrides(kwargs, self.limits.max_image_pixels)  # validates kwargs
        return {"min_pixels": cfg.min_pixels, "max_pixels": cfg.max_pixels}

    def expand_image(self, image: Image.Image, kwargs: dict[str, Any], num_images: int) -> ItemExpansion:
        p = self.image_processor.preprocess_image(image, kwargs)
        rows = p.num_patches // (self.merge * self.merge)
        return ItemExpansion([self.pad_ids[IMAGE]] * rows, rows, p.num_patches, VisionInput(p.pixel_values,
                                                                                             p.grid_thw))

    def expand_video(self, frames: list[Image.Image], fps: float, kwargs: dict[str, Any]) -> ItemExpansion:
        p = self.video_processor.preprocess_video(frames, kwargs)
        t, h, w = p.grid_thw
        frame_rows = h * w // (self.merge * self.merge)
        times = frame_timestamps(len(frames), fps, self.video_processor.cfg.temporal_patch_size)
        span: list[int] = []
        offsets = []
        for seconds in times[:t]:
            span.extend(self.tokenizer.encode(f"<{seconds:.1f} seconds>"))
            span.append(self.start_id)
            offsets.append(len(span))
            span.extend([self.pad_ids[VIDEO]] * frame_rows)
            span.append(self.end_id)
        parts = video_parts(p.pixel_values, p.grid_thw, frames, self.video_processor.cfg.temporal_patch_size,
                            self.merge, offsets, lambda pixels, grid: VisionInput(pixels, grid))
        return ItemExpansion(span, t * frame_rows, p.num_patches, None, parts=parts)

    def positions(self, token_ids: list[int], items: list[MMItem]) -> PromptPositions:
        m = self.merge
        # every item is one frame run: an image, or one temporal group of a video
        runs = [FrameRun(i.offset, i.payload.grid_thw[1] // m, i.payload.grid_thw[2] // m) for i in items]
        table, delta = mrope_positions(len(token_ids), runs)
        return PromptPositions(3, table, delta)

    def largest_item_patches(self, max_video_frames: int) -> dict[str, int]:
        """Encoder tokens of the largest item per modality: an image at max_pixels; a video's largest
        item is one temporal group at the largest per-frame size the video resize allows for up to
        `max_video_frames` frames. Its budget counts `t_bar` frames (the count rounded to temporal
        patches), so a few frames can take more than max_pixels / count each; every count is checked."""
        img = self.image_processor.cfg
        vid = self.video_processor.cfg
        unit = self.merge * self.merge
        image = img.max_pixels // (img.patch_size ** 2) // unit * unit
        video = 0
        temporal = vid.temporal_patch_size
        for n in range(1, max_video_frames + 1):
            counted = max(n, temporal)
            t_bar = max(round(counted / temporal) * temporal, temporal)
            per_frame = max(vid.max_pixels // t_bar, vid.max_pixels // counted, vid.factor ** 2)
            per_frame = per_frame // vid.factor ** 2 * vid.factor ** 2
            video = max(video, per_frame // vid.patch_size ** 2)
        return {IMAGE: max(image, unit), VIDEO: video}
