"""Gemma 3 input processor: resize and normalize images (and their pan-and-scan crops), expand spans.

Role: the family's hooks on `MultimodalProcessor`, producing what transformers' `Gemma3Processor`
with its PIL image processor produces. A prompt holds one `<start_of_image>` per image (what Gemma 3's
chat template writes); transformers rewrites it to "\\n\\n<start_of_image>" + soft tokens +
"<end_of_image>\\n\\n" and tokenizes the whole string, so the newlines merge with the prompt's own:
here the newlines and the `<start_of_image>` before the span and the `<end_of_image>` and newlines
after it are the expansion's `text_before` / `text_after`, which the base tokenizes with the
neighbouring text. The span runs from the first soft token to the last: with pan-and-scan crops
(mm_processor_kwargs `do_pan_and_scan` and transformers' `pan_and_scan_*` knobs) it holds the soft
tokens of the whole image, then for each crop the special tokens and text transformers writes
between them ("Here is the original image ... and here are some crops to help you see better ..."),
tokenized here on its own (it lies between special tokens, so it tokenizes the same in context).
Only soft tokens are encoder rows; each run of them attends bidirectionally in the language model.

Pixels: RGB (transparency onto white), each crop resized to the tower's square with Pillow
(bilinear by default), rescaled and normalized in float32 as transformers does. Settings are read
from preprocessor_config.json, or from the `image_processor` entry of processor_config.json (where
transformers 5 saves them). As in transformers, the pan-and-scan settings come from the request or
Gemma3Processor's defaults, never from the image processor's config. No video: the base refuses
videos.

What it does not know: devices, KV caches, scheduling, the model's weights.
"""

from __future__ import annotations

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
from mmserve.models.gemma3.config import Gemma3Config
from mmserve.models.gemma3.pan_and_scan import (
    DEFAULT_MAX_NUM_CROPS,
    PanAndScan,
    crop_boxes,
    parse_pan_and_scan,
)

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
# the text transformers' Gemma3Processor writes around an image with crops, split at the image sequences
PAS_INTRO = "Here is the original image "
PAS_AFTER_ORIGINAL = " and here are some crops to help you see better "
PAS_BETWEEN_CROPS = " "
NEWLINES = "\n\n"  # before <start_of_image> and after <end_of_image>, for every image and crop


@dataclass(frozen=True)
class ImageInput:
    """One image's encoder input."""

    pixel_values: np.ndarray  # (1 + crops, C, S, S) float32: the whole image, then its pan-and-scan crops


@dataclass(frozen=True)
class Preprocessing:
    """The settings of the image processor's config this family honours."""

    edge_pixels: int  # side of the square every image and crop is resized to
    resample: int
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], size: int) -> Preprocessing:
        edges = raw.get("size") or {"height": size, "width": size}
        if edges.get("height") != size or edges.get("width") != size:
            raise ModelLoadError(f"preprocessor size {edges} does not match the vision image size {size}")
        if raw.get("do_resize") is False or raw.get("do_rescale") is False or raw.get("do_normalize") is False:
            raise ModelLoadError("unsupported preprocessor_config: resize, rescale or normalize turned off")
        mean, std = raw.get("image_mean") or IMAGENET_STANDARD, raw.get("image_std") or IMAGENET_STANDARD
        return cls(size, int(raw.get("resample", Image.Resampling.BILINEAR)),
                   float(raw.get("rescale_factor", 1 / 255)),
                   tuple(float(x) for x in mean), tuple(float(x) for x in std))

    def pixels(self, crops: list[Image.Image]) -> np.ndarray:
        """RGB crops -> (n, 3, S, S) float32: resized, rescaled in float64 then cast, normalized in float32."""
        stack = np.stack([resize_exact(c, self.edge_pixels, self.edge_pixels, self.resample) for c in crops])
        x = rescale_normalize(stack, self.rescale_factor, self.mean, self.std)
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))



