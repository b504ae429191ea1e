"""The Gemma 4 entry of the registry, and the facts the engine reads of it.

Its KV layout is per layer (`FamilySpec.kv_layers`): sliding layers' head size and full layers' own
(`global_head_dim`), and the KV-shared layers reading an earlier layer's cache at no cost. Its forward reads
the step's token ids (per-layer embeddings). On checkpoints with bidirectional vision (12B and larger) an
image's or a frame's rows attend both ways on sliding layers, so the engine keeps such a span in one
prefill chunk; audio rows stay causal.

What it does not know: the engine; it only states the family's `FamilySpec`.
"""

from __future__ import annotations

from types import MappingProxyType

from mmserve.inputs.items import IMAGE, VIDEO
from mmserve.inputs.media import MediaLimits
from mmserve.models.gemma4.config import GEMMA4, Gemma4Config, parse_config
from mmserve.models.gemma4.model import Gemma4ForConditionalGeneration
from mmserve.models.gemma4.processor import Gemma4Processor
from mmserve.models.spec import FamilySpec, KVLayerShape, ModelFamily, PositionScheme


def build_spec(config: Gemma4Config, processor: Gemma4Processor, limits: MediaLimits) -> FamilySpec:
    text = config.text
    # a sliding layer's window: its blocks live in the window pool (core/window_kv.py), a shared one reads them there
    kv_layers = tuple(KVLayerShape(layer.num_kv_heads, layer.head_dim,
                                   None if layer.kv_source == i else layer.kv_source, text.window(i))
                      for i, layer in enumerate(text.layers))
    return FamilySpec.for_decoder(
        "gemma4", text, eos_token_ids=config.eos_token_ids, default_video_fps=processor.default_video_fps,
        num_embedding_streams=1, largest_item=processor.largest_items(limits.max_video_frames),
        position_scheme=PositionScheme.ROPE_1D, bidirectional_media=text.bidirectional_vision,
        bidirectional_modalities=frozenset({IMAGE, VIDEO}), kv_layers=kv_layers, forward_reads_token_ids=True)


FAMILIES = MappingProxyType({
    GEMMA4: ModelFamily("gemma4", parse_config, Gemma4ForConditionalGeneration, Gemma4Processor, build_spec),
})
