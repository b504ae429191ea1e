"""Prompt-level bad input: clear InvalidInputError, and the processor keeps working afterwards."""

import numpy as np
import pytest
from PIL import Image

from mmserve import InvalidInputError
from tests.models.helpers import image_part, load_processor, random_image, text_part, user


@pytest.fixture
def processor(checkpoint_dirs):
    return load_processor(checkpoint_dirs["qwen2_vl"])


@pytest.fixture
def img():
    return random_image(np.random.default_rng(0), 56, 56)


def test_more_images_than_placeholders(processor, img):
    prompt = processor.render_chat(user(image_part(img), text_part("hi"))).prompt
    with pytest.raises(InvalidInputError, match=r"1 image placeholder.*but 2 image\(s\) were given"):
        processor.process(prompt, images=[img, img])


def test_more_placeholders_than_images(processor, img):
    prompt = processor.render_chat(user(image_part(img), image_part(img), text_part("hi"))).prompt
    with pytest.raises(InvalidInputError, match=r"2 image placeholder.*but 1 image\(s\) were given"):
        processor.process(prompt, images=[img])


def test_video_placeholder_without_video(processor):
    with pytest.raises(InvalidInputError, match=r"1 video placeholder.*but 0 video"):
        processor.process("<|vision_start|><|video_pad|><|vision_end|>hi")


def test_expanded_run_of_wrong_length_names_both_counts(processor, img):
    good = processor.process(processor.render_chat(user(image_part(img), text_part("hi"))).prompt, images=[img])
    rows = good.items[0].output_rows
    ids = list(good.prompt_token_ids)
    pad = processor.pad_ids["image"]
    start = ids.index(pad)
    broken = ids[:start] + [pad] * (rows - 1) + ids[start + rows:]
    with pytest.raises(InvalidInputError, match=rf"image 0.*{rows - 1} placeholder positions.*{rows} embedding rows"):
        processor.process(prompt_token_ids=broken, images=[img])


def test_unknown_content_part_type(processor):
    with pytest.raises(InvalidInputError, match="unsupported content part type 'audio_url'"):
        processor.render_chat(user({"type": "audio_url", "audio_url": {"url": "x"}}))


def test_extreme_aspect_ratio(processor):
    wide = Image.new("RGB", (4020, 20))
    prompt = processor.render_chat(user(image_part(wide))).prompt
    with pytest.raises(InvalidInputError, match="aspect ratio"):
        processor.process(prompt, images=[wide])


def test_bad_processor_kwargs(processor, img):
    prompt = processor.render_chat(user(image_part(img))).prompt
    with pytest.raises(InvalidInputError, match="unsupported mm_processor_kwargs"):
        processor.process(prompt, images=[img], mm_processor_kwargs={"resize_mode": "crop"})
    with pytest.raises(InvalidInputError, match="min_pixels <= max_pixels"):
        processor.process(prompt, images=[img], mm_processor_kwargs={"max_pixels": 10})


def test_processor_kwargs_change_processing(processor):
    big = random_image(np.random.default_rng(1), 400, 300)
    prompt = processor.render_chat(user(image_part(big))).prompt
    full = processor.process(prompt, images=[big])
    small = processor.process(prompt, images=[big], mm_processor_kwargs={"max_pixels": 28 * 28 * 16})
    assert small.items[0].output_rows < full.items[0].output_rows
    assert small.items[0].content_hash != full.items[0].content_hash


def test_token_ids_outside_vocab(processor):
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        processor.process(prompt_token_ids=[1, 2, 10**6])


def test_corrupt_image_in_chat_then_good_request(processor, img):
    prompt = processor.render_chat(user(image_part(img))).prompt
    with pytest.raises(InvalidInputError, match="image 0 could not be decoded"):
        processor.process(prompt, images=[b"\x89PNG\r\n\x1a\n garbage"])
    assert processor.process(prompt, images=[img]).items[0].output_rows == 4
