"""Which encoder rows a prefill chunk needs, and where they go — computed on the CPU.

Role: `MultimodalRuntimeData` answers, per request, three O(1) questions from precomputed
arrays: how many embedding rows precede a token (the embed cumsum), which item holds a given
row, and where that item's rows start. `plan_chunk` turns a chunk [start, end) into
(item, row slice, token positions) pieces; `gather_chunk_rows` slices the items' output
tensors (all embedding streams alike) — a chunk inside one item gets a view, never a copy (slice before joining).

What it does not know: scheduling, models, devices beyond the tensors it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ChunkPiece:
    item_index: int
    row_start: int  # within the item's output rows
    row_end: int
    token_positions: np.ndarray  # (row_end - row_start,) int64: chunk-relative token positions


class MultimodalRuntimeData:
    def __init__(self, embed_mask: np.ndarray, embed_cumsum: np.ndarray, item_rows: list[int]) -> None:
        self.embed_mask = embed_mask
        self.embed_cumsum = embed_cumsum  # (num_prompt_tokens,) inclusive
        self.item_row_starts = np.concatenate(([0], np.cumsum(item_rows, dtype=np.int64)))
        total = int(self.item_row_starts[-1])
        if total != (int(embed_cumsum[-1]) if len(embed_cumsum) else 0):
            raise ValueError(f"items produce {total} rows but the prompt has "
                             f"{int(embed_cumsum[-1]) if len(embed_cumsum) else 0} embed positions")
        # row -> item, one entry per embedding row
        self.item_of_row = np.repeat(np.arange(len(item_rows), dtype=np.int64), item_rows)

    def rows_before(self, token: int) -> int:
        """Embedding rows among tokens [0, token)."""
        return int(self.embed_cumsum[token - 1]) if token > 0 else 0

    def plan_chunk(self, start: int, end: int) -> list[ChunkPiece]:
        """The rows prompt tokens [start, end) take from encoder outputs, split by item."""
        end = min(end, len(self.embed_cumsum))
        r0, r1 = self.rows_before(start), self.rows_before(end)
        if r1 <= r0:
            return []
        positions = np.flatnonzero(self.embed_mask[start:end])  # chunk-relative, r1 - r0 of them
        pieces, row = [], r0
        while row < r1:
            item = int(self.item_of_row[row])
            item_start, item_end = int(self.item_row_starts[item]), int(self.item_row_starts[item + 1])
            stop = min(r1, item_end)
            pieces.append(ChunkPiece(item, row - item_start, stop - item_start, positions[row - r0:stop - r0]))
            row = stop
        return pieces

    def items_needed(self, start: int, end: int) -> set[int]:
        return {p.item_index for p in self.plan_chunk(start, end)}


def gather_chunk_rows(pieces: list[ChunkPiece], item_outputs: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
    """Row slices for each piece, every stream: views into the items' (streams, rows, width) outputs."""
    return [item_outputs[p.item_index][:, p.row_start:p.row_end] for p in pieces]
