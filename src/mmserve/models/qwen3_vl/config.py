"""Typed view of a Qwen3-VL `config.json` (transformers 5's nested `text_config` / `vision_config`).

Role: turn the checkpoint's JSON into frozen dataclasses the model code reads, with the checks
that would otherwise fail deep inside a forward (head sizes, the interleaved M-RoPE sections,
deepstack layers that the decoder must have). What it does not know: weights, tokenizers, devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_fields import token_ids

QWEN3_VL = "Qwen3VLForConditionalGeneration"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # explicit: Qwen3 heads need not divide hidden_size
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]  # frequency bands driven by t, h, w (interleaved)
    tie_word_embeddings: bool
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 128000

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_key_value_heads}")
        if len(self.mrope_section) != 3 or sum(self.mrope_section) * 2 != self.head_dim:
            raise ModelLoadError(f"mrope_section {list(self.mrope_section)} must be three sections summing to "
                                 f"head_dim/2 = {self.head_dim // 2}")
        t, h, w = self.mrope_section
        if 3 * max(h, w) > self.head_dim // 2:  # h bands sit at 1, 4, ..., w bands at 2, 5, ...
            raise ModelLoadError(f"mrope_section {list(self.mrope_section)}: interleaved h/w bands run past "
                                 f"head_dim/2 = {self.head_dim // 2}")


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
    params = dict(section.get("rope_parameters") or section.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "axial", "mrope"):
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}")
    params.setdefault("rope_theta", section.get("rope_theta", default_theta))
    return params



def _parse_text(raw: dict[str, Any], t: dict[str, Any]) -> TextConfig:
    rope = _rope(t, 5_000_000.0)
    heads = int(t["num_attention_heads"])
    return TextConfig(
        vocab_size=int(t["vocab_size"]),
        hidden_size=int(t["hidden_size"]),
        intermediate_size=int(t["intermediate_size"]),
        num_hidden_layers=int(t["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(t.get("num_key_value_heads") or heads),
        head_dim=int(t.get("head_dim") or int(t["hidden_size"]) // heads),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]),
        mrope_section=tuple(int(x) for x in rope.get("mrope_section", (24, 20, 20))),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
        attention_bias=bool(t.get("attention_bias", False)),
        hidden_act=str(t.get("hidden_act", "silu")),
        max_position_embeddings=int(t.get("max_position_embeddings", 128000)),
    )


def _parse_vision(v: dict[str, Any], text_hidden: int) -> VisionConfig:
    return VisionConfig(
        depth=int(v["depth"]),
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        patch_size=int(v.get("patch_size", 16)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", 3)),
        out_hidden_size=int(v.get("out_hidden_size", text_hidden)),
        num_position_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))),
        rope_theta=float(_rope(v, 10000.0)["rope_theta"]),
    )


def parse_config(raw: dict[str, Any]) -> Qwen3VLConfig:
    """Build a Qwen3VLConfig from a config.json dict."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch != QWEN3_VL:
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {QWEN3_VL}")
    t = raw.get("text_config") or {}
    try:
        text = _parse_text(raw, t)
        return Qwen3VLConfig(
            architecture=arch,
            text=text,
            vision=_parse_vision(raw.get("vision_config") or {}, text.hidden_size),
            image_token_id=int(raw.get("image_token_id", 151655)),
            video_token_id=int(raw.get("video_token_id", 151656)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
            eos_token_ids=token_ids(t.get("eos_token_id", raw.get("eos_token_id"))),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from exc
