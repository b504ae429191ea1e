"""Gemma 4's image and video-frame preprocessing: pixels to the patch rows the vision tower reads.

Role: for one image, what transformers' `Gemma4ImageProcessorPil` produces for it, bit for bit: the
image converted to RGB (transparency onto white), resized with Pillow (bicubic by default) to the
largest size whose sides are multiples of patch_size * pooling_kernel_size and whose patches fit
`max_soft_tokens * pooling_kernel_size^2` (transformers' `get_aspect_ratio_preserving_size`, float
arithmetic and all), rescaled (float64, cast to float32) and optionally normalized, cut into
patch_size^2 * 3 rows — patches row by row, each patch's pixels row by row, RGB innermost — with each
patch's (x, y) grid position. For a video's already-sampled frames, what `Gemma4VideoProcessor`
produces: the same sizes and layout, but resized as torchvision resizes a uint8 tensor (torch's
`interpolate` with antialiasing, which rounds differently from Pillow) and rescaled as its fused
rescale-normalize does (float32 arithmetic). Only real patches are kept: transformers pads every
image to max_patches rows with zeros and positions (-1, -1); the encoder pads its own batch.

`soft_tokens_for_size` is the count transformers' processor puts in the prompt (`num_soft_tokens`);
`max_soft_tokens_per_image` bounds it for any image.

What it does not know: decoding or sampling video, timestamps and prompts, the tower's weights, devices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.inputs.image_ops import resize_exact, to_rgb
from mmserve.models.config_reader import Key, read

# transformers refuses every other budget (image and video processors alike)
SUPPORTED_MAX_SOFT_TOKENS = (70, 140, 280, 560, 1120)
# the resample filters torchvision can apply to a video tensor, as torch's interpolate modes
_VIDEO_MODES = MappingProxyType({int(Image.Resampling.NEAREST): "nearest",
                                 int(Image.Resampling.BILINEAR): "bilinear",
                                 int(Image.Resampling.BICUBIC): "bicubic"})


def _triple(value: Any) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ModelLoadError(f"image_mean / image_std {value!r} does not have one value per RGB channel")
    return values[0], values[1], values[2]


@dataclass(frozen=True)
class Gemma4ImageSettings:
    """The settings transformers' Gemma 4 image (or video) processor reads; the defaults are the image
    processor's class defaults (`from_dict(..., video=True)` takes the video processor's)."""

    patch_size: int = 16  # pixels per patch side
    max_soft_tokens: int = 280  # per image (per frame for a video)
    pooling_kernel_size: int = 3  # patches per side pooled into one soft token
    do_resize: bool = True
    resample: int = int(Image.Resampling.BICUBIC)  # a PIL.Image.Resampling value
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False  # Gemma 4 reads pixels in [0, 1]; the tower scales them itself
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SUPPORTED_MAX_SOFT_TOKENS:
            raise ModelLoadError(f"max_soft_tokens must be one of {SUPPORTED_MAX_SOFT_TOKENS}, "
                                 f"got {self.max_soft_tokens}")
        if self.patch_size < 1 or self.pooling_kernel_size < 1:
            raise ModelLoadError(f"patch_size {self.patch_size} and pooling_kernel_size "
                                 f"{self.pooling_kernel_size} must be positive")
        if self.resample not in tuple(int(r) for r in Image.Resampling):
            raise ModelLoadError(f"resample {self.resample!r} is not a PIL resampling filter")
        if self.do_normalize and 0.0 in self.image_std:
            raise ModelLoadError(f"image_std {self.image_std} has a zero")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, video: bool = False) -> Gemma4ImageSettings:
        """From processor_config.json's `image_processor` (or, with video=True, `video_processor`) section;
        an absent key takes that processor's class default."""
        try:
            settings = read(cls, raw, VIDEO_KEYS if video else IMAGE_KEYS)
        except (TypeError, ValueError) as exc:
            kind = "video" if video else "image"
            raise ModelLoadError(f"bad Gemma 4 {kind} processor config: {exc}") from exc
        if video and settings.resample not in _VIDEO_MODES:
            raise ModelLoadError(f"video resample {settings.resample} is not one torchvision applies to "
                                 f"tensors ({sorted(_VIDEO_MODES)})")
        return settings

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    @property
    def side_multiple_px(self) -> int:
        """Resized sides are multiples of this: whole patches that pool into whole soft tokens."""
        return self.patch_size * self.pooling_kernel_size


