"""Typed view of a Qwen2-VL / Qwen2.5-VL `config.json`.

Role: turn the checkpoint's JSON (the hub's flat layout or transformers 5's nested `text_config`)
into frozen dataclasses the model code reads. What it does not know: weights, tokenizers, devices.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import DecoderTextConfig, Key, read, rope_section, token_ids

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"


@dataclass(frozen=True, kw_only=True)
class TextConfig(DecoderTextConfig):
    rope_theta: float
    mrope_section: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelLoadError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        super().__post_init__()
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ModelLoadError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim/2 = {self.head_dim // 2}"
            )


@dataclass(frozen=True)
class VisionConfig:
    """Both vision towers. Qwen2.5-VL adds window attention, RMSNorm and a SwiGLU MLP."""

    depth: int
    embed_dim: int  # width of the vision blocks
    out_hidden_size: int  # width after the patch merger (= the language model's hidden size)
    num_heads: int
    mlp_hidden_size: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    rope_theta: float
    window_size: int = 0  # Qwen2.5-VL only; 0 means no window attention
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float = 0.0
    is_qwen2_5: bool = False

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_input_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass(frozen=True)
class Qwen2VLConfig:
    architecture: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]

    @property
    def is_qwen2_5(self) -> bool:
        return self.architecture == QWEN2_5_VL


def _rope_params(section: Mapping[str, Any]) -> tuple[float, tuple[int, ...] | None]:
    params = rope_section(section)
    theta = params.get("rope_theta", section.get("rope_theta", 10000.0))
    mrope = params.get("mrope_section")
    return float(theta), (tuple(int(x) for x in mrope) if mrope else None)


TEXT_KEYS = MappingProxyType({
    "num_key_value_heads": Key(default=lambda f: f["num_attention_heads"]),
    "head_dim": Key(computed=lambda f: f["hidden_size"] // f["num_attention_heads"]),
    "max_position_embeddings": Key(default=32768),
})
# the vision section: Qwen2-VL's and Qwen2.5-VL's towers name the same widths differently
VISION_KEYS = MappingProxyType({
    "patch_size": Key(default=14), "temporal_patch_size": Key(default=2), "spatial_merge_size": Key(default=2),
    "in_channels": Key(names=("in_channels", "in_chans"), default=3),
})
QWEN2_5_VISION_KEYS = MappingProxyType({
    **VISION_KEYS, "embed_dim": Key(names=("hidden_size",)), "mlp_hidden_size": Key(names=("intermediate_size",)),
    "hidden_act": Key(default="silu"), "window_size": Key(default=112), "tokens_per_second": Key(default=2.0),
})


def parse_config(raw: dict[str, Any]) -> Qwen2VLConfig:
    """Build a Qwen2VLConfig from a config.json dict (flat hub layout or nested text_config)."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in (QWEN2_VL, QWEN2_5_VL):
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {QWEN2_VL}, {QWEN2_5_VL}")
    text_raw = ChainMap(raw.get("text_config") or {}, raw)  # the nested section over the flat layout
    theta, mrope = _rope_params(text_raw)
    text = read(TextConfig, text_raw, TEXT_KEYS, rope_theta=theta, mrope_section=mrope or (16, 24, 24),
                tie_word_embeddings=bool(ChainMap(raw, text_raw).get("tie_word_embeddings", False)))
    if "vision_config" not in raw:
        raise ModelLoadError("config.json lacks required field 'vision_config'")
    # the media token ids at the top level, else in the text section
    media_keys = {name: Key(default=lambda f, n=name, d=default: int(text_raw.get(n, d))) for name, default in
                  (("image_token_id", 151655), ("video_token_id", 151656))}
    return read(Qwen2VLConfig, raw, {**media_keys, "vision_start_token_id": Key(default=151652),
                                     "vision_end_token_id": Key(default=151653)},
                architecture=arch, text=text, vision=_parse_vision(raw["vision_config"], arch, text.hidden_size),
                eos_token_ids=token_ids(text_raw.get("eos_token_id")))


def _parse_vision(v: dict[str, Any], arch: str, text_hidden: int) -> VisionConfig:
    theta, _ = _rope_params(v)
    if arch == QWEN2_5_VL:
        return read(VisionConfig, v, {**QWEN2_5_VISION_KEYS, "out_hidden_size": Key(default=text_hidden)},
                    rope_theta=theta, is_qwen2_5=True)
    # Qwen2-VL: `hidden_size` is the merger's output width; the MLP is `mlp_ratio` times the blocks' width
    keys = {**VISION_KEYS, "out_hidden_size": Key(names=("hidden_size",), default=text_hidden),
            "mlp_hidden_size": Key(computed=lambda f: int(f["embed_dim"] * float(v.get("mlp_ratio", 4)))),
            "hidden_act": Key(default="quick_gelu")}
    return read(VisionConfig, v, keys, rope_theta=theta, window_size=0, fullatt_block_indexes=(),
                tokens_per_second=0.0)
