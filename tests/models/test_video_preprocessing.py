"""mmserve's Qwen2-VL / Qwen2.5-VL video preprocessing against transformers' documented video steps.

Role: the only check that the pixels, patch grid, placeholder count and M-RoPE positions of a
*video* match transformers. The model and engine parity tests feed transformers mmserve's own
video pixels, so a resize, padding or patch-order bug in mmserve's video path would pass there.

transformers' `Qwen2VLVideoProcessor` needs torchvision, which cannot be installed here, so the
reference rebuilds its steps (`video_processing_qwen2_vl.py`: `resize`, `rescale_and_normalize`,
`patchify`) from transformers' PIL image-processing functions (`Qwen2VLImageProcessorPil`, its
`PilBackend` resize / rescale / normalize and `convert_to_rgb`, and the module's `smart_resize`):
every frame is converted to RGB, resized to the one smart_resize target of the frame size
(factor patch * merge, the checkpoint's min/max pixels, which the video processor also reads from
preprocessor_config.json when there is no video config) with the PIL backend's resample, rescaled,
normalised with the processor's mean/std; the frame count is padded to a multiple of
temporal_patch_size by repeating the last frame; and the frames are cut into the Qwen2-VL
(t*h*w, C*T*P*P) rows in merge-block order. Only the patchify layout is re-typed from the video
processor (in numpy); it is anchored to transformers' own image patchify by a one-frame video,
which transformers' image processor must produce to the bit.

M-RoPE positions of Qwen2.5-VL videos are compared with `Qwen2_5_VLModel.get_rope_index`, given
`second_per_grid_ts = temporal_patch_size / fps` as `Qwen2_5_VLProcessor` computes it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.image_processing_backends import PilBackend
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from testkit.families import whole_items
from testkit.tiny_checkpoints import reference_inputs, spatial_merge_size
from tests.models.helpers import load_processor, random_image, text_part, user

TOLERANCE = 1e-5
SMALL_MAX_PIXELS = 28 * 28 * 6  # per-request override, still >= the checkpoint's min_pixels (56 * 56)

# name: (width, height, mode, frames)
VIDEOS = {
    "wide_3_frames": (200, 57, "RGB", 3),
    "tall_4_frames": (48, 130, "RGB", 4),
    "max_pixels_downscale_3_frames": (640, 400, "RGB", 3),  # 256000 px > the checkpoint's 28*28*256
    "rgba_4_frames": (90, 60, "RGBA", 4),
    "gray_3_frames": (90, 60, "L", 3),
}


def _frames(name: str, seed: int = 0):
    width, height, mode, count = VIDEOS[name]
    rng = np.random.default_rng(seed)
    return [random_image(rng, width, height, mode) for _ in range(count)]


def reference_video(model_dir, frames, max_pixels: int | None = None):
    """(pixel_values (t*h*w, C*T*P*P) float32, grid (t, h, w)) the Qwen2-VL video processor's steps give."""
    ip = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    size = SizeDict(**ip.size) if isinstance(ip.size, dict) else ip.size
    min_pixels, max_pixels = size.shortest_edge, max_pixels or size.longest_edge
    p, m, tp = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    # one target for the whole video, from the frame size (the video processor resizes the stacked frames)
    height, width = smart_resize(frames[0].height, frames[0].width, factor=p * m,
                                 min_pixels=min_pixels, max_pixels=max_pixels)
    processed = []
    for frame in frames:
        chw = ip.process_image(frame, do_convert_rgb=True)  # (C, H, W) uint8, PIL convert_to_rgb
        chw = PilBackend.resize(ip, chw, SizeDict(height=height, width=width), resample=ip.resample)
        chw = ip.rescale(chw, ip.rescale_factor)
        processed.append(ip.normalize(chw, ip.image_mean, ip.image_std))
    video = np.stack(processed).astype(np.float32)  # (F, C, H, W)
    if pad := -len(video) % tp:  # repeat the last frame, as Qwen2VLVideoProcessor.patchify does
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    f, c = video.shape[:2]
    gt, gh, gw = f // tp, height // p, width // p
    # Qwen2VLVideoProcessor.patchify without the batch axis: view, permute(1,4,7,5,8,3,2,6,9) - 1
    patches = video.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)


def _assert_close(ours, ours_grid, ref, ref_grid):
    assert tuple(ours_grid) == tuple(ref_grid)
    assert ours.shape == ref.shape
    assert float(np.abs(np.asarray(ours, dtype=np.float32) - ref).max()) <= TOLERANCE


def test_reference_one_frame_video_is_transformers_image_output(model_dir):
    """Anchor for the rebuilt reference: one frame, padded to temporal_patch_size by repetition,
    is exactly what transformers' own image processor (its patchify included) makes of that image."""
    image = random_image(np.random.default_rng(7), 200, 57)
    feats = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=[image], return_tensors="np")
    ref, grid = reference_video(model_dir, [image])
    assert tuple(feats["image_grid_thw"][0]) == grid
    np.testing.assert_array_equal(feats["pixel_values"], ref)


