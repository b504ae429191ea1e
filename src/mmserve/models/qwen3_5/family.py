"""The Qwen3.5 entries of the registry, and the facts the engine reads of them.

Role: the family's `FamilySpec`: KV for the full-attention layers only (`num_layers` counts them), the
DeltaNet layers' per-request state as a `LinearStateLayout`, the Qwen3-VL processor's largest items, M-RoPE.

What it does not know: the engine; it only states the family's facts.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from mmserve.inputs.items import IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits
from mmserve.models.qwen3_5.config import QWEN3_5, QWEN3_5_MOE, Qwen35Config, TextConfig, parse_config
from mmserve.models.qwen3_5.model import Qwen35ForConditionalGeneration
from mmserve.models.qwen3_5.mtp import Qwen35MtpHead
from mmserve.models.spec import FamilySpec, ItemSize, LinearStateLayout, ModelFamily, PositionScheme
from mmserve.models.vision.qwen3_processor import Qwen3VLProcessor


def linear_state_layout(text: TextConfig) -> LinearStateLayout:
    conv_channels = 2 * text.linear_num_key_heads * text.linear_key_head_dim \
        + text.linear_num_value_heads * text.linear_value_head_dim
    return LinearStateLayout(len(text.linear_layers), (conv_channels, text.linear_conv_kernel_dim - 1),
                             (text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim))


def build_spec(config: Qwen35Config, processor: Qwen3VLProcessor, limits: MediaLimits) -> FamilySpec:
    unit = config.vision.spatial_merge_size ** 2
    patches = processor.largest_item_patches(limits.max_video_frames)
    spec = FamilySpec.for_decoder(
        "qwen3_5_moe" if config.text.num_experts else "qwen3_5", config.text, eos_token_ids=config.eos_token_ids, default_video_fps=processor.default_video_fps,
        num_embedding_streams=1, largest_item={m: ItemSize(patches[m], patches[m] // unit) for m in (IMAGE, VIDEO)},
        position_scheme=PositionScheme.MROPE, linear_state=linear_state_layout(config.text),
        eager_decode="a hybrid model's state layers" + (" and sparse experts" if config.text.num_experts else ""))
    return replace(spec, num_layers=len(config.text.full_layers))  # KV: the full-attention layers only


FAMILIES = MappingProxyType({
    QWEN3_5: ModelFamily("qwen3_5", parse_config, Qwen35ForConditionalGeneration, Qwen3VLProcessor, build_spec,
                         Qwen35MtpHead),
    QWEN3_5_MOE: ModelFamily("qwen3_5_moe", parse_config, Qwen35ForConditionalGeneration, Qwen3VLProcessor,
                             build_spec, Qwen35MtpHead),
})
