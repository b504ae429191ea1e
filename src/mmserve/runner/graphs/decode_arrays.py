"""A decode step's host-side inputs for a captured (or compiled) decode graph, padded to its bucket.

Role: take a decode-only step's ids, positions, KV slots, block tables and query positions from the batch
builder, and pad them to a bucket's batch size and block-table width: a padding row decodes token 0 at
position 0 over the scratch block, writing its K/V to the scratch slot, which no request owns. Where the
sliding layers keep their blocks in a pool of their own (core/window_kv.py), their slots and tables are
padded the same way over that pool's scratch (its null block).

What it does not know: the model, graphs, buckets' choice (runner/graphs/buckets.py), requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mmserve.runner.batch import BatchBuilder
    from mmserve.runner.graphs.buckets import DecodeBucket


@dataclass
class DecodeArrays:
    """One decode step's host-side inputs, in batch order (before padding)."""

    input_ids: np.ndarray  # (n,)
    positions: np.ndarray  # (position_rows, n)
    slot_mapping: np.ndarray  # (n,)
    block_tables: list[list[int]]
    query_positions: np.ndarray  # (n,)
    window_slot_mapping: np.ndarray | None = None  # the window pool's, where there is one
    window_block_tables: list[list[int]] | None = None

    @classmethod
    def from_builder(cls, builder: BatchBuilder) -> DecodeArrays:
        # decode_rows == range(n) here, so the decode tables are in batch order
        window = builder.window_tables
        return cls(np.concatenate(builder.ids), np.concatenate(builder.pos, axis=1),
                   np.concatenate(builder.tables.slots), [list(t) for t in builder.tables.decode_tables],
                   np.asarray(builder.context_lens, dtype=np.int64),
                   None if window is None else np.concatenate(window.slots),
                   None if window is None else [list(t) for t in window.decode_tables])

    @classmethod
    def padding(cls, num_position_rows: int, window_pool: bool) -> DecodeArrays:
        """No real row: the capture's inputs."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, np.zeros((num_position_rows, 0), dtype=np.int64), empty, [], empty,
                   empty if window_pool else None, [] if window_pool else None)

    def padded(self, bucket: DecodeBucket, block_size: int, scratch_block: int,
               window_scratch_block: int | None) -> dict[str, np.ndarray]:
        """Padded to the bucket: padding rows decode token 0 at position 0 over the scratch block (the
        window pool's own, `window_scratch_block`, for the sliding layers' slots and tables)."""
        n, b = len(self.input_ids), bucket.batch_size
        positions = np.zeros((self.positions.shape[0], b), dtype=np.int64)
        positions[:, :n] = self.positions
        query_positions = np.zeros((b, 1), dtype=np.int64)
        query_positions[:n, 0] = self.query_positions
        out = {"input_ids": np.concatenate([self.input_ids, np.zeros(b - n, dtype=np.int64)]),
               "positions": positions, "query_positions": query_positions,
               "slot_mapping": _padded_slots(self.slot_mapping, b, scratch_block * block_size),
               "block_table": _padded_table(self.block_tables, bucket, scratch_block)}
        if window_scratch_block is not None:
            out["window_slot_mapping"] = _padded_slots(self.window_slot_mapping, b, window_scratch_block * block_size)
            out["window_block_table"] = _padded_table(self.window_block_tables, bucket, window_scratch_block)
        return out


def _padded_slots(slots: np.ndarray, batch: int, scratch_slot: int) -> np.ndarray:
    return np.concatenate([slots, np.full(batch - len(slots), scratch_slot, dtype=np.int64)])


def _padded_table(tables: list[list[int]], bucket: DecodeBucket, scratch: int) -> np.ndarray:
    table = np.full((bucket.batch_size, bucket.num_blocks), scratch, dtype=np.int64)  # also past each row's blocks
    for row, blocks in enumerate(tables):
        table[row, :len(blocks)] = blocks
    return table
