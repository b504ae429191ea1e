"""Typed view of a Llama 3.2 Vision `config.json` (`MllamaConfig`).

Role: turn the checkpoint's `vision_config` (transformers' `MllamaVisionConfig`), its `text_config`
(`MllamaTextConfig`: a Llama 3 decoder whose `cross_attention_layers` cross-attend to the image, with
Llama 3's rope scaling) and the image token into frozen dataclasses, with transformers' names and
defaults: an absent section or field takes `MllamaVisionConfig` / `MllamaTextConfig` / `MllamaConfig`'s
default (Llama 3.2 11B Vision's sizes). A malformed config fails here with a `ModelLoadError`: sizes
that are not positive, heads that do not divide the width, intermediate layers outside the local
encoder, a `vision_output_dim` other than the width times (1 + intermediate layers) that the encoder
concatenates, aspect ratios that are not (rows, columns) grids of at most `max_num_tiles` tiles.

What it does not know: weights, tokenizers, pixels, devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import DecoderTextConfig, Key, read, rope_section, rope_type, token_ids

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


@dataclass(frozen=True, kw_only=True)
class MllamaTextConfig(DecoderTextConfig):
    """The Llama 3 decoder; the layers at `cross_attention_layers` cross-attend to the image instead of
    attending to the text (they hold no self-attention KV). `head_dim` is hidden / heads, as transformers
    computes it for both kinds of layer. `vocab_size` is the width of the logits: the embedding has 8
    rows more (`<|image|>` is the first of them)."""

    rope_theta: float
    rope_llama3: tuple[float, float, float, int] | None  # (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings) of Llama 3's rope scaling; None: plain RoPE
    cross_attention_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        outside = [i for i in self.cross_attention_layers if not 0 <= i < self.num_hidden_layers]
        if outside:
            raise ModelLoadError(f"cross_attention_layers {outside} are outside the {self.num_hidden_layers} layers")
        if len(set(self.cross_attention_layers)) == self.num_hidden_layers:
            raise ModelLoadError("every text layer is a cross-attention layer: no layer attends to the text")

    @property
    def num_embeddings(self) -> int:
        return self.vocab_size + 8

    @property
    def self_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.cross_attention_layers)


@dataclass(frozen=True)
class MllamaConfig:
    """The whole checkpoint: vision tower, projector, decoder, the image token and the eos ids."""

    vision: MllamaVisionConfig
    text_hidden_size: int  # text_config.hidden_size: the width of the projected cross-attention states
    image_token_index: int  # <|image|>
    text: MllamaTextConfig | None = None  # None only where the image encoder is read alone
    eos_token_ids: tuple[int, ...] = (128001,)

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


# MllamaTextConfig's defaults (Llama 3.2 11B Vision's decoder)
DEFAULT_CROSS_ATTENTION_LAYERS = (3, 8, 13, 18, 23, 28, 33, 38)
DEFAULT_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TEXT_KEYS = MappingProxyType({
    "vocab_size": _int_key("vocab_size"), "hidden_size": _int_key("hidden_size"),
    "intermediate_size": _int_key("intermediate_size"), "num_hidden_layers": _int_key("num_hidden_layers"),
    "num_attention_heads": _int_key("num_attention_heads"),
    "num_key_value_heads": Key(default=lambda f: f["num_attention_heads"], falsy_is_absent=True),
    "max_position_embeddings": _int_key("max_position_embeddings"),
    "cross_attention_layers": Key(convert=lambda value: _integers(value, "cross_attention_layers")),
})
TEXT_DEFAULTS = MappingProxyType({
    "vocab_size": 128256, "hidden_size": TEXT_HIDDEN_DEFAULT, "intermediate_size": 14336, "num_hidden_layers": 40,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": False, "cross_attention_layers": DEFAULT_CROSS_ATTENTION_LAYERS,
})


def _rope(section: dict[str, Any]) -> tuple[float, tuple[float, float, float, int] | None]:
    params = rope_section(section) or dict(DEFAULT_ROPE)
    kind = rope_type(params)
    theta = float(params.get("rope_theta", section.get("rope_theta", DEFAULT_ROPE["rope_theta"])))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ModelLoadError(f"unsupported text rope_type {kind!r}; supported: default, llama3")
    return theta, (float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                   int(params["original_max_position_embeddings"]))


def parse_text_config(t: dict[str, Any]) -> MllamaTextConfig:
    """Read a `text_config` section (absent fields: MllamaTextConfig's defaults)."""
    section = {**TEXT_DEFAULTS, **{k: v for k, v in t.items() if v is not None or k == "num_key_value_heads"}}
    theta, llama3 = _rope(t)
    heads = _integer(section["num_attention_heads"], "text_config num_attention_heads")
    if heads < 1 or section["hidden_size"] % heads:
        raise ModelLoadError(f"text_config hidden_size {section['hidden_size']} is not divisible by "
                             f"num_attention_heads {heads}")
    return read(MllamaTextConfig, section, TEXT_KEYS, rope_theta=theta, rope_llama3=llama3,
                head_dim=section["hidden_size"] // heads)


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
        text_section = _section(raw, "text_config")
        text = parse_text_config(text_section)
        eos = token_ids(text_section.get("eos_token_id", raw.get("eos_token_id", 128001)))
        return read(MllamaConfig, raw, TOP_KEYS, vision=vision, text_hidden_size=text.hidden_size, text=text,
                    eos_token_ids=eos)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad Llama 3.2 Vision config: {exc}") from exc
