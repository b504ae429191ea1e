"""Typed view of a Gemma 4 `config.json` (`Gemma4Config`: a `gemma4_text` decoder, a vision tower and,
on the on-device models, an audio tower).

Role: turn the checkpoint's JSON into frozen dataclasses the model, the processor and the KV layout
read, with transformers' defaults for absent fields. The decoder's per-layer facts are resolved here
once: each layer's type (sliding or full), head size and kv heads (`head_dim` on sliding layers,
`global_head_dim` on full ones; `num_global_key_value_heads` only with `attention_k_eq_v`, as
transformers reads it; or both from `per_layer_config`, the per-layer overrides transformers 5 writes), and which layer's cache it reads (`kv_source`: itself, or — for the last
`num_kv_shared_layers` layers — the last earlier layer of its type, which transformers calls the
"store" layer). Hub quirks read here: `global_head_dim` with `num_global_key_value_heads: null`, both
`eoa_token_index` and `eoa_token_id`, a list of eos ids. What mmserve does not implement fails here
with a `ModelLoadError`: bidirectional text attention ("all"), rope types other than default and
proportional.

What it does not know: weights, tokenizers, pixels, audio samples, devices.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmserve.errors import ModelLoadError
from mmserve.models.config_reader import DecoderTextConfig, Key, check_layer_types, read, rope_type, token_ids

GEMMA4 = "Gemma4ForConditionalGeneration"
SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TYPES = ("default", "proportional")
# transformers' Gemma4TextConfig defaults: rope per layer type
DEFAULT_ROPE = MappingProxyType({
    SLIDING: MappingProxyType({"rope_type": "default", "rope_theta": 10_000.0}),
    FULL: MappingProxyType({"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}),
})


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # "default", or "proportional": only the first `partial_rotary_factor` of the angles turn
    theta: float
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class LayerKV:
    """One decoder layer's attention shape and where its keys and values live."""

    layer_type: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    kv_source: int  # the layer whose cache it reads: itself, or the store layer it shares with


