"""Anyres geometry of LLaVA-OneVision, from sizes alone, on the CPU.

Role: for an image of a given size, pick the canvas among the grid pinpoints, size the resized image
on it, lay out the tiles, and work out which rows/columns of the tiles' joint feature map survive
unpadding and what the `anyres_max_N` rule scales them down to. From that follow the rows the item
fills (base tile + feature rows, each with one newline row) and the encoder tokens it costs. The
processor and the model both read this one `AnyresLayout`, so the span length and the encoder's
output cannot disagree.
What it does not know: pixels, tensors, tokenizers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def select_best_resolution(size: tuple[int, int], pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (height, width) canvas that keeps the most of the image's pixels, then wastes the least."""
    height, width = size
    best, best_effective, best_wasted = pinpoints[0], 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = ph * pw - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (ph, pw), effective, wasted
    return best


def fit_size(size: tuple[int, int], canvas: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized to fit the canvas, aspect ratio kept (rounded up)."""
    height, width = size
    ch, cw = canvas
    scale_w, scale_h = cw / width, ch / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), ch), cw
    return ch, min(math.ceil(width * scale_h), cw)


def unpad_bounds(size: tuple[int, int], feat_h: int, feat_w: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the joint tile feature map that holds image, not padding."""
    height, width = size
    if width / height > feat_w / feat_h:
        new_h = int(round(height * (feat_w / width), 7))
        pad = (feat_h - new_h) // 2
        return pad, feat_h - pad, 0, feat_w
    new_w = int(round(width * (feat_h / height), 7))
    pad = (feat_w - new_w) // 2
    return 0, feat_h, pad, feat_w - pad


def downscaled(h: int, w: int, side: int, max_tiles: int) -> tuple[int, int] | None:
    """Feature map size after the `anyres_max_N` rule, or None when it is kept as is."""
    ratio = math.sqrt(h * w / (max_tiles * side ** 2))
    if ratio > 1.1:
        return int(h // ratio), int(w // ratio)
    return None


@dataclass(frozen=True)
class AnyresLayout:
    tile_grid: tuple[int, int]  # tiles per (column, row) of the canvas: (rows, cols)
    crop: tuple[int, int, int, int]  # (top, bottom, left, right) kept of the (rows*side, cols*side) map
    resized: tuple[int, int] | None  # (height, width) the kept map is scaled to (bilinear), or None
    side: int  # patches per tile edge

    @property
    def feature_hw(self) -> tuple[int, int]:
        if self.resized is not None:
            return self.resized
        top, bottom, left, right = self.crop
        return bottom - top, right - left

    @property
    def num_tiles(self) -> int:
        """Tiles the encoder runs: the base image plus the canvas tiles."""
        return 1 + self.tile_grid[0] * self.tile_grid[1]

    @property
    def rows(self) -> int:
        """Embedding rows: the base tile's patches, then each feature row followed by a newline row."""
        h, w = self.feature_hw
        return self.side ** 2 + h * (w + 1)


def anyres_layout(size: tuple[int, int], pinpoints: Sequence[tuple[int, int]], tile: int, side: int,
                  max_tiles: int) -> AnyresLayout:
    """Layout for an image of (height, width) `size`; `tile` is the tile edge in pixels, `side` in patches."""
    canvas = select_best_resolution(size, pinpoints)
    grid = (canvas[0] // tile, canvas[1] // tile)
    crop = unpad_bounds(size, grid[0] * side, grid[1] * side)
    resized = downscaled(crop[1] - crop[0], crop[3] - crop[2], side, max_tiles)
    return AnyresLayout(grid, crop, resized, side)


def largest_rows(pinpoints: Sequence[tuple[int, int]], tile: int, side: int, max_tiles: int) -> int:
    """The most rows any image can fill: every canvas, every crop the unpadding can leave."""
    def rows(h: int, w: int) -> int:
        hw = downscaled(h, w, side, max_tiles) or (h, w)
        return side ** 2 + hw[0] * (hw[1] + 1)

    best = 0
    for ph, pw in pinpoints:
        fh, fw = ph // tile * side, pw // tile * side
        best = max(best, max(rows(h, fw) for h in range(1, fh + 1)), max(rows(fh, w) for w in range(1, fw + 1)))
    return best