@pytest.mark.parametrize("override", [None, SMALL_MAX_PIXELS], ids=["default", "max_pixels_override"])
@pytest.mark.parametrize("name", list(VIDEOS))
def test_preprocess_video_matches_reference(model_dir, name, override):
    frames = _frames(name)
    image_processor = load_processor(model_dir).image_processor
    ours = image_processor.preprocess_video(frames, None if override is None else {"max_pixels": override})
    ref, grid = reference_video(model_dir, frames, override)
    _assert_close(ours.pixel_values, ours.grid_thw, ref, grid)
    cfg = image_processor.cfg
    assert grid[0] == -(-len(frames) // cfg.temporal_patch_size)  # odd frame counts are padded, not dropped
    if name == "max_pixels_downscale_3_frames" or override is not None:
        assert grid[1] * grid[2] * cfg.patch_size**2 <= (override or cfg.max_pixels)


@pytest.mark.parametrize("override", [None, SMALL_MAX_PIXELS], ids=["default", "max_pixels_override"])
def test_processed_prompt_video_rows_and_pixels(model_dir, override):
    """Through the full processor: one <|video_pad|> per merged patch (merge from the checkpoint's
    config), and the item's payload holds the reference pixels and grid."""
    frames = _frames("wide_3_frames", seed=1)
    processor = load_processor(model_dir)
    chat = processor.render_chat(user({"type": "video", "video": frames}, text_part("What happens?")))
    kwargs = None if override is None else {"max_pixels": override}
    prompt = processor.process(chat.prompt, videos=chat.videos, mm_processor_kwargs=kwargs)
    ((pixels, ours_grid),) = whole_items(prompt, "video")
    ref, grid = reference_video(model_dir, frames, override)
    _assert_close(pixels, tuple(ours_grid), ref, grid)
    rows = int(np.prod(grid)) // spatial_merge_size(model_dir) ** 2
    assert [i.part for i in prompt.items] == list(range(grid[0]))  # one item per temporal group
    assert sum(i.output_rows for i in prompt.items) == rows
    assert prompt.prompt_token_ids.count(processor.config.video_token_id) == rows
    ref_inputs, _ = reference_inputs(model_dir, chat.prompt, videos_pixel_values=ref, video_grid_thw=[list(grid)])
    assert prompt.prompt_token_ids == ref_inputs["input_ids"][0].tolist()


@pytest.fixture(scope="module")
def qwen2_5_reference(checkpoint_dirs):
    from transformers import Qwen2_5_VLModel

    return Qwen2_5_VLModel.from_pretrained(checkpoint_dirs["qwen2_5_vl"]).eval()


@pytest.mark.parametrize("fps", [2.0, 3.0, 0.5])
def test_qwen2_5_video_mrope_temporal_step(checkpoint_dirs, qwen2_5_reference, fps):
    """Qwen2.5-VL spaces a video's temporal patches by tokens_per_second * temporal_patch_size / fps
    (truncated to integers), exactly as transformers' get_rope_index does."""
    model_dir = checkpoint_dirs["qwen2_5_vl"]
    frames = [random_image(np.random.default_rng(3), 84, 56) for _ in range(6)]  # 3 temporal patches
    processor = load_processor(model_dir)
    chat = processor.render_chat(user(text_part("Watch:"), {"type": "video", "video": frames},
                                      text_part("What happens?")))
    ours = processor.process(chat.prompt, videos=chat.videos, mm_processor_kwargs={"fps": fps})
    ((pixels, grid),) = whole_items(ours, "video")
    ref, _ = reference_inputs(model_dir, chat.prompt, videos_pixel_values=pixels, video_grid_thw=[list(grid)])
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    vision = qwen2_5_reference.config.vision_config
    with torch.no_grad():
        positions, delta = qwen2_5_reference.get_rope_index(
            ref["input_ids"], ref["mm_token_type_ids"], video_grid_thw=torch.tensor([list(grid)]),
            second_per_grid_ts=torch.tensor([vision.temporal_patch_size / fps]),
            attention_mask=ref["attention_mask"])
    expected = positions[:, 0].numpy()
    np.testing.assert_array_equal(ours.positions.table, expected)
    assert ours.positions.decode_delta == int(delta[0, 0])
    # the step itself, spelled out: temporal patch k sits at start + int(k * interval)
    interval = vision.tokens_per_second * vision.temporal_patch_size / fps
    pads = np.flatnonzero(np.asarray(ours.prompt_token_ids) == processor.config.video_token_id)
    temporal = ours.positions.table[0, pads[::len(pads) // grid[0]]]
    assert (temporal - temporal[0]).tolist() == [int(k * interval) for k in range(grid[0])]
