"""LLaVA-OneVision input processor: anyres tiling of images, frame resizing of videos, placeholder spans.

Role: the family's hooks on `MultimodalProcessor`. An image becomes the base image and the tiles of
its anyres canvas, preprocessed as transformers' LLaVA-OneVision image processor (PIL backend) does
it (bicubic resizes with Pillow, zero padding centred on the canvas, rescale, normalize); its span is
one `<image>` id per embedding row, counted from sizes alone (`anyres.py`). A video's frames are each
resized to one tile and normalized (the documented steps of transformers' video processor, done
with Pillow as the image processor does them); its span is one `<video>` id per pooled row plus the
trailing newline row. An image alone in its prompt is tiled (anyres); each image of a prompt with
several is padded to a square with the mean colour and resized to one tile, its span the tile's rows
plus one newline row (as transformers does for a conversation's images since it stopped tiling
multi-image prompts). Positions are token indices (1-D RoPE), the base class's default.
What it does not know: devices, KV caches, scheduling, the model's weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import ModelLoadError
from mmserve.inputs.image_ops import rescale_normalize, resize_exact, to_rgb
from mmserve.inputs.items import IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.processing import ItemExpansion, MultimodalProcessor
from mmserve.inputs.tokenizer import TextTokenizer
from mmserve.models.llava_onevision.anyres import AnyresLayout, anyres_layout, fit_size, largest_rows
from mmserve.models.llava_onevision.config import LlavaOnevisionConfig

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageInput:
    """One image's encoder input."""

    pixel_values: np.ndarray  # (1 + tiles, C, S, S) float32: the base image, then the tiles row by row
    layout: AnyresLayout | None  # None: one of several images, the padded square as one tile


@dataclass(frozen=True)
class VideoInput:
    """One video's encoder input."""

    pixel_values: np.ndarray  # (frames, C, S, S) float32


@dataclass(frozen=True)
class Preprocessing:
    """The settings of preprocessor_config.json this family honours."""

    tile: int
    resample: int
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], tile: int) -> Preprocessing:
        size = raw.get("size") or {"height": tile, "width": tile}
        edge = size.get("height", size.get("shortest_edge"))
        if edge != tile or size.get("width", edge) != tile:
            raise ModelLoadError(f"preprocessor size {size} does not match the vision tile size {tile}")
        if raw.get("do_center_crop") or raw.get("do_resize") is False or raw.get("do_rescale") is False \
                or raw.get("do_normalize") is False:
            raise ModelLoadError("unsupported preprocessor_config: center crop, or resize/rescale/normalize off")
        return cls(tile, int(raw.get("resample", Image.Resampling.BICUBIC)),
                   float(raw.get("rescale_factor", 1 / 255)),
                   tuple(float(x) for x in raw.get("image_mean", OPENAI_CLIP_MEAN)),
                   tuple(float(x) for x in raw.get("image_std", OPENAI_CLIP_STD)))

    def normalize(self, tiles: np.ndarray) -> np.ndarray:
        """(n, S, S, 3) uint8 -> (n, 3, S, S) float32, as rescale then normalize compute it."""
        x = rescale_normalize(tiles, self.rescale_factor, self.mean, self.std)
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


