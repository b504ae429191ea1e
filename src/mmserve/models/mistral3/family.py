"""The Mistral 3 entry of the registry, and the facts the engine reads of it.

Its largest item is an image filling the processor's bound on both axes; its span is longer than
its rows by one `[IMG_BREAK]` / `[IMG_END]` per row of merged patches.
What it does not know: the engine; it only states the family's `FamilySpec`.
"""

from __future__ import annotations

from types import MappingProxyType

from mmserve.inputs.items import IMAGE
from mmserve.inputs.media import MediaLimits
from mmserve.models.mistral3.config import MISTRAL3, Mistral3Config, parse_config
from mmserve.models.mistral3.model import Mistral3ForConditionalGeneration
from mmserve.models.mistral3.processor import Mistral3Processor
from mmserve.models.spec import FamilySpec, ItemSize, ModelFamily, PositionScheme


def build_spec(config: Mistral3Config, processor: Mistral3Processor, limits: MediaLimits) -> FamilySpec:
    patches, rows, span = processor.largest_image()
    return FamilySpec.for_decoder(
        "mistral3", config.text, eos_token_ids=config.eos_token_ids, default_video_fps=processor.default_video_fps,
        num_embedding_streams=1, largest_item={IMAGE: ItemSize(patches, rows, span)},
        position_scheme=PositionScheme.ROPE_1D)


FAMILIES = MappingProxyType({
    MISTRAL3: ModelFamily("mistral3", parse_config, Mistral3ForConditionalGeneration, Mistral3Processor, build_spec),
})
