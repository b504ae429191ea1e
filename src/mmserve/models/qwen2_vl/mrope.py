"""M-RoPE position ids for a prompt with image and video placeholder spans (CPU, numpy).

Text tokens advance all three rows together; the tokens of a vision item take (t, h, w)
positions over its merged grid, offset by the position where the item starts. Matches
transformers' `get_rope_index` (v5): after an item, text resumes at
start + max(h, w) // merge, and Qwen2.5-VL spaces video frames by
tokens_per_second * seconds_per_grid_t.

What it does not know: tokenizers, pixels, KV caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisionSpan:
    """A contiguous run of placeholder tokens standing for one item."""

    offset: int  # first placeholder token of the item in the prompt
    grid_thw: tuple[int, int, int]  # the item's patch grid (pre-merge)
    time_interval: float = 1.0  # position step between temporal patches (1 for images)


def mrope_positions(num_tokens: int, spans: Sequence[VisionSpan], merge: int) -> tuple[np.ndarray, int]:
    """Return (positions (3, num_tokens) int64, rope_delta).

    rope_delta is what decode adds to a token's index to get its (shared) t/h/w position:
    position of token i >= num_tokens is i + rope_delta.
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor, pos = 0, 0
    for span in sorted(spans, key=lambda s: s.offset):
        text_len = span.offset - cursor
        positions[:, cursor : span.offset] = np.arange(pos, pos + text_len)
        pos += text_len
        t, h, w = span.grid_thw
        lt, lh, lw = t, h // merge, w // merge
        tpos = (np.arange(lt) * span.time_interval).astype(np.int64) + pos
        n = lt * lh * lw
        end = span.offset + n
        if end > num_tokens:
            raise ValueError(f"item at offset {span.offset} with {n} rows runs past the prompt ({num_tokens} tokens)")
        positions[0, span.offset : end] = np.repeat(tpos, lh * lw)
        positions[1, span.offset : end] = np.tile(np.repeat(np.arange(lh), lw), lt) + pos
        positions[2, span.offset : end] = np.tile(np.arange(lw), lt * lh) + pos
        pos += max(h, w) // merge
        cursor = end
    positions[:, cursor:] = np.arange(pos, pos + num_tokens - cursor)
    rope_delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, rope_delta


def decode_positions(start_index: int, num_tokens: int, rope_delta: int) -> np.ndarray:
    """(3, num_tokens) positions for tokens at indices start_index.. past the prompt's spans."""
    row = np.arange(start_index, start_index + num_tokens, dtype=np.int64) + rope_delta
    return np.broadcast_to(row, (3, num_tokens))
