"""Typed view of a LLaVA-OneVision `config.json`.

Role: turn the checkpoint's JSON (`text_config` for the Qwen2 decoder, `vision_config` for the SigLIP
tower, the anyres grid pinpoints, the feature layer and select strategy, the aspect-ratio rule and the
placeholder ids) into frozen dataclasses the model and the processor read. Unsupported settings fail
here with a `ModelLoadError`. What it does not know: weights, tokenizers, pixels, devices.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import TEXT_KEYS as BASE_TEXT_KEYS
from mmserve.models.config_reader import DecoderTextConfig, Key, read, rope_section, rope_type, token_ids
from mmserve.models.vision.siglip_config import SiglipVisionConfig

LLAVA_ONEVISION = "LlavaOnevisionForConditionalGeneration"


@dataclass(frozen=True, kw_only=True)
class TextConfig(DecoderTextConfig):
    """The Qwen2 decoder, with 1-D RoPE."""

    rope_theta: float


@dataclass(frozen=True)
class LlavaOnevisionConfig:
    text: TextConfig
    vision: SiglipVisionConfig
    image_token_id: int
    video_token_id: int
    image_grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width) canvases for anyres tiling
    vision_feature_layers: tuple[int, ...]  # indices into [embeddings, layer 1 out, ...]; may be negative
    vision_aspect_ratio: str  # "anyres_max_N": feature maps larger than ~N tiles are scaled down
    projector_hidden_act: str
    multimodal_projector_bias: bool
    eos_token_ids: tuple[int, ...]

    @property
    def max_num_tiles(self) -> int:
        """N of `anyres_max_N`."""
        return int(self.vision_aspect_ratio.removeprefix("anyres_max_"))

    @property
    def resolved_feature_layers(self) -> tuple[int, ...]:
        """Feature layers as non-negative indices into the tower's hidden states (0 = embeddings)."""
        n = self.vision.num_hidden_layers + 1
        return tuple(i % n for i in self.vision_feature_layers)


TEXT_KEYS = MappingProxyType({**BASE_TEXT_KEYS, "max_position_embeddings": Key(default=32768)})
# LLaVA-OneVision's defaults for its SigLIP tower (SO400M at 384 px)
VISION_KEYS = MappingProxyType({
    "hidden_size": Key(default=1152), "intermediate_size": Key(default=4304), "num_hidden_layers": Key(default=26),
    "num_attention_heads": Key(default=16), "image_size": Key(default=384), "patch_size": Key(default=14),
    "num_channels": Key(default=3), "layer_norm_eps": Key(default=1e-6), "hidden_act": Key(default="gelu_pytorch_tanh"),
})
TOP_KEYS = MappingProxyType({
    "image_token_id": Key(names=("image_token_index", "image_token_id"), default=151646),
    "video_token_id": Key(names=("video_token_index", "video_token_id"), default=151647),
    "vision_aspect_ratio": Key(default="anyres_max_9"), "projector_hidden_act": Key(default="gelu"),
    "multimodal_projector_bias": Key(default=True),
})


def _parse_text(raw: dict[str, Any], top: dict[str, Any]) -> TextConfig:
    params = rope_section(raw)
    if rope_type(params) != "default":
        raise ModelLoadError(f"unsupported rope type {params.get('rope_type')!r}; only default RoPE is supported")
    if raw.get("use_sliding_window"):
        raise ModelLoadError("Qwen2 sliding-window attention is not supported")
    return read(TextConfig, raw, TEXT_KEYS, rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
                tie_word_embeddings=bool(top.get("tie_word_embeddings") or raw.get("tie_word_embeddings", False)))


def _feature_layers(raw: dict[str, Any], vision: SiglipVisionConfig) -> tuple[int, ...]:
    layer = raw.get("vision_feature_layer", -1)
    layers = tuple(int(i) for i in layer) if isinstance(layer, list) else (int(layer),)
    strategy = raw.get("vision_feature_select_strategy", "full")
    if strategy != "full":  # SigLIP has no CLS token; "default" would drop a real patch
        raise ModelLoadError(f"unsupported vision_feature_select_strategy {strategy!r}; SigLIP needs 'full'")
    depth = vision.num_hidden_layers
    if any(not -depth - 1 <= i <= depth for i in layers) or all(i % (depth + 1) == 0 for i in layers):
        raise ModelLoadError(f"vision_feature_layer {layer!r} is out of range (or selects only the embeddings)")
    return layers


def parse_config(raw: dict[str, Any]) -> LlavaOnevisionConfig:
    """Build a LlavaOnevisionConfig from a config.json dict."""
    try:
        if "text_config" not in raw:
            raise ModelLoadError("config.json lacks required field 'text_config'")
        text = _parse_text(dict(raw["text_config"]), raw)
        vision = read(SiglipVisionConfig, dict(raw.get("vision_config") or {}), VISION_KEYS)
        layers = _feature_layers(raw, vision)
        pinpoints = tuple((int(h), int(w)) for h, w in raw.get("image_grid_pinpoints") or ())
        if not pinpoints:
            raise ModelLoadError("config.json has no image_grid_pinpoints")
        if any(h % vision.image_size or w % vision.image_size for h, w in pinpoints):
            raise ModelLoadError(f"image_grid_pinpoints must be multiples of the tile size {vision.image_size}")
        config = read(LlavaOnevisionConfig, raw, TOP_KEYS, text=text, vision=vision, image_grid_pinpoints=pinpoints,
                      vision_feature_layers=layers,
                      eos_token_ids=token_ids(ChainMap(raw["text_config"], raw).get("eos_token_id")))
        if config.max_num_tiles < 1:  # int() raises ValueError on a string that is not anyres_max_N
            raise ModelLoadError(f"unsupported vision_aspect_ratio {config.vision_aspect_ratio!r}")
    except ValueError as exc:
        raise ModelLoadError(f"bad LLaVA-OneVision config: {exc}") from exc
    return config
