"""What the engine, the runner, the budgets and the server know of a model family — and nothing more.

Role: a family (one folder under `models/`) plugs in through three things, all declared here:
- `FamilySpec`, a frozen record of facts: the KV layout, the width of an encoder output row and how
  many embedding streams an item has (1, or 1 + deepstack layers), the largest atomic item per
  modality, eos ids, the position scheme, the default video sampling;
- `FamilyModel`, the calls the runner makes on the model;
- `FamilyProcessor`, the calls the engine makes on the processor.
`ModelFamily` ties them to the architecture names in `registry.py`.

Item payloads (`MMItem.payload`) are the family's own: only its processor makes them and only its
model's `encode_items` reads them. Everything else passes them through unread.

What it does not know: any particular family.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from mmserve.inputs.chat import ChatInput
from mmserve.inputs.items import ProcessedPrompt
from mmserve.inputs.media import MediaLimits
from mmserve.inputs.placeholders import embed_runs
from mmserve.inputs.tokenizer import TextTokenizer
from mmserve.models.config_reader import DecoderTextConfig
from mmserve.models.layers.attention import AttentionBackend, AttentionMetadata


class PositionScheme(enum.Enum):
    ROPE_1D = "rope_1d"  # one position row: the token index
    MROPE = "mrope"  # three rows (t, h, w) inside media spans, text advances all three; decode adds a delta


@dataclass(frozen=True)
class KVLayerShape:
    """One self-attention layer's KV: its heads and head size, or the earlier layer whose cache it reads."""

    num_kv_heads: int
    head_dim: int
    reads_layer: int | None = None  # None: it keeps its own keys and values
    sliding_window: int | None = None  # it attends to the last this many positions only (None: all of them)


@dataclass(frozen=True)
class ItemSize:
    """The cost of one item: pre-merge patches the encoder runs, post-merge rows it outputs."""

    encoder_tokens: int
    rows: int
    span_tokens: int | None = None  # prompt tokens of its span, when specials inside make it longer than rows

    @property
    def span(self) -> int:
        return self.rows if self.span_tokens is None else self.span_tokens


@dataclass(frozen=True)
class CrossAttentionLayout:
    """A family whose language model reads items through cross-attention layers: their K/V per item row."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_row(self, dtype_bytes: int) -> int:
        """Bytes of one item row's keys and values over every cross-attention layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class LinearStateLayout:
    """A hybrid family's linear-attention layers (Gated DeltaNet): each keeps, per request, a conv state and a
    recurrent state of fixed shapes instead of KV; `FamilySpec.num_layers` then counts the other layers."""

    num_layers: int
    conv_shape: tuple[int, int]  # (conv channels, kernel - 1)
    recurrent_shape: tuple[int, int, int]  # (value heads, key head dim, value head dim)

    def bytes_per_slot(self, dtype_bytes: int) -> int:
        """One request's state over every linear-attention layer."""
        per_layer = self.conv_shape[0] * self.conv_shape[1] + math.prod(self.recurrent_shape)
        return self.num_layers * per_layer * dtype_bytes


