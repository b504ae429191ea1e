"""Placeholder masks, per-item embedding lengths and the embed cumsum — all on the CPU.

Role: decide, for every prompt token, whether it belongs to a multimodal span (`mm_mask`) and
whether its input row comes from an encoder output (`embed_mask`), and check invariant 1:
an item's embed-mask positions equal the rows its encoder produces.

Three placeholder identities are supported:
- in-vocab placeholder ids: `np.isin(ids, mm_token_ids)`;
- out-of-vocab sentinels: `ids >= vocab_size`, used when no placeholder ids are given;
- special tokens inside a span (e.g. row breaks): in `mm_mask`, not in `embed_mask`; they keep
  their text embedding. A span is a maximal run of placeholder/special tokens that contains at
  least one placeholder.

What it does not know: models, pixels, devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmserve.errors import InvalidInputError


@dataclass(frozen=True)
class PlaceholderMasks:
    mm_mask: np.ndarray  # (num_tokens,) bool
    embed_mask: np.ndarray  # (num_tokens,) bool
    embed_cumsum: np.ndarray  # (num_tokens,) int64, inclusive running count of embed_mask


@dataclass(frozen=True)
class Span:
    offset: int
    length: int
    num_embeds: int


def compute_masks(
    input_ids: Sequence[int] | np.ndarray,
    mm_token_ids: Sequence[int] | None = None,
    special_token_ids: Sequence[int] = (),
    vocab_size: int | None = None,
) -> PlaceholderMasks:
    ids = np.asarray(input_ids, dtype=np.int64)
    if mm_token_ids:
        embed = np.isin(ids, np.asarray(mm_token_ids, dtype=np.int64))
    elif vocab_size is not None:
        embed = ids >= vocab_size
    else:
        raise ValueError("need mm_token_ids or vocab_size to find placeholders")
    special = np.isin(ids, np.asarray(list(special_token_ids), dtype=np.int64)) & ~embed
    mm = embed.copy()
    for span in _runs(embed | special):
        if embed[span[0]:span[1]].any():
            mm[span[0]:span[1]] = True
    return PlaceholderMasks(mm_mask=mm, embed_mask=embed, embed_cumsum=np.cumsum(embed, dtype=np.int64))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of True."""
    padded = np.concatenate(([False], mask, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def embed_runs(embed_mask: np.ndarray | None) -> tuple[tuple[int, int], ...]:
    """[start, end) of every maximal run of encoder rows: the spans a bidirectional family's image
    tokens attend within (transformers groups image tokens by contiguity the same way)."""
    return () if embed_mask is None else tuple(_runs(embed_mask))


def find_spans(masks: PlaceholderMasks) -> list[Span]:
    """Every multimodal span, in prompt order, with its embedding-row count."""
    out = []
    for start, end in _runs(masks.mm_mask):
        before = int(masks.embed_cumsum[start - 1]) if start else 0
        out.append(Span(start, end - start, int(masks.embed_cumsum[end - 1]) - before))
    return out


def embeds_in_range(embed_cumsum: np.ndarray, start: int, end: int) -> int:
    """Embedding rows among tokens [start, end) — O(1)."""
    if end <= start:
        return 0
    return int(embed_cumsum[end - 1]) - (int(embed_cumsum[start - 1]) if start else 0)


def check_item_rows(item_name: str, placeholder_rows: int, encoder_rows: int, request: str | None = None) -> None:
    """Invariant 1: placeholder rows == embedding rows, or a clear InvalidInputError."""
    if placeholder_rows != encoder_rows:
        where = f" in request {request}" if request else ""
        raise InvalidInputError(
            f"{item_name}{where}: the prompt has {placeholder_rows} placeholder positions but the encoder "
            f"produces {encoder_rows} embedding rows"
        )
