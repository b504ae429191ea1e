"""The processed prompt: token ids plus one `MMItem` per image, video or audio clip.

Role: the typed result of input processing and the only thing the engine sees of a prompt.
An item carries its placeholder span, its encoder sizes (pre-merge patches, post-merge rows),
its content key and its family-owned payload (pixels, grids, audio features: whatever the family's
encoder reads).
The prompt carries its placeholder masks, the embed cumsum and its position table.
What it does not know: engine state, tensors on devices, what a payload holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

IMAGE = "image"
VIDEO = "video"
AUDIO = "audio"


@dataclass(frozen=True)
class CrossAttentionSpan:
    """An item the language model reads through cross-attention (its rows are keys and values, not prompt
    rows): which token positions see it, and which of its rows they see."""

    visible_from: int  # first token position that sees the item
    visible_until: int | None  # first position that no longer does; None: every later one, generated included
    attended_rows: int  # its first rows; the rest (padding) count only for a query that sees no row at all


@dataclass(frozen=True)
class MMItem:
    modality: str  # IMAGE, VIDEO or AUDIO
    index: int  # which image, video or audio clip of the prompt, in its modality (its parts share the index)
    offset: int  # first token of the item's placeholder span in the prompt
    length: int  # tokens in the span (embedding rows plus any special tokens inside it)
    encoder_tokens: int  # what the encoder processes: pre-merge patches, audio feature frames (the family's)
    output_rows: int  # post-merge embedding rows the item fills
    content_hash: str  # identity of what the model sees (pixels or samples + processing)
    payload: Any = None  # the family's encoder input; only the family's model reads it
    part: int = 0  # which part of its image or video (a video's temporal group, in families that split)
    # set when the item is read by cross-attention layers: its span is one token that keeps its text
    # embedding, and `output_rows` are rows of cross-attention states, not prompt rows
    cross_attention: CrossAttentionSpan | None = None

    @property
    def ref(self) -> tuple[str, int]:
        return (self.modality, self.index)


@dataclass(frozen=True)
class PromptPositions:
    """Rotary positions of a prompt's tokens, and of the tokens generated after it.

    `table` is (num_rows, num_prompt_tokens) int64, or None when a token's position is its index
    (1-D RoPE). Past the prompt every row holds `index + decode_delta`."""

    num_rows: int
    table: np.ndarray | None = None
    decode_delta: int = 0

    def columns(self, start: int, end: int, num_prompt_tokens: int) -> np.ndarray:
        """(num_rows, end - start) positions of tokens [start, end)."""
        if end == start + 1 and start >= num_prompt_tokens:  # one generated token: the decode step's case
            return np.full((self.num_rows, 1), start + self.decode_delta, dtype=np.int64)
        if self.table is None and self.decode_delta == 0:
            row = np.arange(start, end, dtype=np.int64)
            return np.broadcast_to(row, (self.num_rows, row.size))
        cols = []
        if start < num_prompt_tokens:
            stop = min(end, num_prompt_tokens)
            cols.append(self.table[:, start:stop] if self.table is not None
                        else np.broadcast_to(np.arange(start, stop, dtype=np.int64), (self.num_rows, stop - start)))
        if end > num_prompt_tokens:
            row = np.arange(max(start, num_prompt_tokens), end, dtype=np.int64) + self.decode_delta
            cols.append(np.broadcast_to(row, (self.num_rows, row.size)))
        return cols[0] if len(cols) == 1 else np.concatenate(cols, axis=1)


@dataclass(frozen=True)
class ItemMetadata:
    """Per-item sizes of one prompt, in item order."""

    item_refs: tuple[tuple[str, int], ...]
    encoder_token_lengths: tuple[int, ...]  # pre-merge patches
    output_embedding_lengths: tuple[int, ...]  # post-merge rows

    @classmethod
    def of(cls, items: list[MMItem]) -> ItemMetadata:
        return cls(tuple(i.ref for i in items), tuple(i.encoder_tokens for i in items),
                   tuple(i.output_rows for i in items))


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    items: list[MMItem] = field(default_factory=list)
    mm_mask: np.ndarray | None = None  # (num_tokens,) bool: inside a multimodal span
    embed_mask: np.ndarray | None = None  # (num_tokens,) bool: row comes from an encoder output
    embed_cumsum: np.ndarray | None = None  # (num_tokens,) int64 running count of embed rows
    positions: PromptPositions = field(default_factory=lambda: PromptPositions(1))
    cache_salt: str | None = None  # only prompts with the same salt share prefix-cache blocks

    @property
    def metadata(self) -> ItemMetadata:
        return ItemMetadata.of(self.items)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def without_payloads(self) -> ProcessedPrompt:
        """The same prompt without the items' encoder inputs: what a decode replica needs (their keys,
        spans and rows shape the prefix hashes and positions; their pixels are never encoded there)."""
        return dataclasses.replace(self, items=[dataclasses.replace(item, payload=None) for item in self.items])
