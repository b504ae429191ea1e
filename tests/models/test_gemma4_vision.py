"""Gemma 4's vision preprocessing and vision encoder against transformers.

Images: `preprocess_image` equals `Gemma4ImageProcessorPil` exactly on tiny settings, for ordinary, very
wide and very tall (the one-cell-thick branch), one-pixel, transparent and grey images; the counts equal
`Gemma4Processor._get_num_multimodal_tokens`. Videos: `Gemma4VideoProcessor` needs torchvision, absent
here, so its `_preprocess` is transcribed below in torch (torchvision's uint8 CPU resize dispatch, the
fused rescale-normalize, patches, padding) and frames are also checked against the image path (equal
unresized; resized, within two 8-bit levels: torch's antialiased resize rounds unlike Pillow's).
Encoder: a tiny random tower built as transformers' `Gemma4Model`, loaded into ours strictly through
`vision_weight_name`; ours runs images and a video as one padded batch against `get_image_features` /
`get_video_features`, with clipped linears (finite bounds that do clip) and standardization, and without.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.models.gemma4 import image_processing_pil_gemma4
from transformers.models.gemma4.configuration_gemma4 import Gemma4Config as HFConfig
from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig as HFVisionConfig
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.modeling_gemma4 import Gemma4Model
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor, get_aspect_ratio_preserving_size

from mmserve.errors import InvalidInputError, ModelLoadError
from mmserve.models.gemma4.image_processing import (
    Gemma4ImageSettings,
    Gemma4VisionInput,
    max_soft_tokens_per_image,
    preprocess_image,
    preprocess_video_frames,
    soft_tokens_for_size,
    soft_tokens_for_video,
)
from mmserve.models.gemma4.vision import Gemma4VisionEncoder, vision_weight_name
from mmserve.models.gemma4.vision_config import Gemma4VisionConfig, parse_vision_config
from testkit.conversations import random_image

TOL = dict(atol=1e-5, rtol=1e-5)
TEXT_HIDDEN = 24
TINY_TEXT = dict(vocab_size=64, hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8,
                 vocab_size_per_layer_input=64, hidden_size_per_layer_input=4, sliding_window=8,
                 max_position_embeddings=64, layer_types=["full_attention"])
TINY_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                   position_embedding_size=160, rms_norm_eps=1e-6)
PROCESSOR_SETTINGS = {
    "p4_k2_70": dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70),
    "p8_k3_70": dict(patch_size=8, pooling_kernel_size=3, max_soft_tokens=70),
    "p4_k3_140_normalized_bilinear": dict(patch_size=4, pooling_kernel_size=3, max_soft_tokens=140,
                                          do_normalize=True, image_mean=[0.5, 0.4, 0.3],
                                          image_std=[0.2, 0.3, 0.45], resample=2),
}
TOWER_PROCESSOR = PROCESSOR_SETTINGS["p4_k2_70"]  # the processors' settings for the tiny tower
SIZES = {  # (width, height)
    "square": (64, 64), "landscape": (50, 40), "portrait": (37, 91), "at_target": (80, 56),
    "wide": (400, 7), "very_wide": (3000, 2), "tall": (9, 500), "very_tall": (3, 2500), "one_pixel": (1, 1),
    "large": (640, 480),
}


def reference_image(image: Image.Image, settings: dict) -> tuple[np.ndarray, np.ndarray, int]:
    out = Gemma4ImageProcessorPil(**settings)(image)
    return out["pixel_values"][0], out["image_position_ids"][0], out["num_soft_tokens_per_image"][0]


def assert_same_as_reference(ours: Gemma4VisionInput, pixels: np.ndarray, positions: np.ndarray,
                             num_soft_tokens: int) -> None:
    """Ours are the reference's real rows; the reference pads the rest with zeros and (-1, -1)."""
    n = ours.pixel_values.shape[0]
    assert ours.pixel_values.dtype == pixels.dtype == np.float32
    assert ours.position_ids.dtype == positions.dtype == np.int64
    assert np.array_equal(ours.pixel_values, pixels[:n]) and np.array_equal(ours.position_ids, positions[:n])
    assert not pixels[n:].any() and (positions[n:] == -1).all()
    assert ours.num_soft_tokens == num_soft_tokens


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("name", PROCESSOR_SETTINGS)
def test_image_matches_transformers(name, size):
    kw = PROCESSOR_SETTINGS[name]
    image = random_image(np.random.default_rng(hash(size) % 1000), *size)
    settings = Gemma4ImageSettings.from_dict(kw)
    ours = preprocess_image(image, settings)
    assert_same_as_reference(ours, *reference_image(image, kw))
    assert ours.num_soft_tokens == soft_tokens_for_size(size[1], size[0], settings) <= \
        max_soft_tokens_per_image(settings)


