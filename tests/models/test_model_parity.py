"""mmserve's model against transformers on the same tiny random checkpoints (float32), on every device
(`devices()`: the CPU, and CUDA where one exists)."""

import numpy as np
import pytest
import torch
import transformers

from mmserve.models.generation import generate
from testkit.families import whole_items
from testkit.tiny_checkpoints import reference_inputs
from tests.models.helpers import (
    REFERENCE_IMAGE_PART,
    REFERENCE_VIDEO_PART,
    devices,
    full_logits,
    image_part,
    load_family,
    random_image,
    text_part,
    to_device,
    user,
)

REFERENCE_CLASSES = {
    "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
}


@pytest.fixture(params=devices())
def device(request):
    return request.param


@pytest.fixture
def loaded(model_dir, device):
    return load_family(model_dir, device=device)


@pytest.fixture
def reference(model_dir, family, device):
    return REFERENCE_CLASSES[family].from_pretrained(model_dir).eval().to(device)


def _cases(rng):
    small, wide, tall = random_image(rng, 90, 60), random_image(rng, 200, 57), random_image(rng, 48, 130)
    frames = [random_image(rng, 84, 56) for _ in range(4)]
    return {
        "text": (user(text_part("Hello, who are you?")), [], None),
        "one_image": (user(image_part(small), text_part("Describe the image.")), [small], None),
        "two_images": (user(image_part(wide), text_part("and"), image_part(tall), text_part("Which has more?")),
                       [wide, tall], None),
        "video": (user({"type": "video", "video": frames}, text_part("What happens?")), [], frames),
    }


def _reference_messages(messages):
    parts = []
    for part in messages[0]["content"]:
        kind = part["type"]
        parts.append(REFERENCE_IMAGE_PART if kind == "image_pil" else REFERENCE_VIDEO_PART if kind == "video" else part)
    return user(*parts)


def _both_inputs(model_dir, processor, case, device="cpu"):
    messages, images, frames = case
    chat = processor.render_chat(messages)
    ours = processor.process(chat.prompt, images=chat.images, videos=chat.videos)
    videos = whole_items(ours, "video")
    kwargs = {}
    if frames is not None:  # feed both implementations the same pixel_values_videos
        kwargs = dict(videos_pixel_values=np.concatenate([p for p, _ in videos]),
                      video_grid_thw=[g for _, g in videos])
    ref, _ = reference_inputs(model_dir, _reference_messages(messages), images, **kwargs)
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    return ours, to_device(ref, device)


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "video"])
def test_logits_match_reference(model_dir, loaded, reference, case, device):
    model, processor, spec = loaded
    ours, ref = _both_inputs(model_dir, processor, _cases(np.random.default_rng(11))[case], device)
    with torch.no_grad():
        ref_logits = reference(**ref).logits[0]
    our_logits = full_logits(model, ours, spec)
    assert our_logits.shape == ref_logits.shape
    assert (our_logits - ref_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["one_image", "two_images", "video"])
def test_greedy_generation_matches_reference(model_dir, loaded, reference, case, device):
    model, processor, spec = loaded
    ours, ref = _both_inputs(model_dir, processor, _cases(np.random.default_rng(12))[case], device)
    with torch.no_grad():
        out = reference.generate(**ref, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = out[0, ref["input_ids"].shape[1]:].tolist()
    got = list(generate(model, spec, ours, 24, min_new_tokens=24, stop_token_ids=model.config.eos_token_ids))
    assert got == expected
