"""Native Qwen-style image and video preprocessing: smart resize, rescale, normalise, patchify.

Shared by the Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors (Qwen3-VL with its own video resize).
Role: turn RGB pixels into the vision tower's input rows (num_patches, C*T*P*P) float32 plus the
(t, h, w) patch grid, with output identical to transformers' Qwen2-VL image processor (same
Pillow resampling, same float arithmetic). `normalize_table` holds, per channel, the value of
every uint8 level after rescale + normalise in the reference's arithmetic; the fast path uses
float32 ops only after checking they reproduce that table for all 256 levels, so the values
match to the bit. Images are resized in strips on a thread pool, and each finished strip is
patchified on the thread that resized it (numpy releases the GIL), straight into the output.
`video_parts` splits a patchified video into one engine item per temporal group.

What it does not know: tokens, prompts, where the pixels came from.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError
from mmserve.inputs.image_ops import resize_rgbx, run_pieces, to_rgb
from mmserve.inputs.processing import ItemPart

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

    def with_overrides(self, overrides: dict[str, Any] | None, pixel_limit: int | None = None) -> ImageProcessorConfig:
        """Apply per-request processor kwargs (min_pixels, max_pixels); unknown keys are an error, and so is a
        value over `pixel_limit` (checked before anything is resized: such a target would not fit memory)."""
        if not overrides:
            return self
        allowed = {"min_pixels", "max_pixels"}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise InvalidInputError(f"unsupported mm_processor_kwargs {unknown}; supported: {sorted(allowed)}",
                                    param=f"mm_processor_kwargs.{unknown[0]}")
        values = {}
        for key, value in overrides.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise InvalidInputError(f"mm_processor_kwargs.{key} must be an integer, got {value!r:.40}",
                                        param=f"mm_processor_kwargs.{key}")
            try:
                values[key] = int(value)
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidInputError(f"mm_processor_kwargs.{key} must be an integer, got {value!r:.40}",
                                        param=f"mm_processor_kwargs.{key}") from exc
            if values[key] < 1 or (pixel_limit is not None and values[key] > pixel_limit):
                raise InvalidInputError(f"mm_processor_kwargs.{key}={value!r:.40} is outside 1 to {pixel_limit} pixels "
                                        "(max_image_pixels)", param=f"mm_processor_kwargs.{key}",
                                        setting="max_image_pixels")
        try:
            return replace(self, **values)
        except InvalidInputError as exc:
            raise InvalidInputError(str(exc), param="mm_processor_kwargs") from exc


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


# Below this many patches, patchify on the calling thread: a thread hop costs more than it saves.
_PARALLEL_MIN_PATCHES = 1024
# Work is cut into this many pieces per thread, so a thread slowed by a busy core gets fewer.
_PIECES_PER_THREAD = 2
# Patches normalised per step: the float32 scratch (~0.8 MB) stays in cache across its passes.
_CHUNK_PATCHES = 1024
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True)
class _Normaliser:
    """Turns uint8 levels into normalised float32 exactly as `normalize_table` does.

    Either three float32 ops with scalar operands, (x / divisor - mean) / std, which numpy runs
    in its SIMD loops; used only when they reproduce the table for all 256 levels of every
    channel (checked exhaustively, so exact for every image). Otherwise a gather from the table.
    """

    divisor: np.float32 | None
    mean: np.ndarray  # (C,) float32
    std: np.ndarray  # (C,) float32
    table: np.ndarray  # (C, 256) float32

    @classmethod
    def build(cls, cfg: ImageProcessorConfig) -> _Normaliser:
        table = normalize_table(cfg)
        c = table.shape[0]
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        inverse = 1 / cfg.rescale_factor if cfg.rescale_factor else None
        for candidate in () if inverse is None else (inverse, round(inverse)):
            trial = cls(np.float32(candidate), mean, std, table)
            for k in (c, 4) if c <= 4 else (c,):  # both pixel layouts take different paths
                levels = np.zeros((1, 1, 256, k), dtype=np.uint8)
                levels[..., :c] = np.arange(256, dtype=np.uint8)[:, None]
                out = np.empty((1, 1, c, 1, 256), dtype=np.float32)
                trial.apply(levels, out)
                if not np.array_equal(out[0, 0, :, 0], table):
                    break
            else:
                return trial
        return cls(None, mean, std, table)

    def apply(self, u8: np.ndarray, out: np.ndarray) -> None:
        """u8 (R, M, ft*PP, K) pixels, channel-last with the C channels first in K ->
        out (R, M, C, T, PP) float32 (may be strided along R); ft is T, or 1 and then
        broadcast over T."""
        r, m, c, _, pp = out.shape
        step = max(1, _CHUNK_PATCHES // m)  # rows of blocks per chunk
        x = np.empty((min(r, step) * m, u8.shape[2]), dtype=np.float32)  # one channel, contiguous
        words = np.empty(x.shape, dtype=np.int32) if u8.shape[3] == 4 and _LITTLE_ENDIAN else None
        for a in range(0, r, step):
            b = min(a + step, r)
            pixels, xs = u8[a:b].reshape(-1, u8.shape[2], u8.shape[3]), x[:(b - a) * m]
            for ch in range(c):
                self._channel(pixels, ch, xs, None if words is None else words[:len(xs)])
                out[a:b, :, ch] = xs.reshape(b - a, m, -1, pp)

    def _channel(self, pixels: np.ndarray, ch: int, x: np.ndarray, words: np.ndarray | None) -> None:
        """x (N, L) <- normalised channel `ch` of pixels (N, L, K)."""
        if self.divisor is None:
            np.take(self.table[ch], pixels[:, :, ch], out=x)
            return
        if words is None:
            x[...] = pixels[:, :, ch]  # de-interleave and widen in one (strided) pass
        else:  # RGBX pixels as int32 words: shift and mask run in SIMD, unlike a stride-4 gather
            np.right_shift(pixels.view(np.int32)[..., 0], 8 * ch, out=words)
            np.bitwise_and(words, 255, out=words)
            x[...] = words
        np.divide(x, self.divisor, out=x)
        np.subtract(x, self.mean[ch], out=x)
        np.divide(x, self.std[ch], out=x)


class _PatchWriter:
    """Normalised patches of frames (F, H, W, K) uint8, written region by region into one
    (t*gh*gw, C, T, PP) float32 array; regions must be aligned to whole merged patches."""

    def __init__(self, frames: np.ndarray, cfg: ImageProcessorConfig, norm: _Normaliser) -> None:
        p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        frames = np.ascontiguousarray(frames)  # no copy when contiguous: regions may be filled later
        f, h, w, k = frames.shape
        self.p, self.m, self.k, self.norm = p, m, k, norm
        self.ft = tp if f >= tp else 1  # frames per temporal patch actually present
        self.grid = (max(f // tp, 1), h // p, w // p)
        gt, gh, gw = self.grid
        self.out = np.empty((gt * gh * gw, len(cfg.image_mean), tp, p * p), dtype=np.float32)
        # (t, merged row, patches in that row in output order, C, T, PP): a region is a slice
        self.blocks = self.out.reshape(gt, gh // m, gw * m, *self.out.shape[1:])
        # One void element = one patch row (P pixels, P*K contiguous bytes), so the shuffle
        # (gt, ft, gh/m, m, P, gw/m, m) -> (gt, gh/m, gw/m, m, m, ft, P) moves few, large elements.
        rows = frames.reshape(f, h, gw, p * k).view(np.dtype((np.void, p * k)))
        self.rows = rows.reshape(gt, self.ft, gh // m, m, p, gw // m, m).transpose(0, 2, 5, 3, 6, 1, 4)

    def region(self, x0: int, y0: int, x1: int, y1: int, t: int = 0) -> None:
        unit, mm = self.p * self.m, self.m * self.m
        r0, r1, c0, c1 = y0 // unit, y1 // unit, x0 // unit, x1 // unit
        u8 = np.ascontiguousarray(self.rows[t, r0:r1, c0:c1]).view(np.uint8)
        u8 = u8.reshape(r1 - r0, (c1 - c0) * mm, self.ft * self.p * self.p, self.k)
        self.norm.apply(u8, self.blocks[t, r0:r1, c0 * mm:c1 * mm])

    def item(self) -> PatchifiedItem:
        return PatchifiedItem(self.out.reshape(len(self.out), -1), self.grid)


class Qwen2VLImageProcessor:
    def __init__(self, cfg: ImageProcessorConfig, num_threads: int | None = None) -> None:
        self.cfg = cfg
        self._norms: dict[tuple[Any, ...], _Normaliser] = {}
        self._threads = num_threads if num_threads is not None else min(4, os.cpu_count() or 1)
        self._pieces = self._threads * _PIECES_PER_THREAD
        # helpers for resize strips and patch blocks (Pillow and numpy release the GIL in them);
        # the calling thread is the other worker
        self._pool = (ThreadPoolExecutor(self._threads - 1, thread_name_prefix="mmserve-preprocess")
                      if self._threads > 1 else None)

    def _norm(self, cfg: ImageProcessorConfig) -> _Normaliser:
        key = (cfg.rescale_factor, cfg.image_mean, cfg.image_std)
        norm = self._norms.get(key)
        if norm is None:
            norm = self._norms[key] = _Normaliser.build(cfg)
        return norm

    def target_size(self, height: int, width: int, cfg: ImageProcessorConfig | None = None) -> tuple[int, int]:
        cfg = cfg or self.cfg
        return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)

    def _resized(self, image: Image.Image, cfg: ImageProcessorConfig, size: tuple[int, int],
                 on_piece: Callable[[int, int, int, int], None] | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
        """(H, W, 4) uint8: RGB plus Pillow's padding byte, which the patch writer skips."""
        h, w = size
        return resize_rgbx(to_rgb(image), w, h, cfg.resample, self._pool, self._pieces,
                           out=out, align=cfg.factor, on_piece=on_piece)

    def _patchify(self, frames: np.ndarray, cfg: ImageProcessorConfig) -> PatchifiedItem:
        """frames: (F, H, W, K) uint8 with the C channels first in K (K = 3, or 4 for RGBX), F a
        multiple of T (or 1 for an image: repeated T times)."""
        writer = _PatchWriter(frames, cfg, self._norm(cfg))
        gt, gh, gw = writer.grid
        height, width = gh * cfg.patch_size, gw * cfg.patch_size
        parts = self._pieces if len(writer.out) >= _PARALLEL_MIN_PATCHES and self._pool else 1
        step = -(-(gh // cfg.merge_size) // parts) * cfg.factor  # pixel rows per block

        def job(span: tuple[int, int]) -> None:
            t, y0 = span
            writer.region(0, y0, width, min(y0 + step, height), t)

        spans = [(t, y0) for t in range(gt) for y0 in range(0, height, step)]
        run_pieces(lambda i: job(spans[i]), len(spans), self._pool)
        return writer.item()

    def _preprocess_one(self, image: Image.Image, cfg: ImageProcessorConfig) -> PatchifiedItem:
        """Resize and patchify fused: each finished strip of the resize is turned into patches
        on the thread that made it, while it is still in cache, with no barrier in between."""
        h, w = self.target_size(image.height, image.width, cfg)
        frame = np.empty((1, h, w, 4), dtype=np.uint8)
        writer = _PatchWriter(frame, cfg, self._norm(cfg))
        self._resized(image, cfg, (h, w), on_piece=writer.region, out=frame[0])
        return writer.item()

    def preprocess_image(self, image: Image.Image, overrides: dict[str, Any] | None = None) -> PatchifiedItem:
        return self._preprocess_one(image, self.cfg.with_overrides(overrides))

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


def video_parts(pixel_values: np.ndarray, grid_thw: tuple[int, int, int], frames: list[Image.Image],
                temporal_patch_size: int, merge: int, row_offsets: list[int],
                payload: Callable[[np.ndarray, tuple[int, int, int]], Any]) -> tuple[ItemPart, ...]:
    """A patchified video as one part per temporal group, the group's rows at `row_offsets[k]` of the
    span. The vision tower attends within a group only (each temporal patch is its own attention
    segment, its rotary positions are per frame), so encoding the groups one by one gives the whole
    video's rows exactly. A part is keyed by its own frames (the last group's padding repeats
    included) and their target size, so a video that extends an earlier one shares its leading parts.
    The size also holds how many of the group's frames are real, so that under a caller's uuid (one
    name for a growing stream) a padded last group is not taken for the full group that replaces it."""
    t, h, w = grid_thw
    per_group = h * w
    padded = list(frames) + [frames[-1]] * (-len(frames) % temporal_patch_size)
    return tuple(ItemPart(row_offsets[k], per_group // (merge * merge), per_group,
                          payload(pixel_values[k * per_group:(k + 1) * per_group], (1, h, w)),
                          padded[k * temporal_patch_size:(k + 1) * temporal_patch_size],
                          (h, w, min(temporal_patch_size, len(frames) - k * temporal_patch_size)))
                 for k in range(t))