IMAGE_KEYS = MappingProxyType({"image_mean": Key(convert=_triple), "image_std": Key(convert=_triple)})
# transformers' Gemma4VideoProcessor class defaults where they differ from the image processor's
VIDEO_KEYS = MappingProxyType({**IMAGE_KEYS, "max_soft_tokens": Key(default=70),
                               "do_normalize": Key(default=True)})


@dataclass(frozen=True)
class Gemma4VisionInput:
    """One image's or one video's tower input: real patches only, frame after frame."""

    pixel_values: np.ndarray  # (num_frames * patches_per_frame, patch_size^2 * 3) float32
    position_ids: np.ndarray  # (same rows, 2) int64: each patch's (x, y) = (column, row) in its frame's grid
    num_soft_tokens: int  # rows the tower returns for all frames
    num_frames: int = 1  # 1 for an image

    def __post_init__(self) -> None:
        rows = self.pixel_values.shape[0]
        if self.pixel_values.ndim != 2 or self.position_ids.shape != (rows, 2):
            raise InvalidInputError(f"vision input shapes {self.pixel_values.shape} and "
                                    f"{self.position_ids.shape} are not (rows, patch values) and (rows, 2)")
        if self.pixel_values.dtype != np.float32 or self.position_ids.dtype != np.int64:
            raise InvalidInputError(f"vision input dtypes {self.pixel_values.dtype}, "
                                    f"{self.position_ids.dtype} are not float32, int64")
        frames = self.num_frames
        if frames < 1 or rows == 0 or rows % frames or self.num_soft_tokens % frames:
            raise InvalidInputError(f"{rows} patches and {self.num_soft_tokens} soft tokens do not split "
                                    f"into {frames} equal frames")

    @property
    def patches_per_frame(self) -> int:
        return self.pixel_values.shape[0] // self.num_frames

    @property
    def num_soft_tokens_per_frame(self) -> int:
        return self.num_soft_tokens // self.num_frames


def aspect_ratio_preserving_size(height_px: int, width_px: int,
                                 settings: Gemma4ImageSettings) -> tuple[int, int]:
    """(height, width) an image is resized to: transformers' `get_aspect_ratio_preserving_size`, step by step
    (its float rounding decides the sizes)."""
    if height_px < 1 or width_px < 1:
        raise InvalidInputError(f"an image of {height_px}x{width_px} pixels has no pixels")
    target_px = settings.max_patches * settings.patch_size ** 2
    factor = math.sqrt(target_px / (height_px * width_px))
    side = settings.side_multiple_px
    height = int(math.floor(factor * height_px / side)) * side
    width = int(math.floor(factor * width_px / side)) * side
    if height == 0 and width == 0:  # unreachable: the area is scaled to the whole budget
        raise InvalidInputError(f"a {height_px}x{width_px} image resizes to 0x0")
    # a very thin image: one soft token across, as many along as the ratio gives (capped by the budget)
    max_side = settings.max_soft_tokens * side
    if height == 0:
        height, width = side, min(int(math.floor(width_px / height_px)) * side, max_side)
    elif width == 0:
        width, height = side, min(int(math.floor(height_px / width_px)) * side, max_side)
    if height * width > target_px:
        raise InvalidInputError(f"a {height_px}x{width_px} image resizes to {height}x{width}, past "
                                f"{settings.max_patches} patches")
    return height, width