@dataclass(frozen=True)
class FamilySpec:
    name: str
    num_layers: int  # KV layout: one K and one V per layer ...
    num_kv_heads: int
    head_dim: int  # ... each (num_kv_heads, head_dim) per token
    embed_dim: int  # width of one encoder output row (the language model's hidden size)
    num_embedding_streams: int  # rows per position an item carries: 1 (main) + deepstack streams
    largest_item: Mapping[str, ItemSize]  # modality -> the largest item the processor can make
    eos_token_ids: tuple[int, ...]
    position_scheme: PositionScheme
    max_position_embeddings: int
    default_video_fps: float
    vocab_size: int  # the width of the logits: token ids a request may name are below it
    # each run of an item's encoder rows attends to itself in both directions (Gemma 3): the language
    # model must see an item's span in one prefill chunk
    bidirectional_media: bool = False
    # the modalities whose rows attend both ways (None: all of them, when `bidirectional_media`)
    bidirectional_modalities: frozenset[str] | None = None
    # items are read by cross-attention layers (Llama 3.2 Vision): a request's items are encoded before its
    # first prefill chunk, their K/V kept per request; `num_layers` above counts self-attention layers only
    cross_attention: CrossAttentionLayout | None = None
    # a hybrid family's linear-attention layers, whose per-request state lives in slots (None: every layer
    # keeps KV)
    linear_state: LinearStateLayout | None = None
    # why the decode step cannot be captured or compiled (state layers, sparse experts' data-dependent
    # routing): it runs eagerly; None: it can be
    eager_decode: str | None = None
    # each layer's KV shape when the layers differ (Gemma 4: head sizes per layer type, KV-shared layers);
    # None: every layer is (num_kv_heads, head_dim) and keeps its own
    kv_layers: tuple[KVLayerShape, ...] | None = None
    # the model's forward also reads the step's token ids (`token_ids=`; Gemma 4's per-layer embeddings)
    forward_reads_token_ids: bool = False

    @classmethod
    def for_decoder(cls, name: str, text: DecoderTextConfig, *, eos_token_ids: tuple[int, ...],
                    default_video_fps: float, embed_dim: int | None = None, **facts: Any) -> FamilySpec:
        """The spec of a family whose KV layout and context are its decoder's; `embed_dim` defaults to the
        decoder's width, `facts` are the remaining fields."""
        return cls(name=name, num_layers=text.num_hidden_layers, num_kv_heads=text.num_key_value_heads,
                   head_dim=text.head_dim, embed_dim=text.hidden_size if embed_dim is None else embed_dim,
                   eos_token_ids=eos_token_ids, max_position_embeddings=text.max_position_embeddings,
                   default_video_fps=default_video_fps, vocab_size=text.vocab_size, **facts)

    def __post_init__(self) -> None:
        if self.num_embedding_streams < 1:
            raise ValueError("a family has at least one embedding stream")
        if not self.largest_item:
            raise ValueError(f"{self.name}: no modality declares its largest item")

    @property
    def kv_layer_shapes(self) -> tuple[KVLayerShape, ...]:
        """Every self-attention layer's KV shape."""
        if self.kv_layers is not None:
            return self.kv_layers
        return (KVLayerShape(self.num_kv_heads, self.head_dim),) * self.num_layers

    @property
    def kv_window(self) -> int | None:
        """The window a window pool keeps for the sliding layers (core/window_kv.py): the widest of theirs,
        where some layers keep a window and others the whole context; None: one pool serves every layer."""
        owners = [s for s in self.kv_layer_shapes if s.reads_layer is None]
        windows = [s.sliding_window for s in owners if s.sliding_window is not None]
        return max(windows) if windows and len(windows) < len(owners) else None

    def bidirectional_spans(self, prompt: ProcessedPrompt) -> tuple[tuple[int, int], ...]:
        """[start, end) of every run of a prompt's encoder rows that attends within itself both ways."""
        if not self.bidirectional_media or not prompt.items or prompt.embed_mask is None:
            return ()
        mask = prompt.embed_mask
        if self.bidirectional_modalities is not None:
            mask = mask.copy()
            for item in prompt.items:
                if item.modality not in self.bidirectional_modalities:
                    mask[item.offset:item.offset + item.length] = False
        return embed_runs(mask)

    def forward_kwargs(self, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The keyword arguments a forward over the step's `token_ids` takes besides the common ones."""
        return {"token_ids": token_ids} if self.forward_reads_token_ids else {}

    @property
    def num_position_rows(self) -> int:
        return 3 if self.position_scheme is PositionScheme.MROPE else 1

    @property
    def max_item_encoder_tokens(self) -> int:
        return max(s.encoder_tokens for s in self.largest_item.values())

    @property
    def max_item_rows(self) -> int:
        return max(s.rows for s in self.largest_item.values())

    @property
    def max_item_span(self) -> int:
        return max(s.span for s in self.largest_item.values())


class FamilyModel(Protocol):
    """The calls the runner makes. Tensors are on the model's device; indices were built on the CPU.
    A family with `FamilySpec.cross_attention` also has `cross_attention_kv(states (rows, hidden)) ->
    [(keys, values)]`, each (num_kv_heads, rows, head_dim), one pair per cross-attention layer."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) -> (num_tokens, hidden) text embeddings (with any scaling the family applies)."""
        ...

    def encode_items(self, payloads: Sequence[Any]) -> list[torch.Tensor]:
        """Encode items as one batch: one (num_embedding_streams, rows, embed_dim) tensor per payload."""
        ...

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, extra_streams: torch.Tensor | None = None) -> torch.Tensor:
        """inputs_embeds (num_tokens, hidden); positions (num_position_rows, num_tokens) int64;
        extra_streams (num_embedding_streams - 1, num_tokens, hidden) or None (zero at text rows).
        A family with `FamilySpec.forward_reads_token_ids` also takes `token_ids` (num_tokens,).
        Returns the final hidden states (num_tokens, hidden)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class FamilyProcessor(Protocol):
    """The calls the engine makes: chat rendering and prompt processing, all on the CPU."""

    tokenizer: TextTokenizer

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> ChatInput: ...

    def process(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                images: list[Any] | None = None, videos: list[Any] | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None,
                uuids: dict[str, list[str | None]] | None = None, item_params: dict[str, list[str]] | None = None,
                audios: list[Any] | None = None) -> ProcessedPrompt: ...


@dataclass(frozen=True)
class ModelFamily:
    name: str
    parse_config: Callable[[dict], Any]  # raw config.json -> the family's typed config
    model_class: Callable[[Any], torch.nn.Module]  # typed config -> FamilyModel
    processor_class: Callable[[Path, Any, MediaLimits], FamilyProcessor]  # (model dir, config, limits)
    build_spec: Callable[[Any, Any, MediaLimits], FamilySpec]  # (config, processor, limits)
    # typed config -> the checkpoint's multi-token-prediction head (`MtpHead`), for speculative decoding's
    # method "mtp" (None: the family ships none)
    mtp_class: Callable[[Any], torch.nn.Module] | None = None