class LlavaOnevisionProcessor(MultimodalProcessor):
    def __init__(self, model_dir: str | Path, config: LlavaOnevisionConfig, limits: MediaLimits | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        super().__init__(model_dir, {IMAGE: config.image_token_id, VIDEO: config.video_token_id},
                         config.text.vocab_size, limits, tokenizer=tokenizer)
        self.config = config
        self.prep = Preprocessing.from_dict(self.preprocessor_config, config.vision.image_size)
        self.side = config.vision.patches_per_side
        self.pinpoints = config.image_grid_pinpoints

    def layout(self, width: int, height: int) -> AnyresLayout:
        """Anyres layout of a width x height image (what sizes its span, from sizes alone)."""
        return anyres_layout((height, width), self.pinpoints, self.prep.tile, self.side, self.config.max_num_tiles)

    def image_tiles(self, rgb: Image.Image, layout: AnyresLayout) -> np.ndarray:
        """(1 + tiles, S, S, 3) uint8: the image resized to one tile, then its canvas cut into tiles."""
        tile = self.prep.tile
        rows, cols = layout.tile_grid
        canvas_hw = (rows * tile, cols * tile)
        new_h, new_w = fit_size((rgb.height, rgb.width), canvas_hw)
        canvas = np.zeros((*canvas_hw, 3), dtype=np.uint8)  # zero padding, centred (extra pixel after)
        top, left = (canvas_hw[0] - new_h) // 2, (canvas_hw[1] - new_w) // 2
        canvas[top:top + new_h, left:left + new_w] = resize_exact(rgb, new_w, new_h, self.prep.resample)
        tiles = canvas.reshape(rows, tile, cols, tile, 3).transpose(0, 2, 1, 3, 4).reshape(-1, tile, tile, 3)
        base = resize_exact(rgb, tile, tile, self.prep.resample)
        return np.concatenate([base[None], tiles])

    def square_tile(self, rgb: Image.Image) -> np.ndarray:
        """(1, S, S, 3) uint8: the image centred on a square of the mean colour, resized to one tile."""
        side = max(rgb.width, rgb.height)
        square = np.empty((side, side, 3), dtype=np.uint8)
        square[:] = [int(m * 255) for m in self.prep.mean]
        top, left = (side - rgb.height) // 2, (side - rgb.width) // 2
        square[top:top + rgb.height, left:left + rgb.width] = np.asarray(rgb)
        tile = self.prep.tile
        return resize_exact(Image.fromarray(square), tile, tile, self.prep.resample)[None]

    def expand_image(self, image: Image.Image, kwargs: dict[str, Any], num_images: int) -> ItemExpansion:
        rgb = to_rgb(image)
        if num_images > 1:  # one of several: no tiling, one newline row after the tile's rows
            rows = self.side ** 2 + 1
            return ItemExpansion([self.pad_ids[IMAGE]] * rows, rows, self.side ** 2,
                                 ImageInput(self.prep.normalize(self.square_tile(rgb)), None), key_extra={"tiled": False})
        layout = self.layout(*rgb.size)
        pixels = self.prep.normalize(self.image_tiles(rgb, layout))
        return ItemExpansion([self.pad_ids[IMAGE]] * layout.rows, layout.rows, layout.num_tiles * self.side ** 2,
                             ImageInput(pixels, layout))

    def video_rows(self, num_frames: int) -> int:
        """Pooled rows per frame (2x2 bilinear, rounded up) for every frame, plus one newline row."""
        return num_frames * math.ceil(self.side / 2) ** 2 + 1

    def expand_video(self, frames: list[Image.Image], fps: float, kwargs: dict[str, Any]) -> ItemExpansion:
        tile = self.prep.tile
        stack = np.stack([resize_exact(to_rgb(f), tile, tile, self.prep.resample) for f in frames])
        rows = self.video_rows(len(frames))
        return ItemExpansion([self.pad_ids[VIDEO]] * rows, rows, len(frames) * self.side ** 2,
                             VideoInput(self.prep.normalize(stack)))

    def largest_items(self, max_video_frames: int) -> dict[str, tuple[int, int]]:
        """(encoder tokens, rows) of the largest item per modality: the image on the biggest canvas with
        the most rows any crop can leave, and a video of `max_video_frames` frames."""
        tile, unit = self.prep.tile, self.side ** 2
        tiles = max((h // tile) * (w // tile) for h, w in self.pinpoints)
        image_rows = largest_rows(self.pinpoints, tile, self.side, self.config.max_num_tiles)
        return {IMAGE: ((1 + tiles) * unit, image_rows),
                VIDEO: (max_video_frames * unit, self.video_rows(max_video_frames))}
