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
from mmserve.models.config_reader import DecoderTextConfig, Key, read, rope_section, rope_type, token_ids

QWEN3_VL = "Qwen3VLForConditionalGeneration"


@dataclass(frozen=True, kw_only=True)
class TextConfig(DecoderTextConfig):
    """head_dim is explicit (Qwen3 heads need not divide hidden_size); M-RoPE's bands are interleaved."""

    rope_theta: float
    mrope_section: tuple[int, int, int]  # frequency bands driven by t, h, w (interleaved)
    attention_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        # the model's own bound (transformers' Qwen3VLTextRotaryEmbedding): three sections; the h and w
        # bands interleave at 1, 4, ... and 2, 5, ... up to 3 * section, clipped to head_dim / 2 bands,
        # and every other band follows t: no sum and no upper bound is required
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ModelLoadError(f"mrope_section {list(self.mrope_section)} must be three non-negative sections "
                                 "(t, h, w)")


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int  # width of the vision blocks
    intermediate_size: int
    num_heads: int
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int  # width after the mergers (= the language model's hidden size)
    num_position_embeddings: int  # a square grid of learned position embeddings
    deepstack_visual_indexes: tuple[int, ...]  # blocks whose output a deepstack merger taps
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ModelLoadError(f"vision hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ModelLoadError(f"num_position_embeddings {self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ModelLoadError(f"deepstack_visual_indexes {bad} are outside the {self.depth} vision blocks")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_input_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def num_grid_per_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)


@dataclass(frozen=True)
class Qwen3VLConfig:
    architecture: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]

    @property
    def num_deepstack(self) -> int:
        return len(self.vision.deepstack_visual_indexes)

    def __post_init__(self) -> None:
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ModelLoadError(f"vision out_hidden_size {self.vision.out_hidden_size} != text hidden_size "
                                 f"{self.text.hidden_size}")
        if self.num_deepstack > self.text.num_hidden_layers:
            raise ModelLoadError(f"{self.num_deepstack} deepstack streams but only {self.text.num_hidden_layers} "
                                 "decoder layers to add them to")


def _rope(section: dict[str, Any], default_theta: float) -> dict[str, Any]:
    params = rope_section(section)
    if rope_type(params) not in ("default", "axial", "mrope"):
        raise ModelLoadError(f"unsupported rope_type {rope_type(params)!r}")
    params.setdefault("rope_theta", section.get("rope_theta", default_theta))
    return params


TEXT_KEYS = MappingProxyType({**BASE_TEXT_KEYS, "max_position_embeddings": Key(default=128000)})
VISION_KEYS = MappingProxyType({
    "hidden_act": Key(default="gelu_pytorch_tanh"), "patch_size": Key(default=16), "temporal_patch_size": Key(default=2),
    "spatial_merge_size": Key(default=2), "in_channels": Key(default=3), "num_position_embeddings": Key(default=2304),
    "deepstack_visual_indexes": Key(default=(8, 16, 24)),
})


def parse_config(raw: dict[str, Any]) -> Qwen3VLConfig:
    """Build a Qwen3VLConfig from a config.json dict."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch != QWEN3_VL:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {QWEN3_VL}")
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
