"""The declarative config.json reader every family's config parser is written in (`models/config_reader.py`):
a field's JSON names (first given wins), its default (a value, the dataclass's, or one computed from the
fields before it), what a null means, falsy values read as absent where a family says so, conversion by
the field's type, a clear error for a required field the section lacks, and the decoder's shared check."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mmserve import ModelLoadError
from mmserve.models.config_reader import TEXT_KEYS, DecoderTextConfig, Key, read, token_ids


@dataclass(frozen=True)
class Section:
    width: int
    eps: float
    name: str
    window: int | None
    layers: tuple[int, ...] = (1, 2)
    heads: int = 4


def test_names_defaults_and_conversion():
    keys = {"width": Key(names=("hidden_size", "width")), "eps": Key(default=1e-6),
            "name": Key(default=lambda f: f"w{f['width']}"), "window": Key(default=4096, null=None)}
    got = read(Section, {"hidden_size": "64", "width": 8, "layers": [3, "4"], "window": None}, keys)
    assert got == Section(width=64, eps=1e-6, name="w64", window=None, layers=(3, 4), heads=4)
    assert read(Section, {"width": 8}, keys).window == 4096  # absent: the default; null: what `null` says


def test_null_and_falsy_read_as_absent_where_declared():
    keys = {"width": Key(), "eps": Key(default=0.5), "name": Key(default="x", falsy_is_absent=True),
            "window": Key(default=7), "heads": Key(null=lambda f: f["width"])}
    got = read(Section, {"width": 3, "eps": None, "name": "", "window": 0, "heads": None}, keys)
    assert (got.eps, got.name, got.window, got.heads) == (0.5, "x", 0, 3)


def test_computed_fields_are_never_read_and_given_ones_win():
    keys = {"eps": Key(default=1.0), "name": Key(computed=lambda f: "always"), "window": Key(default=None)}
    got = read(Section, {"width": 2, "name": "ignored", "heads": 9}, keys, heads=5)
    assert (got.name, got.heads) == ("always", 5)
    with pytest.raises(TypeError, match="no fields"):
        read(Section, {"width": 2}, keys, depth=1)


def test_a_required_field_the_section_lacks_is_named():
    with pytest.raises(ModelLoadError, match="config.json lacks required field 'hidden_size'"):
        read(Section, {"width": 3}, {"width": Key(names=("hidden_size",))})


def test_the_decoder_text_config_and_its_shared_check():
    section = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "max_position_embeddings": 512}
    text = read(DecoderTextConfig, section, TEXT_KEYS, tie_word_embeddings=False)
    assert (text.num_key_value_heads, text.head_dim, text.hidden_act, text.rms_norm_eps) == (4, 16, "silu", 1e-6)
    assert read(DecoderTextConfig, {**section, "head_dim": 0, "num_key_value_heads": 2}, TEXT_KEYS,
                tie_word_embeddings=True).head_dim == 16  # a 0 reads as unset
    with pytest.raises(ModelLoadError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        read(DecoderTextConfig, {**section, "num_key_value_heads": 3}, TEXT_KEYS, tie_word_embeddings=False)


def test_token_ids():
    assert token_ids(None) == () and token_ids(5) == (5,) and token_ids([1, "2"]) == (1, 2)


@dataclass(frozen=True)
class Typed:
    size: int | None
    scale: float | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)


def test_optional_fields_convert_and_factories_apply():
    got = read(Typed, {"size": "7", "scale": 2})
    assert got == Typed(size=7, scale=2.0, tags=()) and isinstance(got.scale, float)
    assert read(Typed, {"size": 3, "tags": [1, "b"]}, {"tags": Key(convert=lambda v: tuple(map(str, v)))}).tags \
        == ("1", "b")


def test_an_explicit_null_under_a_name_is_that_value_not_a_reason_to_try_the_next_name():
    keys = {"size": Key(names=("first", "second"), null=None)}
    assert read(Typed, {"first": None, "second": 5}, keys).size is None
    assert read(Typed, {"second": 5}, keys).size == 5


# ---- the families' parsers, as the checkpoints on the hub write their configs -------------------------
def _qwen2_vl(**top):
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "eos_token_id": 7,
            "vision_config": {"depth": 2, "embed_dim": 32, "num_heads": 4, "hidden_size": 64, "in_chans": 3},
            **top}


def test_qwen2_vl_reads_the_hubs_flat_layout():
    from mmserve.models.qwen2_vl.config import parse_config

    cfg = parse_config(_qwen2_vl())
    t, v = cfg.text, cfg.vision
    assert (t.num_key_value_heads, t.head_dim, t.mrope_section, t.rope_theta, t.tie_word_embeddings) \
        == (2, 16, (2, 3, 3), 10000.0, False)
    assert (v.embed_dim, v.out_hidden_size, v.mlp_hidden_size, v.hidden_act, v.patch_size, v.window_size) \
        == (32, 64, 128, "quick_gelu", 14, 0)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.eos_token_ids) == (151655, 151652, (7,))
    with pytest.raises(ModelLoadError, match="lacks required field 'vision_config'"):
        parse_config({k: v for k, v in _qwen2_vl().items() if k != "vision_config"})
    with pytest.raises(ModelLoadError, match=r"mrope_section \[2, 3, 4\] must sum to head_dim/2 = 8"):
        parse_config(_qwen2_vl(rope_scaling={"mrope_section": [2, 3, 4]}))


def test_qwen2_5_vl_reads_its_tower_under_its_own_names():
    from mmserve.models.qwen2_vl.config import parse_config

    raw = _qwen2_vl(architectures=["Qwen2_5_VLForConditionalGeneration"],
                    vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4,
                                   "out_hidden_size": 64, "fullatt_block_indexes": [1]})
    v = parse_config(raw).vision
    assert (v.embed_dim, v.mlp_hidden_size, v.hidden_act, v.window_size, v.fullatt_block_indexes,
            v.tokens_per_second, v.is_qwen2_5) == (32, 48, "silu", 112, (1,), 2.0, True)


def test_qwen3_vl_and_llava_onevision_read_their_nested_sections():
    from mmserve.models.llava_onevision.config import parse_config as llava
    from mmserve.models.qwen3_vl.config import parse_config as qwen3

    text = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 0, "head_dim": 16}
    q3 = qwen3({"architectures": ["Qwen3VLForConditionalGeneration"], "tie_word_embeddings": True,
                "text_config": {**text, "head_dim": 32,
                                "rope_parameters": {"rope_type": "default", "mrope_section": [6, 5, 5]}},
                "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4,
                                  "deepstack_visual_indexes": [0]}})
    assert (q3.text.num_key_value_heads, q3.text.rope_theta, q3.text.max_position_embeddings,
            q3.text.tie_word_embeddings) == (4, 5_000_000.0, 128000, True)
    assert (q3.vision.out_hidden_size, q3.vision.patch_size, q3.num_deepstack) == (64, 16, 1)
    lo = llava({"text_config": {**text, "eos_token_id": 3}, "vision_config": {"image_size": 28, "patch_size": 14},
                "image_grid_pinpoints": [[28, 56]], "image_token_index": 9, "vision_feature_layer": -1})
    assert (lo.image_token_id, lo.video_token_id, lo.eos_token_ids, lo.vision.hidden_size, lo.max_num_tiles) \
        == (9, 151647, (3,), 1152, 9)
    with pytest.raises(ModelLoadError, match="lacks required field 'text_config'"):
        llava({"image_grid_pinpoints": [[28, 56]]})
    with pytest.raises(ModelLoadError, match="image_grid_pinpoints must be multiples of the tile size 28"):
        llava({"text_config": text, "vision_config": {"image_size": 28}, "image_grid_pinpoints": [[30, 56]]})
