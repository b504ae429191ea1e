"""The declarative config.json reader every family's config parser is written in (`models/config_reader.py`):
a field's JSON names (first given wins), its default (a value, the dataclass's, or one computed from the
fields before it), what a null means, falsy values read as absent where a family says so, conversion by
the field's type, a clear error for a required field the section lacks, and the decoder's shared check."""

from __future__ import annotations

from dataclasses import dataclass

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