class Gemma3Processor(MultimodalProcessor):
    modalities = (IMAGE,)

    def __init__(self, model_dir: str | Path, config: Gemma3Config, limits: MediaLimits | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        super().__init__(model_dir, {IMAGE: config.boi_token_id}, config.text.vocab_size, limits,
                         embed_ids={IMAGE: config.image_token_id}, tokenizer=tokenizer)
        root = Path(model_dir)
        self.config = config
        processor_config = read_json(root / "processor_config.json")
        image_config = self.preprocessor_config or dict(processor_config.get("image_processor") or {})
        self.prep = Preprocessing.from_dict(image_config, config.vision.image_size)
        seq = processor_config.get("image_seq_length", image_config.get("image_seq_length"))
        if seq is not None and int(seq) != config.mm_tokens_per_image:
            raise ModelLoadError(f"image_seq_length {seq} != mm_tokens_per_image {config.mm_tokens_per_image}")
        self.rows_per_crop = config.mm_tokens_per_image
        self.patches_per_crop = config.vision.patches_per_side ** 2
        # the most crops a request may ask for: transformers' default, or the checkpoint's own if larger
        self.max_num_crops = max(DEFAULT_MAX_NUM_CROPS, int(image_config.get("pan_and_scan_max_num_crops") or 0))
        boi, eoi = (self.tokenizer.id_to_token(i) for i in (config.boi_token_id, config.eoi_token_id))
        if not boi or not eoi or not self.tokenizer.id_to_token(config.image_token_id):
            raise ModelLoadError("the tokenizer lacks Gemma 3's <start_of_image>, <end_of_image> or soft image token")
        self.boi_text, self.eoi_text = boi, eoi
        # token ids between one image sequence's <end_of_image> and the next one's <start_of_image>
        self._after_original = self.tokenizer.encode(NEWLINES + PAS_AFTER_ORIGINAL + NEWLINES)
        self._between_crops = self.tokenizer.encode(NEWLINES + PAS_BETWEEN_CROPS + NEWLINES)

    # ---- hooks --------------------------------------------------------------------------------
    def pan_and_scan(self, kwargs: dict[str, Any]) -> PanAndScan | None:
        return parse_pan_and_scan(kwargs, self.max_num_crops)

    def processing_key(self, modality: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        settings = self.pan_and_scan(kwargs)  # validates, whatever the modality
        if modality != IMAGE or settings is None:
            return {"pan_and_scan": None}
        return {"pan_and_scan": [settings.min_crop_size, settings.max_num_crops, settings.min_ratio_to_activate]}

    def span_ids(self, num_crops: int) -> list[int]:
        """The span of an image with `num_crops` pan-and-scan crops: its soft tokens, then per crop the
        tokens between two image sequences and the crop's soft tokens."""
        soft = [self.embed_ids[IMAGE]] * self.rows_per_crop
        span = list(soft)
        for i in range(num_crops):
            gap = self._after_original if i == 0 else self._between_crops
            span += [self.config.eoi_token_id, *gap, self.config.boi_token_id, *soft]
        return span

    def expand_image(self, image: Image.Image, kwargs: dict[str, Any], num_images: int) -> ItemExpansion:
        rgb = to_rgb(image)
        settings = self.pan_and_scan(kwargs)
        boxes = crop_boxes(rgb.width, rgb.height, settings) if settings is not None else []
        pixels = self.prep.pixels([rgb] + [rgb.crop(box) for box in boxes])
        crops = 1 + len(boxes)
        before = (PAS_INTRO if boxes else "") + NEWLINES + self.boi_text
        return ItemExpansion(self.span_ids(len(boxes)), crops * self.rows_per_crop, crops * self.patches_per_crop,
                             ImageInput(pixels), text_before=before, text_after=self.eoi_text + NEWLINES)

    def largest_image(self) -> tuple[int, int, int]:
        """(encoder tokens, rows, span tokens) of the largest image: one with the most crops a request may
        ask for (any request can turn pan-and-scan on)."""
        crops = 1 + self.max_num_crops
        return crops * self.patches_per_crop, crops * self.rows_per_crop, len(self.span_ids(self.max_num_crops))