@pytest.mark.parametrize("mode", ["RGBA", "L", "P"])
def test_image_modes_match_transformers(mode):
    image = random_image(np.random.default_rng(5), 45, 30, "RGB" if mode == "P" else mode)
    if mode == "P":  # a palette with a transparent colour: composited onto white as well
        image = image.quantize(16)
        image.info["transparency"] = 3
    ours = preprocess_image(image, Gemma4ImageSettings.from_dict(TOWER_PROCESSOR))
    assert_same_as_reference(ours, *reference_image(image, TOWER_PROCESSOR))


def test_unresized_image_matches_transformers():
    kw = dict(TOWER_PROCESSOR, do_resize=False)
    settings, rng = Gemma4ImageSettings.from_dict(kw), np.random.default_rng(7)
    image = random_image(rng, 48, 32)  # whole 8 px cells, 96 of 280 patches
    assert_same_as_reference(preprocess_image(image, settings), *reference_image(image, kw))
    for width, height in [(50, 32), (48, 36), (200, 200)]:  # partial cells; past the patch budget
        with pytest.raises(InvalidInputError):
            preprocess_image(random_image(rng, width, height), settings)


@pytest.mark.parametrize("name", PROCESSOR_SETTINGS)
def test_counts_match_the_processor(name):
    kw = PROCESSOR_SETTINGS[name]
    sizes = [(h, w) for w, h in SIZES.values()] + [(123, 457), (1000, 17), (17, 1000)]
    # what `_get_num_multimodal_tokens` reads of a Gemma4Processor (its video processor needs torchvision)
    processor = types.SimpleNamespace(
        _merge_kwargs=lambda **_: {"images_kwargs": {}, "videos_kwargs": {}},
        image_processor=Gemma4ImageProcessorPil(**kw),
        video_processor=types.SimpleNamespace(**{k: kw[k] for k in TOWER_PROCESSOR}))
    data = Gemma4Processor._get_num_multimodal_tokens(processor, image_sizes=sizes,
                                                       video_sizes=[(3, h, w) for h, w in sizes])
    settings = Gemma4ImageSettings.from_dict(kw)
    assert data["num_image_tokens"] == [soft_tokens_for_size(h, w, settings) for h, w in sizes]
    video_settings = Gemma4ImageSettings.from_dict(kw, video=True)
    assert data["num_video_tokens"] == [soft_tokens_for_video(3, h, w, video_settings) for h, w in sizes]
    # the largest count any image gets, reached by a budget-filling size (e.g. 7 x 10 cells of 70)
    counts = [soft_tokens_for_size(h, w, settings) for h in range(1, 300, 7) for w in range(1, 300, 11)]
    assert max(counts) <= max_soft_tokens_per_image(settings) == kw["max_soft_tokens"]
    assert soft_tokens_for_size(7 * 8, 10 * 8, Gemma4ImageSettings.from_dict(TOWER_PROCESSOR)) == 70


