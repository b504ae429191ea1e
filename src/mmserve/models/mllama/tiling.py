"""Tiling geometry of Llama 3.2 Vision (mllama), from sizes alone.

Role: for an image of a given size, list the tile grids `max_image_tiles` allows, pick the canvas the
image is scaled onto (transformers' `get_optimal_tiled_canvas`), size the resized image on it
(`get_image_size_fit_to_canvas`; it is then padded at the bottom and right, never centred) and number
its grid as the model's aspect-ratio embedding does (`convert_aspect_ratios_to_ids`: 1-based, 0 is a
padding image). Everything is plain Python arithmetic in float64, as transformers computes it with
numpy, so the same canvas wins every tie. The pixel work and a later span count read this one
`TileLayout`, so they cannot disagree.
What it does not know: pixels, tensors, tokenizers, checkpoints.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

PADDING_ASPECT_RATIO_ID = 0  # the id of an image slot a prompt leaves empty in a batch


@dataclass(frozen=True)
class TileLayout:
    """Where one image goes: resized (aspect kept), pasted at the top left of a canvas of whole tiles."""

    resized_height_px: int
    resized_width_px: int
    canvas_height_px: int
    canvas_width_px: int
    num_tiles_height: int
    num_tiles_width: int
    aspect_ratio_id: int  # 1-based index of (num_tiles_height, num_tiles_width) in the supported grids

    @property
    def num_tiles(self) -> int:
        """Tiles the image is cut into, row by row."""
        return self.num_tiles_height * self.num_tiles_width


def _check_positive(**values: int) -> None:
    bad = {name: v for name, v in values.items() if not isinstance(v, numbers.Integral) or v < 1}
    if bad:
        raise ValueError(f"expected positive integers, got {bad}")


def supported_aspect_ratios(max_image_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (num_tiles_height, num_tiles_width) grid of at most `max_image_tiles` tiles, in transformers'
    order (the first count outer): the order the aspect-ratio ids number them in."""
    _check_positive(max_image_tiles=max_image_tiles)
    return tuple((h, w) for h in range(1, max_image_tiles + 1) for w in range(1, max_image_tiles + 1)
                 if h * w <= max_image_tiles)


def optimal_tiled_canvas(height_px: int, width_px: int, max_image_tiles: int, tile_px: int) -> tuple[int, int]:
    """(canvas_height_px, canvas_width_px): among the supported grids, the one needing the least upscale
    if any grid holds the image without shrinking it, else the one shrinking it least; ties go to the
    smallest area, then to the earliest grid."""
    _check_positive(height_px=height_px, width_px=width_px, max_image_tiles=max_image_tiles, tile_px=tile_px)
    canvases = [(h * tile_px, w * tile_px) for h, w in supported_aspect_ratios(max_image_tiles)]
    # the scale that fits the image inside the canvas; divisions as numpy's, so ties stay exact ties
    scales = [min(ch / height_px, cw / width_px) for ch, cw in canvases]
    upscales = [s for s in scales if s >= 1]
    chosen = min(upscales) if upscales else max(scales)
    return min((c for c, s in zip(canvases, scales) if s == chosen), key=lambda c: c[0] * c[1])


def size_fit_to_canvas(height_px: int, width_px: int, canvas_height_px: int, canvas_width_px: int,
                       tile_px: int) -> tuple[int, int]:
    """(height_px, width_px) the image is resized to: each side first clamped between one tile and the
    canvas, then the side that scales less is kept and the other follows the aspect ratio (floored,
    at least 1 px, never past its clamp)."""
    _check_positive(height_px=height_px, width_px=width_px, canvas_height_px=canvas_height_px,
                    canvas_width_px=canvas_width_px, tile_px=tile_px)
    target_w = min(max(width_px, tile_px), canvas_width_px)
    target_h = min(max(height_px, tile_px), canvas_height_px)
    scale_h, scale_w = target_h / height_px, target_w / width_px
    # the scale is computed first and then multiplied, as transformers does: (h * tw) / w can round apart
    if scale_w < scale_h:
        return min(math.floor(height_px * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width_px * scale_h) or 1, target_w)


def aspect_ratio_id(num_tiles_height: int, num_tiles_width: int, max_image_tiles: int) -> int:
    """1-based index of the grid in `supported_aspect_ratios(max_image_tiles)`."""
    grids = supported_aspect_ratios(max_image_tiles)
    if (num_tiles_height, num_tiles_width) not in grids:
        raise ValueError(f"a {num_tiles_height}x{num_tiles_width} grid is not one of {max_image_tiles} tiles")
    return grids.index((num_tiles_height, num_tiles_width)) + 1


def tile_layout(height_px: int, width_px: int, tile_px: int, max_image_tiles: int) -> TileLayout:
    """The layout of a height_px x width_px image cut into square tiles of `tile_px`."""
    canvas_h, canvas_w = optimal_tiled_canvas(height_px, width_px, max_image_tiles, tile_px)
    resized_h, resized_w = size_fit_to_canvas(height_px, width_px, canvas_h, canvas_w, tile_px)
    rows, cols = canvas_h // tile_px, canvas_w // tile_px
    return TileLayout(resized_h, resized_w, canvas_h, canvas_w, rows, cols,
                      aspect_ratio_id(rows, cols, max_image_tiles))
