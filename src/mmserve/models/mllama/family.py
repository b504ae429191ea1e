"""The Llama 3.2 Vision entry of the registry, and the facts the engine reads of it.

Its images are read by cross-attention layers (`cross_attention`): the KV cache holds the
self-attention layers only, and an image's rows (every tile the tower pads to, class tokens included)
become per-request cross-attention K/V. The largest item is any image: the tower always runs
`max_num_tiles` tiles.

What it does not know: the engine; it only states the family's `FamilySpec`.
"""

from __future__ import annotations

from types import MappingProxyType

from mmserve.inputs.items import IMAGE
from mmserve.inputs.media import MediaLimits
from mmserve.models.mllama.config import MLLAMA, MllamaConfig, parse_config
from mmserve.models.mllama.model import MllamaForConditionalGeneration
from mmserve.models.mllama.processor import MllamaProcessor
from mmserve.models.spec import CrossAttentionLayout, FamilySpec, ItemSize, ModelFamily, PositionScheme


def build_spec(config: MllamaConfig, processor: MllamaProcessor, limits: MediaLimits) -> FamilySpec:
    text = config.text
    assert text is not None
    num_cross = len(set(text.cross_attention_layers))
    return FamilySpec(
        name="mllama", num_layers=text.num_hidden_layers - num_cross, num_kv_heads=text.num_key_value_heads,
        head_dim=text.head_dim, embed_dim=text.hidden_size, num_embedding_streams=1,
        largest_item={IMAGE: ItemSize(processor.encoder_tokens_per_image, processor.rows_per_image, 1)},
        eos_token_ids=config.eos_token_ids, position_scheme=PositionScheme.ROPE_1D,
        max_position_embeddings=text.max_position_embeddings, default_video_fps=processor.default_video_fps,
        vocab_size=text.vocab_size,
        cross_attention=CrossAttentionLayout(num_cross, text.num_key_value_heads, text.head_dim))


FAMILIES = MappingProxyType({
    MLLAMA: ModelFamily("mllama", parse_config, MllamaForConditionalGeneration, MllamaProcessor, build_spec),
})