def _video_processor_defaults() -> dict:
    """Gemma4VideoProcessor's literal class attributes, read from its source (it cannot be imported)."""
    path = Path(inspect.getsourcefile(image_processing_pil_gemma4)).with_name("video_processing_gemma4.py")
    classes = {getattr(n, "name", None): n for n in ast.parse(path.read_text()).body}
    cls = classes["Gemma4VideoProcessor"]
    return {n.targets[0].id: ast.literal_eval(n.value) for n in cls.body  # literals only: not `resample`
            if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Constant, ast.List))}


def _same(ours, want) -> bool:
    return ours == (tuple(want) if isinstance(want, list) else want)


def test_settings_defaults_are_transformers():
    image, reference = Gemma4ImageSettings.from_dict({}), Gemma4ImageProcessorPil()
    for field in dataclasses.fields(Gemma4ImageSettings):
        assert _same(getattr(image, field.name), getattr(reference, field.name)), field.name
    video, video_defaults = Gemma4ImageSettings.from_dict({}, video=True), _video_processor_defaults()
    for name in ("patch_size", "max_soft_tokens", "pooling_kernel_size", "do_resize", "do_rescale",
                 "do_normalize", "do_convert_rgb", "image_mean", "image_std"):
        assert _same(getattr(video, name), video_defaults[name]), name
    assert (video.resample, video.rescale_factor) == (int(Image.Resampling.BICUBIC), 1 / 255)


@pytest.mark.parametrize("raw,video", [({"max_soft_tokens": 100}, False), ({"patch_size": 0}, False),
                                       ({"image_mean": [0.5, 0.5]}, False), ({"resample": 9}, False),
                                       ({"do_normalize": True, "image_std": [1.0, 0.0, 1.0]}, False),
                                       ({"resample": int(Image.Resampling.LANCZOS)}, True)])
def test_bad_settings(raw, video):
    with pytest.raises(ModelLoadError):
        Gemma4ImageSettings.from_dict(raw, video=video)


