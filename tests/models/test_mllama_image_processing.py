"""mllama's image preprocessing and tiling geometry against transformers' PIL image processor."""

import dataclasses

import numpy as np
import pytest
from PIL import Image
from transformers.models.mllama import image_processing_pil_mllama as ref_mllama
from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.models.mllama.image_processing import Preprocessing, preprocess_image, stack_images
from mmserve.models.mllama.tiling import (
    PADDING_ASPECT_RATIO_ID,
    TileLayout,
    aspect_ratio_id,
    optimal_tiled_canvas,
    size_fit_to_canvas,
    supported_aspect_ratios,
    tile_layout,
)
from testkit.conversations import random_image

# Llama-3.2-11B-Vision's preprocessor_config.json, the tile size and tile count varied per test
HUB_CONFIG = {
    "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_image_tiles": 4, "resample": 2, "rescale_factor": 0.00392156862745098,
    "size": {"height": 560, "width": 560},
}
SMALL_TILE_PX = 32


def config(tile_px: int = SMALL_TILE_PX, max_image_tiles: int = 4, **overrides) -> dict:
    return {**HUB_CONFIG, "size": {"height": tile_px, "width": tile_px}, "max_image_tiles": max_image_tiles,
            **overrides}


def image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A random image in `mode`; P, CMYK and transparent-colour images are converted from RGB."""
    rng = np.random.default_rng(seed * 1_000_003 + width * 7 + height)
    base = random_image(rng, width, height, mode if mode in ("RGB", "RGBA", "L") else "RGB")
    if mode == "P+transparency":  # a palette file's transparent colour, kept by Pillow in info
        base = base.convert("P")
        base.info["transparency"] = int(np.asarray(base)[0, 0])
    elif mode == "RGB+transparency":
        base.info["transparency"] = tuple(int(v) for v in np.asarray(base)[0, 0])
    elif mode not in ("RGB", "RGBA", "L"):
        base = base.convert(mode)
    return base


def assert_matches_reference(img: Image.Image, raw: dict) -> None:
    ref = MllamaImageProcessorPil(**raw)(images=img, return_tensors="np")
    ours = preprocess_image(img, Preprocessing.from_dict(raw))
    n = ours.num_tiles
    assert ref["num_tiles"] == [[n]]
    assert ref["aspect_ratio_ids"].tolist() == [[ours.aspect_ratio_id]]
    assert ref["aspect_ratio_mask"].tolist() == [[ours.aspect_ratio_mask.tolist()]]
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.flags.c_contiguous
    assert ours.pixel_values.shape == ref["pixel_values"][0, 0, :n].shape
    # the same uint8 resize and the same float32 arithmetic: equal bit for bit, padding included
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"][0, 0, :n])


# (width, height, mode): tiny, exactly tile-sized, near ties, square, very wide / tall, huge, other modes
SIZES = [
    (1, 1, "RGB"), (3, 7, "RGB"), (10, 2, "RGB"), (20, 20, "RGB"),
    (32, 32, "RGB"), (64, 32, "RGB"), (32, 64, "RGB"), (64, 64, "RGB"), (128, 32, "RGB"), (32, 96, "RGB"),
    (33, 33, "RGB"), (48, 48, "RGB"), (96, 33, "RGB"), (33, 96, "RGB"), (50, 90, "RGB"), (63, 65, "RGB"),
    (100, 100, "RGB"), (1000, 12, "RGB"), (2000, 5, "RGB"), (8, 900, "RGB"), (2400, 1800, "RGB"),
    (120, 96, "RGBA"), (77, 51, "L"), (90, 60, "P"), (70, 110, "P+transparency"), (45, 81, "RGB+transparency"),
    (60, 40, "CMYK"), (52, 37, "LA"),
]


@pytest.mark.parametrize("max_image_tiles", [4, 2, 6])
@pytest.mark.parametrize("width,height,mode", SIZES)
def test_tiles_match_reference(width, height, mode, max_image_tiles):
    assert_matches_reference(image(width, height, mode), config(max_image_tiles=max_image_tiles))


@pytest.mark.parametrize("width,height", [(1500, 1000), (300, 700), (560, 560), (2000, 400)])
def test_tiles_match_reference_at_the_real_tile_size(width, height):
    assert_matches_reference(image(width, height), config(tile_px=560))


@pytest.mark.parametrize("max_image_tiles", [1, 3, 8])
def test_other_tile_counts_match_reference(max_image_tiles):
    for width, height in [(50, 90), (300, 40), (17, 200), (64, 64)]:
        assert_matches_reference(image(width, height), config(tile_px=56, max_image_tiles=max_image_tiles))


@pytest.mark.parametrize("overrides", [
    {"resample": int(Image.Resampling.BICUBIC)}, {"resample": int(Image.Resampling.NEAREST)},
    {"resample": int(Image.Resampling.LANCZOS)}, {"do_rescale": False}, {"do_normalize": False},
    {"do_rescale": False, "do_normalize": False}, {"image_mean": [0.5] * 3, "image_std": [0.5] * 3},
    {"rescale_factor": 1 / 127.5}, {"do_convert_rgb": False},
], ids=str)
def test_settings_match_reference(overrides):
    for width, height in [(50, 90), (300, 40)]:
        assert_matches_reference(image(width, height), config(**overrides))


def test_class_defaults_fill_missing_keys():
    prep = Preprocessing.from_dict({})
    ref = MllamaImageProcessorPil()
    assert (prep.tile_px, prep.max_image_tiles, prep.resample) == (ref.size.height, ref.max_image_tiles, ref.resample)
    assert (prep.mean, prep.std, prep.rescale_factor) == (tuple(ref.image_mean), tuple(ref.image_std),
                                                          ref.rescale_factor)
    assert prep.do_convert_rgb and prep.do_rescale and prep.do_normalize
    img = image(300, 200)
    out = MllamaImageProcessorPil()(images=img, return_tensors="np")
    ours = preprocess_image(img, prep)
    np.testing.assert_array_equal(ours.pixel_values, out["pixel_values"][0, 0, :ours.num_tiles])


@pytest.mark.parametrize("sizes", [[(50, 90), (300, 40)], [(20, 20, "RGBA"), (64, 128), (400, 410, "L")]], ids=len)
def test_stacked_images_match_reference_batch(sizes):
    images = [image(*size, seed=i) for i, size in enumerate(sizes)]
    raw = config()
    ref = MllamaImageProcessorPil(**raw)(images=[images], return_tensors="np")
    prep = Preprocessing.from_dict(raw)
    stacked = stack_images([preprocess_image(img, prep) for img in images])
    assert stacked.pixel_values.shape == ref["pixel_values"].shape == (1, len(images), 4, 3, 32, 32)
    np.testing.assert_array_equal(stacked.pixel_values, ref["pixel_values"])  # zero tiles past each image
    assert stacked.aspect_ratio_ids.dtype == ref["aspect_ratio_ids"].dtype == np.int64
    np.testing.assert_array_equal(stacked.aspect_ratio_ids, ref["aspect_ratio_ids"])
    np.testing.assert_array_equal(stacked.aspect_ratio_mask, ref["aspect_ratio_mask"])
    assert [list(stacked.num_tiles)] == ref["num_tiles"]


def test_stacking_refuses_mixed_settings_and_nothing():
    img = image(50, 90)
    with pytest.raises(ValueError):
        stack_images([preprocess_image(img, Preprocessing.from_dict(config())),
                      preprocess_image(img, Preprocessing.from_dict(config(max_image_tiles=2)))])
    with pytest.raises(ValueError):
        stack_images([])


def test_a_non_rgb_image_without_conversion_is_refused():
    with pytest.raises(InvalidInputError):
        preprocess_image(image(40, 40, "L"), Preprocessing.from_dict(config(do_convert_rgb=False)))


@pytest.mark.parametrize("overrides", [{"do_pad": False}, {"do_resize": False}, {"size": {"height": 32, "width": 64}},
                                       {"size": {"shortest_edge": 32}}, {"max_image_tiles": 0},
                                       {"image_mean": [0.5, 0.5]}], ids=str)
def test_unsupported_configs_are_refused(overrides):
    with pytest.raises(ModelLoadError):
        Preprocessing.from_dict(config(**overrides))


# ---- tiling.py's geometry -------------------------------------------------------------------------
def test_supported_aspect_ratios_for_four_tiles():
    assert supported_aspect_ratios(4) == ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))


@pytest.mark.parametrize("max_image_tiles", range(1, 10))
def test_supported_aspect_ratios_match_reference(max_image_tiles):
    assert list(supported_aspect_ratios(max_image_tiles)) == ref_mllama.get_all_supported_aspect_ratios(max_image_tiles)


# heights/widths around tile multiples and their ratios, where the canvas choice ties or rounds
EDGES_PX = [1, 2, 5, 16, 31, 32, 33, 47, 48, 49, 63, 64, 65, 95, 96, 97, 100, 127, 128, 129, 150, 191, 192,
            200, 255, 256, 257, 300, 1000, 4321]


@pytest.mark.parametrize("max_image_tiles", [1, 2, 4, 6])
def test_canvas_and_fit_match_reference(max_image_tiles):
    for h in EDGES_PX:
        for w in EDGES_PX:
            canvas = optimal_tiled_canvas(h, w, max_image_tiles, SMALL_TILE_PX)
            assert canvas == tuple(int(v) for v in ref_mllama.get_optimal_tiled_canvas(
                h, w, max_image_tiles, SMALL_TILE_PX)), (h, w)
            assert size_fit_to_canvas(h, w, *canvas, SMALL_TILE_PX) == tuple(int(v) for v in (
                ref_mllama.get_image_size_fit_to_canvas(h, w, *canvas, SMALL_TILE_PX))), (h, w, canvas)


def test_canvas_at_the_real_tile_size_matches_reference():
    for h, w in [(1, 1), (559, 561), (560, 560), (561, 1120), (1120, 1120), (3000, 4000), (333, 2240),
                 (4032, 3024), (720, 1280)]:
        canvas = optimal_tiled_canvas(h, w, 4, 560)
        assert canvas == tuple(int(v) for v in ref_mllama.get_optimal_tiled_canvas(h, w, 4, 560))
        assert size_fit_to_canvas(h, w, *canvas, 560) == tuple(
            int(v) for v in ref_mllama.get_image_size_fit_to_canvas(h, w, *canvas, 560))


@pytest.mark.parametrize("max_image_tiles", [1, 4, 6])
def test_aspect_ratio_ids_match_reference(max_image_tiles):
    grids = list(supported_aspect_ratios(max_image_tiles))
    ref = ref_mllama.convert_aspect_ratios_to_ids_np([grids], max_image_tiles)
    assert [aspect_ratio_id(h, w, max_image_tiles) for h, w in grids] == ref[0].tolist()
    # transformers pads a prompt with fewer images with id 0
    short = ref_mllama.convert_aspect_ratios_to_ids_np([grids[:1] * 2, grids[:1]], max_image_tiles)
    assert short[1, 1] == PADDING_ASPECT_RATIO_ID


def test_aspect_ratio_id_refuses_a_grid_too_big():
    with pytest.raises(ValueError):
        aspect_ratio_id(3, 2, 4)


def test_tile_layout():
    layout = tile_layout(90, 50, SMALL_TILE_PX, 4)  # height 90, width 50: shrinks least onto the 2x2 canvas
    assert layout == TileLayout(64, 35, 64, 64, 2, 2, 6)
    assert layout.num_tiles == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.num_tiles_width = 1  # type: ignore[misc]
    wide = tile_layout(12, 1000, SMALL_TILE_PX, 4)
    assert (wide.num_tiles_height, wide.num_tiles_width, wide.num_tiles) == (1, 4, 4)
    assert (wide.resized_height_px, wide.resized_width_px) == (1, 128)  # floored, then at least 1 px


@pytest.mark.parametrize("args", [(0, 10, 32, 4), (10, -1, 32, 4), (10, 10, 0, 4), (10, 10, 32, 0), (10.0, 10, 32, 4)])
def test_tile_layout_refuses_non_positive_sizes(args):
    with pytest.raises(ValueError):
        tile_layout(*args)
