"""Typed view of a Gemma 4 `audio_config` (transformers' `Gemma4AudioConfig`): the conformer audio tower.

Role: turn the raw `audio_config` dict of a hub `config.json` into a frozen dataclass that the audio
tower (`audio_tower.py`) reads, with transformers' defaults for absent keys (Gemma 4 E2B / E4B's
tower). Values transformers would accept but the tower cannot run (an odd hidden size, heads that do
not divide it, non-positive sizes, an unknown activation) raise `ModelLoadError` here, at load time.

What it does not know: weights, mel features (their bin count is the feature extractor's; the tower's
input projection assumes 128 bins, see `projection_input_dims`), the processor's soft-token cap
(`audio_seq_length`, a processor setting), the text model, devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import Key, read
from mmserve.models.layers.activations import get_activation


@dataclass(frozen=True)
class Gemma4AudioConfig:
    """transformers' `Gemma4AudioConfig` fields; the defaults are its own."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)  # output channels of the two stride-2 convs
    conv_kernel_size: int = 5  # the conformer's depthwise causal conv, in frames
    residual_weight: float = 0.5  # the feed-forward blocks' output scale before their residual add
    attention_chunk_size: int = 12  # query frames per attention block
    attention_context_left: int = 13  # transformers admits context_left - 1 keys at or before a query
    attention_context_right: int = 0  # keys after a query (transformers admits context_right - 1)
    attention_logit_cap: float = 50.0  # logits become cap * tanh(logit / cap)
    attention_invalid_logits_value: float = -1.0e9  # what masked logits are set to (not -inf)
    use_clipped_linears: bool = True  # linears clamp input and output to bounds stored in the checkpoint
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10  # activations are clamped to +-this (at most the dtype's max)
    output_proj_dims: int = 1536  # the tower's output width, the projector's input

    def __post_init__(self) -> None:
        positive = {
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "conv_kernel_size": self.conv_kernel_size,
            "attention_chunk_size": self.attention_chunk_size,
            "attention_context_left": self.attention_context_left, "output_proj_dims": self.output_proj_dims,
        }
        for name, value in positive.items():
            if value < 1:
                raise ModelLoadError(f"audio_config.{name} must be positive, got {value}")
        if self.hidden_size % self.num_attention_heads:
            raise ModelLoadError(f"audio_config.hidden_size {self.hidden_size} is not divisible by "
                                 f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_size % 2:
            # the relative position table is [sin, cos] of hidden_size // 2 timescales each
            raise ModelLoadError(f"audio_config.hidden_size must be even, got {self.hidden_size}")
        if len(self.subsampling_conv_channels) != 2 or min(self.subsampling_conv_channels) < 1:
            raise ModelLoadError(f"audio_config.subsampling_conv_channels must be two positive channel "
                                 f"counts, got {list(self.subsampling_conv_channels)}")
        if self.subsampling_conv_channels[0] < 4:
            raise ModelLoadError("audio_config.subsampling_conv_channels[0] must be at least 4 (the input "
                                 "projection is (channels[0] // 4) * channels[1] wide)")
        if self.attention_context_right < 0:
            raise ModelLoadError(f"audio_config.attention_context_right must be >= 0, got "
                                 f"{self.attention_context_right}")
        for name, value in (("attention_logit_cap", self.attention_logit_cap),
                            ("rms_norm_eps", self.rms_norm_eps),
                            ("gradient_clipping", self.gradient_clipping)):
            if not value > 0.0:
                raise ModelLoadError(f"audio_config.{name} must be positive, got {value}")
        get_activation(self.hidden_act)  # raises ModelLoadError naming the supported ones

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def projection_input_dims(self) -> int:
        """Width of the subsampler's input projection, as transformers sizes it: (channels[0] // 4) *
        channels[1]. The flattened conv output is (mel bins subsampled twice) * channels[1] wide, so the
        two agree only when channels[0] // 4 equals the twice-halved bin count (32 for 128 bins with
        the default 128 channels); `accepts_mel_bins` says whether they do."""
        first, second = self.subsampling_conv_channels
        return (first // 4) * second

    def accepts_mel_bins(self, mel_bins: int) -> bool:
        """Whether features of `mel_bins` bins flatten to the input projection's width."""
        return subsampled_length(subsampled_length(mel_bins)) * self.subsampling_conv_channels[1] \
            == self.projection_input_dims


def subsampled_length(length: int) -> int:
    """Output length of one of the subsampler's convs (kernel 3, stride 2, padding 1) along an axis:
    ceil(length / 2), the length of `mask[::2]`."""
    return (length + 2 * 1 - 3) // 2 + 1 if length > 0 else 0


def _strict_int(value: Any) -> int:
    """An int field: an int, or a float with an integral value (JSON writers may emit 12.0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def _strict_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def _channels(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"subsampling_conv_channels must be a list, got {value!r}")
    return tuple(_strict_int(v) for v in value)


_INT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "conv_kernel_size",
               "attention_chunk_size", "attention_context_left", "attention_context_right",
               "output_proj_dims")
AUDIO_KEYS: Mapping[str, Key] = MappingProxyType({
    **{name: Key(convert=_strict_int) for name in _INT_FIELDS},
    "subsampling_conv_channels": Key(convert=_channels),
    "use_clipped_linears": Key(convert=_strict_bool),
})


def parse_audio_config(raw: Mapping[str, Any]) -> Gemma4AudioConfig:
    """The audio tower's config from the raw `audio_config` dict of a Gemma 4 `config.json`. Absent (or
    null) keys take transformers' defaults; unknown keys (`model_type`, `dtype`, ...) are ignored."""
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"audio_config must be an object, got {type(raw).__name__}")
    try:
        return read(Gemma4AudioConfig, raw, AUDIO_KEYS)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad Gemma 4 audio_config: {exc}") from exc
