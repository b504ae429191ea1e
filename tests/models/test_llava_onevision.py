"""LLaVA-OneVision against transformers on a tiny random checkpoint (float32): prompt ids and pixels
against transformers' processor, logits and greedy generation against its model, and the span
lengths counted on the CPU against the rows the encoder produces."""

import numpy as np
import pytest
import torch
from transformers import LlavaOnevisionForConditionalGeneration
from transformers.image_utils import SizeDict

from mmserve.models.generation import generate
from testkit.tiny_llava_onevision import build_checkpoint, reference_processor
from tests.models.helpers import (
    REFERENCE_IMAGE_PART,
    REFERENCE_VIDEO_PART,
    full_logits,
    image_part,
    load_family,
    random_image,
    text_part,
    user,
)


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llava_onevision"))


@pytest.fixture(scope="module")
def ours(ov_dir):
    return load_family(ov_dir)


@pytest.fixture(scope="module")
def ref_processor(ov_dir):
    return reference_processor(ov_dir)


@pytest.fixture(scope="module")
def ref_model(ov_dir):
    return LlavaOnevisionForConditionalGeneration.from_pretrained(ov_dir).eval()


def _cases(seed):
    rng = np.random.default_rng(seed)
    small, wide, tall = random_image(rng, 90, 60), random_image(rng, 400, 50, "RGBA"), random_image(rng, 48, 130)
    frames = [random_image(rng, 84, 56) for _ in range(4)]
    turns = [{"role": "user", "content": [image_part(small), text_part("What is this?")]},
             {"role": "assistant", "content": [text_part("A red square.")]},
             {"role": "user", "content": [text_part("And the colour of the circle?")]}]
    return {
        "text": (user(text_part("Hello, who are you?")), [], None),
        "one_image": (user(image_part(small), text_part("Describe the image.")), [small], None),
        "two_images": (user(image_part(wide), text_part("and"), image_part(tall), text_part("Which has more?")),
                       [wide, tall], None),
        "video": (user({"type": "video", "video": frames}, text_part("What happens?")), [], frames),
        "multi_turn": (turns, [small], None),
    }


def _reference_messages(messages):
    kinds = {"image_pil": REFERENCE_IMAGE_PART, "video": REFERENCE_VIDEO_PART}
    return [{**m, "content": [kinds.get(p["type"], p) for p in m["content"]]} for m in messages]


def _reference_frames(processor, frames):
    """(1, frames, C, S, S): the video processor's steps (convert, resize to a tile, rescale, normalize)
    run with transformers' PIL image-processor backend."""
    ip = processor.image_processor
    size = SizeDict(height=ip.size["height"], width=ip.size["width"])
    out = []
    for frame in frames:
        x = ip.resize(ip.process_image(frame, do_convert_rgb=True), size=size, resample=ip.resample)
        out.append(ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std))
    return torch.from_numpy(np.stack(out))[None]


def _both_inputs(processor, ref_proc, case):
    """Our ProcessedPrompt and transformers' inputs for the same chat; prompt ids and pixels must agree."""
    messages, images, frames = case
    chat = processor.render_chat(messages)
    mine = processor.process(chat.prompt, images=chat.images, videos=chat.videos)
    prompt = ref_proc.apply_chat_template(_reference_messages(messages), add_generation_prompt=True, tokenize=False)
    assert chat.prompt == prompt
    if frames is None:
        # one list of images per prompt, as transformers' chat path passes them: a prompt with several
        # images takes its multi-image mode (no tiling)
        ref = dict(ref_proc(text=prompt, images=[images] if images else None, return_tensors="pt"))
    else:  # transformers' video processor needs torchvision: expand <video> as its processor would
        videos = _reference_frames(ref_proc, frames)
        span = ref_proc.replace_video_token({"pixel_values_videos": videos}, 0)
        ref = {**ref_proc.tokenizer(prompt.replace("<video>", span), return_tensors="pt"),
               "pixel_values_videos": videos}
    assert mine.prompt_token_ids == ref["input_ids"][0].tolist()
    for modality, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        for n, item in enumerate(i for i in mine.items if i.modality == modality):
            pixels = item.payload.pixel_values
            assert np.abs(pixels - ref[key][n][:len(pixels)].numpy()).max() <= 1e-5
            if modality == "image":  # the padding the reference adds for batching is all that differs
                assert not ref[key][n][len(pixels):].any()
    return mine, ref


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "video", "multi_turn"])
def test_prompt_and_pixels_match_reference(ours, ref_processor, case):
    _, processor, _ = ours
    mine, _ = _both_inputs(processor, ref_processor, _cases(3)[case])
    assert [i.output_rows for i in mine.items] == [i.length for i in mine.items]


