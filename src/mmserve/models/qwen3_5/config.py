"""Typed view of a Qwen3.5 `config.json`: a hybrid text model (Gated DeltaNet and gated full attention, in the
order `layer_types` gives) and the Qwen3-VL vision tower without deepstack.

Role: turn the checkpoint's JSON into frozen dataclasses the model code reads, with the checks that would
otherwise fail deep inside a forward: every `layer_types` entry known and their count the layer count, the
linear-attention head counts grouping evenly, the rotary part of a head even and inside it, the M-RoPE
sections inside the rotary bands. transformers writes `layer_types` or, for older configs,
`full_attention_interval` (every n-th layer full); both are read.

What it does not know: weights, tokenizers, devices.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import (
    TEXT_KEYS,
    DecoderTextConfig,
    Key,
    check_experts,
    read,
    rope_section,
    rope_type,
    token_ids,
)
from mmserve.models.vision.qwen3_vision_config import VISION_KEYS, Qwen3StyleConfig, VisionConfig

QWEN3_5 = "Qwen3_5ForConditionalGeneration"
QWEN3_5_MOE = "Qwen3_5MoeForConditionalGeneration"
ARCHITECTURES = (QWEN3_5, QWEN3_5_MOE)
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class TextConfig(DecoderTextConfig):
    rope_theta: float
    mrope_section: tuple[int, int, int]
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 0  # MoE (Qwen3.5-MoE): every layer's MLP is a sparse block with a shared expert
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_experts(self.num_experts, self.num_experts_per_tok)
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ModelLoadError("moe_intermediate_size must be set for a model with experts")
        if not self.num_experts and self.intermediate_size < 1:
            raise ModelLoadError("intermediate_size must be set for a model without experts")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} "
                                 "num_hidden_layers")
        unknown = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if unknown:
            raise ModelLoadError(f"layer_types has unknown entries {unknown}; known: {LINEAR!r}, {FULL!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelLoadError(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                                 f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.linear_conv_kernel_dim < 2:
            raise ModelLoadError(f"linear_conv_kernel_dim {self.linear_conv_kernel_dim} must be at least 2")
        rotary = self.rotary_dim
        if rotary < 2 or rotary % 2 or rotary > self.head_dim:
            raise ModelLoadError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {self.head_dim} "
                                 f"gives {rotary} rotary dims: an even number in [2, head_dim] is needed")
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ModelLoadError(f"mrope_section {list(self.mrope_section)} must be three non-negative sections")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)


@dataclass(frozen=True)
class Qwen35Config(Qwen3StyleConfig):
    text: TextConfig


def _layer_types(section: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    given = section.get("layer_types")
    if given is not None:
        return tuple(str(t) for t in given)
    interval = int(section.get("full_attention_interval", 4))
    if interval < 1:
        raise ModelLoadError(f"full_attention_interval {interval} must be at least 1")
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(num_layers))


def parse_text(t: dict[str, Any], raw: dict[str, Any]) -> TextConfig:
    rope = rope_section(t)
    if rope_type(rope) not in ("default", "mrope"):
        raise ModelLoadError(f"unsupported rope_type {rope_type(rope)!r}")
    layers = int(t.get("num_hidden_layers", 0))
    return read(TextConfig, t, {**TEXT_KEYS, "max_position_embeddings": Key(default=262144),
                                "intermediate_size": Key(default=0)},
                rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10_000_000.0))),
                mrope_section=tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10))),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))),
                layer_types=_layer_types(t, layers),
                tie_word_embeddings=bool(ChainMap(raw, t).get("tie_word_embeddings", False)))


def parse_config(raw: dict[str, Any]) -> Qwen35Config:
    """Build a Qwen35Config from a config.json dict."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    t = raw.get("text_config") or {}
    text = parse_text(t, raw)
    v = raw.get("vision_config") or {}
    vision = read(VisionConfig, v, {**VISION_KEYS, "out_hidden_size": Key(default=text.hidden_size),
                                    "deepstack_visual_indexes": Key(default=())},
                  rope_theta=float(rope_section(v).get("rope_theta", v.get("rope_theta", 10000.0))))
    if vision.deepstack_visual_indexes:
        raise ModelLoadError(f"vision_config.deepstack_visual_indexes {list(vision.deepstack_visual_indexes)}: "
                             "Qwen3.5's vision tower has no deepstack mergers")
    return read(Qwen35Config, raw, {"image_token_id": Key(default=248056), "video_token_id": Key(default=248057),
                                    "vision_start_token_id": Key(default=248053),
                                    "vision_end_token_id": Key(default=248054)},
                architecture=arch, text=text, vision=vision,
                eos_token_ids=token_ids(ChainMap(t, raw).get("eos_token_id")))
