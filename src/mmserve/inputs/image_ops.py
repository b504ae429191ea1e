"""Exact, parallel image operations on PIL images and uint8 arrays.

Role: the pixel work of preprocessing, done fast without changing a single output value.
`resize_exact` gives the same bytes as `PIL.Image.resize` (Pillow resamples separably: a
horizontal pass into a uint8 intermediate, then a vertical pass), but runs the horizontal pass
on row strips and the vertical pass on column strips in a thread pool (Pillow releases the GIL
while resampling). `to_rgb` composites transparency onto white, as the reference does.

What it does not know: models, patch sizes, normalisation constants.
"""

from __future__ import annotations

from concurrent.futures import Executor

import numpy as np
from PIL import Image

# Below this many source pixels, threads cost more than they save.
_PARALLEL_MIN_PIXELS = 256 * 256


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB view of `image`; transparent pixels are composited onto a white background."""
    if image.mode == "RGB":
        return image
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _bounds(total: int, parts: int) -> list[int]:
    return [total * i // parts for i in range(parts + 1)]


def _stack(pieces: list[np.ndarray], axis: int) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)


def resize_exact(image: Image.Image, width: int, height: int, resample: int,
                 pool: Executor | None = None, num_parts: int = 4) -> np.ndarray:
    """Resize an RGB image to (height, width, 3) uint8, bit-identical to `image.resize`."""
    src_w, src_h = image.size
    if (src_w, src_h) == (width, height):
        return np.asarray(image)
    if pool is None or src_w * src_h < _PARALLEL_MIN_PIXELS:
        return np.asarray(image.resize((width, height), resample=resample))
    inter = image
    if width != src_w:  # horizontal pass: rows are independent
        ys = _bounds(src_h, num_parts)
        strips = pool.map(
            lambda i: np.asarray(image.crop((0, ys[i], src_w, ys[i + 1])).resize((width, ys[i + 1] - ys[i]),
                                                                                 resample=resample)),
            range(num_parts),
        )
        inter = Image.fromarray(_stack(list(strips), axis=0))
    if height == src_h:
        return np.asarray(inter)
    xs = _bounds(width, num_parts)  # vertical pass: columns are independent
    cols = pool.map(
        lambda i: np.asarray(inter.crop((xs[i], 0, xs[i + 1], src_h)).resize((xs[i + 1] - xs[i], height),
                                                                             resample=resample)),
        range(num_parts),
    )
    return _stack(list(cols), axis=1)
