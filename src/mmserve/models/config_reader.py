"""Read a `config.json` section into a family's frozen config dataclass, from a declaration.

Role: every family's config parser reads the same kinds of fields the same way: a JSON name (or a
few, the first given wins), a default when absent (a value, or one computed from the fields read
before it), what an explicit null means, and a conversion that follows the field's type (`int`,
`float`, `bool`, `str`, `X | None`, `tuple[int, ...]`). `read(cls, section, keys, **given)` does that
for each field of `cls` in order; a family declares only its `Key`s where they differ from "the
field's own name, the dataclass's default, null means absent", and passes what it computes itself
(rope parameters, nested sections) as `given`. A field with no default that the section lacks fails
with `ModelLoadError("config.json lacks required field ...")`.

`DecoderTextConfig` is the part of a text config every family's decoder has (the fields
`layers/decoder.py` reads, and their one shared check); a family's text config subclasses it with its
own fields and checks.

What it does not know: any family's names or defaults (its `config.py` says them), weights, devices.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, NoneType, UnionType
from typing import Any, TypeVar

from mmserve.errors import ModelLoadError

Config = TypeVar("Config")
# a default computed from the fields read before this one (by name)
Derived = Callable[[Mapping[str, Any]], Any]


class Unset(enum.Enum):
    """No value declared here: the dataclass's default applies (`Key.default`), or null reads as absent
    (`Key.null`)."""

    UNSET = "unset"


@dataclass(frozen=True)
class Key:
    """How one field is read from its section."""

    names: tuple[str, ...] = ()  # JSON names, the first given wins; () is the field's own name
    default: Any = Unset.UNSET  # when absent: a value, or a `Derived`; UNSET: the dataclass's default
    null: Any = Unset.UNSET  # what an explicit null reads as (a value, or a `Derived`); UNSET: absent
    falsy_is_absent: bool = False  # 0, "" and [] read as absent too (`value or default`)
    convert: Callable[[Any], Any] | None = None  # instead of the conversion the field's type implies
    computed: Derived | None = None  # never read: computed from the fields before it


def token_ids(value: Any) -> tuple[int, ...]:
    """A token id field given as an int, a list of ints, or absent (None) -> a tuple of ints."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def read(cls: type[Config], section: Mapping[str, Any], keys: Mapping[str, Key] | None = None,
         **given: Any) -> Config:
    """`cls(**fields)`, each field from `given` if passed, else read from `section` as its `Key` says."""
    keys = keys or {}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name in given:
            values[field.name] = given[field.name]
        else:
            values[field.name] = _read_field(field, keys.get(field.name, Key()), section, hints[field.name], values)
    unknown = set(given) - set(values)
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    return cls(**values)


def _read_field(field: dataclasses.Field, key: Key, section: Mapping[str, Any], hint: Any,
                read_so_far: Mapping[str, Any]) -> Any:
    if key.computed is not None:
        return key.computed(read_so_far)
    for name in key.names or (field.name,):
        if name not in section:
            continue
        value = section[name]
        if value is None and key.null is not Unset.UNSET:
            return _resolve(key.null, read_so_far)
        if value is None or (key.falsy_is_absent and not value):
            continue
        return key.convert(value) if key.convert is not None else _convert(value, hint)
    if key.default is not Unset.UNSET:
        return _resolve(key.default, read_so_far)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise ModelLoadError(f"config.json lacks required field {(key.names or (field.name,))[0]!r}")


def _resolve(value: Any, read_so_far: Mapping[str, Any]) -> Any:
    return value(read_so_far) if callable(value) else value


def _convert(value: Any, hint: Any) -> Any:
    """`value` as the field's type says: scalars by their constructor, `X | None` as X, tuples per element."""
    if hint in (int, float, bool, str):
        return hint(value)
    args = typing.get_args(hint)
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [a for a in args if a is not NoneType]
        return _convert(value, kinds[0]) if len(kinds) == 1 else value
    if typing.get_origin(hint) is tuple:
        element = args[0]
        return tuple(_convert(v, element) for v in value)
    return value


@dataclass(frozen=True, kw_only=True)
class DecoderTextConfig:
    """What every family's decoder reads (`layers/decoder.py`), and the check they share."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                                 f"num_key_value_heads {self.num_key_value_heads}")


def check_layer_types(layer_types: tuple[str, ...], num_layers: int, supported: tuple[str, ...]) -> None:
    """A decoder's `layer_types`: one per layer, each one the family supports (else a ModelLoadError)."""
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    bad = sorted({t for t in layer_types if t not in supported})
    if bad:
        raise ModelLoadError(f"unsupported layer_types {bad}; supported: {', '.join(supported)}")


def _heads(fields: Mapping[str, Any]) -> int:
    return fields["num_attention_heads"]


def _hidden_per_head(fields: Mapping[str, Any]) -> int:
    return fields["hidden_size"] // fields["num_attention_heads"]


# the usual reading of the decoder's head counts: kv heads default to the query heads, head_dim to
# hidden / heads; a 0 or null in either reads as unset (transformers' writers leave them so)
TEXT_KEYS: Mapping[str, Key] = MappingProxyType({
    "num_key_value_heads": Key(default=_heads, falsy_is_absent=True),
    "head_dim": Key(default=_hidden_per_head, falsy_is_absent=True),
})


def rope_section(section: Mapping[str, Any]) -> dict[str, Any]:
    """The section's rope parameters: transformers 5's `rope_parameters`, or the hub's `rope_scaling`."""
    return dict(section.get("rope_parameters") or section.get("rope_scaling") or {})


def rope_type(params: Mapping[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def check_experts(num_experts: int, num_experts_per_tok: int) -> None:
    """A sparse-MLP config's expert counts (0 experts: a dense model, nothing to check)."""
    if num_experts and not 1 <= num_experts_per_tok <= num_experts:
        raise ModelLoadError(f"num_experts_per_tok {num_experts_per_tok} must be in [1, num_experts {num_experts}]")