@dataclass(frozen=True, kw_only=True)
class TextConfig(DecoderTextConfig):
    """`head_dim` / `num_key_value_heads` are the sliding layers'; `layers` has every layer's own."""

    global_head_dim: int
    global_kv_heads: int | None = None  # full layers' kv heads; None: num_key_value_heads
    sliding_window: int
    layer_types: tuple[str, ...]
    sliding_rope: RopeConfig
    full_rope: RopeConfig
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    attention_k_eq_v: bool = False  # full layers have no v projection: the keys (before k_norm) are the values
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False  # KV-shared layers' MLP is twice as wide
    hidden_size_per_layer_input: int = 0  # per-layer embeddings (PLE) width; 0: none
    vocab_size_per_layer_input: int = 0
    enable_moe_block: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    bidirectional_vision: bool = False  # sliding layers see an image's or a video's tokens both ways
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_layer_types(self.layer_types, self.num_hidden_layers, (SLIDING, FULL))
        if self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be positive, got {self.sliding_window}")
        if not 0 <= self.num_kv_shared_layers <= self.num_hidden_layers:
            raise ModelLoadError(f"num_kv_shared_layers {self.num_kv_shared_layers} must be in [0, "
                                 f"num_hidden_layers {self.num_hidden_layers}]")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ModelLoadError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        if not self.reads_another_models_cache:
            self.layers  # noqa: B018 -- resolves the sharing, which raises on a layout without a store layer

    @property
    def reads_another_models_cache(self) -> bool:
        """Every layer shares KV: the assistant drafter's decoder, which reads its target's caches."""
        return self.num_kv_shared_layers == self.num_hidden_layers

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def layers(self) -> tuple[LayerKV, ...]:
        """Each layer's attention shape and cache source (transformers' `kv_sharing_modes`)."""
        first = self.first_shared_layer
        store = {}
        for i in range(first):
            store[self.layer_types[i]] = i  # the last unshared layer of each type
        out = []
        for i, kind in enumerate(self.layer_types):
            if i >= first and kind not in store:
                raise ModelLoadError(f"layer {i} ({kind}) shares KV but no earlier layer of its type keeps any")
            full = kind == FULL
            kv_heads = self.global_kv_heads if full and self.global_kv_heads else self.num_key_value_heads
            out.append(LayerKV(kind, self.global_head_dim if full else self.head_dim, kv_heads,
                               store[kind] if i >= first else i))
        return tuple(out)

    def window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None

    def is_kv_shared(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_shared_layer


@dataclass(frozen=True)
class Gemma4Config:
    text: TextConfig
    vision: dict[str, Any] | None  # the raw `vision_config` (None: a text-only checkpoint)
    audio: dict[str, Any] | None  # the raw `audio_config` (None: no audio tower)
    image_token_id: int  # one per image row
    video_token_id: int  # one per video row
    audio_token_id: int  # one per audio row
    boi_token_id: int  # opens an image or a video frame
    eoi_token_id: int
    boa_token_id: int  # opens an audio clip
    eoa_token_id: int
    eos_token_ids: tuple[int, ...]

    @property
    def media_token_ids(self) -> tuple[int, int, int]:
        return (self.image_token_id, self.video_token_id, self.audio_token_id)


def _rope(params: dict[str, Any], layer_type: str) -> RopeConfig:
    merged = {**DEFAULT_ROPE[layer_type], **params} if params else dict(DEFAULT_ROPE[layer_type])
    kind = rope_type(merged)
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope_type {kind!r} for {layer_type} layers; supported: {ROPE_TYPES}")
    if float(merged.get("factor", 1.0)) != 1.0:
        raise ModelLoadError(f"rope factor {merged['factor']} on {layer_type} layers is not supported")
    factor = float(merged.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    return RopeConfig(kind, float(merged.get("rope_theta", DEFAULT_ROPE[layer_type]["rope_theta"])), factor)


def _layer_types(t: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = [str(x) for x in t["layer_types"]] if t.get("layer_types") else [
        SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    if types:
        types[-1] = FULL  # transformers forces the last layer to full attention
    return tuple(types)


# transformers' Gemma4TextConfig defaults
TEXT_KEYS = MappingProxyType({
    "vocab_size": Key(default=262_144), "hidden_size": Key(default=2304), "intermediate_size": Key(default=9216),
    "num_hidden_layers": Key(default=30), "num_attention_heads": Key(default=8),
    "num_key_value_heads": Key(default=4, falsy_is_absent=True), "head_dim": Key(default=256, falsy_is_absent=True),
    "hidden_act": Key(names=("hidden_activation", "hidden_act"), default="gelu_pytorch_tanh", falsy_is_absent=True),
    "sliding_window": Key(default=512), "max_position_embeddings": Key(default=131_072),
    "hidden_size_per_layer_input": Key(default=256, null=0),
    "vocab_size_per_layer_input": Key(default=262_144, null=0),
    "pad_token_id": Key(default=0, null=0),
})
TOP_KEYS = MappingProxyType({
    "image_token_id": Key(default=258_880), "video_token_id": Key(default=258_884),
    "audio_token_id": Key(default=258_881), "boi_token_id": Key(default=255_999),
    "eoi_token_id": Key(default=258_882), "boa_token_id": Key(default=256_000),
    "eoa_token_id": Key(names=("eoa_token_id", "eoa_token_index"), default=258_883),
})


def _global_shape(t: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, Any]:
    """(global_head_dim, global_kv_heads) from the hub's keys, or from transformers 5's `per_layer_config`
    (overrides of the full layers, keyed by layer index), which must be the same on every full layer."""
    overrides = t.get("per_layer_config")
    if not overrides:
        k_eq_v = bool(t.get("attention_k_eq_v", False))
        return {"global_head_dim": t.get("global_head_dim") or 512,
                "global_kv_heads": t.get("num_global_key_value_heads") if k_eq_v else None}
    per_layer = {int(k): dict(v) for k, v in overrides.items()}
    bad = sorted(i for i, v in per_layer.items() if layer_types[i] != FULL or set(v) - {"head_dim", "num_key_value_heads"})
    full = [per_layer.get(i, {}) for i, kind in enumerate(layer_types) if kind == FULL]
    if bad or any(f != full[0] for f in full):
        raise ModelLoadError(f"per_layer_config overrides other than one head_dim / num_key_value_heads for every "
                             f"full-attention layer are not supported (layers {bad or 'differ'})")
    return {"global_head_dim": full[0].get("head_dim") or t.get("head_dim") or 256,
            "global_kv_heads": full[0].get("num_key_value_heads")}


def parse_text_config(t: dict[str, Any], top: dict[str, Any]) -> TextConfig:
    if t.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("attn_logit_softcapping is not supported (Gemma 4 checkpoints leave it null)")
    bidirectional = t.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise ModelLoadError(f"use_bidirectional_attention {bidirectional!r} is not supported (null or 'vision')")
    params = dict(t.get("rope_parameters") or {})
    if params and not set(params) <= {SLIDING, FULL}:
        raise ModelLoadError(f"rope_parameters must be given per layer type ({SLIDING}, {FULL}), got {sorted(params)}")
    keys = {**TEXT_KEYS, "layer_types": Key(computed=lambda f: _layer_types(t, f["num_hidden_layers"]))}
    layer_types = _layer_types(t, int(t.get("num_hidden_layers") or 30))
    return read(TextConfig, t, keys, **_global_shape(t, layer_types), sliding_rope=_rope(dict(params.get(SLIDING) or {}), SLIDING),
                full_rope=_rope(dict(params.get(FULL) or {}), FULL), bidirectional_vision=bidirectional == "vision",
                tie_word_embeddings=bool(ChainMap(top, t).get("tie_word_embeddings", True)))


def parse_config(raw: dict[str, Any]) -> Gemma4Config:
    """Build a Gemma4Config from a config.json dict."""
    t = dict(raw.get("text_config") or {})
    try:
        return read(Gemma4Config, raw, TOP_KEYS, text=parse_text_config(t, raw), vision=raw.get("vision_config"),
                    audio=raw.get("audio_config"), eos_token_ids=token_ids(ChainMap(t, raw).get("eos_token_id", 1)))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"bad Gemma 4 config: {exc}") from exc
