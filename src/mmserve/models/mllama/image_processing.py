"""Image preprocessing of Llama 3.2 Vision (mllama): one image -> its normalized tiles.

Role: produce, for one PIL image, what transformers' `MllamaImageProcessorPil` produces for it: the
image converted to RGB (transparency onto white), resized with Pillow (bilinear by default) to the
size `tiling.py` gives, zero-padded at the bottom and right to whole tiles, rescaled and normalized
(so the padding comes out as -mean/std, not 0), and cut into tiles row by row; with it the
aspect-ratio id and the aspect-ratio mask (1 for each real tile). `stack_images` lays several images
of one prompt out as transformers batches them (each padded to `max_image_tiles` with all-zero
tiles), so a model can be checked against transformers' `pixel_values`. Settings are read from the checkpoint's
preprocessor config; a missing key takes transformers' class default.

What it does not know: prompts, tokens, the cross-attention mask, devices, the model's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.inputs.image_ops import rescale_normalize, resize_exact, to_rgb
from mmserve.models.mllama.tiling import TileLayout, tile_layout

# transformers' class defaults, which a config without the key gets (the hub's configs set them all)
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
DEFAULT_TILE_PX = 224
DEFAULT_MAX_IMAGE_TILES = 4


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(x) for x in value]
    if len(values) != 3:
        raise ModelLoadError(f"preprocessor {name} {value!r} does not have one value per RGB channel")
    return values[0], values[1], values[2]


@dataclass(frozen=True)
class Preprocessing:
    """The settings of the image processor's config this module honours."""

    tile_px: int  # side of the square tiles (the config's `size`)
    max_image_tiles: int
    resample: int  # a PIL.Image.Resampling value
    do_convert_rgb: bool
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Preprocessing:
        """From preprocessor_config.json (or processor_config.json's `image_processor` entry)."""
        if raw.get("do_resize") is False or raw.get("do_pad") is False:
            raise ModelLoadError("unsupported preprocessor_config: mllama always resizes and pads (as transformers)")
        size = raw.get("size") or {"height": DEFAULT_TILE_PX, "width": DEFAULT_TILE_PX}
        tile_px = size.get("height")
        if not isinstance(tile_px, int) or tile_px < 1 or size.get("width") != tile_px:
            raise ModelLoadError(f"preprocessor size {size} is not a square tile {{'height': n, 'width': n}}")
        max_image_tiles = raw.get("max_image_tiles", DEFAULT_MAX_IMAGE_TILES)
        if not isinstance(max_image_tiles, int) or max_image_tiles < 1:
            raise ModelLoadError(f"preprocessor max_image_tiles {max_image_tiles!r} is not a positive integer")
        resample = raw.get("resample")
        return cls(tile_px, max_image_tiles,
                   int(Image.Resampling.BILINEAR if resample is None else resample),
                   raw.get("do_convert_rgb") is not False, raw.get("do_rescale") is not False,
                   float(raw.get("rescale_factor", 1 / 255)), raw.get("do_normalize") is not False,
                   _triple(raw.get("image_mean", IMAGENET_STANDARD), "image_mean"),
                   _triple(raw.get("image_std", IMAGENET_STANDARD), "image_std"))

    def scale(self, pixels: np.ndarray) -> np.ndarray:
        """(..., 3) uint8 -> float32 with transformers' arithmetic: rescale in float64 then cast, normalize in
        float32; either step may be off."""
        if self.do_rescale and self.do_normalize:
            return rescale_normalize(pixels, self.rescale_factor, self.mean, self.std)
        if self.do_rescale:
            return (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = pixels.astype(np.float32)
        if self.do_normalize:
            return (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return x


@dataclass(frozen=True)
class ImageTiles:
    """One image's encoder input."""

    pixel_values: np.ndarray  # (num_tiles, 3, tile_px, tile_px) float32, the canvas's tiles row by row
    aspect_ratio_mask: np.ndarray  # (max_image_tiles,) int64: 1 for each of the image's tiles, then 0
    layout: TileLayout

    @property
    def num_tiles(self) -> int:
        return self.layout.num_tiles

    @property
    def aspect_ratio_id(self) -> int:
        return self.layout.aspect_ratio_id


@dataclass(frozen=True)
class StackedImages:
    """The images of one prompt as transformers batches them (a batch of one prompt)."""

    pixel_values: np.ndarray  # (1, num_images, max_image_tiles, 3, tile_px, tile_px) float32, zero tiles after each
    aspect_ratio_ids: np.ndarray  # (1, num_images) int64
    aspect_ratio_mask: np.ndarray  # (1, num_images, max_image_tiles) int64
    num_tiles: tuple[int, ...]  # per image


def preprocess_image(image: Image.Image, prep: Preprocessing) -> ImageTiles:
    """Tiles, aspect-ratio id and mask of one image, as transformers' PIL image processor makes them."""
    if prep.do_convert_rgb:
        rgb = to_rgb(image)
    elif image.mode == "RGB":
        rgb = image  # transformers keeps even a transparent colour as is here
    else:
        raise InvalidInputError(f"a {image.mode} image needs do_convert_rgb (its channels are not RGB)")
    layout = tile_layout(rgb.height, rgb.width, prep.tile_px, prep.max_image_tiles)
    canvas = np.zeros((layout.canvas_height_px, layout.canvas_width_px, 3), dtype=np.uint8)
    canvas[:layout.resized_height_px, :layout.resized_width_px] = resize_exact(
        rgb, layout.resized_width_px, layout.resized_height_px, prep.resample)
    tile = prep.tile_px
    tiles = prep.scale(canvas).reshape(layout.num_tiles_height, tile, layout.num_tiles_width, tile, 3)
    pixel_values = np.ascontiguousarray(tiles.transpose(0, 2, 4, 1, 3).reshape(layout.num_tiles, 3, tile, tile))
    mask = np.zeros(prep.max_image_tiles, dtype=np.int64)
    mask[:layout.num_tiles] = 1
    return ImageTiles(pixel_values, mask, layout)


def stack_images(images: Sequence[ImageTiles]) -> StackedImages:
    """Several images of one prompt, in order, padded to `max_image_tiles` tiles each with zeros."""
    if not images:
        raise ValueError("stack_images needs at least one image")
    max_image_tiles = len(images[0].aspect_ratio_mask)
    tile_shape = images[0].pixel_values.shape[1:]
    if any(len(i.aspect_ratio_mask) != max_image_tiles or i.pixel_values.shape[1:] != tile_shape for i in images):
        raise ValueError("the images were preprocessed with different tile sizes or max_image_tiles")
    pixel_values = np.zeros((1, len(images), max_image_tiles, *tile_shape), dtype=np.float32)
    for j, item in enumerate(images):
        pixel_values[0, j, :item.num_tiles] = item.pixel_values
    ids = np.array([[i.aspect_ratio_id for i in images]], dtype=np.int64)
    mask = np.stack([i.aspect_ratio_mask for i in images])[None]
    return StackedImages(pixel_values, ids, mask, tuple(i.num_tiles for i in images))