@pytest.mark.parametrize("case", ["text", "one_image", "two_images", "video"])
def test_logits_match_reference(ours, ref_processor, ref_model, case):
    model, processor, spec = ours
    mine, ref = _both_inputs(processor, ref_processor, _cases(11)[case])
    with torch.no_grad():
        ref_logits = ref_model(**ref).logits[0]
    our_logits = full_logits(model, mine, spec)
    assert our_logits.shape == ref_logits.shape
    assert (our_logits - ref_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["one_image", "two_images", "video"])
def test_greedy_generation_matches_reference(ours, ref_processor, ref_model, case):
    model, processor, spec = ours
    mine, ref = _both_inputs(processor, ref_processor, _cases(12)[case])
    with torch.no_grad():
        out = ref_model.generate(**ref, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = out[0, ref["input_ids"].shape[1]:].tolist()
    got = list(generate(model, spec, mine, 24, min_new_tokens=24, stop_token_ids=model.config.eos_token_ids))
    assert got == expected


def test_token_id_prompt_expands_like_text_prompt(ours):
    _, processor, _ = ours
    images = [random_image(np.random.default_rng(4), w, h) for w, h in ((90, 60), (400, 50))]
    chat = processor.render_chat(user(image_part(images[0]), image_part(images[1]), text_part("Compare.")))
    from_text = processor.process(chat.prompt, images=images)
    from_ids = processor.process(prompt_token_ids=processor.tokenizer.encode(chat.prompt), images=images)
    expanded = processor.process(prompt_token_ids=from_text.prompt_token_ids, images=images)
    assert from_ids.prompt_token_ids == expanded.prompt_token_ids == from_text.prompt_token_ids
    assert [i.content_hash for i in from_ids.items] == [i.content_hash for i in from_text.items]


SIZES = [(56, 56), (90, 60), (400, 50), (30, 200), (130, 125), (113, 57), (1000, 3), (7, 7), (168, 168), (60, 61)]


def test_span_lengths_equal_encoder_rows(ours, ref_processor):
    model, processor, spec = ours
    rng = np.random.default_rng(5)
    images = [random_image(rng, w, h) for w, h in SIZES]
    # each size alone in its prompt (tiled), and as one of two images (untiled)
    expansions = [processor.expand_image(img, {}, n) for n in (1, 2) for img in images]
    frames = [random_image(rng, 70, 40) for _ in range(3)]
    expansions.append(processor.expand_video(frames, 2.0, {}))
    cases = [(n, w, h) for n in (1, 2) for w, h in SIZES] + [(0, "video", 3)]
    with torch.no_grad():
        rows = model.encode_items([e.payload for e in expansions])  # one batched call
    for (n, w, h), exp, out in zip(cases, expansions, rows):
        assert out.shape == (1, exp.rows, spec.embed_dim), (n, w, h)
        assert len(exp.token_ids) == exp.rows
        assert exp.rows <= spec.largest_item["video" if w == "video" else "image"].rows
        if w != "video":  # transformers' processor counts the same span from the sizes
            assert exp.rows == len(ref_processor.replace_image_token(
                {"batch_num_images": [n], "image_sizes": [(h, w)] * n,
                 "pixel_values": [[np.zeros((3, 56, 56))]] * n}, 0)) // len("<image>")
    batched = torch.cat([r[0] for r in rows])
    single = torch.cat([model.encode_items([e.payload])[0][0] for e in expansions])
    assert (batched - single).abs().max().item() <= 1e-5


def test_an_image_alone_and_among_several_are_different_items(ours):
    """Tiled (alone) and untiled (one of several) encoder inputs differ, so their content keys must."""
    _, processor, _ = ours
    rng = np.random.default_rng(9)
    img, other = random_image(rng, 120, 70), random_image(rng, 50, 90)
    alone = processor.process(processor.render_chat(user(image_part(img), text_part("Hi"))).prompt, images=[img])
    pair = processor.process(processor.render_chat(user(image_part(img), image_part(other), text_part("Hi"))).prompt,
                             images=[img, other])
    assert alone.items[0].content_hash != pair.items[0].content_hash
    assert pair.items[0].payload.layout is None and alone.items[0].payload.layout is not None
