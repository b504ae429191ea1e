"""Typed view of the parts of a Llama 3.2 Vision `config.json` (`MllamaConfig`) its image encoder reads.

Role: turn the checkpoint's `vision_config` (transformers' `MllamaVisionConfig`), the text hidden size
the projector maps onto and the image token into frozen dataclasses, with transformers' names and
defaults: an absent section or field takes `MllamaVisionConfig` / `MllamaTextConfig` / `MllamaConfig`'s
default (Llama 3.2 11B Vision's sizes). A malformed config fails here with a `ModelLoadError`: sizes
that are not positive, heads that do not divide the width, intermediate layers outside the local
encoder, a `vision_output_dim` other than the width times (1 + intermediate layers) that the encoder
concatenates, aspect ratios that are not (rows, columns) grids of at most `max_num_tiles` tiles.

What it does not know: the language model beyond its width, weights, tokenizers, pixels, devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import Key, read

MLLAMA = "MllamaForConditionalGeneration"
VISION_MODEL_TYPE = "mllama_vision_model"
PATCH_MULTIPLE = 8  # the encoder pads each tile's token sequence to a multiple of this (transformers' constant)
# MllamaVisionConfig's defaults for a missing list field
DEFAULT_INTERMEDIATE_LAYERS = (3, 7, 15, 23, 30)
DEFAULT_ASPECT_RATIOS = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))


@dataclass(frozen=True)
class MllamaVisionConfig:
    """The tile encoder: a local transformer over each image's tiles, then a gated global one."""

    hidden_size: int = 1280
    hidden_act: str = "gelu"
    num_hidden_layers: int = 32  # the local transformer
    num_global_layers: int = 8  # the gated global transformer after it
    attention_heads: int = 16
    num_channels: int = 3
    intermediate_size: int = 5120
    vision_output_dim: int = 7680  # hidden_size * (1 + len(intermediate_layers_indices))
    image_size: int = 448  # side of one square tile in pixels
    patch_size: int = 14
    norm_eps: float = 1e-5  # the encoder layers' LayerNorms (layernorm_pre/post keep torch's 1e-5)
    max_num_tiles: int = 4
    intermediate_layers_indices: tuple[int, ...] = DEFAULT_INTERMEDIATE_LAYERS  # local layers, 0-based
    supported_aspect_ratios: tuple[tuple[int, int], ...] = DEFAULT_ASPECT_RATIOS  # (rows, columns) per id - 1

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in (
            "hidden_size", "num_hidden_layers", "attention_heads", "num_channels", "intermediate_size",
            "vision_output_dim", "image_size", "patch_size", "max_num_tiles")}
        bad = {name: value for name, value in sizes.items() if value < 1}
        if self.num_global_layers < 0:
            bad["num_global_layers"] = self.num_global_layers
        if bad:
            raise ModelLoadError(f"vision_config sizes must be positive (num_global_layers at least 0), got {bad}")
        if self.hidden_size % self.attention_heads:
            raise ModelLoadError(f"vision hidden_size {self.hidden_size} is not divisible by "
                                 f"attention_heads {self.attention_heads}")
        if self.patch_size > self.image_size:
            raise ModelLoadError(f"vision patch_size {self.patch_size} is larger than image_size {self.image_size}")
        if not self.norm_eps > 0:
            raise ModelLoadError(f"vision norm_eps must be positive, got {self.norm_eps}")
        depth = self.num_hidden_layers
        if not self.intermediate_layers_indices:
            raise ModelLoadError("vision intermediate_layers_indices is empty")
        outside = [i for i in self.intermediate_layers_indices if not -depth <= i < depth]
        if outside:
            raise ModelLoadError(f"vision intermediate_layers_indices {outside} are outside the {depth} local layers")
        expected = self.hidden_size * (1 + len(self.intermediate_layers_indices))
        if self.vision_output_dim != expected:
            raise ModelLoadError(f"vision_output_dim {self.vision_output_dim} is not hidden_size {self.hidden_size} "
                                 f"x (1 + {len(self.intermediate_layers_indices)} intermediate layers) = {expected}")
        if not self.supported_aspect_ratios:
            raise ModelLoadError("vision supported_aspect_ratios is empty")
        if self.supported_aspect_ratios == DEFAULT_ASPECT_RATIOS and self.max_num_tiles != 4:
            # transformers' own check: the default grids are the 4-tile ones
            raise ModelLoadError("max_num_tiles must be 4 for the default supported_aspect_ratios")
        grids = [g for g in self.supported_aspect_ratios
                 if len(g) != 2 or min(g) < 1 or g[0] * g[1] > self.max_num_tiles]
        if grids:
            raise ModelLoadError(f"vision supported_aspect_ratios {grids} are not (rows, columns) grids of at most "
                                 f"max_num_tiles {self.max_num_tiles} tiles")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.attention_heads

    @property
    def max_aspect_ratio_id(self) -> int:
        """The largest aspect-ratio id (ids are 1-based; 0 is a padding image)."""
        return len(self.supported_aspect_ratios)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size  # the conv drops a remainder, as transformers' does

    @property
    def num_patches(self) -> int:
        """Tokens of one tile: its patches and the class token (transformers' `num_patches`)."""
        return self.patches_per_side ** 2 + 1

    @property
    def padded_patches(self) -> int:
        """Tokens of one tile inside the encoder: `num_patches` padded up to a multiple of 8."""
        return -(-self.num_patches // PATCH_MULTIPLE) * PATCH_MULTIPLE


@dataclass(frozen=True)
class MllamaConfig:
    """What the image encoder and its projector need of the whole checkpoint."""

    vision: MllamaVisionConfig
    text_hidden_size: int  # text_config.hidden_size: the width of the projected cross-attention states
    image_token_index: int  # <|image|>

    def __post_init__(self) -> None:
        if self.text_hidden_size < 1:
            raise ModelLoadError(f"text_config hidden_size must be positive, got {self.text_hidden_size}")


def _square(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ModelLoadError(f"vision {name} {value!r} is not square")
        value = value[0]
    return _integer(value, name)


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{name} {value!r} is not an integer")
    return value


def _integers(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ModelLoadError(f"vision {name} {value!r} is not a list of integers")
    return tuple(_integer(v, name) for v in value)


def _grids(value: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, (list, tuple)):
        raise ModelLoadError(f"vision supported_aspect_ratios {value!r} is not a list of [rows, columns]")
    grids = tuple(_integers(g, "supported_aspect_ratios") for g in value)
    return tuple((g[0], g[1]) if len(g) == 2 else g for g in grids)  # a bad length fails in __post_init__


def _int_key(name: str, names: tuple[str, ...] = ()) -> Key:
    """An integer field (a bool or a float is malformed); absent: the dataclass's default."""
    return Key(names=names, convert=lambda value: _integer(value, name))


# MllamaVisionConfig's defaults; `num_attention_heads` is its attribute_map alias of attention_heads;
# the image and patch sizes may be given as a square (h, w)
VISION_KEYS = MappingProxyType({
    **{name: _int_key(name) for name in (
        "hidden_size", "num_hidden_layers", "num_global_layers", "num_channels", "intermediate_size",
        "vision_output_dim", "max_num_tiles")},
    "attention_heads": _int_key("attention_heads", ("attention_heads", "num_attention_heads")),
    "image_size": Key(convert=lambda value: _square(value, "image_size")),
    "patch_size": Key(convert=lambda value: _square(value, "patch_size")),
    "intermediate_layers_indices": Key(convert=lambda value: _integers(value, "intermediate_layers_indices")),
    "supported_aspect_ratios": Key(convert=_grids),
})
# MllamaTextConfig's hidden_size; MllamaConfig's image token (`image_token_id` is its alias)
TEXT_HIDDEN_DEFAULT = 4096
TOP_KEYS = MappingProxyType({
    "image_token_index": Key(names=("image_token_index", "image_token_id"), default=128256,
                             convert=lambda value: _integer(value, "image_token_index")),
})


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    section = raw.get(name)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ModelLoadError(f"{name} is not a JSON object, got {type(section).__name__}")
    return section


def parse_vision_config(v: dict[str, Any]) -> MllamaVisionConfig:
    """Read a `vision_config` section."""
    model_type = v.get("model_type", VISION_MODEL_TYPE)
    if model_type != VISION_MODEL_TYPE:
        raise ModelLoadError(f"vision_config model_type {model_type!r} is not {VISION_MODEL_TYPE!r}")
    return read(MllamaVisionConfig, v, VISION_KEYS)


def parse_config(raw: dict[str, Any]) -> MllamaConfig:
    """Build an MllamaConfig from a config.json dict."""
    try:
        if not isinstance(raw, dict):
            raise ModelLoadError(f"config.json is not a JSON object, got {type(raw).__name__}")
        vision = parse_vision_config(_section(raw, "vision_config"))
        text_hidden = _integer(_section(raw, "text_config").get("hidden_size", TEXT_HIDDEN_DEFAULT),
                               "text_config hidden_size")
        return read(MllamaConfig, raw, TOP_KEYS, vision=vision, text_hidden_size=text_hidden)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad Llama 3.2 Vision config: {exc}") from exc
