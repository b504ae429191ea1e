"""The Gemma 3 entry of the registry, and the facts the engine reads of it.

Gemma 3's image tokens attend to each other in both directions (`bidirectional_media`), so the
engine keeps an item's span in one prefill chunk; the largest item is an image with the most
pan-and-scan crops a request may ask for, its span including the text between the crops. Its sliding
layers keep only their window's KV blocks (`KVLayerShape.sliding_window`).

What it does not know: the engine; it only states the family's `FamilySpec`.
"""

from __future__ import annotations

from types import MappingProxyType

from mmserve.inputs.items import IMAGE
from mmserve.inputs.media import MediaLimits
from mmserve.models.gemma3.config import GEMMA3, Gemma3Config, parse_config
from mmserve.models.gemma3.model import Gemma3ForConditionalGeneration
from mmserve.models.gemma3.processor import Gemma3Processor
from mmserve.models.spec import FamilySpec, ItemSize, KVLayerShape, ModelFamily, PositionScheme


def build_spec(config: Gemma3Config, processor: Gemma3Processor, limits: MediaLimits) -> FamilySpec:
    encoder_tokens, rows, span = processor.largest_image()
    text = config.text
    # the sliding layers' windows: their blocks live in the window pool (core/window_kv.py)
    kv_layers = tuple(KVLayerShape(text.num_key_value_heads, text.head_dim, sliding_window=text.window(i))
                      for i in range(text.num_hidden_layers))
    return FamilySpec.for_decoder(
        "gemma3", text, eos_token_ids=config.eos_token_ids, default_video_fps=processor.default_video_fps,
        num_embedding_streams=1, largest_item={IMAGE: ItemSize(encoder_tokens, rows, span)},
        position_scheme=PositionScheme.ROPE_1D, bidirectional_media=True, kv_layers=kv_layers)


FAMILIES = MappingProxyType({
    GEMMA3: ModelFamily("gemma3", parse_config, Gemma3ForConditionalGeneration, Gemma3Processor, build_spec),
})