def reference_video(frames: np.ndarray, kw: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """`Gemma4VideoProcessor._preprocess` on one video of (T, H, W, 3) uint8 frames, transcribed (bicubic)."""
    s = dict(image_mean=[0.0] * 3, image_std=[1.0] * 3, rescale_factor=1 / 255, do_normalize=True) | kw
    patch, kernel = s["patch_size"], s["pooling_kernel_size"]
    max_patches = s["max_soft_tokens"] * kernel ** 2
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # _prepare_input_videos
    height, width = get_aspect_ratio_preserving_size(height=frames.shape[1], width=frames.shape[2],
                                                     patch_size=patch, max_patches=max_patches,
                                                     pooling_kernel_size=kernel)
    if (height, width) != tuple(video.shape[-2:]):  # torchvision's resize_image: bicubic keeps uint8 on CPU
        video = F.interpolate(video, size=[height, width], mode="bicubic", align_corners=False,
                              antialias=True)
    if s["do_normalize"]:  # _fuse_mean_std_and_rescale_factor, then tvF.normalize
        mean = torch.tensor(s["image_mean"]) * (1.0 / s["rescale_factor"])
        std = torch.tensor(s["image_std"]) * (1.0 / s["rescale_factor"])
        video = video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    else:
        video = video * s["rescale_factor"]
    t, c, h, w = video.shape  # convert_video_to_patches
    patches = video.reshape(t, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 3, 5, 1)
    patches = patches.reshape(t, (h // patch) * (w // patch), -1)
    grid = torch.stack(torch.meshgrid(torch.arange(w // patch), torch.arange(h // patch), indexing="xy"),
                       dim=-1)
    positions = grid.reshape(patches.shape[1], 2)[None].repeat(t, 1, 1)
    pad = max_patches - patches.shape[1]  # pad_to_max_patches
    patches = F.pad(patches, [0, 0, 0, pad, 0, 0], value=0)
    positions = F.pad(positions, (0, 0, 0, pad, 0, 0), value=-1)
    return patches.numpy(), positions.numpy(), (h // patch) * (w // patch) // kernel ** 2


def random_video(rng: np.random.Generator, num_frames: int, width: int, height: int) -> np.ndarray:
    return np.stack([np.asarray(random_image(rng, width, height)) for _ in range(num_frames)])


VIDEO_SIZES = {"resized": (50, 40), "tall": (30, 90), "at_target": (80, 56), "wide": (500, 6)}


@pytest.mark.parametrize("size", VIDEO_SIZES.values(), ids=VIDEO_SIZES.keys())
@pytest.mark.parametrize("extra", [{}, {"do_normalize": False}, {"image_mean": [0.5, 0.4, 0.3],
                                                                   "image_std": [0.2, 0.3, 0.45]}],
                         ids=["default", "rescale_only", "normalized"])
def test_video_matches_video_processor(size, extra):
    kw = dict(TOWER_PROCESSOR, **extra)
    frames = random_video(np.random.default_rng(11), 3, *size)
    settings = Gemma4ImageSettings.from_dict(kw, video=True)
    ours = preprocess_video_frames(frames, settings)
    as_images = preprocess_video_frames([Image.fromarray(f) for f in frames], settings)
    assert np.array_equal(ours.pixel_values, as_images.pixel_values)
    pixels, positions, per_frame = reference_video(frames, kw)
    assert ours.num_frames == 3 and ours.num_soft_tokens_per_frame == per_frame
    n = ours.patches_per_frame
    assert np.array_equal(ours.pixel_values.reshape(3, n, -1), pixels[:, :n])
    assert np.array_equal(ours.position_ids.reshape(3, n, 2), positions[:, :n])
    assert not pixels[:, n:].any() and (positions[:, n:] == -1).all()


def test_video_frames_against_the_image_path():
    """The video's fused x / 255 equals the image path's float64 rescale for every 8-bit value, so frames
    that need no resize come out as images; resized ones differ by torch's vs Pillow's rounding only (a
    level or two, on well under 2% of the values)."""
    levels = np.arange(256, dtype=np.uint8)
    assert np.array_equal(levels.astype(np.float32) / np.float32(255),
                          (levels.astype(np.float64) * (1 / 255)).astype(np.float32))
    image_settings = Gemma4ImageSettings.from_dict(TOWER_PROCESSOR)
    video_settings = Gemma4ImageSettings.from_dict(TOWER_PROCESSOR, video=True)
    for size, exact in [((80, 56), True), ((50, 40), False)]:  # 7 x 10 cells: the full budget
        frames = random_video(np.random.default_rng(13), 2, *size)
        video = preprocess_video_frames(frames, video_settings)
        rows = video.pixel_values.reshape(2, video.patches_per_frame, -1)
        for i, frame in enumerate(frames):
            image = preprocess_image(Image.fromarray(frame), image_settings)
            assert np.array_equal(image.position_ids, video.position_ids[:video.patches_per_frame])
            assert image.num_soft_tokens == video.num_soft_tokens_per_frame
            if exact:
                assert np.array_equal(image.pixel_values, rows[i])
            else:
                levels_off = np.rint(np.abs(image.pixel_values - rows[i]) * 255)
                assert levels_off.max() <= 2 and (levels_off > 0).mean() < 0.02


def test_config_reads_transformers():
    ours, reference = parse_vision_config({}), HFVisionConfig()
    for field in dataclasses.fields(Gemma4VisionConfig):  # the defaults
        name = field.name
        want = reference.rope_parameters["rope_theta"] if name == "rope_theta" else getattr(reference, name)
        assert getattr(ours, name) == want, name
    raw = HFVisionConfig(**TINY_VISION, use_clipped_linears=True, standardize=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 50.0}).to_dict()
    cfg = parse_vision_config(raw)
    assert dataclasses.asdict(cfg) == dict(TINY_VISION, use_clipped_linears=True, standardize=True,
                                           rope_theta=50.0, hidden_activation="gelu_pytorch_tanh")
    assert parse_vision_config({"rope_theta": 30}).rope_theta == 30.0


@pytest.mark.parametrize("raw", [{"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, {"head_dim": 6},
                                 {"num_key_value_heads": 5}, {"hidden_activation": "nope"}, {"patch_size": 0},
                                 {"hidden_size": "wide"}])
def test_bad_config(raw):
    with pytest.raises(ModelLoadError):
        parse_vision_config(raw)


def _randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights of a scale that keeps activations O(1); finite clip bounds that do clip."""
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        param.data = 1.0 + 0.1 * noise if name.endswith("norm.weight") else noise * param.shape[-1] ** -0.5
    for name, buffer in model.named_buffers():
        if name.endswith(("input_min", "output_min", "input_max", "output_max")):
            bound = 0.5 + torch.rand((), generator=generator).item()
            buffer.fill_(-bound if name.endswith("min") else bound)
        elif name.endswith(("std_bias", "std_scale")):
            noise = torch.randn(buffer.shape, generator=generator)
            buffer.copy_(0.3 * noise if name.endswith("bias") else 1.0 + 0.1 * noise)


@pytest.fixture(scope="module", params=[True, False], ids=["clipped_standardized", "plain"])
def models(request) -> tuple[Gemma4Model, Gemma4VisionEncoder]:
    vision = dict(TINY_VISION, use_clipped_linears=request.param, standardize=request.param)
    config = HFConfig(text_config=TINY_TEXT, vision_config=vision, audio_config=None)
    config._attn_implementation = "eager"
    reference = Gemma4Model(config).eval()
    with torch.no_grad():
        _randomize(reference, torch.Generator().manual_seed(0))
    ours = Gemma4VisionEncoder(parse_vision_config(config.vision_config.to_dict()), TEXT_HIDDEN).eval()
    checkpoint = {f"model.{name}": value for name, value in reference.state_dict().items()}
    renamed = {vision_weight_name(k): v for k, v in checkpoint.items() if vision_weight_name(k)}
    ours.load_state_dict(renamed, strict=True)
    return reference, ours


def test_rename_maps_every_tensor(models):
    reference, ours = models
    prefixes = ("vision_tower.", "embed_vision.")
    wanted = {k: v for k, v in reference.state_dict().items() if k.startswith(prefixes)}
    state = ours.state_dict()
    for prefix in ("model.", ""):  # a checkpoint's names, and Gemma4Model's own
        renamed = {vision_weight_name(prefix + k): v for k, v in wanted.items()}
        assert None not in renamed and set(renamed) == set(state)
        assert all(torch.equal(state[name], value) for name, value in renamed.items())
    if ours.config.use_clipped_linears:
        assert any(name.endswith("q_proj.input_min") for name in state)
    dropped = dict(list(renamed.items())[1:])
    with pytest.raises(RuntimeError, match="Missing key"):
        Gemma4VisionEncoder(ours.config, TEXT_HIDDEN).load_state_dict(dropped, strict=True)
    for other in ("model.language_model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                  "model.embed_audio.embedding_projection.weight",
                  "model.audio_tower.layers.0.self_attn.q_proj.linear.weight"):
        assert vision_weight_name(other) is None


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(21)
    return [random_image(rng, 50, 40), random_image(rng, 30, 90)]


def reference_image_rows(reference: Gemma4Model, images: list[Image.Image]) -> list[torch.Tensor]:
    batch = Gemma4ImageProcessorPil(**TOWER_PROCESSOR)(images, return_tensors="pt")
    with torch.no_grad():
        out = reference.get_image_features(batch["pixel_values"], batch["image_position_ids"])
    return list(out.pooler_output)


def reference_video_rows(reference: Gemma4Model, payload: Gemma4VisionInput) -> torch.Tensor:
    """get_video_features on the video processor's layout: each frame padded to max_patches."""
    max_patches = Gemma4ImageSettings.from_dict(TOWER_PROCESSOR, video=True).max_patches
    n, frames = payload.patches_per_frame, payload.num_frames
    pixels = torch.zeros(frames, max_patches, payload.pixel_values.shape[1])
    positions = torch.full((frames, max_patches, 2), -1, dtype=torch.long)
    pixels[:, :n] = torch.from_numpy(payload.pixel_values).view(frames, n, -1)
    positions[:, :n] = torch.from_numpy(payload.position_ids).view(frames, n, 2)
    with torch.no_grad():
        out = reference.get_video_features(pixels, positions, num_frames_per_video=torch.tensor([frames]))
    (rows,) = out.pooler_output
    return rows


def test_encoder_matches_transformers(models):
    """Two images of different sizes (a padded batch), then with a video between them, against
    get_image_features on the image processor's batch and get_video_features on the video's frames."""
    reference, ours = models
    images, settings = _images(), Gemma4ImageSettings.from_dict(TOWER_PROCESSOR)
    payloads = [preprocess_image(image, settings) for image in images]
    assert payloads[0].num_soft_tokens != payloads[1].num_soft_tokens
    want_images = reference_image_rows(reference, images)
    rows = ours.encode(payloads)
    assert [r.shape for r in rows] == [(p.num_soft_tokens, TEXT_HIDDEN) for p in payloads]
    for got, want in zip(rows, want_images, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    video = preprocess_video_frames(random_video(np.random.default_rng(22), 3, 60, 44),
                                    Gemma4ImageSettings.from_dict(TOWER_PROCESSOR, video=True))
    rows = ours.encode([payloads[0], video, payloads[1]])
    want_video = reference_video_rows(reference, video)
    assert rows[1].shape == (video.num_soft_tokens, TEXT_HIDDEN) == want_video.shape
    for got, want in zip(rows, [want_images[0], want_video, want_images[1]], strict=True):
        torch.testing.assert_close(got, want, **TOL)
    (alone,) = ours.encode([video])  # no padding in the batch: no mask
    torch.testing.assert_close(alone, want_video, **TOL)


def test_clipping_is_exercised(models):
    """The bounds matter: the same weights without them give other rows."""
    _, ours = models
    if not ours.config.use_clipped_linears:
        pytest.skip("no clipped linears")
    payload = preprocess_image(_images()[0], Gemma4ImageSettings.from_dict(TOWER_PROCESSOR))
    unclipped = Gemma4VisionEncoder(ours.config, TEXT_HIDDEN).eval()
    weights = {k: v for k, v in ours.state_dict().items() if not k.endswith(("_min", "_max"))}
    unclipped.load_state_dict(weights, strict=False)
    assert not torch.allclose(unclipped.encode([payload])[0], ours.encode([payload])[0])


def test_bad_inputs(models):
    _, ours = models
    video_settings = Gemma4ImageSettings.from_dict(TOWER_PROCESSOR, video=True)
    for frames in ([], np.zeros((2, 8, 8, 4), np.uint8), np.zeros((2, 8, 8, 3), np.float32),
                   [Image.new("RGB", (8, 8)), Image.new("RGB", (9, 8))]):
        with pytest.raises(InvalidInputError):
            preprocess_video_frames(frames, video_settings)
    image = _images()[0]
    good = preprocess_image(image, Gemma4ImageSettings.from_dict(TOWER_PROCESSOR))
    stretched = Gemma4VisionInput(good.pixel_values, good.position_ids * [2, 1], good.num_soft_tokens)
    for payload in (preprocess_image(image, Gemma4ImageSettings.from_dict(PROCESSOR_SETTINGS["p8_k3_70"])),
                    stretched):  # 8 px patches for a 4 px tower; positions that do not tile pooling cells
        with pytest.raises(InvalidInputError):
            ours.encode([payload])
    assert ours.encode([]) == []
