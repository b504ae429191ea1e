"""Typed view of a Qwen3-VL `config.json` (transformers 5's nested `text_config` / `vision_config`).

Role: turn the checkpoint's JSON into frozen dataclasses the model code reads, with the checks
that would otherwise fail deep inside a forward (head sizes, the interleaved M-RoPE sections,
deepstack layers that the decoder must have). What it does not know: weights, tokenizers, devices.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import TEXT_KEYS as BASE_TEXT_KEYS
from mmserve.models.config_reader import (
    DecoderTextConfig,
    Key,
    check_experts,
    read,
    rope_section,
    rope_type,
    token_ids,
)
from mmserve.models.vision.qwen3_vision_config import VISION_KEYS, Qwen3StyleConfig, VisionConfig

QWEN3_VL = "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"


@dataclass(frozen=True, kw_only=True)
class TextConfig(DecoderTextConfig):
    """head_dim is explicit (Qwen3 heads need not divide hidden_size); M-RoPE's bands are interleaved."""

    rope_theta: float
    mrope_section: tuple[int, int, int]  # frequency bands driven by t, h, w (interleaved)
    attention_bias: bool = False
    num_experts: int = 0  # Qwen3-VL-MoE: sparse MLPs in every `decoder_sparse_step`-th layer not in mlp_only_layers
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_hidden_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_experts(self.num_experts, self.num_experts_per_tok)
        if self.num_experts and self.decoder_sparse_step < 1:
            raise ModelLoadError(f"decoder_sparse_step {self.decoder_sparse_step} must be at least 1")
        # the model's own bound (transformers' Qwen3VLTextRotaryEmbedding): three sections; the h and w
        # bands interleave at 1, 4, ... and 2, 5, ... up to 3 * section, clipped to head_dim / 2 bands,
        # and every other band follows t: no sum and no upper bound is required
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ModelLoadError(f"mrope_section {list(self.mrope_section)} must be three non-negative sections "
                                 "(t, h, w)")


@dataclass(frozen=True)
class Qwen3VLConfig(Qwen3StyleConfig):
    text: TextConfig

    @property
    def num_deepstack(self) -> int:
        return len(self.vision.deepstack_visual_indexes)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_deepstack > self.text.num_hidden_layers:
            raise ModelLoadError(f"{self.num_deepstack} deepstack streams but only {self.text.num_hidden_layers} "
                                 "decoder layers to add them to")


def _rope(section: dict[str, Any], default_theta: float) -> dict[str, Any]:
    params = rope_section(section)
    if rope_type(params) not in ("default", "axial", "mrope"):
        raise ModelLoadError(f"unsupported rope_type {rope_type(params)!r}")
    params.setdefault("rope_theta", section.get("rope_theta", default_theta))
    return params


TEXT_KEYS = MappingProxyType({**BASE_TEXT_KEYS, "max_position_embeddings": Key(default=128000),
                              "num_experts": Key(names=("num_experts", "num_local_experts"))})  # (as transformers writes it)


def parse_config(raw: dict[str, Any]) -> Qwen3VLConfig:
    """Build a Qwen3VLConfig from a config.json dict."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in (QWEN3_VL, QWEN3_VL_MOE):
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {QWEN3_VL}, {QWEN3_VL_MOE}")
    t = raw.get("text_config") or {}
    rope = _rope(t, 5_000_000.0)
    text = read(TextConfig, t, TEXT_KEYS, rope_theta=float(rope["rope_theta"]),
                mrope_section=tuple(int(x) for x in rope.get("mrope_section", (24, 20, 20))),
                tie_word_embeddings=bool(ChainMap(raw, t).get("tie_word_embeddings", False)))
    v = raw.get("vision_config") or {}
    vision = read(VisionConfig, v, {**VISION_KEYS, "out_hidden_size": Key(default=text.hidden_size)},
                  rope_theta=float(_rope(v, 10000.0)["rope_theta"]))
    return read(Qwen3VLConfig, raw, {"image_token_id": Key(default=151655), "video_token_id": Key(default=151656),
                                     "vision_start_token_id": Key(default=151652),
                                     "vision_end_token_id": Key(default=151653)},
                architecture=arch, text=text, vision=vision,
                eos_token_ids=token_ids(ChainMap(t, raw).get("eos_token_id")))
