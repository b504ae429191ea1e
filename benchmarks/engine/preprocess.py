"""Qwen2-VL image preprocessing: mmserve's native processor against transformers' PIL processor.

Run: python -m benchmarks.engine.preprocess [--reps N] [--warmup N]

For each image size both processors run interleaved (reference, mmserve, reference, ...) on the
same image, so machine noise hits both alike; the median of the timed repetitions is reported,
plus the minimum. Outputs are checked to be identical (max abs diff of pixel_values, grid).
Prints a machine card, a table, and one JSON line last.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import PIL
import torch
from PIL import Image

from benchmarks.card import json_line
from mmserve.models.vision.qwen_image_processor import ImageProcessorConfig, Qwen2VLImageProcessor

SIZES = [(1280, 720), (4000, 3000)]


def natural_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth colour gradient with soft blobs and sensor-like noise: photo-ish statistics."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    x /= width
    y /= height
    r = 200 * x + 40 * np.sin(6 * y)
    g = 180 * y + 50 * np.cos(5 * x + 2 * y)
    b = 120 + 90 * np.sin(3 * (x + y))
    img = np.stack([r, g, b], axis=-1)
    for _ in range(6):  # a few soft blobs ("objects")
        cx, cy, rad = rng.random(), rng.random(), 0.05 + 0.2 * rng.random()
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / rad**2)[..., None]
        img += blob * rng.uniform(-80, 80, size=3)
    img += rng.normal(0, 6, size=img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def card(mm_threads: int) -> list[str]:
    import transformers

    return [
        "preprocess benchmark: Qwen2-VL image processor, transformers (PIL backend) vs mmserve",
        f"machine: {os.cpu_count()} CPUs, {platform.platform()}, {platform.processor() or platform.machine()}",
        f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"pillow {PIL.__version__}, transformers {transformers.__version__}",
        f"threads: mmserve preprocess pool {mm_threads}, torch intra-op {torch.get_num_threads()} "
        f"(not used by either processor), reference single-threaded (numpy + Pillow)",
        "settings: defaults (min_pixels=56*56, max_pixels=28*28*1280, bicubic, CLIP mean/std)",
    ]


def _busy_seconds() -> float | None:
    """CPU seconds spent busy by the whole machine so far (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def bench_size(ref, ours: Qwen2VLImageProcessor, width: int, height: int, reps: int, warmup: int) -> dict:
    img = natural_image(width, height, seed=width + height)
    ref_times, mm_times = [], []
    busy0, own0, wall0 = _busy_seconds(), sum(os.times()[:2]), time.perf_counter()
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        expected = ref(images=img, return_tensors="np")
        t1 = time.perf_counter()
        got = ours.preprocess_image(img)
        t2 = time.perf_counter()
        if i >= warmup:
            ref_times.append(t1 - t0)
            mm_times.append(t2 - t1)
    # other processes' CPU use during the run, in cores: this machine may be shared
    busy1, own1, wall1 = _busy_seconds(), sum(os.times()[:2]), time.perf_counter()
    others = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0 - (own1 - own0)) / (wall1 - wall0))
    ref_pv = expected["pixel_values"]
    same_shape = got.pixel_values.shape == ref_pv.shape
    diff = float(np.abs(got.pixel_values - ref_pv).max()) if same_shape else float("inf")
    ref_ms, mm_ms = statistics.median(ref_times) * 1e3, statistics.median(mm_times) * 1e3
    return {
        "size": f"{width}x{height}",
        "target": f"{got.grid_thw[2] * 14}x{got.grid_thw[1] * 14}",
        "ref_ms": round(ref_ms, 2),
        "mmserve_ms": round(mm_ms, 2),
        "speedup": round(ref_ms / mm_ms, 2),
        "ref_min_ms": round(min(ref_times) * 1e3, 2),
        "mmserve_min_ms": round(min(mm_times) * 1e3, 2),
        "max_abs_diff": diff,
        "grid_equal": list(got.grid_thw) == expected["image_grid_thw"][0].tolist(),
        "dtype": str(got.pixel_values.dtype),
        "reps": reps,
        "other_load_cores": None if others is None else round(others, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=21, help="timed repetitions per size")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    from transformers import Qwen2VLImageProcessorPil  # benchmark-only dependency

    ref = Qwen2VLImageProcessorPil()
    ours = Qwen2VLImageProcessor(ImageProcessorConfig())
    for line in card(ours._threads):
        print(line)
    results = [bench_size(ref, ours, w, h, args.reps, args.warmup) for w, h in SIZES]
    print()
    print(f"{'size':>10} {'target':>10} {'ref ms':>9} {'mmserve ms':>11} {'speedup':>8} "
          f"{'ref min':>8} {'mm min':>8} {'max|diff|':>10} {'grid':>5} {'others':>7}")
    for r in results:
        print(f"{r['size']:>10} {r['target']:>10} {r['ref_ms']:>9.2f} {r['mmserve_ms']:>11.2f} "
              f"{r['speedup']:>7.2f}x {r['ref_min_ms']:>8.2f} {r['mmserve_min_ms']:>8.2f} "
              f"{r['max_abs_diff']:>10.3g} {str(r['grid_equal']):>5} {r['other_load_cores']!s:>7}")
    print("others: CPU cores used by other processes during the run (noise; ideally 0)")
    json_line({"bench": "preprocess", "results": results})
    ok = all(r["max_abs_diff"] == 0.0 and r["grid_equal"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
