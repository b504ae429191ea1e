"""Llama 3.2 Vision input processor: each `<|image|>` stays one token; the image becomes tiles read by
cross-attention.

Role: the family's hooks on `MultimodalProcessor` (with `fuses_rows` off), computing what transformers'
`MllamaProcessor` with its PIL image processor computes. An image becomes its tiles
(`image_processing.preprocess_image`), padded to the tower's `max_num_tiles` with zero tiles; its item
has one placeholder token and `max_num_tiles * num_patches` rows of cross-attention states (padded
tiles included: transformers' language model reads them all).

Which text positions see which image follows transformers' `get_cross_attention_token_mask`: an image
is seen from its `<|image|>` up to the next `<|image|>`, except that consecutive `<|image|>`s are one
group seen until the token after the group's next image; the last group is seen to the end of the
prompt and, as transformers repeats the prompt's last mask row while generating, by every generated
token. A query sees only the real tiles of the images it sees (`attended_rows`). Positions are token
indices (1-D RoPE). No videos; no mm_processor_kwargs.

What it does not know: devices, KV caches, scheduling, the model's weights, what a query that sees no
image does (the runner and the model decide: see models/mllama/language.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmserve.errors import ModelLoadError
from mmserve.inputs.items import IMAGE, CrossAttentionSpan, MMItem
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.processing import ItemExpansion, MultimodalProcessor
from mmserve.inputs.tokenizer import TextTokenizer, read_json
from mmserve.models.mllama.config import MllamaConfig
from mmserve.models.mllama.image_processing import Preprocessing, preprocess_image
from mmserve.models.mllama.model import MllamaImage


def image_groups(image_offsets: list[int], num_tokens: int) -> list[tuple[int, int]]:
    """transformers' `get_cross_attention_token_mask`: per image (in prompt order) the [start, end) token
    positions that see it."""
    if not image_offsets:
        return []
    spans = [[a, b] for a, b in zip(image_offsets, image_offsets[1:])] + [[image_offsets[-1], num_tokens]]
    last_end = spans[-1][1]
    for span in reversed(spans):  # consecutive images: each is seen as far as the group's last one
        if span[0] == span[1] - 1:
            span[1] = last_end
        last_end = span[1]
    return [(a, b) for a, b in spans]


class MllamaProcessor(MultimodalProcessor):
    modalities = (IMAGE,)
    fuses_rows = False

    def __init__(self, model_dir: str | Path, config: MllamaConfig, limits: MediaLimits | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        assert config.text is not None
        super().__init__(model_dir, {IMAGE: config.image_token_index}, config.text.num_embeddings, limits,
                         tokenizer=tokenizer)
        raw = self.preprocessor_config or read_json(Path(model_dir) / "processor_config.json").get("image_processor", {})
        self.prep = Preprocessing.from_dict(raw)
        vision = config.vision
        if self.prep.max_image_tiles != vision.max_num_tiles or self.prep.tile_px != vision.image_size:
            raise ModelLoadError(f"preprocessor tiles ({self.prep.max_image_tiles} of {self.prep.tile_px} px) differ "
                                 f"from the vision tower's ({vision.max_num_tiles} of {vision.image_size} px)")
        self.max_tiles = vision.max_num_tiles
        self.num_patches = vision.num_patches
        self.encoder_tokens_per_image = vision.max_num_tiles * vision.padded_patches

    @property
    def rows_per_image(self) -> int:
        return self.max_tiles * self.num_patches

    def expand_image(self, image: Image.Image, kwargs: dict[str, Any], num_images: int) -> ItemExpansion:
        tiles = preprocess_image(image, self.prep)
        pixels = tiles.pixel_values
        if tiles.num_tiles < self.max_tiles:
            padded = np.zeros((self.max_tiles, *pixels.shape[1:]), dtype=np.float32)
            padded[:tiles.num_tiles] = pixels
            pixels = padded
        payload = MllamaImage(pixels, tiles.aspect_ratio_id, tiles.num_tiles)
        return ItemExpansion([self.pad_ids[IMAGE]], self.rows_per_image, self.encoder_tokens_per_image, payload,
                             key_extra={"num_tiles": tiles.num_tiles})

    def cross_attention_items(self, token_ids: list[int], items: list[MMItem]) -> list[MMItem]:
        groups = image_groups([item.offset for item in items], len(token_ids))
        return [dataclasses.replace(item, cross_attention=CrossAttentionSpan(
                    start, None if end >= len(token_ids) else end, item.payload.num_tiles * self.num_patches))
                for item, (start, end) in zip(items, groups)]
