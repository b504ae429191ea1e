"""The Qwen3-VL entry of the registry, and the facts the engine reads of it.

What it does not know: the engine; it only states the family's `FamilySpec`.
"""

from __future__ import annotations

from types import MappingProxyType

from mmserve.inputs.items import IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits
from mmserve.models.qwen3_vl.config import QWEN3_VL, QWEN3_VL_MOE, Qwen3VLConfig, parse_config
from mmserve.models.qwen3_vl.model import Qwen3VLForConditionalGeneration
from mmserve.models.spec import FamilySpec, ItemSize, ModelFamily, PositionScheme
from mmserve.models.vision.qwen3_processor import Qwen3VLProcessor


def build_spec(config: Qwen3VLConfig, processor: Qwen3VLProcessor, limits: MediaLimits) -> FamilySpec:
    unit = config.vision.spatial_merge_size ** 2
    patches = processor.largest_item_patches(limits.max_video_frames)
    return FamilySpec.for_decoder(
        "qwen3_vl", config.text, eos_token_ids=config.eos_token_ids, default_video_fps=processor.default_video_fps,
        num_embedding_streams=1 + config.num_deepstack,
        largest_item={m: ItemSize(patches[m], patches[m] // unit) for m in (IMAGE, VIDEO)},
        position_scheme=PositionScheme.MROPE, eager_decode="sparse experts" if config.text.num_experts else None)


FAMILIES = MappingProxyType({
    QWEN3_VL: ModelFamily("qwen3_vl", parse_config, Qwen3VLForConditionalGeneration, Qwen3VLProcessor, build_spec),
    QWEN3_VL_MOE: ModelFamily("qwen3_vl_moe", parse_config, Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
                              build_spec),
})
