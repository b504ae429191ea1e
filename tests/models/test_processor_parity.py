"""mmserve's native processor against transformers' image processor and tokenizer."""

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmserve.models.vision.qwen_image_processor import ImageProcessorConfig, Qwen2VLImageProcessor
from testkit.tiny_checkpoints import reference_inputs
from tests.models.helpers import (
    REFERENCE_IMAGE_PART,
    image_part,
    load_processor,
    random_image,
    text_part,
    user,
)

SIZES = [(57, 311, "RGB"), (640, 48, "RGB"), (29, 29, "RGB"), (4000, 3000, "RGB"), (120, 96, "RGBA"),
         (77, 51, "L")]


@pytest.mark.parametrize("width,height,mode", SIZES)
def test_pixel_values_match_reference(width, height, mode):
    rng = np.random.default_rng(width * 7 + height)
    img = random_image(rng, width, height, mode)
    # default max_pixels: the 4000x3000 image is scaled down by it
    ref = Qwen2VLImageProcessorPil()(images=img, return_tensors="np")
    ours = Qwen2VLImageProcessor(ImageProcessorConfig()).preprocess_image(img)
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert np.abs(ours.pixel_values - ref["pixel_values"]).max() <= 1e-5
    if (width, height) == (4000, 3000):
        assert ours.grid_thw[1] * ours.grid_thw[2] * 14 * 14 <= 28 * 28 * 1280


def test_max_pixels_downscale_matches_reference():
    img = random_image(np.random.default_rng(1), 4000, 3000)
    ref = Qwen2VLImageProcessorPil(max_pixels=28 * 28 * 64)(images=img, return_tensors="np")
    ours = Qwen2VLImageProcessor(ImageProcessorConfig(max_pixels=28 * 28 * 64)).preprocess_image(img)
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert ours.grid_thw[1] * ours.grid_thw[2] * 14 * 14 <= 28 * 28 * 64
    assert np.abs(ours.pixel_values - ref["pixel_values"]).max() <= 1e-5


def test_prompt_with_several_images_matches_reference(model_dir):
    rng = np.random.default_rng(3)
    images = [random_image(rng, 57, 311), random_image(rng, 100, 80, "RGBA"), random_image(rng, 64, 64, "L")]
    proc = load_processor(model_dir)
    chat = proc.render_chat(user(image_part(images[0]), text_part("Compare these."), image_part(images[1]),
                                 image_part(images[2]), text_part("Which is brighter?")))
    ours = proc.process(chat.prompt, images=chat.images)
    ref, ref_prompt = reference_inputs(
        model_dir, user(REFERENCE_IMAGE_PART, text_part("Compare these."), REFERENCE_IMAGE_PART,
                        REFERENCE_IMAGE_PART, text_part("Which is brighter?")), images)
    assert chat.prompt == ref_prompt
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    assert [list(i.payload.grid_thw) for i in ours.items] == ref["image_grid_thw"].tolist()
    pixels = np.concatenate([i.payload.pixel_values for i in ours.items])
    assert np.abs(pixels - ref["pixel_values"].numpy()).max() <= 1e-5
    assert ours.metadata.output_embedding_lengths == tuple(int(g.prod()) // 4 for g in ref["image_grid_thw"])
    assert ours.metadata.encoder_token_lengths == tuple(int(g.prod()) for g in ref["image_grid_thw"])
    assert ours.metadata.item_refs == (("image", 0), ("image", 1), ("image", 2))


def test_token_id_prompt_expands_like_text_prompt(model_dir):
    rng = np.random.default_rng(4)
    img = random_image(rng, 90, 60)
    proc = load_processor(model_dir)
    chat = proc.render_chat(user(image_part(img), text_part("What is this?")))
    from_text = proc.process(chat.prompt, images=[img])
    unexpanded = proc.tokenizer.encode(chat.prompt)
    from_ids = proc.process(prompt_token_ids=unexpanded, images=[img])
    assert from_ids.prompt_token_ids == from_text.prompt_token_ids
    already_expanded = proc.process(prompt_token_ids=from_text.prompt_token_ids, images=[img])
    assert already_expanded.prompt_token_ids == from_text.prompt_token_ids
    assert (from_ids.positions.table == from_text.positions.table).all()
