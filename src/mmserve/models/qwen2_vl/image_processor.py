"""Native Qwen2-VL image and video preprocessing: smart resize, rescale, normalise, patchify.

Role: turn RGB pixels into the vision tower's input rows (num_patches, C*T*P*P) float32 plus the
(t, h, w) patch grid, with output identical to transformers' Qwen2-VL image processor (same
Pillow resampling, same float arithmetic). Rescale and normalise are one lookup table per
channel, computed with the reference's arithmetic, so the values match to the bit.

What it does not know: tokens, prompts, where the pixels came from.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.inputs.image_ops import resize_exact, to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessorConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL bicubic

    def __post_init__(self) -> None:
        if self.min_pixels <= 0 or self.max_pixels < self.min_pixels:
            raise InvalidInputError(
                f"need 0 < min_pixels <= max_pixels, got min_pixels={self.min_pixels} max_pixels={self.max_pixels}"
            )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessorConfig:
        """Read a preprocessor_config.json (old min/max_pixels keys or the newer size dict)."""
        size = raw.get("size") or {}
        kwargs: dict[str, Any] = {
            "min_pixels": raw.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", 56 * 56))),
            "max_pixels": raw.get("max_pixels", size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280))),
        }
        for key in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample"):
            if key in raw:
                kwargs[key] = raw[key]
        for key in ("image_mean", "image_std"):
            if key in raw:
                kwargs[key] = tuple(float(x) for x in raw[key])
        return cls(**kwargs)

    def with_overrides(self, overrides: dict[str, Any] | None) -> ImageProcessorConfig:
        """Apply per-request processor kwargs (min_pixels, max_pixels); unknown keys are an error."""
        if not overrides:
            return self
        allowed = {"min_pixels", "max_pixels"}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise InvalidInputError(f"unsupported mm_processor_kwargs {unknown}; supported: {sorted(allowed)}")
        try:
            values = {k: int(v) for k, v in overrides.items()}
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"mm_processor_kwargs must be integers, got {overrides}") from exc
        return replace(self, **values)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels], aspect kept."""
    if min(height, width) <= 0:
        raise InvalidInputError(f"image has zero size ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInputError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO} "
            f"({width}x{height})"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def normalize_table(cfg: ImageProcessorConfig) -> np.ndarray:
    """(C, 256) float32: value of every uint8 level after rescale + normalise, reference arithmetic."""
    levels = (np.arange(256, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
    return (levels[None, :] - mean) / std


@dataclass
class PatchifiedItem:
    """One image or video as vision-tower input."""

    pixel_values: np.ndarray  # (t*h*w, C*T*P*P) float32
    grid_thw: tuple[int, int, int]  # patch grid before merging

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]


class Qwen2VLImageProcessor:
    def __init__(self, cfg: ImageProcessorConfig, num_threads: int | None = None) -> None:
        self.cfg = cfg
        self._tables: dict[ImageProcessorConfig, np.ndarray] = {}
        threads = num_threads if num_threads is not None else min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mmserve-resize") if threads > 1 else None

    def _table(self, cfg: ImageProcessorConfig) -> np.ndarray:
        table = self._tables.get(cfg)
        if table is None:
            table = self._tables[cfg] = normalize_table(cfg)
        return table

    def target_size(self, height: int, width: int, cfg: ImageProcessorConfig | None = None) -> tuple[int, int]:
        cfg = cfg or self.cfg
        return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)

    def _resized(self, image: Image.Image, cfg: ImageProcessorConfig, size: tuple[int, int]) -> np.ndarray:
        h, w = size
        return resize_exact(to_rgb(image), w, h, cfg.resample, self._pool)

    def _patchify(self, frames: np.ndarray, cfg: ImageProcessorConfig) -> PatchifiedItem:
        """frames: (F, H, W, C) uint8 with F a multiple of T (or 1 for an image: repeated T times)."""
        p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        f, h, w, c = frames.shape
        gt, gh, gw = max(f // tp, 1), h // p, w // p
        ft = tp if f >= tp else 1  # frames per temporal patch actually present
        # (gt, ft, gh/m, m, P, gw/m, m, P, C) -> (gt, gh/m, gw/m, m, m, C, ft, P, P)
        u8 = frames.reshape(gt, ft, gh // m, m, p, gw // m, m, p, c).transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
        table = self._table(cfg)
        out = np.empty((gt * gh * gw, c, tp, p * p), dtype=np.float32)
        u8 = np.ascontiguousarray(u8).reshape(gt * gh * gw, c, ft, p * p)
        for ch in range(c):
            values = table[ch][u8[:, ch]]  # (N, ft, P*P)
            if ft == tp:
                out[:, ch] = values
            else:  # an image: the same frame fills every temporal slot
                out[:, ch] = values[:, :1]
        return PatchifiedItem(out.reshape(gt * gh * gw, -1), (gt, gh, gw))

    def preprocess_image(self, image: Image.Image, overrides: dict[str, Any] | None = None) -> PatchifiedItem:
        cfg = self.cfg.with_overrides(overrides)
        size = self.target_size(image.height, image.width, cfg)
        return self._patchify(self._resized(image, cfg, size)[None], cfg)

    def preprocess_video(self, frames: list[Image.Image], overrides: dict[str, Any] | None = None) -> PatchifiedItem:
        """Frames are resized to the first frame's target size; the count is padded to a multiple of
        temporal_patch_size by repeating the last frame, as Qwen2-VL does."""
        if not frames:
            raise InvalidInputError("video has no frames")
        cfg = self.cfg.with_overrides(overrides)
        size = self.target_size(frames[0].height, frames[0].width, cfg)
        arrays = [self._resized(frame, cfg, size) for frame in frames]
        while len(arrays) % cfg.temporal_patch_size:
            arrays.append(arrays[-1])
        return self._patchify(np.stack(arrays), cfg)
