"""Typed view of a Gemma 4 checkpoint's `vision_config` (transformers' `Gemma4VisionConfig`).

Role: turn the raw `vision_config` dict of config.json into a frozen dataclass the vision tower reads,
with transformers' defaults for absent keys. Rope is read as transformers standardizes it: the
parameters from `rope_parameters` (or the older `rope_scaling`), the base from their `rope_theta`, else
a top-level `rope_theta`, else 100; a type of "default" (or none) means the tower's axial rope, as
transformers forces it to; any other type fails. What the tower cannot run fails here with a
`ModelLoadError`: head counts that do not divide, a head width the axial rope cannot split in four,
an unknown activation, non-positive sizes.

What it does not know: weights, pixels, the image processor's settings (patch size and pooling there
are the processor's own copy), the text model, devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import Key, read, rope_section, rope_type
from mmserve.models.layers.activations import get_activation

DEFAULT_ROPE_THETA = 100.0  # transformers' Gemma4VisionConfig.default_theta
# "default" is what older configs wrote; transformers rewrites it to the tower's axial rope
AXIAL_ROPE_TYPES = ("axial", "default")


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """The fields the tower reads; the defaults are transformers' class defaults."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64  # not hidden_size / heads: transformers' default is a fixed 64
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA  # base of the axial 2-D rope (x and y share its frequencies)
    pooling_kernel_size: int = 3  # patches per side averaged into one soft token
    patch_size: int = 16  # pixels per patch side
    position_embedding_size: int = 10 * 1024  # rows of the learned x and y position tables
    use_clipped_linears: bool = False  # each linear clamps its input and output to bounds in the checkpoint
    standardize: bool = False  # soft tokens get (x - std_bias) * std_scale after pooling

    def __post_init__(self) -> None:
        positive = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                    "num_hidden_layers": self.num_hidden_layers,
                    "num_attention_heads": self.num_attention_heads,
                    "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                    "pooling_kernel_size": self.pooling_kernel_size, "patch_size": self.patch_size,
                    "position_embedding_size": self.position_embedding_size}
        bad = {name: value for name, value in positive.items() if value < 1}
        if bad:
            raise ModelLoadError(f"vision_config values must be positive, got {bad}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"vision num_attention_heads {self.num_attention_heads} is not a multiple "
                                 f"of num_key_value_heads {self.num_key_value_heads}")
        # the axial rope rotates two halves (x, y), each by rotate-half over quarters of the head
        if self.head_dim % 4:
            raise ModelLoadError(f"vision head_dim {self.head_dim} is not a multiple of 4 (the axial rope's "
                                 f"split)")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ModelLoadError(f"vision rms_norm_eps {self.rms_norm_eps} and rope_theta {self.rope_theta} "
                                 f"must be positive")
        get_activation(self.hidden_activation)  # raises ModelLoadError for an unknown name

    @property
    def patch_dim(self) -> int:
        """Values per patch: patch_size^2 pixels, RGB."""
        return 3 * self.patch_size * self.patch_size

    @property
    def patches_per_soft_token(self) -> int:
        return self.pooling_kernel_size * self.pooling_kernel_size


KEYS = MappingProxyType({
    "hidden_activation": Key(names=("hidden_activation", "hidden_act")),
})


def _rope_theta(raw: dict[str, Any]) -> float:
    params = rope_section(raw)
    kind = rope_type(params)
    if kind not in AXIAL_ROPE_TYPES:
        raise ModelLoadError(f"unsupported vision rope_type {kind!r}: the Gemma 4 tower has an axial rope "
                             f"only")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    return DEFAULT_ROPE_THETA if theta is None else float(theta)


def parse_vision_config(raw: dict[str, Any]) -> Gemma4VisionConfig:
    """A Gemma4VisionConfig from config.json's `vision_config` dict."""
    try:
        return read(Gemma4VisionConfig, raw, KEYS, rope_theta=_rope_theta(raw))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad Gemma 4 vision_config: {exc}") from exc
