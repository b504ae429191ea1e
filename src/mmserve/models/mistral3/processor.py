"""Mistral 3 input processor: images resized to whole merged patches, and their `[IMG]` spans with row
breaks.

Role: the family's hooks on `MultimodalProcessor`, computing what transformers' `PixtralProcessor`
with its PIL image processor computes. An image is converted to RGB (transparency onto white),
shrunk so that it fits the longest edge (sides floored, aspect ratio kept; images that fit are
not shrunk), then each side is rounded *up* to whole merged patches (patch_size x
spatial_merge_size pixels: the processor's unit, not the encoder's patch) and the image resized to
that with Pillow (bicubic by default), rescaled and normalized in float32 — each image at its own
size, no padding. Its span is, per row of merged patches, one `[IMG]` per merged patch then
`[IMG_BREAK]`, the last `[IMG_BREAK]` replaced by `[IMG_END]`: the `[IMG]` ids are the encoder's
rows (embed rows), the breaks and the end are special rows inside the span that keep their text
embedding. Positions are token indices (1-D RoPE), the base class's default. No videos (the base
refuses them) and no mm_processor_kwargs (the base's default `processing_key` refuses them).

One departure: an image so thin that transformers would shrink a side to zero pixels (and then fail)
gets one merged patch on that side.

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
from mmserve.inputs.items import IMAGE
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.processing import ItemExpansion, MultimodalProcessor
from mmserve.inputs.tokenizer import TextTokenizer, read_json
from mmserve.models.mistral3.config import Mistral3Config

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageInput:
    """One image's encoder input: its patches, row-major, each flattened in (C, P, P) order."""

    patches: np.ndarray  # (grid_h * grid_w, C * P * P) float32
    grid_hw: tuple[int, int]  # (rows, columns) of encoder patches
    patch_size: int

    def pixel_values(self) -> np.ndarray:
        """(C, H, W) float32: the image as transformers' processor hands it to the model (unpadded)."""
        (h, w), p = self.grid_hw, self.patch_size
        c = self.patches.shape[1] // (p * p)
        grid = self.patches.reshape(h, w, c, p, p).transpose(2, 0, 3, 1, 4)  # (C, h, P, w, P)
        return np.ascontiguousarray(grid).reshape(c, h * p, w * p)


@dataclass(frozen=True)
class Preprocessing:
    """The settings of preprocessor_config.json this family honours."""

    max_height: int  # an image larger than this along either axis is shrunk to fit
    max_width: int
    resample: int
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Preprocessing:
        size = raw.get("size") or {"longest_edge": 1024}
        if size.get("longest_edge"):
            bound = (int(size["longest_edge"]),) * 2
        elif size.get("height") and size.get("width"):
            bound = (int(size["height"]), int(size["width"]))
        else:
            raise ModelLoadError(f"preprocessor size {size} has neither 'longest_edge' nor 'height' and 'width'")
        if raw.get("do_center_crop") or raw.get("do_resize") is False or raw.get("do_rescale") is False \
                or raw.get("do_normalize") is False:
            raise ModelLoadError("unsupported preprocessor_config: center crop, or resize/rescale/normalize off")
        return cls(*bound, int(raw.get("resample", Image.Resampling.BICUBIC)),
                   float(raw.get("rescale_factor", 1 / 255)),
                   tuple(float(x) for x in raw.get("image_mean", OPENAI_CLIP_MEAN)),
                   tuple(float(x) for x in raw.get("image_std", OPENAI_CLIP_STD)))

    def patches(self, pixels: np.ndarray, patch: int) -> np.ndarray:
        """(H, W, 3) uint8 -> (H/P * W/P, 3*P*P) float32, rescaled then normalized as transformers computes
        it (float64 rescale cast to float32, then float32 normalize), laid out as patches."""
        x = rescale_normalize(pixels, self.rescale_factor, self.mean, self.std)
        h, w = x.shape[0] // patch, x.shape[1] // patch
        return np.ascontiguousarray(x.reshape(h, patch, w, patch, 3).transpose(0, 2, 4, 1, 3)).reshape(h * w, -1)



class Mistral3Processor(MultimodalProcessor):
    modalities = (IMAGE,)

    def __init__(self, model_dir: str | Path, config: Mistral3Config, limits: MediaLimits | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        super().__init__(model_dir, {IMAGE: config.image_token_id}, config.text.vocab_size, limits,
                         tokenizer=tokenizer)
        root = Path(model_dir)
        self.config = config
        self.prep = Preprocessing.from_dict(self.preprocessor_config)
        self.patch, self.merge = config.vision.patch_size, config.spatial_merge_size
        self.unit = config.pixels_per_row
        proc = read_json(root / "processor_config.json")
        self._check_processor_config(proc)
        self.break_id = self._token_id(proc.get("image_break_token", "[IMG_BREAK]"))
        self.end_id = self._token_id(proc.get("image_end_token", "[IMG_END]"))
        if self._token_id(proc.get("image_token", "[IMG]")) != config.image_token_id:
            raise ModelLoadError(f"the tokenizer's image token is not config.json's image_token_index "
                                 f"{config.image_token_id}")

    def _check_processor_config(self, proc: dict[str, Any]) -> None:
        """transformers sizes images by the processor's own patch_size x spatial_merge_size; a checkpoint
        whose processor disagrees with its model could not run there either."""
        for key, ours in (("patch_size", self.patch), ("spatial_merge_size", self.merge)):
            if key in proc and int(proc[key]) != ours:
                raise ModelLoadError(f"processor_config.json {key}={proc[key]} differs from the model's {ours}")

    def _token_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"the tokenizer has no {token!r} token")
        return token_id

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) in pixels an image is resized to: shrunk (floored) to fit the bound, then each
        side rounded up to whole merged patches."""
        ratio = max(height / self.prep.max_height, width / self.prep.max_width)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        # transformers would go on with a zero side (and fail): keep one merged patch
        return (-(-max(height, 1) // self.unit) * self.unit, -(-max(width, 1) // self.unit) * self.unit)

    def span(self, rows: int, cols: int) -> list[int]:
        """Per row `cols` x [IMG] then [IMG_BREAK]; the last [IMG_BREAK] becomes [IMG_END]."""
        ids = ([self.pad_ids[IMAGE]] * cols + [self.break_id]) * rows
        ids[-1] = self.end_id
        return ids

    def expand_image(self, image: Image.Image, kwargs: dict[str, Any], num_images: int) -> ItemExpansion:
        rgb = to_rgb(image)
        height, width = self.resized_size(rgb.height, rgb.width)
        rows, cols = height // self.unit, width // self.unit
        patches = self.prep.patches(resize_exact(rgb, width, height, self.prep.resample), self.patch)
        payload = ImageInput(patches, (height // self.patch, width // self.patch), self.patch)
        return ItemExpansion(self.span(rows, cols), rows * cols, len(patches), payload)

    def largest_image(self) -> tuple[int, int, int]:
        """(encoder patches, rows, span tokens) of the largest image: one filling the bound on both axes."""
        rows, cols = -(-self.prep.max_height // self.unit), -(-self.prep.max_width // self.unit)
        return rows * cols * self.merge ** 2, rows * cols, rows * (cols + 1)
