"""Qwen3-VL M-RoPE position ids for a prompt (CPU, numpy), as transformers' `get_rope_index` makes them.

Every run of placeholder ids is one frame: an image is one run, a video one run per temporal patch
(its frames are separated by timestamp text and vision start/end tokens). Text tokens advance all
three rows together; a run of (h, w) merged rows starting at position p takes t = p, h = p + row,
w = p + column, and text resumes at p + max(h, w). Past the prompt, every row is index + delta.

What it does not know: tokenizers, pixels, KV caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FrameRun:
    """One contiguous run of placeholder ids: a frame's (merged) rows."""

    offset: int  # first placeholder id of the run in the prompt
    rows: int  # merged grid height
    cols: int  # merged grid width


def mrope_positions(num_tokens: int, runs: Sequence[FrameRun]) -> tuple[np.ndarray, int]:
    """Return (positions (3, num_tokens) int64, rope_delta): token i >= num_tokens has position
    i + rope_delta on every row."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor, pos = 0, 0
    for run in sorted(runs, key=lambda r: r.offset):
        if run.offset < cursor:
            raise ValueError(f"frame runs overlap at token {run.offset}")
        positions[:, cursor:run.offset] = np.arange(pos, pos + run.offset - cursor)
        pos += run.offset - cursor
        end = run.offset + run.rows * run.cols
        if end > num_tokens:
            raise ValueError(f"frame at token {run.offset} with {run.rows * run.cols} rows runs past the prompt "
                             f"({num_tokens} tokens)")
        positions[0, run.offset:end] = pos
        positions[1, run.offset:end] = np.repeat(np.arange(run.rows), run.cols) + pos
        positions[2, run.offset:end] = np.tile(np.arange(run.cols), run.rows) + pos
        pos += max(run.rows, run.cols)
        cursor = end
    positions[:, cursor:] = np.arange(pos, pos + num_tokens - cursor)
    rope_delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, rope_delta