def _target_size(height_px: int, width_px: int, settings: Gemma4ImageSettings) -> tuple[int, int]:
    if settings.do_resize:
        return aspect_ratio_preserving_size(height_px, width_px, settings)
    # unresized, transformers patchifies as is: only whole patches that pool evenly, within the budget, work
    side = settings.side_multiple_px
    budget_px = settings.max_patches * settings.patch_size ** 2
    if height_px % side or width_px % side or height_px * width_px > budget_px:
        raise InvalidInputError(f"without resizing, an image's sides must be multiples of {side} px within "
                                f"{settings.max_patches} patches; got {height_px}x{width_px}")
    return height_px, width_px


def soft_tokens_for_size(height_px: int, width_px: int, settings: Gemma4ImageSettings) -> int:
    """Soft tokens of an image (or of each frame of a video) of this size: transformers' processor count."""
    height, width = _target_size(height_px, width_px, settings)
    patches = (height // settings.patch_size) * (width // settings.patch_size)
    return patches // settings.pooling_kernel_size ** 2


def soft_tokens_for_video(num_frames: int, height_px: int, width_px: int,
                          settings: Gemma4ImageSettings) -> int:
    return num_frames * soft_tokens_for_size(height_px, width_px, settings)


def max_soft_tokens_per_image(settings: Gemma4ImageSettings) -> int:
    """The most soft tokens any image gets: the resized area holds at most max_soft_tokens pooled cells,
    and an image already at a budget-filling size (e.g. 14 x 20 cells for 280) gets exactly that many."""
    return settings.max_soft_tokens


def _patchify(pixels: np.ndarray, patch: int) -> np.ndarray:
    """(..., H, W, C) -> (..., (H/p) * (W/p), p * p * C): transformers' order (patch rows, then within a
    patch its pixel rows, pixels, channels)."""
    *lead, height, width, channels = pixels.shape
    grid = pixels.reshape(*lead, height // patch, patch, width // patch, patch, channels)
    grid = np.moveaxis(grid, -4, -3)  # (..., rows, cols, p, p, C)
    return grid.reshape(*lead, (height // patch) * (width // patch), patch * patch * channels)


def _grid_positions(rows: int, cols: int) -> np.ndarray:
    x, y = np.meshgrid(np.arange(cols, dtype=np.int64), np.arange(rows, dtype=np.int64), indexing="xy")
    return np.stack([x, y], axis=-1).reshape(rows * cols, 2)


def _image_values(patches: np.ndarray, settings: Gemma4ImageSettings) -> np.ndarray:
    """uint8 -> float32 as the PIL processor computes it: the rescale in float64 cast to float32, then the
    normalize in float32 (values are per channel, RGB innermost, so any layout ending in channels works)."""
    values = patches
    if settings.do_rescale:
        values = (values.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    values = values.astype(np.float32, copy=False)
    if settings.do_normalize:
        mean = np.asarray(settings.image_mean, np.float32)
        std = np.asarray(settings.image_std, np.float32)
        values = (values.reshape(*values.shape[:-1], -1, 3) - mean) / std
    return values.reshape(patches.shape)


def preprocess_image(image: Image.Image, settings: Gemma4ImageSettings) -> Gemma4VisionInput:
    """One image's patch rows and positions, as `Gemma4ImageProcessorPil` makes them (without its padding)."""
    rgb = _rgb(image, settings)
    height, width = _target_size(rgb.height, rgb.width, settings)
    if (height, width) == (rgb.height, rgb.width):
        pixels = np.asarray(rgb)
    else:
        pixels = resize_exact(rgb, width, height, settings.resample)
    patch = settings.patch_size
    values = _image_values(_patchify(pixels, patch), settings)
    positions = _grid_positions(height // patch, width // patch)
    return Gemma4VisionInput(values, positions, len(positions) // settings.pooling_kernel_size ** 2)


def _rgb(image: Image.Image, settings: Gemma4ImageSettings) -> Image.Image:
    if settings.do_convert_rgb:
        return to_rgb(image)
    if image.mode != "RGB":
        raise InvalidInputError(f"a {image.mode} image needs do_convert_rgb (the tower reads RGB)")
    return image  # transformers keeps even a transparent colour as is here


def _frames_array(frames: Sequence[Image.Image] | np.ndarray, settings: Gemma4ImageSettings) -> np.ndarray:
    """A video's frames as one writable (T, H, W, 3) uint8 array."""
    if isinstance(frames, np.ndarray):
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
            raise InvalidInputError(f"video frames must be a (T, H, W, 3) uint8 array, got {frames.dtype} "
                                    f"{frames.shape}")
        return frames if frames.flags.writeable else frames.copy()
    if not frames:
        raise InvalidInputError("a video needs at least one frame")
    rgb = [_rgb(frame, settings) for frame in frames]
    if len({frame.size for frame in rgb}) != 1:
        raise InvalidInputError(f"a video's frames must share one size, got {sorted({f.size for f in rgb})}")
    return np.stack([np.asarray(frame) for frame in rgb])


def _resize_video(video: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """(T, H, W, 3) uint8 resized as torchvision's `resize` does a uint8 CPU tensor: torch's interpolate
    on the uint8 frames where torchvision keeps them uint8 (bicubic, nearest; bilinear on AVX2), else in
    float32 rounded back."""
    mode = _VIDEO_MODES.get(resample)
    if mode is None:
        raise InvalidInputError(f"video resample {resample} is not one torchvision applies to tensors")
    native = mode != "bilinear" or "AVX2" in torch.backends.cpu.get_cpu_capability()
    frames = torch.from_numpy(video).permute(0, 3, 1, 2).contiguous()
    smooth = mode != "nearest"
    out = F.interpolate(frames if native else frames.float(), size=[height, width], mode=mode,
                        align_corners=False if smooth else None, antialias=smooth)
    if not native:
        out = out.round_().to(torch.uint8)
    return out.permute(0, 2, 3, 1).numpy()


def _video_values(patches: np.ndarray, settings: Gemma4ImageSettings) -> np.ndarray:
    """uint8 -> float32 as the video processor computes it, in torch: with normalization the rescale is
    fused into it (mean and std divided by the factor, float32), else a float32 multiply."""
    values = torch.from_numpy(patches)
    if settings.do_normalize:
        mean, std = torch.tensor(settings.image_mean), torch.tensor(settings.image_std)
        if settings.do_rescale:
            mean, std = mean * (1.0 / settings.rescale_factor), std * (1.0 / settings.rescale_factor)
        values = values.to(torch.float32).view(*values.shape[:-1], -1, 3).sub_(mean).div_(std)
    elif settings.do_rescale:
        values = values * settings.rescale_factor
    return values.to(torch.float32).reshape(patches.shape).numpy()


def preprocess_video_frames(frames: Sequence[Image.Image] | np.ndarray,
                            settings: Gemma4ImageSettings) -> Gemma4VisionInput:
    """A video's sampled frames as `Gemma4VideoProcessor` makes them (without its padding), frame after
    frame in one payload; `settings` are the video processor's (`from_dict(..., video=True)`)."""
    video = _frames_array(frames, settings)
    num_frames, height_px, width_px, _ = video.shape
    height, width = _target_size(height_px, width_px, settings)
    if (height, width) != (height_px, width_px):
        video = _resize_video(video, height, width, settings.resample)
    patch = settings.patch_size
    patches = _patchify(video, patch)  # (T, patches per frame, values)
    values = _video_values(patches, settings).reshape(-1, patches.shape[-1])
    positions = np.tile(_grid_positions(height // patch, width // patch), (num_frames, 1))
    per_frame = patches.shape[1] // settings.pooling_kernel_size ** 2
    return Gemma4VisionInput(values, positions, num_frames * per_frame, num_frames)
