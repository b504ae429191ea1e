"""Typed view of a Mistral 3 `config.json` (transformers' `Mistral3Config`).

Role: turn the checkpoint's JSON (`text_config`, a `MistralConfig`; `vision_config`, a
`PixtralVisionConfig`; the merge size, the image token, the projector's activation and bias, the
vision feature layer, tied embeddings) into frozen dataclasses the model and the processor read,
with transformers' defaults for missing fields: a section that is absent takes `Mistral3Config`'s
defaults for it (Mistral Small 3.1's sizes), a field absent from a present section the defaults of
`MistralConfig` / `PixtralVisionConfig`. Unsupported settings fail here with a `ModelLoadError`:
RoPE scaling (YaRN & co.), text models other than Mistral's, several vision feature layers.

What it does not know: weights, tokenizers, pixels, devices.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import DecoderTextConfig, Key, read, rope_section, rope_type, token_ids

MISTRAL3 = "Mistral3ForConditionalGeneration"

# Mistral3Config's defaults for a missing text_config / vision_config (Mistral Small 3.1)
_TEXT_SECTION_DEFAULTS: dict[str, Any] = {
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
    "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072,
}
_VISION_SECTION_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14, "image_size": 1540, "num_hidden_layers": 24,
    "num_attention_heads": 16, "hidden_act": "gelu",
}


@dataclass(frozen=True, kw_only=True)
class TextConfig(DecoderTextConfig):
    """The Mistral decoder. head_dim is explicit: Mistral Small's heads (32 x 128) do not divide hidden_size
    (5120)."""

    rope_theta: float
    sliding_window: int | None  # every layer attends over the last this-many positions; None: full

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be positive or null, got {self.sliding_window}")


@dataclass(frozen=True)
class VisionConfig:
    """The Pixtral vision encoder."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int  # the longest edge the encoder was trained for (the processor's setting rules)
    patch_size: int
    hidden_act: str
    rope_theta: float

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelLoadError(f"vision hidden_size {self.hidden_size} is not divisible by "
                                 f"num_attention_heads {self.num_attention_heads}")
        if self.head_dim % 4:  # 2-D RoPE: a quarter of the head's bands per axis and half (cos, sin)
            raise ModelLoadError(f"vision head_dim {self.head_dim} is not a multiple of 4, as 2-D RoPE needs")

    @property
    def head_dim(self) -> int:
        """Pixtral's head dim is always hidden / heads (its config overwrites any `head_dim` given)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_input_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size


@dataclass(frozen=True)
class Mistral3Config:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    spatial_merge_size: int
    projector_hidden_act: str
    vision_feature_layer: int  # index into [ln_pre output, layer 1 output, ..., layer N output]
    multimodal_projector_bias: bool
    eos_token_ids: tuple[int, ...]

    @property
    def pixels_per_row(self) -> int:
        """Pixels per merged row along each axis: the unit images are resized to."""
        return self.vision.patch_size * self.spatial_merge_size


def _rope_theta(section: dict[str, Any], default: float, allowed: tuple[str, ...], what: str) -> float:
    params = rope_section(section)
    if rope_type(params) not in allowed:
        raise ModelLoadError(f"unsupported {what} rope_type {rope_type(params)!r}; supported: {', '.join(allowed)}")
    return float(params.get("rope_theta", section.get("rope_theta", default)))


# MistralConfig's defaults for fields a present text section lacks; an explicit null num_key_value_heads
# means one kv head per query head, a null sliding_window no window
TEXT_KEYS = MappingProxyType({
    "vocab_size": Key(default=32000), "hidden_size": Key(default=4096), "intermediate_size": Key(default=14336),
    "num_hidden_layers": Key(default=32), "num_attention_heads": Key(default=32),
    "num_key_value_heads": Key(default=8, null=lambda f: f["num_attention_heads"]),
    "head_dim": Key(default=lambda f: f["hidden_size"] // f["num_attention_heads"], falsy_is_absent=True),
    "sliding_window": Key(default=4096, null=None), "max_position_embeddings": Key(default=131072),
})
# PixtralVisionConfig's defaults; a square patch size may be given as (p, p), the image size as (h, w)
VISION_KEYS = MappingProxyType({
    "hidden_size": Key(default=1024), "intermediate_size": Key(default=4096), "num_hidden_layers": Key(default=24),
    "num_attention_heads": Key(default=16), "num_channels": Key(default=3),
    "image_size": Key(default=1024, convert=lambda size: int(max(size) if isinstance(size, (list, tuple)) else size)),
    "patch_size": Key(default=16, convert=lambda patch: int(_square_patch(patch))), "hidden_act": Key(default="gelu"),
})
TOP_KEYS = MappingProxyType({
    "image_token_id": Key(names=("image_token_index", "image_token_id"), default=10),
    "spatial_merge_size": Key(default=2), "projector_hidden_act": Key(default="gelu"),
    "multimodal_projector_bias": Key(default=False),
})


def _parse_text(raw: dict[str, Any]) -> TextConfig:
    given = raw.get("text_config")
    t = dict(given) if given is not None else dict(_TEXT_SECTION_DEFAULTS)
    model_type = t.get("model_type", "mistral")
    if model_type != "mistral":
        raise ModelLoadError(f"unsupported Mistral 3 text model {model_type!r}; only 'mistral' is supported")
    # Mistral3Config's own field (default True) decides, not the text section's; the model unties the
    # head when the checkpoint carries a separate one, as transformers does
    return read(TextConfig, t, TEXT_KEYS, rope_theta=_rope_theta(t, 10000.0, ("default",), "text"),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


def _square_patch(patch: Any) -> Any:
    if isinstance(patch, (list, tuple)):
        if len(set(patch)) != 1:
            raise ModelLoadError(f"non-square vision patch_size {patch} is not supported")
        return patch[0]
    return patch


def _parse_vision(raw: dict[str, Any]) -> VisionConfig:
    given = raw.get("vision_config")
    v = dict(given) if given is not None else dict(_VISION_SECTION_DEFAULTS)
    return read(VisionConfig, v, VISION_KEYS, rope_theta=_rope_theta(v, 10000.0, ("default", "axial"), "vision"))


def _feature_layer(value: Any, depth: int) -> int:
    if isinstance(value, (list, tuple)):
        # the projector's RMSNorm and patch merger are sized for one layer's width: transformers'
        # Mistral 3 cannot run several layers either
        raise ModelLoadError(f"vision_feature_layer {list(value)}: Mistral 3 takes a single feature layer")
    layer = int(value)
    if not -depth - 1 <= layer <= depth:
        raise ModelLoadError(f"vision_feature_layer {layer} is outside the vision encoder's {depth} layers")
    return layer % (depth + 1)


def parse_config(raw: dict[str, Any]) -> Mistral3Config:
    """Build a Mistral3Config from a config.json dict."""
    try:
        text = _parse_text(raw)
        vision = _parse_vision(raw)
        config = read(Mistral3Config, raw, TOP_KEYS, text=text, vision=vision,
                      vision_feature_layer=_feature_layer(raw.get("vision_feature_layer", -1), vision.num_hidden_layers),
                      eos_token_ids=token_ids(ChainMap(raw.get("text_config") or {}, raw).get("eos_token_id", 2)))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad Mistral 3 config: {exc}") from exc
    if config.spatial_merge_size < 1:
        raise ModelLoadError(f"spatial_merge_size must be at least 1, got {config.spatial_merge_size}")
    return config
