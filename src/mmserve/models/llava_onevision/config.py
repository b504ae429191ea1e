"""Typed view of a LLaVA-OneVision `config.json`.

Role: turn the checkpoint's JSON (`text_config` for the Qwen2 decoder, `vision_config` for the SigLIP
tower, the anyres grid pinpoints, the feature layer and select strategy, the aspect-ratio rule and the
placeholder ids) into frozen dataclasses the model and the processor read. Unsupported settings fail
here with a `ModelLoadError`. What it does not know: weights, tokenizers, pixels, devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_fields import token_ids

LLAVA_ONEVISION = "LlavaOnevisionForConditionalGeneration"


@dataclass(frozen=True)
class TextConfig:
    """The Qwen2 decoder; field names match what `qwen2_vl.language`'s decoder layer reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_key_value_heads}")


@dataclass(frozen=True)
class VisionConfig:
    """The SigLIP vision tower."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int  # edge of one square tile in pixels
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patch_input_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size


@dataclass(frozen=True)
class LlavaOnevisionConfig:
    text: TextConfig
    vision: VisionConfig
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



def _parse_text(raw: dict[str, Any], top: dict[str, Any]) -> TextConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise ModelLoadError(f"unsupported rope type {params.get('rope_type')!r}; only default RoPE is supported")
    if raw.get("use_sliding_window"):
        raise ModelLoadError("Qwen2 sliding-window attention is not supported")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    return TextConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(top.get("tie_word_embeddings") or raw.get("tie_word_embeddings", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
    )


def _parse_vision(raw: dict[str, Any]) -> VisionConfig:
    vision = VisionConfig(
        hidden_size=int(raw.get("hidden_size", 1152)),
        intermediate_size=int(raw.get("intermediate_size", 4304)),
        num_hidden_layers=int(raw.get("num_hidden_layers", 26)),
        num_attention_heads=int(raw.get("num_attention_heads", 16)),
        image_size=int(raw.get("image_size", 384)),
        patch_size=int(raw.get("patch_size", 14)),
        num_channels=int(raw.get("num_channels", 3)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-6)),
        hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
    )
    if vision.hidden_size % vision.num_attention_heads:
        raise ModelLoadError("vision hidden_size is not divisible by num_attention_heads")
    return vision


def parse_config(raw: dict[str, Any]) -> LlavaOnevisionConfig:
    """Build a LlavaOnevisionConfig from a config.json dict."""
    try:
        text = _parse_text(dict(raw["text_config"]), raw)
        vision = _parse_vision(dict(raw.get("vision_config") or {}))
        layer = raw.get("vision_feature_layer", -1)
        layers = tuple(int(i) for i in layer) if isinstance(layer, list) else (int(layer),)
        strategy = raw.get("vision_feature_select_strategy", "full")
        if strategy != "full":  # SigLIP has no CLS token; "default" would drop a real patch
            raise ModelLoadError(f"unsupported vision_feature_select_strategy {strategy!r}; SigLIP needs 'full'")
        depth = vision.num_hidden_layers
        if any(not -depth - 1 <= i <= depth for i in layers) or all(i % (depth + 1) == 0 for i in layers):
            raise ModelLoadError(f"vision_feature_layer {layer!r} is out of range (or selects only the embeddings)")
        pinpoints = tuple((int(h), int(w)) for h, w in raw.get("image_grid_pinpoints") or ())
        if not pinpoints:
            raise ModelLoadError("config.json has no image_grid_pinpoints")
        if any(h % vision.image_size or w % vision.image_size for h, w in pinpoints):
            raise ModelLoadError(f"image_grid_pinpoints must be multiples of the tile size {vision.image_size}")
        config = LlavaOnevisionConfig(
            text=text,
            vision=vision,
            image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 151646))),
            video_token_id=int(raw.get("video_token_index", raw.get("video_token_id", 151647))),
            image_grid_pinpoints=pinpoints,
            vision_feature_layers=layers,
            vision_aspect_ratio=str(raw.get("vision_aspect_ratio", "anyres_max_9")),
            projector_hidden_act=str(raw.get("projector_hidden_act", "gelu")),
            multimodal_projector_bias=bool(raw.get("multimodal_projector_bias", True)),
            eos_token_ids=token_ids(raw["text_config"].get("eos_token_id", raw.get("eos_token_id"))),
        )
        if config.max_num_tiles < 1:  # int() raises ValueError on a string that is not anyres_max_N
            raise ModelLoadError(f"unsupported vision_aspect_ratio {config.vision_aspect_ratio!r}")
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from exc
    except ValueError as exc:
        raise ModelLoadError(f"bad LLaVA-OneVision config: {exc}") from exc
    return config
