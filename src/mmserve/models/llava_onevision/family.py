"""The LLaVA-OneVision entry of the registry, and the facts the engine reads of it.

What it does not know: the engine; it only states the family's `FamilySpec`.
"""

from __future__ import annotations

from types import MappingProxyType

from mmserve.inputs.media import MediaLimits
from mmserve.models.llava_onevision.config import LLAVA_ONEVISION, LlavaOnevisionConfig, parse_config
from mmserve.models.llava_onevision.model import LlavaOnevisionForConditionalGeneration
from mmserve.models.llava_onevision.processor import LlavaOnevisionProcessor
from mmserve.models.spec import FamilySpec, ItemSize, ModelFamily, PositionScheme


def build_spec(config: LlavaOnevisionConfig, processor: LlavaOnevisionProcessor, limits: MediaLimits) -> FamilySpec:
    largest = processor.largest_items(limits.max_video_frames)
    return FamilySpec.for_decoder(
        "llava_onevision", config.text, eos_token_ids=config.eos_token_ids,
        default_video_fps=processor.default_video_fps, num_embedding_streams=1,
        largest_item={m: ItemSize(tokens, rows) for m, (tokens, rows) in largest.items()},
        position_scheme=PositionScheme.ROPE_1D)


FAMILIES = MappingProxyType({
    LLAVA_ONEVISION: ModelFamily("llava_onevision", parse_config, LlavaOnevisionForConditionalGeneration,
                                 LlavaOnevisionProcessor, build_spec),
})
