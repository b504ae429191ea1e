"""Typed view of a Qwen2-VL / Qwen2.5-VL `config.json`.

Role: turn the checkpoint's JSON (the hub's flat layout or transformers 5's nested `text_config`)
into frozen dataclasses the model code reads. What it does not know: weights, tokenizers, devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_fields import token_ids

QWEN2_VL = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelLoadError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
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


def _rope_params(section: dict[str, Any]) -> tuple[float, tuple[int, ...] | None]:
    params = section.get("rope_parameters") or section.get("rope_scaling") or {}
    theta = params.get("rope_theta", section.get("rope_theta", 10000.0))
    mrope = params.get("mrope_section")
    return float(theta), (tuple(int(x) for x in mrope) if mrope else None)



def parse_config(raw: dict[str, Any]) -> Qwen2VLConfig:
    """Build a Qwen2VLConfig from a config.json dict (flat hub layout or nested text_config)."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in (QWEN2_VL, QWEN2_5_VL):
        raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {QWEN2_VL}, {QWEN2_5_VL}")
    text_raw = dict(raw)
    text_raw.update(raw.get("text_config") or {})
    try:
        theta, mrope = _rope_params(text_raw)
        tie = bool(raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False)))
        text = TextConfig(
            vocab_size=int(text_raw["vocab_size"]),
            hidden_size=int(text_raw["hidden_size"]),
            intermediate_size=int(text_raw["intermediate_size"]),
            num_hidden_layers=int(text_raw["num_hidden_layers"]),
            num_attention_heads=int(text_raw["num_attention_heads"]),
            num_key_value_heads=int(text_raw.get("num_key_value_heads", text_raw["num_attention_heads"])),
            rms_norm_eps=float(text_raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            mrope_section=mrope or (16, 24, 24),
            tie_word_embeddings=tie,
            hidden_act=str(text_raw.get("hidden_act", "silu")),
            max_position_embeddings=int(text_raw.get("max_position_embeddings", 32768)),
        )
        vision = _parse_vision(raw["vision_config"], arch, text.hidden_size)
        return Qwen2VLConfig(
            architecture=arch,
            text=text,
            vision=vision,
            image_token_id=int(raw.get("image_token_id", text_raw.get("image_token_id", 151655))),
            video_token_id=int(raw.get("video_token_id", text_raw.get("video_token_id", 151656))),
            vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
            eos_token_ids=token_ids(text_raw.get("eos_token_id")),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from exc


def _parse_vision(v: dict[str, Any], arch: str, text_hidden: int) -> VisionConfig:
    theta, _ = _rope_params(v)
    common = dict(
        depth=int(v["depth"]),
        num_heads=int(v["num_heads"]),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        rope_theta=theta,
    )
    if arch == QWEN2_5_VL:
        return VisionConfig(
            embed_dim=int(v["hidden_size"]),
            out_hidden_size=int(v.get("out_hidden_size", text_hidden)),
            mlp_hidden_size=int(v["intermediate_size"]),
            hidden_act=str(v.get("hidden_act", "silu")),
            window_size=int(v.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
            tokens_per_second=float(v.get("tokens_per_second", 2)),
            is_qwen2_5=True,
            **common,
        )
    embed_dim = int(v["embed_dim"])
    return VisionConfig(
        embed_dim=embed_dim,
        out_hidden_size=int(v.get("hidden_size", text_hidden)),
        mlp_hidden_size=int(embed_dim * float(v.get("mlp_ratio", 4))),
        hidden_act=str(v.get("hidden_act", "quick_gelu")),
        **common,
    )
