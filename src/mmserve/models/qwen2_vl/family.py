"""The Qwen2-VL and Qwen2.5-VL entries of the registry, and the facts the engine reads of them.

What it does not know: the engine; it only states the family's `FamilySpec`.
"""

from __future__ import annotations

from types import MappingProxyType

from mmserve.inputs.items import IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits
from mmserve.models.qwen2_vl.config import QWEN2_5_VL, QWEN2_VL, Qwen2VLConfig, parse_config
from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration
from mmserve.models.qwen2_vl.processor import Qwen2VLProcessor
from mmserve.models.spec import FamilySpec, ItemSize, ModelFamily, PositionScheme


def build_spec(config: Qwen2VLConfig, processor: Qwen2VLProcessor, limits: MediaLimits) -> FamilySpec:
    unit = config.vision.spatial_merge_size ** 2
    patches = processor.largest_item_patches(limits.max_video_frames)
    return FamilySpec.for_decoder(
        "qwen2_5_vl" if config.is_qwen2_5 else "qwen2_vl", config.text, eos_token_ids=config.eos_token_ids,
        default_video_fps=processor.default_video_fps, embed_dim=config.vision.out_hidden_size,
        num_embedding_streams=1, largest_item={m: ItemSize(patches[m], patches[m] // unit) for m in (IMAGE, VIDEO)},
        position_scheme=PositionScheme.MROPE)


def _family(name: str) -> ModelFamily:
    return ModelFamily(name, parse_config, Qwen2VLForConditionalGeneration, Qwen2VLProcessor, build_spec)


FAMILIES = MappingProxyType({QWEN2_VL: _family("qwen2_vl"), QWEN2_5_VL: _family("qwen2_5_vl")})
