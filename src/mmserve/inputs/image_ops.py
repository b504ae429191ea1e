"""Exact, parallel image operations on PIL images and uint8 arrays.

Role: the pixel work of preprocessing, done fast without changing a single output value.
`resize_exact` / `resize_rgbx` give the same bytes as `PIL.Image.resize`. Pillow resamples
separably, one pass per axis with a uint8 intermediate between them; here the horizontal pass
runs on row strips and the vertical pass on column strips in a thread pool (Pillow releases the
GIL while cropping, pasting and resampling). Rows are independent in the horizontal pass and
columns in the vertical one, and the filter coefficients depend only on (source size, target
size), so the strips reproduce the whole-image result bit for bit, provided the passes run in
Pillow's order: before Pillow 13 always horizontal first, since then vertical first when the
height shrinks much more than the width. The order is learnt once from probe images, never
assumed. Finished strips are pasted straight into a numpy buffer that Pillow maps as an RGBX
image, so no `tobytes` copy (which holds the GIL) is made. `to_rgb` composites transparency onto
white, as the reference does.

What it does not know: models, patch sizes, normalisation constants.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np
from PIL import Image

# Below this many output pixels in a pass, a thread hop costs more than it saves.
_PARALLEL_MIN_PIXELS = 192 * 192
# Largest strip to crop out of a pass's input. Small crops are recycled by malloc from one strip
# to the next; big ones come back as fresh pages, and page faults are costly (in VMs especially).
_PIECE_BYTES = 4 << 20


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB view of `image`; transparent pixels are composited onto a white background. As transformers'
    `convert_to_rgb`: an RGB image that still carries a transparent colour (`info["transparency"]`, kept by
    Pillow from a palette file) is composited too."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if image.mode == "RGB" and not has_alpha:
        return image
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def run_pieces(fn: Callable[[int], None], n: int, pool: Executor | None) -> None:
    """Run fn(0), ..., fn(n - 1). The calling thread works too, and pool threads join in, each
    taking the next undone index when free: a thread slowed by a busy core just takes fewer, and
    the caller (already awake, caches warm) never sits idle waiting for a worker to wake up."""
    if pool is None or n <= 1:
        for i in range(n):
            fn(i)
        return
    counter = itertools.count()  # next() on it is atomic under the GIL

    def drain() -> None:
        while (i := next(counter)) < n:
            fn(i)

    helpers = [pool.submit(drain) for _ in range(n - 1)]  # spare ones find nothing left to do
    try:
        drain()
    finally:
        started = [future for future in helpers if not future.cancel()]  # queued ones: dropped
        for future in started:  # wait even on error: the pieces write into shared buffers
            future.exception()
    for future in started:
        future.result()  # re-raise a helper's error


def _bounds(total: int, parts: int, align: int = 1) -> list[int]:
    """Up to `parts` near-equal strips of [0, total); inner edges are multiples of `align`."""
    units = -(-total // align)
    return sorted({min(total, units * i // parts * align) for i in range(parts + 1)})


def _parts(src: tuple[int, int], dst: tuple[int, int], num_parts: int, pool: Executor | None) -> int:
    """How many strips to cut a pass into: num_parts, fewer when the pass is small, more when
    the strips would be bigger than _PIECE_BYTES (RGB is stored as 4 bytes a pixel)."""
    by_work = min(num_parts, dst[0] * dst[1] // _PARALLEL_MIN_PIXELS)
    if pool is None or by_work < 2:
        return 1
    return max(by_work, -(-src[0] * src[1] * 4 // _PIECE_BYTES))


def _map_rgbx(buffer: np.ndarray) -> Image.Image:
    """An RGBX image whose pixels live in `buffer` (H, W, 4 uint8, C-contiguous)."""
    h, w, _ = buffer.shape
    return Image.frombuffer("RGBX", (w, h), buffer, "raw", "RGBX", 0, 1)


def _mapping_works() -> bool:
    """Whether pasting into a mapped image writes the numpy buffer (checked once, on a 1x1)."""
    try:
        buffer = np.zeros((1, 1, 4), dtype=np.uint8)
        # the core paste: Image.paste would first copy the read-only mapped image
        _map_rgbx(buffer).im.paste(Image.new("RGB", (1, 1), (1, 2, 3)).im, (0, 0, 1, 1))
        return bool((buffer[0, 0, :3] == (1, 2, 3)).all())
    except (AttributeError, TypeError, ValueError):
        return False


_MAPPING_WORKS = _mapping_works()


class _Sink:
    """Where the finished strips go: pasted into a numpy-mapped image, or copied via asarray."""

    def __init__(self, out: np.ndarray) -> None:
        self.out = out
        self.mapped = _map_rgbx(out) if _MAPPING_WORKS else None

    def put(self, piece: Image.Image, x0: int, y0: int) -> None:
        w, h = piece.size
        if self.mapped is not None:  # a memcpy without the GIL
            self.mapped.im.paste(piece.im, (x0, y0, x0 + w, y0 + h))
        else:
            self.out[y0:y0 + h, x0:x0 + w, :3] = np.asarray(piece)


def _always_horizontal_first(src_w: int, src_h: int, width: int, height: int) -> bool:
    return True


def _horizontal_first_pillow13(src_w: int, src_h: int, width: int, height: int) -> bool:
    # Pillow 13: when the height shrinks by more than twice what the width does, vertical first
    return not (src_h - height > 0 and src_h - height > (src_w - width) * 2)


_PROBES = [((40, 100), (50, 60)), ((100, 100), (50, 60)), ((100, 100), (80, 50)),
           ((100, 100), (75, 50)), ((100, 100), (120, 130)), ((90, 120), (60, 70))]


@functools.cache
def _pass_order() -> Callable[[int, int, int, int], bool] | None:
    """Which pass this Pillow runs first, learnt once from small noise images (the two orders
    round differently); None when it fits no known rule, and then resizes are never split."""
    rng = np.random.default_rng(0)
    seen = []
    for (sw, sh), (w, h) in _PROBES:
        img = Image.fromarray(rng.integers(0, 256, (sh, sw, 3), dtype=np.uint8))
        full = img.resize((w, h), Image.Resampling.BICUBIC).tobytes()
        h_first = img.resize((w, sh), Image.Resampling.BICUBIC).resize((w, h), Image.Resampling.BICUBIC)
        v_first = img.resize((sw, h), Image.Resampling.BICUBIC).resize((w, h), Image.Resampling.BICUBIC)
        if h_first.tobytes() == v_first.tobytes() or full not in (h_first.tobytes(), v_first.tobytes()):
            return None
        seen.append(full == h_first.tobytes())
    for rule in (_always_horizontal_first, _horizontal_first_pillow13):
        if all(rule(*src, *dst) == s for (src, dst), s in zip(_PROBES, seen)):
            return rule
    return None


Rect = Callable[[int, int, int, int], None]


def _one_pass(image: Image.Image, size: tuple[int, int], resample: int, put: Callable[..., None],
              pool: Executor | None, parts: int, align: int = 1, done: Rect | None = None) -> None:
    """Resize to `size`, hand each piece to put(piece, x0, y0), then report its output rect
    to done(x0, y0, x1, y1) on the same thread. With parts > 1 the resize must keep one axis;
    it then runs on strips cut along the kept axis (edges multiples of `align`): row strips
    when the width changes (or nothing does), column strips when the height does."""
    (src_w, src_h), (width, height) = image.size, size
    rows = height == src_h
    edges = _bounds(height if rows else width, parts if pool is not None else 1, align)

    def strip(i: int) -> None:
        a, b = edges[i], edges[i + 1]
        if len(edges) == 2:  # one piece: no crop
            piece, x0, y0, rect = image, 0, 0, (0, 0, width, height)
        elif rows:  # crop (a row-range memcpy), resize and paste all run without the GIL
            piece, x0, y0, rect = image.crop((0, a, src_w, b)), 0, a, (0, a, width, b)
        else:
            piece, x0, y0, rect = image.crop((a, 0, b, src_h)), a, 0, (a, 0, b, height)
        if piece.size != (rect[2] - rect[0], rect[3] - rect[1]):
            piece = piece.resize((rect[2] - rect[0], rect[3] - rect[1]), resample)
        put(piece, x0, y0)
        if done is not None:
            done(*rect)

    run_pieces(strip, len(edges) - 1, pool)


def _paste_into(target: Image.Image) -> Callable[[Image.Image, int, int], None]:
    def put(piece: Image.Image, x0: int, y0: int) -> None:
        target.paste(piece, (x0, y0))  # a memcpy without the GIL; strips are disjoint
    return put


def resize_rgbx(image: Image.Image, width: int, height: int, resample: int,
                pool: Executor | None = None, num_parts: int = 2, *, out: np.ndarray | None = None,
                align: int = 1, on_piece: Rect | None = None) -> np.ndarray:
    """Resize an RGB image into a (height, width, 4) uint8 array: channels 0-2 equal
    `np.asarray(image.resize((width, height), resample))` bit for bit, channel 3 is padding
    (Pillow's own RGB layout, so pieces are pasted with a plain memcpy).

    With a pool, each pass is cut into up to `num_parts` strips; small passes stay whole, where
    the thread hops would cost more than they save. `out` (C-contiguous) receives the pixels
    instead of a fresh array. `on_piece(x0, y0, x1, y1)` is called, on the worker that made it,
    for each finished piece of the output (the pieces tile it; inner edges are multiples of
    `align`), so a consumer can work on it while it is still in cache.
    """
    if image.mode != "RGB":
        raise ValueError(f"resize_rgbx needs an RGB image, got mode {image.mode!r}")
    src_w, src_h = image.size
    if out is None:
        out = np.empty((height, width, 4), dtype=np.uint8)
    elif out.shape != (height, width, 4) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous ({height}, {width}, 4) uint8 array")
    sink = _Sink(out)
    sizes = [(width, height)]
    if width != src_w and height != src_h:  # two passes, in the order this Pillow runs them
        order = _pass_order() if pool is not None else None
        if order is not None:
            sizes.insert(0, (width, src_h) if order(src_w, src_h, width, height) else (src_w, height))
    for i, size in enumerate(sizes):
        one_axis = size[0] == image.width or size[1] == image.height
        parts = _parts(image.size, size, num_parts, pool) if one_axis else 1
        if i == len(sizes) - 1:
            _one_pass(image, size, resample, sink.put, pool, parts, align, on_piece)
        else:
            inter = Image.new("RGB", size, None)
            _one_pass(image, size, resample, _paste_into(inter), pool, parts)
            image = inter
    return sink.out


def resize_exact(image: Image.Image, width: int, height: int, resample: int,
                 pool: Executor | None = None, num_parts: int = 2) -> np.ndarray:
    """Resize an RGB image to a (height, width, 3) uint8 array (a view of a fresh RGBX buffer),
    bit-identical to `np.asarray(image.resize((width, height), resample))`."""
    return resize_rgbx(image, width, height, resample, pool, num_parts)[..., :3]


def rescale_normalize(pixels: np.ndarray, rescale_factor: float, mean: tuple[float, ...],
                      std: tuple[float, ...]) -> np.ndarray:
    """(..., 3) uint8 -> (..., 3) float32 as transformers' PIL image processors compute it: the rescale in
    float64 cast to float32, then the normalize in float32."""
    x = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
