"""Typed view of a Gemma 3 `config.json` (`Gemma3Config`: a `gemma3_text` decoder and a SigLIP tower).

Role: turn the checkpoint's JSON into frozen dataclasses the model and the processor read, with
transformers' defaults for absent fields. Both rope layouts are read: transformers 5's
`rope_parameters` per layer type ({"sliding_attention": ..., "full_attention": ...}) and the hub's
older `rope_theta` / `rope_local_base_freq` / `rope_scaling` (the scaling applies to the global
layers only). Layer types come from `layer_types`, or from `sliding_window_pattern` (every n-th
layer global) when absent. What mmserve does not implement fails here with a `ModelLoadError`:
attention-logit softcapping, bidirectional text attention, rope types other than default and linear.

What it does not know: weights, tokenizers, pixels, devices.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import DecoderTextConfig, Key, check_layer_types, read, rope_type, token_ids
from mmserve.models.vision.siglip_config import SiglipVisionConfig

GEMMA3 = "Gemma3ForConditionalGeneration"
SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TYPES = ("default", "linear")
# transformers' Gemma3TextConfig.default_theta
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # "default" or "linear" (positions divided by `factor`)
    theta: float
    factor: float = 1.0


@dataclass(frozen=True, kw_only=True)
class TextConfig(DecoderTextConfig):
    """`hidden_act` is config.json's `hidden_activation` (or `hidden_act`); rope is per layer type."""

    query_pre_attn_scalar: float  # softmax scale = query_pre_attn_scalar ** -0.5 (not head_dim's)
    sliding_window: int | None  # tokens a sliding layer's query sees, itself included
    layer_types: tuple[str, ...]  # per layer: "sliding_attention" or "full_attention"
    local_rope: RopeConfig  # sliding layers
    global_rope: RopeConfig  # full-attention layers
    final_logit_softcapping: float | None = None
    attention_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be positive, got {self.sliding_window}")

    def window(self, layer_idx: int) -> int | None:
        """The layer's sliding window, or None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None


@dataclass(frozen=True)
class Gemma3Config:
    text: TextConfig
    vision: SiglipVisionConfig
    mm_tokens_per_image: int  # soft tokens (rows) per image or crop, after pooling
    boi_token_id: int  # <start_of_image>: the placeholder a prompt holds per image
    eoi_token_id: int  # <end_of_image>
    image_token_id: int  # <image_soft_token>: one per encoder row
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        side = round(self.mm_tokens_per_image ** 0.5)
        if side * side != self.mm_tokens_per_image:
            raise ModelLoadError(f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square")
        if self.vision.patches_per_side % side:
            raise ModelLoadError(f"{self.vision.patches_per_side} patches a side do not pool evenly to {side} tokens")

    @property
    def tokens_per_side(self) -> int:
        return round(self.mm_tokens_per_image ** 0.5)


def _rope(params: dict[str, Any] | None, default_theta: float, layer_type: str) -> RopeConfig:
    params = dict(params or {})
    kind = rope_type(params)
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope_type {kind!r} for {layer_type} layers; supported: {ROPE_TYPES}")
    factor = float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    return RopeConfig(kind, float(params.get("rope_theta", default_theta)), factor)


def _ropes(t: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(local, global) rope of the text config, in either layout (see the module docstring)."""
    params = t.get("rope_parameters")
    if params is not None and not (set(params) <= {SLIDING, FULL}):
        raise ModelLoadError(f"rope_parameters must be given per layer type ({SLIDING}, {FULL}), got {sorted(params)}")
    params = dict(params or {})
    full = dict(params.get(FULL) or {})
    if t.get("rope_scaling"):
        full.update(t["rope_scaling"])
    full.setdefault("rope_theta", t.get("rope_theta", DEFAULT_THETA[FULL]))
    local = dict(params.get(SLIDING) or {})
    local.setdefault("rope_theta", t.get("rope_local_base_freq", DEFAULT_THETA[SLIDING]))
    return _rope(local, DEFAULT_THETA[SLIDING], SLIDING), _rope(full, DEFAULT_THETA[FULL], FULL)


def _layer_types(t: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if t.get("layer_types"):
        return tuple(str(x) for x in t["layer_types"])
    pattern = int(t.get("sliding_window_pattern", t.get("_sliding_window_pattern", 6)))
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


# transformers' Gemma3TextConfig defaults (Gemma 3 4B's decoder)
TEXT_KEYS = MappingProxyType({
    "vocab_size": Key(default=262_208), "hidden_size": Key(default=2304), "intermediate_size": Key(default=9216),
    "num_hidden_layers": Key(default=26), "num_attention_heads": Key(default=8),
    "num_key_value_heads": Key(default=4, falsy_is_absent=True), "head_dim": Key(default=256, falsy_is_absent=True),
    "hidden_act": Key(names=("hidden_activation", "hidden_act"), default="gelu_pytorch_tanh", falsy_is_absent=True),
    "query_pre_attn_scalar": Key(default=256.0), "sliding_window": Key(default=4096, null=None),
    "max_position_embeddings": Key(default=131_072),
})
# transformers' SiglipVisionConfig defaults; image and patch sizes may be given as a square (h, w)
VISION_KEYS = MappingProxyType({
    "hidden_size": Key(default=768), "intermediate_size": Key(default=3072), "num_hidden_layers": Key(default=12),
    "num_attention_heads": Key(default=12),
    "image_size": Key(default=224, convert=lambda value: _square(value, "image_size")),
    "patch_size": Key(default=16, convert=lambda value: _square(value, "patch_size")),
    "num_channels": Key(default=3), "layer_norm_eps": Key(default=1e-6), "hidden_act": Key(default="gelu_pytorch_tanh"),
})
TOP_KEYS = MappingProxyType({
    "mm_tokens_per_image": Key(default=256, falsy_is_absent=True),
    **{f"{name}_token_id": Key(names=(f"{name}_token_index", f"{name}_token_id"), default=default)
       for name, default in (("boi", 255_999), ("eoi", 256_000), ("image", 262_144))},
})


def _parse_text(t: dict[str, Any], top: dict[str, Any]) -> TextConfig:
    if t.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("attn_logit_softcapping is not supported (Gemma 3 checkpoints leave it null)")
    if t.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention (bidirectional text attention) is not supported")
    local, full = _ropes(t)
    keys = {**TEXT_KEYS, "layer_types": Key(computed=lambda f: _layer_types(t, f["num_hidden_layers"]))}
    return read(TextConfig, t, keys, local_rope=local, global_rope=full,
                tie_word_embeddings=bool(ChainMap(top, t).get("tie_word_embeddings", True)))


def _square(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ModelLoadError(f"vision {name} {value!r} is not square")
        value = value[0]
    return int(value)


def _parse_vision(v: dict[str, Any]) -> SiglipVisionConfig:
    vision = read(SiglipVisionConfig, v, VISION_KEYS)
    if vision.image_size % vision.patch_size:
        raise ModelLoadError(f"vision image_size {vision.image_size} is not a multiple of patch_size {vision.patch_size}")
    return vision


def parse_config(raw: dict[str, Any]) -> Gemma3Config:
    """Build a Gemma3Config from a config.json dict."""
    t = dict(raw.get("text_config") or {})
    try:
        return read(Gemma3Config, raw, TOP_KEYS, text=_parse_text(t, raw),
                    vision=_parse_vision(dict(raw.get("vision_config") or {})),
                    eos_token_ids=token_ids(ChainMap(t, raw).get("eos_token_id", 1)))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad Gemma 3 config: {exc}") from exc
