"""Gemma 3's pan-and-scan: which crops of an elongated image are encoded besides the whole image.

Role: the settings (`PanAndScan`, validated from a request's mm_processor_kwargs with transformers'
Gemma3Processor defaults) and the crop rectangles of an image of a given size, computed exactly
as transformers' Gemma 3 image processor does it: an image whose long side exceeds the short one
by `min_ratio_to_activate` is cut along its long side into round(ratio) crops (at least 2, at most
`max_num_crops`, each at least `min_crop_size` pixels), of ceil(long / n) pixels each; the last crop
is cut short at the image's edge, as numpy slicing does in the reference.

What it does not know: pixels, resizing, prompts, models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mmserve.errors import InvalidInputError

# transformers' Gemma3Processor.images_kwargs: they win over the image processor's own settings, whatever
# preprocessor_config.json says, so a request that only turns pan-and-scan on gets these
DEFAULT_MIN_CROP_SIZE = 256
DEFAULT_MAX_NUM_CROPS = 4
DEFAULT_MIN_RATIO = 1.2
KWARGS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
          "pan_and_scan_min_ratio_to_activate")

Box = tuple[int, int, int, int]  # (left, top, right, bottom) in pixels, PIL's crop box


@dataclass(frozen=True)
class PanAndScan:
    min_crop_size: int = DEFAULT_MIN_CROP_SIZE
    max_num_crops: int = DEFAULT_MAX_NUM_CROPS
    min_ratio_to_activate: float = DEFAULT_MIN_RATIO


def _positive(kwargs: dict[str, Any], name: str, kind: type, default: float, most: float | None = None) -> Any:
    value = kwargs.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)) \
            or value <= 0 or (most is not None and value > most):
        bound = f" and at most {most}" if most is not None else ""
        raise InvalidInputError(f"{name} must be a positive {kind.__name__}{bound}, got {value!r:.40}",
                                param=f"mm_processor_kwargs.{name}")
    return kind(value)


def parse_pan_and_scan(kwargs: dict[str, Any], max_num_crops_limit: int) -> PanAndScan | None:
    """The request's pan-and-scan settings, None when it is off. InvalidInputError on unknown keys or
    bad values; a request may ask for at most `max_num_crops_limit` crops (the budgets are sized for it)."""
    unknown = sorted(set(kwargs) - set(KWARGS))
    if unknown:
        raise InvalidInputError(f"unsupported mm_processor_kwargs {unknown}; supported: {list(KWARGS)}",
                                param=f"mm_processor_kwargs.{unknown[0]}")
    enabled = kwargs.get("do_pan_and_scan", False)
    if not isinstance(enabled, bool):
        raise InvalidInputError(f"do_pan_and_scan must be a boolean, got {enabled!r:.40}",
                                param="mm_processor_kwargs.do_pan_and_scan")
    settings = PanAndScan(
        _positive(kwargs, "pan_and_scan_min_crop_size", int, DEFAULT_MIN_CROP_SIZE),
        _positive(kwargs, "pan_and_scan_max_num_crops", int, DEFAULT_MAX_NUM_CROPS, max_num_crops_limit),
        _positive(kwargs, "pan_and_scan_min_ratio_to_activate", float, DEFAULT_MIN_RATIO),
    )
    return settings if enabled else None


def crop_boxes(width: int, height: int, settings: PanAndScan) -> list[Box]:
    """The crops of a width x height image, row by row; empty when pan-and-scan does not apply."""
    long_side, short_side = max(width, height), min(width, height)
    if long_side / short_side < settings.min_ratio_to_activate:
        return []
    # crops close to the aspect ratio (half rounded up), each at least min_crop_size, in [2, max_num_crops]
    count = min(int(math.floor(long_side / short_side + 0.5)), int(math.floor(long_side / settings.min_crop_size)))
    count = min(settings.max_num_crops, max(2, count))
    crops_w, crops_h = (count, 1) if width >= height else (1, count)
    crop_w, crop_h = int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))
    if min(crop_w, crop_h) < settings.min_crop_size:
        return []
    # a crop starting past the edge would be empty (transformers fails on it): only tiny min_crop_size get there
    return [(x, y, min(x + crop_w, width), min(y + crop_h, height))
            for y in range(0, crop_h * crops_h, crop_h) for x in range(0, crop_w * crops_w, crop_w)
            if x < width and y < height]
