"""Exactness of the parallel image ops (resize, RGB conversion) and of the fast patchify path.

Everything is compared bit for bit with plain Pillow / plain numpy; no transformers here.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from mmserve.inputs import image_ops
from mmserve.inputs.image_ops import resize_exact, resize_rgbx, run_pieces, to_rgb
from mmserve.models.vision.qwen_image_processor import (
    ImageProcessorConfig,
    Qwen2VLImageProcessor,
    normalize_table,
)

BICUBIC = Image.Resampling.BICUBIC


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2) as executor:
        yield executor


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradient plus noise: neighbouring pixels correlate, as in a photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8))


SIZES = [
    ((100, 80), (300, 200)),  # upscale
    ((640, 480), (200, 150)),  # downscale
    ((320, 240), (320, 100)),  # width unchanged
    ((320, 240), (500, 240)),  # height unchanged
    ((300, 200), (300, 200)),  # no resize at all
    ((1, 1), (28, 28)),  # tiny
    ((5, 3), (28, 56)),
    ((1280, 720), (1288, 728)),  # large enough for the parallel path, slight upscale
    ((1500, 1000), (812, 532)),  # parallel path, strong downscale
    ((1200, 1600), (1400, 700)),  # height shrinks far more than width: Pillow 13 resizes vertically first
    ((1600, 400), (700, 420)),
]


@pytest.mark.parametrize("use_pool", [True, False], ids=["pool2", "nopool"])
@pytest.mark.parametrize("src,dst", SIZES, ids=[f"{s[0]}x{s[1]}->{d[0]}x{d[1]}" for s, d in SIZES])
def test_resize_exact_matches_pillow(src, dst, use_pool, pool):
    img = _image(*src, seed=src[0] + dst[1])
    expected = np.asarray(img.resize(dst, BICUBIC))
    got = resize_exact(img, dst[0], dst[1], BICUBIC, pool if use_pool else None)
    assert got.shape == expected.shape and got.dtype == np.uint8
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("resample", [Image.Resampling.BILINEAR, Image.Resampling.LANCZOS,
                                      Image.Resampling.BOX, Image.Resampling.NEAREST])
def test_resize_exact_other_filters(resample, pool):
    img = _image(900, 700, seed=int(resample))
    for dst in [(1204, 588), (420, 980)]:
        assert np.array_equal(resize_exact(img, *dst, resample, pool), np.asarray(img.resize(dst, resample)))


def test_resize_exact_more_parts_than_needed(pool):
    img = _image(1000, 800, seed=7)
    expected = np.asarray(img.resize((700, 1100), BICUBIC))
    assert np.array_equal(resize_exact(img, 700, 1100, BICUBIC, pool, num_parts=5), expected)


def test_resize_without_buffer_mapping_still_exact(pool, monkeypatch):
    monkeypatch.setattr(image_ops, "_MAPPING_WORKS", False)
    img = _image(1280, 720, seed=3)
    assert np.array_equal(resize_exact(img, 1288, 728, BICUBIC, pool), np.asarray(img.resize((1288, 728), BICUBIC)))


def test_pass_order_is_known_so_big_resizes_are_split():
    assert image_ops._pass_order() is not None


def test_resize_with_unknown_pass_order_still_exact(pool, monkeypatch):
    monkeypatch.setattr(image_ops, "_pass_order", lambda: None)
    img = _image(800, 1000, seed=4)
    for dst in [(900, 400), (500, 1100)]:
        assert np.array_equal(resize_exact(img, *dst, BICUBIC, pool), np.asarray(img.resize(dst, BICUBIC)))


def test_resize_returns_fresh_writable_buffer(pool):
    img = _image(640, 480)
    first = resize_rgbx(img, 644, 476, BICUBIC, pool)
    assert first.shape == (476, 644, 4) and first.flags.writeable and first.flags.c_contiguous
    second = resize_exact(img, 644, 476, BICUBIC, pool)
    second[...] = 0  # must not touch anything shared
    assert np.array_equal(first[..., :3], np.asarray(img.resize((644, 476), BICUBIC)))


def test_resize_rejects_non_rgb():
    with pytest.raises(ValueError):
        resize_exact(Image.new("L", (10, 10)), 20, 20, BICUBIC)


@pytest.mark.parametrize("use_pool", [True, False], ids=["pool2", "nopool"])
def test_run_pieces_runs_each_index_once(use_pool, pool):
    seen: list[int] = []
    run_pieces(seen.append, 7, pool if use_pool else None)
    assert sorted(seen) == list(range(7))
    run_pieces(seen.append, 0, pool if use_pool else None)
    assert len(seen) == 7


def test_run_pieces_propagates_errors(pool):
    def fail_on_three(i: int) -> None:
        if i == 3:
            raise RuntimeError("piece 3")

    with pytest.raises(RuntimeError, match="piece 3"):
        run_pieces(fail_on_three, 6, pool)


def test_to_rgb_composites_rgba_onto_white():
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 0)  # fully transparent -> white
    rgba[0, 1] = (10, 20, 30, 255)  # opaque -> unchanged
    rgba[1, 0] = (0, 0, 0, 128)  # half transparent black -> mid grey
    out = to_rgb(Image.fromarray(rgba, "RGBA"))
    assert out.mode == "RGB"
    px = np.asarray(out)
    assert tuple(px[0, 0]) == (255, 255, 255)
    assert tuple(px[0, 1]) == (10, 20, 30)
    assert 120 <= px[1, 0, 0] <= 130 and len(set(px[1, 0].tolist())) == 1


def test_to_rgb_l_and_p_modes():
    gray = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4) * 20, "L")
    out = to_rgb(gray)
    assert out.mode == "RGB" and out.size == gray.size
    assert np.array_equal(np.asarray(out), np.repeat(np.asarray(gray)[..., None], 3, axis=2))
    rgb = _image(16, 12)
    pal = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    out = to_rgb(pal)
    assert out.mode == "RGB" and np.array_equal(np.asarray(out), np.asarray(pal.convert("RGB")))
    assert to_rgb(rgb) is rgb


def _patchify_reference(frames: np.ndarray, cfg: ImageProcessorConfig) -> np.ndarray:
    """Straightforward numpy patchify: table lookup, transpose, repeat over time."""
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    frames = frames[..., :3]
    if frames.shape[0] == 1:
        frames = np.repeat(frames, tp, axis=0)
    f, h, w, c = frames.shape
    values = normalize_table(cfg)[np.arange(c), frames]  # (F, H, W, C) float32
    values = values.reshape(f // tp, tp, h // p // m, m, p, w // p // m, m, p, c)
    values = values.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return values.reshape(-1, c * tp * p * p)


@pytest.mark.parametrize("cfg", [ImageProcessorConfig(),
                                 ImageProcessorConfig(rescale_factor=1 / 127.3, image_mean=(0.1, 0.2, 0.3))],
                         ids=["default", "table-fallback"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_patchify_matches_plain_numpy(cfg, num_threads):
    proc = Qwen2VLImageProcessor(cfg, num_threads=num_threads)
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, size=(1, 56 * 9, 28 * 40, 4), dtype=np.uint8)  # RGBX, > 1024 patches
    video = rng.integers(0, 256, size=(4, 56, 84, 3), dtype=np.uint8)
    for frames in (image, video):
        item = proc._patchify(frames, cfg)
        expected = _patchify_reference(frames, cfg)
        assert item.pixel_values.dtype == np.float32 and item.pixel_values.flags.c_contiguous
        assert np.array_equal(item.pixel_values, expected)
        assert item.grid_thw == (max(frames.shape[0] // 2, 1), frames.shape[1] // 14, frames.shape[2] // 14)


def test_on_piece_rects_tile_the_output_on_aligned_edges(pool):
    img = _image(1280, 720, seed=9)
    for dst in [(1288, 728), (1288, 720), (1280, 728), (1280, 720), (1400, 308)]:
        rects: list[tuple[int, int, int, int]] = []
        out = np.zeros((dst[1], dst[0], 4), dtype=np.uint8)
        got = resize_rgbx(img, *dst, BICUBIC, pool, 4, out=out, align=28, on_piece=lambda *r, acc=rects: acc.append(r))
        assert got is out and np.array_equal(out[..., :3], np.asarray(img.resize(dst, BICUBIC)))
        cover = np.zeros((dst[1], dst[0]), dtype=np.int32)
        for x0, y0, x1, y1 in rects:
            cover[y0:y1, x0:x1] += 1
            assert all(v % 28 == 0 or v in dst for v in (x0, y0, x1, y1))
        assert (cover == 1).all() and len(rects) > 1


def _plain_pipeline(frames: list[Image.Image], proc: Qwen2VLImageProcessor) -> np.ndarray:
    h, w = proc.target_size(frames[0].height, frames[0].width)
    arrays = [np.asarray(to_rgb(f).resize((w, h), BICUBIC)) for f in frames]
    while len(arrays) > 1 and len(arrays) % 2:
        arrays.append(arrays[-1])
    return _patchify_reference(np.stack(arrays), proc.cfg)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_preprocess_matches_plain_pillow_numpy_pipeline(num_threads):
    proc = Qwen2VLImageProcessor(ImageProcessorConfig(), num_threads=num_threads)
    for size in [(1280, 720), (1288, 728), (57, 311)]:  # split resize, no resize (split copy), tiny
        img = _image(*size, seed=size[0])
        item = proc.preprocess_image(img)
        assert np.array_equal(item.pixel_values, _plain_pipeline([img], proc))
    frames = [_image(320, 240, seed=1), _image(320, 240, seed=2), _image(300, 260, seed=3)]  # last: other size
    video = proc.preprocess_video(frames)
    assert video.grid_thw[0] == 2 and np.array_equal(video.pixel_values, _plain_pipeline(frames, proc))
